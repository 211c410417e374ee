"""The deliberately naive baseline: FedAvg as a per-client, per-batch Python loop.

What a user would write first with the same JAX model: for each sampled client, for each
epoch, shuffle its indices with numpy; for each batch, slice the examples on the host and
call one jitted `train_step(params, opt_state, x, y)` (plain `optax.sgd` with momentum,
mean cross-entropy over the batch, a short last batch kept short); then average the
clients' parameters uniformly and evaluate the global model on the test set batch by batch.
No scan, no vmap, no bucketing, no device-resident data.

It is naive, not sabotaged: it does not force a device sync per step, so JAX's asynchronous
dispatch overlaps the host-side slicing with compute.

Its maths equals the engine's FedAvg (uniform aggregation, server SGD lr 1, no warm-up,
no weight decay, no clipping) for models without non-trainable state: the engine's masked
mean over a padded last batch is the plain mean over the short batch. Given the engine's
batch order (`engine_orders`) one round reproduces the engine's averaged model up to
float32 rounding; `max_rel_diff` measures that.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import roofline
from fedjax_pan.engine.clients import epoch_order

PyTree = Any
# order(position in cohort, epoch, client size) -> a permutation of range(size)
OrderFn = Callable[[int, int, int], np.ndarray]


class NaiveFedAvg:
    """FedAvg rounds and evaluation as straightforward Python loops over jitted steps."""

    def __init__(self, model: nn.Module, learning_rate: float = 0.05, momentum: float = 0.9,
                 batch_size: int = 64, epochs: int = 5, eval_batch_size: int = 1000):
        if int(epochs) != epochs or epochs < 1:
            raise ValueError(f"the naive loop runs whole epochs only, got {epochs}")
        self.batch_size = int(batch_size)
        self.epochs = int(epochs)
        self.eval_batch_size = int(eval_batch_size)
        self.tx = optax.sgd(learning_rate, momentum=momentum or None)
        tx = self.tx

        def loss_fn(params, x, y):
            logits = model.apply({"params": params}, x, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        @jax.jit
        def train_step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        @jax.jit
        def eval_step(params, x, y):
            logits = model.apply({"params": params}, x, train=False)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jnp.sum(jnp.argmax(logits, -1) == y), jnp.sum(ce)

        self.train_step = train_step
        self.eval_step = eval_step

    def round(self, params: PyTree, images: np.ndarray, labels: np.ndarray,
              client_indices: Sequence[np.ndarray], rng: np.random.Generator,
              order: Optional[OrderFn] = None,
              weights: Optional[Sequence[float]] = None) -> Tuple[PyTree, float]:
        """(mean of the clients' trained params, uniform or weighted by `weights`; mean
        per-step training loss).

        `images`/`labels` are host arrays; `client_indices[m]` holds client m's example
        rows. `order` replaces the numpy shuffle (e.g. `engine_orders` for a comparison).
        """
        trained, losses = [], []
        for m, rows in enumerate(client_indices):
            p, opt_state = params, self.tx.init(params)
            n = len(rows)
            for epoch in range(self.epochs):
                perm = rng.permutation(n) if order is None else order(m, epoch, n)
                for start in range(0, n, self.batch_size):
                    batch = rows[perm[start:start + self.batch_size]]
                    p, opt_state, loss = self.train_step(p, opt_state, images[batch],
                                                         labels[batch])
                    losses.append(loss)
            trained.append(p)
        if weights is None:
            mean = jax.tree_util.tree_map(lambda *xs: sum(xs) / len(xs), *trained)
        else:
            w = np.asarray(weights, np.float64)
            w = [float(v) for v in w / w.sum()]
            mean = jax.tree_util.tree_map(lambda *xs: sum(v * x for v, x in zip(w, xs)),
                                          *trained)
        return mean, float(np.mean(jax.device_get(losses)))

    def cost(self, params: PyTree, images: np.ndarray, labels: np.ndarray
             ) -> roofline.LoopCost:
        """XLA's cost of this loop's rounds: its `train_step` per batch (the averaging runs
        op by op, outside any compiled program, and is not counted)."""
        opt_state = self.tx.init(params)

        def step_at(rows: int) -> roofline.Cost:
            return roofline.program_cost(self.train_step, params, opt_state, images[:rows],
                                         labels[:rows])
        return roofline.LoopCost(step_at, self.batch_size)

    def evaluate(self, params: PyTree, images: np.ndarray,
                 labels: np.ndarray) -> Dict[str, float]:
        """Accuracy and mean loss over the test set, one host batch at a time."""
        correct, loss = 0.0, 0.0
        for start in range(0, len(labels), self.eval_batch_size):
            stop = start + self.eval_batch_size
            c, l_sum = self.eval_step(params, images[start:stop], labels[start:stop])
            correct += float(c)
            loss += float(l_sum)
        return {"accuracy": correct / len(labels), "loss": loss / len(labels)}


def engine_orders(data_keys: jax.Array, width: int) -> OrderFn:
    """The engine's batch order for a cohort (its per-client data keys, table width)."""
    def order(m: int, epoch: int, n: int) -> np.ndarray:
        return np.asarray(epoch_order(data_keys[m], epoch, n, width))[:n]
    return order


def max_rel_diff(a: PyTree, b: PyTree) -> float:
    """max over leaves of max|a - b| / max|b| (a leaf of b that is all zeros counts as 1)."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        raise ValueError(f"trees differ: {len(la)} vs {len(lb)} leaves")
    worst = 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.max(np.abs(y))) or 1.0
        worst = max(worst, float(np.max(np.abs(x - y))) / scale)
    return worst
