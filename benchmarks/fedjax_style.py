"""A second baseline: FedAvg written the way FedJAX runs it.

FedJAX's `fed_avg` with its `jit` for_each_client backend: for each sampled client,
`client_init(server_params, rng)` builds a step state, a Python loop over host-side numpy
batches (FedJAX's `shuffle_repeat_batch`: reshuffled every epoch, the last batch kept short)
dispatches one jitted `client_step(state, batch)` each, and `client_final(state)` returns
the client's delta and weight (its example count). The server averages the deltas weighted
by example counts and applies them with SGD at learning rate 1. Per step the state carries
the parameters, the optimiser state and an rng split once, as FedJAX's client step does.

Unlike `naive.NaiveFedAvg` it keeps FedJAX's per-client state dict and weighted deltas, so
the suite tracks the engine against the library this project is compared with. Given the
engine's batch order (`naive.engine_orders`) its first round equals the engine's FedAvg with
`aggregation='num_examples'` up to float32 rounding.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import roofline
from benchmarks.naive import OrderFn

PyTree = Any


class FedJaxStyleFedAvg:
    """FedAvg rounds as FedJAX's jit backend runs them (host batches, one dispatch per step)."""

    def __init__(self, model: nn.Module, learning_rate: float = 0.05, momentum: float = 0.0,
                 batch_size: int = 64, epochs: int = 5):
        if int(epochs) != epochs or epochs < 1:
            raise ValueError(f"the FedJAX-style loop runs whole epochs only, got {epochs}")
        self.batch_size, self.epochs = int(batch_size), int(epochs)
        tx = optax.sgd(learning_rate, momentum=momentum or None)

        def loss_fn(params, batch, rng):
            del rng  # FedJAX passes it for dropout; this model has none
            logits = model.apply({"params": params}, batch["x"], train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        def client_init(server_params, rng):
            return {"params": server_params, "opt_state": tx.init(server_params), "rng": rng}

        @jax.jit
        def client_step(state, batch):
            rng, use_rng = jax.random.split(state["rng"])
            grads = jax.grad(loss_fn)(state["params"], batch, use_rng)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            return {"params": optax.apply_updates(state["params"], updates),
                    "opt_state": opt_state, "rng": rng}

        @jax.jit
        def client_final(server_params, state, weight):
            """The client's delta times its weight (FedJAX: its number of examples)."""
            return jax.tree_util.tree_map(lambda p, c: (p - c) * weight, server_params,
                                          state["params"])

        @jax.jit
        def server_update(server_params, delta_sum, weight_sum):
            return jax.tree_util.tree_map(lambda p, d: p - d / weight_sum, server_params,
                                          delta_sum)

        self.add = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))
        self.client_init, self.client_step = jax.jit(client_init), client_step
        self.client_final, self.server_update = client_final, server_update

    def cost(self, params: PyTree, images: np.ndarray, labels: np.ndarray
             ) -> roofline.LoopCost:
        """XLA's cost of this loop's rounds: `client_step` per batch, `client_init`,
        `client_final` and the running sum's add per client, the server update once."""
        key = jax.random.PRNGKey(0)
        state = jax.eval_shape(self.client_init, params, key)
        w = jnp.float32(1.0)
        per_client = (roofline.program_cost(self.client_init, params, key)
                      + roofline.program_cost(self.client_final, params, state, w)
                      + roofline.program_cost(self.add, params, params))

        def step_at(rows: int) -> roofline.Cost:
            return roofline.program_cost(self.client_step, state,
                                         {"x": images[:rows], "y": labels[:rows]})
        server = roofline.program_cost(self.server_update, params, params, w)
        return roofline.LoopCost(step_at, self.batch_size, per_client, server)

    def batches(self, images: np.ndarray, labels: np.ndarray, rows: np.ndarray,
                rng: np.random.Generator, position: int, order: Optional[OrderFn]):
        """Host-side batches of one client: `epochs` reshuffled passes, last batch short."""
        n = len(rows)
        for epoch in range(self.epochs):
            perm = rng.permutation(n) if order is None else order(position, epoch, n)
            for start in range(0, n, self.batch_size):
                batch = rows[perm[start:start + self.batch_size]]
                yield {"x": images[batch], "y": labels[batch]}

    def round(self, params: PyTree, images: np.ndarray, labels: np.ndarray,
              client_indices: Sequence[np.ndarray], rng: np.random.Generator,
              key: jax.Array, order: Optional[OrderFn] = None) -> Tuple[PyTree, int]:
        """(new server params, examples trained on) after one round on these clients."""
        delta_sum, weight_sum, examples = None, 0.0, 0
        for m, rows in enumerate(client_indices):
            state = self.client_init(params, jax.random.fold_in(key, m))
            for batch in self.batches(images, labels, rows, rng, m, order):
                state = self.client_step(state, batch)
                examples += len(batch["y"])
            weighted = self.client_final(params, state, jnp.float32(len(rows)))
            delta_sum = weighted if delta_sum is None else self.add(delta_sum, weighted)
            weight_sum += float(len(rows))
        return self.server_update(params, delta_sum, jnp.float32(weight_sum)), examples
