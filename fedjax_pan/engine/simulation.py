"""One federated round as a composition: sample, execute, aggregate, update.

`Simulation` knows no algorithm by name: it samples clients (R fraction, without
replacement, seeded by (seed, round) so a resumed run samples identically), hands them to
an executor, averages the client outputs uniformly (the PAN paper) or by example count
(FedAvg's n_k / n), and applies the algorithm's server update. Per-client persistent
state (for algorithms that keep one) is stored for all K clients and gathered/scattered
for the sampled ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.engine.protocol import FederatedAlgorithm, RoundInfo
from fedjax_pan.engine.clients import (ClientData, LocalWork, client_keys, real_examples,
                                       step_batch)
from fedjax_pan.engine.execution import Cohort

PyTree = Any
AGGREGATIONS = ("uniform", "num_examples")
_DATA_STREAM, _ALGO_STREAM, _ADAPT_STREAM = 1, 2, 3


class SimState(NamedTuple):
    server: PyTree
    client_states: PyTree  # stacked over all K clients, or None
    round: int  # rounds completed


def stream_keys(seed: int) -> Tuple[jax.Array, jax.Array]:
    """(data key, algorithm key) of a run: batch orders and client_init's keys come from
    separate streams of the config seed."""
    key = jax.random.PRNGKey(seed)
    return jax.random.fold_in(key, _DATA_STREAM), jax.random.fold_in(key, _ALGO_STREAM)


def clients_per_round(participation: float, num_clients: int) -> int:
    """max(1, round(R * K)) (SPEC 3)."""
    return max(1, int(round(participation * num_clients)))


def sample_clients(seed: int, num_clients: int, num_sampled: int, round_index: int
                   ) -> np.ndarray:
    """The sorted ids of round `round_index`'s clients, drawn without replacement from
    (seed, round) alone, so a resumed run samples identically."""
    rng = np.random.default_rng([seed, round_index])
    return np.sort(rng.choice(num_clients, num_sampled, replace=False))


@dataclasses.dataclass
class Simulation:
    algorithm: FederatedAlgorithm
    data: ClientData
    work: LocalWork
    executor: Any
    participation: float = 0.1
    aggregation: str = "uniform"
    seed: int = 0
    # Where the K clients' persistent states live: None decides by size (the device when
    # they take at most half its memory, else the host), True/False force it. The numbers
    # are the same either way; the host costs a transfer of the cohort's states per round.
    states_on_host: Optional[bool] = None

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; expected one of "
                             f"{AGGREGATIONS}")
        if not 0.0 < self.participation <= 1.0:
            raise ValueError(f"participation R must lie in (0, 1], got {self.participation}")
        self.num_sampled = clients_per_round(self.participation, self.data.num_clients)
        self.steps = self.work.num_steps(self.data.sizes)
        self._data_key, self._algo_key = stream_keys(self.seed)
        self._server_update = jax.jit(self._aggregate_and_update)
        self._scatter = jax.jit(lambda all_, ids, new: jax.tree_util.tree_map(
            lambda a, n: a.at[ids].set(n), all_, new), donate_argnums=(0,))
        adapt = getattr(self.algorithm, "personal_adapt", None)
        # Every client's model adapted on its batch; a stateless algorithm's None maps over
        # nothing, so the batches set the client axis.
        self._adapt = None if adapt is None else jax.jit(jax.vmap(adapt, in_axes=(None, 0, 0)))

    def init(self, variables: PyTree) -> SimState:
        server = self.algorithm.server_init(variables)
        one = self.algorithm.client_state_init(server)
        if one is None:
            return SimState(server, None, 0)
        k = self.data.num_clients
        if self.states_on_host is None:
            self.states_on_host = _too_big_for_device(
                k * sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(one)))
        if self.states_on_host:
            states = jax.tree_util.tree_map(
                lambda x: np.repeat(np.asarray(x)[None], k, axis=0), one)
        else:
            states = jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(x, (k, *np.shape(x))), one)
        return SimState(server, states, 0)

    # Checkpoints restore into the shapes of `init`'s state (a driver whose model grows,
    # as FedMA's, sets this to restore the saved shapes).
    shapes_change = False

    def sample(self, round_index: int) -> np.ndarray:
        return sample_clients(self.seed, self.data.num_clients, self.num_sampled, round_index)

    def evaluation(self, server: PyTree) -> tuple:
        """(network to evaluate, or None for the experiment's model; its variables)."""
        return None, self.algorithm.eval_variables(server)

    def personal_groups(self, state: SimState) -> None:
        """One network for every client: nothing to group (`protocol.Round`)."""
        del state
        return None

    def personal_evaluation(self, state: SimState) -> Optional[PyTree]:
        """Every client's own model, stacked on a leading client axis (K, ...), or None
        when the algorithm evaluates its global model on each client's data."""
        if self._adapt is not None:
            return self._adapt(state.server, state.client_states,
                               self.adaptation_batches(state.round))
        personal = getattr(self.algorithm, "personal_variables", None)
        if personal is None or state.client_states is None:
            return None
        return jax.vmap(personal, in_axes=(None, 0))(state.server, state.client_states)

    def adaptation_batches(self, round_index: int) -> Dict[str, jax.Array]:
        """Each client's batch for `personal_adapt` after `round_index` rounds, stacked
        (K, B, ...): the first batch of an epoch order of its own, drawn from a stream of
        the seed apart from training's (masked past the client's data)."""
        ids = np.arange(self.data.num_clients)
        keys = client_keys(jax.random.fold_in(self._data_key, _ADAPT_STREAM), round_index, ids)
        b = min(self.work.batch_size, self.data.max_size)  # as the executors' batches
        return jax.vmap(lambda row, n, key: step_batch(
            self.data.images, self.data.labels, row, n, key, 0, b))(
            self.data.index_table, jnp.asarray(self.data.sizes, jnp.int32), keys)

    def cohort(self, state: SimState, round_index: int) -> Cohort:
        ids = self.sample(round_index)
        if self.aggregation == "uniform":
            weights = np.ones(len(ids))
        else:
            weights = self.data.sizes[ids].astype(np.float64)
        states = None if state.client_states is None else jax.tree_util.tree_map(
            lambda x: jnp.asarray(x[ids]), state.client_states)
        return Cohort(ids, self.steps[ids], weights,
                      client_keys(self._data_key, round_index, ids),
                      client_keys(self._algo_key, round_index, ids), states, round_index)

    def _aggregate_and_update(self, server, outputs, weights, info):
        aggregator = self.algorithm.aggregator
        if aggregator.stacked:
            aggregate = aggregator.finalize(outputs, info.weights)
        else:
            aggregate = aggregator.finalize(outputs, jnp.sum(weights))
        return self.algorithm.server_update(server, aggregate, info)

    def client_updates(self, state: SimState) -> list:
        """Each client of round `state.round`'s cohort, run alone: their outputs (for FedAvg,
        {'delta', 'model_state'}), in cohort order. For analyses of local models."""
        cohort = self.cohort(state, state.round)
        outputs = []
        for m in range(len(cohort.ids)):
            one = Cohort(cohort.ids[m:m + 1], cohort.steps[m:m + 1], np.ones(1),
                         cohort.data_keys[m:m + 1], cohort.rngs[m:m + 1],
                         None if cohort.client_states is None else jax.tree_util.tree_map(
                             lambda x: x[m:m + 1], cohort.client_states))
            result = self.executor.run(state.server, one)
            outputs.append(result.output_sum if result.outputs is None else
                           jax.tree_util.tree_map(lambda x: x[0], result.outputs))
        return outputs

    def round(self, state: SimState) -> tuple[SimState, Dict[str, float]]:
        """Runs round `state.round`; returns the new state and the round's statistics."""
        cohort = self.cohort(state, state.round)
        result = self.executor.run(state.server, cohort)
        weights = jnp.asarray(cohort.weights, jnp.float32)
        info = RoundInfo(jnp.int32(state.round), jnp.asarray(cohort.ids, jnp.int32),
                         weights / jnp.sum(weights), self.data.num_clients)
        outputs = result.outputs if self.algorithm.aggregator.stacked else result.output_sum
        server = self._server_update(state.server, outputs, weights, info)
        client_states = state.client_states
        if client_states is not None and isinstance(
                jax.tree_util.tree_leaves(client_states)[0], np.ndarray):
            # In place, as the device path's donated scatter (a restored array may be
            # read-only: copied once).
            client_states = jax.tree_util.tree_map(
                lambda a: a if a.flags.writeable else np.array(a), client_states)
            for a, n in zip(jax.tree_util.tree_leaves(client_states),
                            jax.tree_util.tree_leaves(result.client_states)):
                a[cohort.ids] = np.asarray(n)
        elif client_states is not None:
            client_states = self._scatter(client_states, jnp.asarray(cohort.ids),
                                          result.client_states)
        metrics = dict(jax.device_get(result.metrics))
        upload = float(metrics.pop("upload_bytes"))
        real = real_examples(self.work, self.data.sizes[cohort.ids])
        stats = {**train_metrics(metrics), "real_examples": real,
                 "computed_examples": result.computed_examples, "upload_bytes": upload}
        return SimState(server, client_states, state.round + 1), stats


def train_metrics(sums: Dict[str, Any]) -> Dict[str, float]:
    """Per-example means of a round's metric sums: 'loss_sum' -> 'train_loss', and each
    other '<name>_sum' an algorithm reports -> 'train_<name>'; other keys as summed."""
    count = max(float(sums["num_examples"]), 1.0)
    out = {}
    for key, value in sums.items():
        if key == "num_examples":
            continue
        if key.endswith("_sum"):
            out["train_" + key[:-4]] = float(value) / count
        else:
            out["train_" + key] = float(value)
    return out


def _too_big_for_device(nbytes: int) -> bool:
    """True when `nbytes` exceeds half the first device's memory (when it reports one)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        stats = {}
    limit = stats.get("bytes_limit")
    return bool(limit) and nbytes > limit // 2
