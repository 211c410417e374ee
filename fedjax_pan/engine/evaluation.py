"""Jitted, batched, masked evaluation: of a model on a fixed test set, and of each client
(its own or the global model) on its own local test part."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Optional, Sequence

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


def make_client_evaluator(model: nn.Module, images: np.ndarray, labels: np.ndarray,
                          test_parts: Sequence[np.ndarray], batch_size: int = 1000
                          ) -> Callable[..., Dict[str, np.ndarray]]:
    """Evaluation of each client on its own test part (`data.split_clients`).

    `evaluate(variables)`: one model for every client (global algorithms): one pass over
    the union of the parts, each example counted for its client. `evaluate(stacked,
    personal=True, vmapped=False)`: client k's own model, the leaves of `stacked` holding
    one entry per client (K, ...) on a leading axis, evaluated client by client (a loop of
    one compiled function) or, `vmapped`, all clients at once on their parts padded to the
    largest. `clients`: only these clients' own models (`stacked` then holds one entry per
    listed client; e.g. a group of clients sharing a network `net`). Returns per-client
    float64 arrays (K,): 'correct', 'count', 'loss_sum' (0 for clients not evaluated).
    """
    parts = [np.asarray(p, np.int64) for p in test_parts]
    counts = np.asarray([len(p) for p in parts], np.int64)
    k = len(parts)
    if counts.sum() == 0:
        raise ValueError("every client's test part is empty")
    images = np.asarray(images, np.float32)
    labels = np.asarray(labels, np.int32)

    def sums(net, variables, x, y, m):
        logits = net.apply(variables, x, train=False)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return (jnp.argmax(logits, -1) == y).astype(jnp.float32) * m, ce * m

    # The union of the parts in batches, with each row's owner.
    rows = np.concatenate(parts)
    owner = np.repeat(np.arange(k), counts)
    b = min(batch_size, len(rows))
    nb = -(-len(rows) // b)
    pad = nb * b - len(rows)
    ux = jnp.asarray(np.concatenate([images[rows], np.zeros((pad, *images.shape[1:]),
                                                            np.float32)]))
    uy = jnp.asarray(np.concatenate([labels[rows], np.zeros(pad, np.int32)]))
    uo = jnp.asarray(np.concatenate([owner, np.zeros(pad, np.int64)]).astype(np.int32))
    um = jnp.asarray((np.arange(nb * b) < len(rows)).astype(np.float32))

    # The sets are arguments, not closed-over constants baked into the programs.
    @functools.partial(jax.jit, static_argnums=0)
    def union_batch(net, variables, acc, i, ux, uy, uo, um):
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * b, b)  # noqa: E731
        correct, loss = sums(net, variables, sl(ux), sl(uy), sl(um))
        owners = sl(uo)
        return (acc[0] + jax.ops.segment_sum(correct, owners, k),
                acc[1] + jax.ops.segment_sum(loss, owners, k))

    # Each client's part padded to whole chunks of c rows (one compiled shape); built on
    # the first personal evaluation only (K x the largest part: global algorithms never
    # need it).
    c = max(1, min(batch_size, int(counts.max())))
    width = int(np.maximum(-(-counts // c), 1).max()) * c

    @functools.cache
    def padded():
        px = np.zeros((k, width, *images.shape[1:]), np.float32)
        py = np.zeros((k, width), np.int32)
        pm = np.zeros((k, width), np.float32)
        for j, p in enumerate(parts):
            px[j, :len(p)], py[j, :len(p)], pm[j, :len(p)] = images[p], labels[p], 1.0
        return jnp.asarray(px), jnp.asarray(py), jnp.asarray(pm)

    @functools.partial(jax.jit, static_argnums=0)
    def client_chunk(net, variables, j, t, px, py, pm):
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a[j], t * c, c)  # noqa: E731
        correct, loss = sums(net, variables, sl(px), sl(py), sl(pm))
        return jnp.sum(correct), jnp.sum(loss)

    @functools.partial(jax.jit, static_argnums=0)
    def all_clients(net, stacked, px, py, pm):
        def one(variables, x, y, m):
            def chunk(acc, t):
                sl = lambda a: jax.lax.dynamic_slice_in_dim(a, t * c, c)  # noqa: E731
                correct, loss = sums(net, variables, sl(x), sl(y), sl(m))
                return (acc[0] + jnp.sum(correct), acc[1] + jnp.sum(loss)), None
            return jax.lax.scan(chunk, (jnp.float32(0), jnp.float32(0)),
                                jnp.arange(width // c))[0]
        return jax.vmap(one)(stacked, px, py, pm)

    def evaluate(variables: PyTree, personal: bool = False, vmapped: bool = False,
                 net: Optional[nn.Module] = None, clients: Optional[Sequence[int]] = None
                 ) -> Dict[str, np.ndarray]:
        net = model if net is None else net
        if not personal:
            if clients is not None:
                raise ValueError("clients= selects whose own models are evaluated "
                                 "(personal=True)")
            acc = (jnp.zeros(k, jnp.float32), jnp.zeros(k, jnp.float32))
            for i in range(nb):
                acc = union_batch(net, variables, acc, jnp.int32(i), ux, uy, uo, um)
            return {"correct": np.asarray(acc[0], np.float64),
                    "count": counts.astype(np.float64),
                    "loss_sum": np.asarray(acc[1], np.float64)}
        ids = np.arange(k) if clients is None else np.asarray(clients, np.int64)
        correct, loss = np.zeros(k), np.zeros(k)
        if vmapped:
            arrays = padded()
            if clients is not None:  # only their parts (one compile per group size)
                arrays = tuple(a[jnp.asarray(ids)] for a in arrays)
            cs, ls = all_clients(net, variables, *arrays)
            correct[ids], loss[ids] = np.asarray(cs), np.asarray(ls)
        else:
            for i, j in enumerate(ids):
                own = jax.tree_util.tree_map(lambda x: x[i], variables)
                for t in range(-(-int(counts[j]) // c)):
                    cj, lj = client_chunk(net, own, jnp.int32(j), jnp.int32(t), *padded())
                    correct[j] += float(cj)
                    loss[j] += float(lj)
        # Clients left out count no examples, so evaluations of disjoint groups add up.
        count = np.zeros(k)
        count[ids] = counts[ids]
        return {"correct": correct, "count": count, "loss_sum": loss}

    return evaluate


def client_metrics(correct: np.ndarray, count: np.ndarray) -> Dict[str, float]:
    """Personalised-FL accuracies over clients with a non-empty test part.

    pfl_accuracy: sum of correct / sum of examples (PFLlib's figure); client_accuracy_mean
    and _std (ddof 0): the unweighted mean and spread of per-client accuracies;
    client_accuracy_worst10: the mean accuracy of the worst ceil(10%) of clients.
    """
    correct, count = np.asarray(correct, np.float64), np.asarray(count, np.float64)
    has = count > 0
    if not has.any():
        raise ValueError("no client has test examples")
    acc = correct[has] / count[has]
    worst = np.sort(acc)[:max(1, math.ceil(0.1 * len(acc)))]
    return {"pfl_accuracy": float(correct.sum() / count.sum()),
            "client_accuracy_mean": float(acc.mean()),
            "client_accuracy_std": float(acc.std()),
            "client_accuracy_worst10": float(worst.mean())}
