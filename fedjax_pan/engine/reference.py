"""A slow, obviously-correct sequential reference of one round, for tests only.

Plain Python over clients and batches, no vmap, no padding, no compiled loops: each
client takes exactly its number of steps on batches cut from the same per-epoch
permutation the engine uses (the one shared definition of the data order), a last
partial batch as a short batch. Only the algorithm's own step function is jitted (for
speed; it is the same function eagerly).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.engine.protocol import ClientContext, FederatedAlgorithm, RoundInfo
from fedjax_pan.engine.clients import (Augment, ClientData, augment_batch, augment_key,
                                       epoch_order)
from fedjax_pan.engine.execution import Cohort

PyTree = Any


@functools.lru_cache(maxsize=16)
def _jitted(step: Callable) -> Callable:
    return jax.jit(step)


def client_batches(data: ClientData, batch_size: int, cohort: Cohort, m: int,
                   augment: Optional[Augment] = None) -> list:
    """The batches the cohort's m-th client trains on, in order: exactly its number of
    steps, cut from the engine's per-epoch permutations, a last partial batch short."""
    images, labels = np.asarray(data.images), np.asarray(data.labels)
    table = np.asarray(data.index_table)
    client = int(cohort.ids[m])
    n = int(data.sizes[client])
    per_epoch = -(-n // batch_size)
    batches = []
    for t in range(int(cohort.steps[m])):
        epoch, b = divmod(t, per_epoch)
        if b == 0:
            order = np.asarray(epoch_order(cohort.data_keys[m], epoch, n, data.max_size))[:n]
        rows = table[client, order[b * batch_size:(b + 1) * batch_size]].astype(np.int64)
        batch = {"x": jnp.asarray(images[rows]), "y": jnp.asarray(labels[rows]),
                 "mask": jnp.ones(len(rows), jnp.float32)}
        if augment is not None:
            batch["x"] = augment_batch(batch["x"], augment_key(cohort.data_keys[m], t),
                                       augment)
        batches.append(batch)
    return batches


def reference_round(algorithm: FederatedAlgorithm, data: ClientData, batch_size: int,
                    server: PyTree, cohort: Cohort, augment: Optional[Augment] = None
                    ) -> Tuple[PyTree, list, float]:
    """(new server state, per-client new states, mean training loss) of one round, its
    training batches augmented by `augment` (as the engine's `LocalWork.augment`).

    Aggregates in float64 on the host: a streaming aggregator's weighted sum directly,
    a stacked one on the clients' outputs stacked in cohort order.
    """
    table = np.asarray(data.index_table)
    outputs, states, loss_sum, count = [], [], 0.0, 0.0
    for m, client in enumerate(cohort.ids):
        client_state = None if cohort.client_states is None else jax.tree_util.tree_map(
            lambda x: x[m], cohort.client_states)
        n = int(data.sizes[client])
        ctx = ClientContext(cohort.rngs[m], jnp.int32(cohort.steps[m]), jnp.int32(n),
                            jnp.int32(client), jnp.int32(cohort.round),
                            jnp.asarray(np.bincount(np.asarray(data.labels)[table[client, :n]],
                                                    minlength=data.label_counts.shape[1]),
                                        jnp.float32))
        local = algorithm.client_init(server, client_state, ctx)
        step = _jitted(algorithm.client_step)
        for batch in client_batches(data, batch_size, cohort, m, augment):
            local, metrics = step(local, batch, server)
            loss_sum += float(metrics["loss_sum"])
            count += float(metrics["num_examples"])
        output, new_state = algorithm.client_output(local, server)
        outputs.append(output)
        states.append(new_state)
    weights = np.asarray(cohort.weights, np.float64) / np.sum(cohort.weights)
    info = RoundInfo(jnp.int32(cohort.round), jnp.asarray(cohort.ids, jnp.int32),
                     jnp.asarray(weights, jnp.float32), data.num_clients)
    aggregator = algorithm.aggregator
    if aggregator.stacked:
        aggregate = aggregator.finalize(
            jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outputs),
            jnp.asarray(weights, jnp.float32))
    else:  # the weighted sum in float64, then the algorithm's own finalize
        total = float(np.sum(cohort.weights))
        weighted = jax.tree_util.tree_map(
            lambda *xs: jnp.asarray(sum(float(w) * np.asarray(x, np.float64)
                                        for w, x in zip(cohort.weights, xs)),
                                    np.asarray(xs[0]).dtype), *outputs)
        aggregate = aggregator.finalize(weighted, jnp.float32(total))
    return (algorithm.server_update(server, aggregate, info), states,
            loss_sum / max(count, 1.0))
