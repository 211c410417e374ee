"""Jitted, batched, masked evaluation of a model on a fixed test set."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


def make_evaluator(model: nn.Module, images: np.ndarray, labels: np.ndarray,
                   batch_size: int = 1000, num_classes: int = 0
                   ) -> Callable[..., Dict[str, Any]]:
    """variables -> {'accuracy', 'loss', 'class_accuracy'} over (images, labels), eval mode.

    `evaluate(variables, net)` evaluates another network on the same set (e.g. one whose
    layers grew, as FedMA's global model); each distinct network compiles once.

    The set is padded to whole batches once and kept on the device; batches run as a
    Python loop of one compiled function (convs inside lax.scan are slow on CPU).
    """
    n = len(labels)
    num_classes = max(num_classes, int(np.max(labels)) + 1 if n else 0)
    class_counts = np.bincount(np.asarray(labels), minlength=num_classes)
    if n == 0:
        raise ValueError("the evaluation set is empty")
    batch_size = min(batch_size, n)
    num_batches = -(-n // batch_size)
    pad = num_batches * batch_size - n
    x = np.concatenate([np.asarray(images, np.float32),
                        np.zeros((pad, *images.shape[1:]), np.float32)])
    y = np.concatenate([np.asarray(labels, np.int32), np.zeros(pad, np.int32)])
    mask = (np.arange(len(y)) < n).astype(np.float32)
    shape = (num_batches, batch_size)
    xs = jnp.asarray(x.reshape(*shape, *images.shape[1:]))
    ys, ms = jnp.asarray(y.reshape(shape)), jnp.asarray(mask.reshape(shape))

    @functools.partial(jax.jit, static_argnums=0)
    def batch_sums(net, variables, acc, xs, ys, ms, i):
        # The test set is an argument, not a closed-over constant baked into the program.
        logits = net.apply(variables, xs[i], train=False)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ys[i])
        correct = (jnp.argmax(logits, -1) == ys[i]).astype(jnp.float32) * ms[i]
        per_class = jax.nn.one_hot(ys[i], num_classes).T @ correct
        return acc + jnp.concatenate([jnp.stack([jnp.sum(correct), jnp.sum(ce * ms[i])]),
                                      per_class])

    def evaluate(variables: PyTree, net: Optional[nn.Module] = None) -> Dict[str, Any]:
        net = model if net is None else net
        acc = jnp.zeros(2 + num_classes, jnp.float32)
        for i in range(num_batches):
            acc = batch_sums(net, variables, acc, xs, ys, ms, jnp.int32(i))
        acc = np.asarray(acc, np.float64)
        return {"accuracy": acc[0] / n, "loss": acc[1] / n,
                "class_accuracy": acc[2:] / np.maximum(class_counts, 1)}

    return evaluate
