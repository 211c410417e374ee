"""One federated round as a composition: sample, execute, aggregate, update.

`Simulation` knows no algorithm by name: it samples clients (R fraction, without
replacement, or each client independently with probability R (Poisson), seeded by
(seed, round) so a resumed run samples identically), hands them to
an executor, averages the client outputs uniformly (the PAN paper) or by example count
(FedAvg's n_k / n), and applies the algorithm's server update. Per-client persistent
state (for algorithms that keep one) is stored for all K clients, on the device, the host
or disk (`engine/store.py`), and gathered/scattered for the sampled ones.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.engine import distributed
from fedjax_pan.engine import store, timing
from fedjax_pan.engine.protocol import (Arrivals, FederatedAlgorithm, Recruiter,
                                        RoundDefaults, RoundInfo, placeholder_context,
                                        stacked_aggregate, stacked_entries, tree_bytes)
from fedjax_pan.engine.clients import (ClientData, LocalWork, client_keys, real_examples,
                                       step_batch)
from fedjax_pan.engine.execution import Cohort, CohortResult, pop_upload_bytes
from fedjax_pan.errors import ConfigError

PyTree = Any
AGGREGATIONS = ("uniform", "num_examples")
# A round's statistics when no client trained in it.
_UNTRAINED = {"train_loss": 0.0, "real_examples": 0, "computed_examples": 0,
              "upload_bytes": 0.0, "clients": 0}
SAMPLINGS = ("uniform", "poisson")
_DATA_STREAM, _ALGO_STREAM, _ADAPT_STREAM, _TUNE_STREAM = 1, 2, 3, 4


def untrained() -> Dict[str, Any]:
    """The statistics of a round in which no client trained (nothing sent either way)."""
    return {**_UNTRAINED, "download_bytes": 0.0}


class SimState(NamedTuple):
    server: PyTree
    client_states: PyTree  # stacked over all K clients, or None
    round: int  # rounds completed
    timing: Optional[timing.TimeState] = None  # simulated time, outputs in flight
    selection: Optional[PyTree] = None  # a `Recruiter`'s state (NumPy arrays)

    def saved(self) -> tuple:
        """What a checkpoint holds (`restored` puts it back); the client states' store is
        flushed first (states on disk: the checkpoint names their slots)."""
        store.wrap(self.client_states).flush()
        base = (self.server, self.client_states)
        base = base if self.timing is None else base + (self.timing,)
        return base if self.selection is None else base + ({"selection": self.selection},)

    def checkpointed(self) -> None:
        """A checkpoint of this state was written (states on disk keep its slots)."""
        store.wrap(self.client_states).checkpointed()

    @staticmethod
    def restored(tree: tuple, round_index: int) -> "SimState":
        rest = list(tree[2:])
        selection = (rest.pop()["selection"] if rest and isinstance(rest[-1], dict)
                     else None)
        state = SimState(tree[0], tree[1], round_index, *rest, selection=selection)
        store.wrap(state.client_states).resumed()
        return state


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


def poisson_clients(seed: int, num_clients: int, rate: float, round_index: int
                    ) -> np.ndarray:
    """The sorted ids of round `round_index`'s clients when each takes part independently
    with probability `rate` (Poisson sampling: the cohort's size varies, and may be 0),
    drawn from (seed, round) alone."""
    rng = np.random.default_rng([seed, round_index])
    return np.flatnonzero(rng.random(num_clients) < rate)


def sampled_clients(seed: int, num_clients: int, participation: float, sampling: str,
                    round_index: int) -> np.ndarray:
    """Round `round_index`'s cohort under `sampling` (SAMPLINGS): `poisson_clients`, or
    `sample_clients` of max(1, round(R K)); a pure function of (seed, round)."""
    if sampling == "poisson":
        return poisson_clients(seed, num_clients, participation, round_index)
    return sample_clients(seed, num_clients, clients_per_round(participation, num_clients),
                          round_index)


@dataclasses.dataclass
class Tuning:
    """Local training every client gives the model it is evaluated on before its own test
    part scores it (paper 001's FedAvg-C): `algorithm` takes that model as its client
    state and returns the tuned one as its new state (`algorithms.finetune`), run by
    `executor` for `work`'s local steps."""

    algorithm: FederatedAlgorithm
    work: LocalWork
    executor: Any

    def __post_init__(self):
        self.server = self.algorithm.server_init(None)


@dataclasses.dataclass
class Simulation(RoundDefaults):
    algorithm: FederatedAlgorithm
    data: ClientData
    work: LocalWork
    executor: Any
    participation: float = 0.1
    aggregation: str = "uniform"
    seed: int = 0
    # Where the K clients' persistent states live (`store.PLACES`): 'auto' decides by
    # size (`store.place`). The numbers are the same in every place.
    states_in: str = "auto"
    # Clients that answer late and the server's policy (engine/timing.py); None: none.
    stragglers: Optional[timing.Stragglers] = None
    # 'uniform': round(R K) clients a round without replacement; 'poisson': each client
    # with probability R (`num_sampled` is then the expected count, rounded).
    sampling: str = "uniform"
    # Fine-tuning before every evaluation on the clients' own data; None: none.
    tuning: Optional[Tuning] = None
    # Clients recruited by the server instead of sampled (FAIR's auction); None: sampled.
    recruiter: Optional[Recruiter] = None

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; expected one of "
                             f"{AGGREGATIONS}")
        if not 0.0 < self.participation <= 1.0:
            raise ValueError(f"participation R must lie in (0, 1], got {self.participation}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"unknown sampling {self.sampling!r}; expected one of {SAMPLINGS}")
        if self.sampling == "poisson" and (self.stragglers is not None
                                           and self.stragglers.max_delay > 0):
            raise ValueError("Poisson sampling and stragglers are not available together")
        if self.recruiter is not None and (self.sampling != "uniform" or (
                self.stragglers is not None and self.stragglers.max_delay > 0)):
            raise ValueError("a recruiter replaces sampling, and answers no late clients: "
                             "it needs sampling='uniform' and no stragglers")
        if self.states_in not in store.PLACES:
            raise ValueError(f"unknown place for client states {self.states_in!r}; "
                             f"expected one of {store.PLACES}")
        self._states_dir: Optional[str] = None  # disk states: a temporary folder
        self._place: Optional[str] = None  # where `init` put the client states
        self.num_sampled = clients_per_round(self.participation, self.data.num_clients)
        self.steps = self.work.num_steps(self.data.sizes)
        self._data_key, self._algo_key = stream_keys(self.seed)
        self._server_update = jax.jit(self._aggregate_and_update)
        self._update_and_report = jax.jit(self._aggregate_update_report)
        self._model_bytes, self._download = None, None
        adapt = getattr(self.algorithm, "personal_adapt", None)
        # Every client's model adapted on its batch; a stateless algorithm's None maps over
        # nothing, so the batches set the client axis.
        self._adapt = None if adapt is None else jax.jit(jax.vmap(adapt, in_axes=(None, 0, 0)))
        if self.stragglers is not None and self.stragglers.max_delay == 0:
            self.stragglers = None  # nothing is ever late: the synchronous engine
        if self.stragglers is not None:
            self._slow = self.stragglers.slow_clients(self.seed, self.data.num_clients)
            self._entries = jax.jit(lambda server, outputs: stacked_entries(
                self.algorithm, server, outputs))
            self._stacked_update = jax.jit(self._stacked_update_fn)

    def attach(self, workdir: str, resume: bool) -> None:
        """Client states kept on disk go in `workdir` (where process 0 of a run writes;
        the other processes keep theirs in a temporary folder)."""
        del resume  # a resumed run's checkpoint names the slots it continues from
        self._states_dir = (os.path.join(workdir, store.FOLDER) if distributed.is_primary()
                            else None)

    def init(self, variables: PyTree) -> SimState:
        server = self.algorithm.server_init(variables)
        state = self._init_states(server)
        if self.recruiter is not None:
            state = state._replace(selection=self.recruiter.init(self.data.num_clients))
        if self.stragglers is None:
            return state
        return state._replace(timing=self._empty_time(server, state.client_states))

    def _init_states(self, server: PyTree) -> SimState:
        states = store.create(self.states_in, self.algorithm.client_state_init(server),
                              self.data.num_clients, self._states_dir)
        self._place = states.place
        return SimState(server, states.tree, 0)

    def _states(self, client_states: PyTree) -> store.ClientStates:
        """The store of a state's `client_states` (`store.wrap`)."""
        return store.wrap(client_states, self._place)

    def sample(self, round_index: int) -> np.ndarray:
        return sampled_clients(self.seed, self.data.num_clients, self.participation,
                               self.sampling, round_index)

    def _recruit(self, selection: PyTree, round_index: int) -> tuple:
        """(ids, selection state after choosing, row fields) of round `round_index`: the
        recruiter's choice from its state `selection`, or the sampled cohort."""
        if self.recruiter is None:
            return self.sample(round_index), selection, {}
        ids, selection, fields = self.recruiter.select(selection, round_index)
        return np.asarray(ids, np.int64), selection, fields

    def evaluation(self, server: PyTree) -> tuple:
        """(network to evaluate, or None for the experiment's model; its variables)."""
        return None, self.algorithm.eval_variables(server)

    def personal_groups(self, state: SimState):
        """One network for every client: nothing to group (`protocol.Round`), except where
        the client states' store reads them in chunks (disk: all K at once need not fit in
        memory): then every client's own model, a chunk of clients at a time, as (None:
        the experiment's network, ids, their stacked models)."""
        states = self._states(state.client_states)
        if states.chunk is None or not self._personal_models():
            return None
        return ((None, ids, self._personal(state, chunk, ids))
                for ids, chunk in states.chunks(states.chunk))

    def _personal_models(self) -> bool:
        return self.tuning is not None or self._adapt is not None or (
            getattr(self.algorithm, "personal_variables", None) is not None)

    def _personal(self, state: SimState, states: PyTree, ids: np.ndarray) -> PyTree:
        """Clients `ids`' own models from their stacked `states` (None: stateless), tuned
        where the simulation fine-tunes."""
        if self._adapt is not None:
            models = self._adapt(state.server, states,
                                 self.adaptation_batches(state.round, ids))
        elif getattr(self.algorithm, "personal_variables", None) is not None:
            models = jax.vmap(self.algorithm.personal_variables, in_axes=(None, 0))(
                state.server, states)
        else:  # the global model, each client's copy to tune
            models = jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(x, (len(ids), *np.shape(x))),
                self.algorithm.eval_variables(state.server))
        return models if self.tuning is None else self.tuned(state, models, ids)

    def tuned(self, state: SimState, models: PyTree, ids: np.ndarray) -> PyTree:
        """Clients `ids`' `models` (stacked in `ids` order) after `tuning`'s local
        training on their own data, on batch orders and keys of a stream of the seed of
        their own (apart from training's), for the evaluation after `state.round`
        rounds."""
        t = self.tuning
        ids = np.asarray(ids)
        stream = jax.random.fold_in(self._data_key, _TUNE_STREAM)
        rngs = jax.random.fold_in(self._algo_key, _TUNE_STREAM)
        cohort = Cohort(ids, t.work.num_steps(self.data.sizes[ids]), np.ones(len(ids)),
                        client_keys(stream, state.round, ids),
                        client_keys(rngs, state.round, ids), models, state.round)
        return t.executor.run(t.server, cohort).client_states

    def personal_evaluation(self, state: SimState) -> Optional[PyTree]:
        """Every client's own model, stacked on a leading client axis (K, ...), or None
        when the algorithm evaluates its global model on each client's data (and no
        fine-tuning changes it first)."""
        states = state.client_states
        if not self._personal_models() or (states is None and self._adapt is None
                                           and self.tuning is None):
            return None
        return self._personal(state, self._states(states).everyone(),
                              np.arange(self.data.num_clients))

    def adaptation_batches(self, round_index: int, ids: Optional[np.ndarray] = None
                           ) -> Dict[str, jax.Array]:
        """Each client's (or clients `ids`') batch for `personal_adapt` after
        `round_index` rounds, stacked (K, B, ...): the first batch of an epoch order of
        its own, drawn from a stream of the seed apart from training's (masked past the
        client's data)."""
        ids = np.arange(self.data.num_clients) if ids is None else np.asarray(ids)
        keys = client_keys(jax.random.fold_in(self._data_key, _ADAPT_STREAM), round_index, ids)
        b = min(self.work.batch_size, self.data.max_size)  # as the executors' batches
        return jax.vmap(lambda row, n, key: step_batch(
            self.data.images, self.data.labels, row, n, key, 0, b))(
            self.data.index_table[jnp.asarray(ids)],
            jnp.asarray(self.data.sizes[ids], jnp.int32), keys)

    def _weights(self, ids: np.ndarray) -> np.ndarray:
        """Clients' aggregation weights: 1 each (uniform) or their example counts."""
        if self.aggregation == "uniform":
            return np.ones(len(ids))
        return self.data.sizes[ids].astype(np.float64)

    def cohort(self, state: SimState, round_index: int,
               ids: Optional[np.ndarray] = None) -> Cohort:
        """Round `round_index`'s cohort: its sampled (or recruited) clients, or `ids`."""
        if ids is None:
            ids = self._recruit(state.selection, round_index)[0]
        return Cohort(ids, self.steps[ids], self._weights(ids),
                      client_keys(self._data_key, round_index, ids),
                      client_keys(self._algo_key, round_index, ids),
                      self._states(state.client_states).gather(ids), round_index)

    def _stacked_round(self, server, outputs, info):
        """(entries, arrivals) of a synchronous round's stacked outputs."""
        entries, scores = stacked_entries(self.algorithm, server, outputs)
        arrivals = Arrivals(jnp.zeros(info.weights.shape, jnp.int32), scores, info.round,
                            self.algorithm.eval_variables(server))
        return entries, arrivals

    def _aggregate_and_update(self, server, outputs, weights, info):
        if self.algorithm.aggregator.stacked:
            entries, arrivals = self._stacked_round(server, outputs, info)
            aggregate = stacked_aggregate(self.algorithm, server, entries, info.weights,
                                          arrivals)
        else:
            aggregate = self.algorithm.aggregator.finalize(outputs, jnp.sum(weights))
        return self.algorithm.server_update(server, aggregate, info)

    def _aggregate_update_report(self, server, outputs, weights, info):
        """The server update and the stacked aggregator's `report` of the round."""
        del weights  # a stacked rule reads the normalised weights of `info`
        entries, arrivals = self._stacked_round(server, outputs, info)
        aggregate, report = stacked_aggregate(self.algorithm, server, entries, info.weights,
                                              arrivals, report=True)
        return self.algorithm.server_update(server, aggregate, info), report

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

    def _store_states(self, client_states: PyTree, ids: np.ndarray, new: PyTree) -> PyTree:
        """`client_states` with clients `ids`' rows set to `new` (stacked in `ids` order)."""
        return self._states(client_states).scatter(ids, new).tree

    def _info(self, round_index: int, ids: np.ndarray) -> RoundInfo:
        weights = jnp.asarray(self._weights(ids), jnp.float32)
        return RoundInfo(jnp.int32(round_index), jnp.asarray(ids, jnp.int32),
                         weights / jnp.sum(weights), self.data.num_clients)

    def _statistics(self, results: list, ids: np.ndarray) -> Dict[str, float]:
        """A round's statistics over its executor `results` (clients `ids` trained)."""
        sums = jax.device_get(results[0].metrics)
        for r in results[1:]:
            sums = jax.tree_util.tree_map(lambda a, b: a + b, sums, jax.device_get(r.metrics))
        metrics = dict(sums)
        upload = pop_upload_bytes(metrics)
        return {**train_metrics(metrics),
                "real_examples": real_examples(self.work, self.data.sizes[ids]),
                "computed_examples": sum(r.computed_examples for r in results),
                "upload_bytes": upload, "clients": len(ids)}

    def round(self, state: SimState) -> tuple[SimState, Dict[str, float]]:
        """Runs round `state.round`; returns the new state and the round's statistics."""
        self._states(state.client_states).start_round()
        if self.stragglers is not None:
            return self._timed_round(state)
        return self._synchronous(state)

    def _synchronous(self, state: SimState) -> tuple[SimState, Dict[str, float]]:
        ids, selection, recruited = self._recruit(state.selection, state.round)
        cohort = self.cohort(state, state.round, ids)
        if not len(cohort.ids):
            new, stats = self._empty_round(state)
            selection, stats = self._observed(selection, cohort.ids, {}, state.round, stats,
                                              recruited)
            return new._replace(selection=selection), stats
        download = self.download_bytes(state.server, cohort.ids, state.round)
        result = self.executor.run(state.server, cohort)
        weights = jnp.asarray(cohort.weights, jnp.float32)
        info = RoundInfo(jnp.int32(state.round), jnp.asarray(cohort.ids, jnp.int32),
                         weights / jnp.sum(weights), self.data.num_clients)
        agg = self.algorithm.aggregator
        outputs = result.outputs if agg.stacked else result.output_sum
        report = {}
        if self.recruiter is not None and agg.stacked and agg.report is not None:
            server, report = self._update_and_report(state.server, outputs, weights, info)
        else:
            server = self._server_update(state.server, outputs, weights, info)
        client_states = self._store_states(state.client_states, cohort.ids,
                                           result.client_states)
        selection, stats = self._observed(
            selection, cohort.ids, jax.tree_util.tree_map(np.asarray, report), state.round,
            {**self._statistics([result], cohort.ids), "download_bytes": download}, recruited)
        return (SimState(server, client_states, state.round + 1, state.timing, selection),
                stats)

    def _observed(self, selection: PyTree, ids: np.ndarray, report: Dict[str, Any],
                  round_index: int, stats: Dict[str, Any], recruited: Dict[str, Any]
                  ) -> tuple:
        """(the recruiter's state once it has seen the round's `report`, the round's
        statistics with its fields); without a recruiter, both as they are."""
        if self.recruiter is None:
            return selection, stats
        selection, observed = self.recruiter.observe(selection, ids, report, round_index)
        return selection, {**stats, **recruited, **observed}

    def download_bytes(self, server: PyTree, ids: np.ndarray, round_index: int) -> float:
        """Bytes clients `ids` receive at round `round_index`: the algorithm's count, else
        each the global model (`eval_variables`); summed on the host (exact)."""
        count = self.algorithm.download_bytes
        if count is None:
            if self._model_bytes is None:
                self._model_bytes = tree_bytes(jax.eval_shape(self.algorithm.eval_variables,
                                                              server))
            return float(len(ids) * self._model_bytes)
        if self._download is None:
            self._download = jax.jit(count)
        each = np.asarray(self._download(server, jnp.asarray(ids, jnp.int32),
                                         jnp.int32(round_index)), np.int64)
        return float(np.broadcast_to(each, (len(ids),)).sum())

    def _empty_round(self, state: SimState) -> tuple[SimState, Dict[str, float]]:
        """A round nobody was sampled for (Poisson sampling): the server stays as it was,
        or where its aggregator `closes_empty` (a fixed denominator) its update sees a zero
        sum of outputs and a total weight 0."""
        empty = untrained()
        agg = self.algorithm.aggregator
        if not agg.closes_empty or agg.stacked:
            return state._replace(round=state.round + 1), empty
        zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype),
                                       self._one_entry(state.server, state.client_states))
        info = RoundInfo(jnp.int32(state.round), jnp.zeros(0, jnp.int32),
                         jnp.zeros(0, jnp.float32), self.data.num_clients)
        server = self._server_update(state.server, zeros, jnp.zeros(1, jnp.float32), info)
        return SimState(server, state.client_states, state.round + 1, state.timing), empty

    # --- stragglers (engine/timing.py) -------------------------------------------------

    def _one_entry(self, server: PyTree, client_states: PyTree) -> PyTree:
        """Shapes of one client's in-flight entry: its output (a streaming rule: weighted),
        or for a model-space rule its model; with its scores."""
        ctx = placeholder_context(self.data.label_counts.shape[1])
        one_state = self._states(client_states).template()

        def entry(server, client_state):
            alg = self.algorithm
            output = alg.client_output(alg.client_init(server, client_state, ctx), server)[0]
            if not alg.aggregator.stacked:
                return output
            entries, scores = stacked_entries(alg, server, jax.tree_util.tree_map(
                lambda x: x[None], output))
            return jax.tree_util.tree_map(lambda x: x[0], (entries, scores))
        return jax.eval_shape(entry, server, one_state)

    def _in_flight_slots(self) -> int:
        return timing.in_flight_slots(self.stragglers.max_delay, self.num_sampled,
                                      self.data.num_clients, self.algorithm.aggregator.stacked)

    def _empty_time(self, server: PyTree, client_states: PyTree) -> timing.TimeState:
        k = self.data.num_clients
        if self.stragglers.policy != "stale":
            return timing.empty(k)
        stacked = self.algorithm.aggregator.stacked
        one = self._one_entry(server, client_states)
        # The config's check before the data load estimated the model's size; this is the
        # entry's own (an algorithm's output may be several models).
        error = timing.in_flight_error(self.stragglers.max_delay, self.num_sampled, k,
                                       stacked, tree_bytes(one))
        if error is not None:
            raise ConfigError(f"config.{error}")
        # Stacked: a slot a client; streaming: a slot a (round, delay) group of up to M.
        slots = self._in_flight_slots()
        zeros = jax.tree_util.tree_map(lambda s: np.zeros((slots,) + s.shape, s.dtype), one)
        return timing.empty(k, zeros, 1 if stacked else self.num_sampled)

    def _stacked_update_fn(self, server, fresh, fresh_weights, slots, slot_weights,
                           staleness, info):
        """The server update over this round's fresh entries and the slots in flight
        (weights 0 where nothing arrives), as one stack."""
        entries, scores = jax.tree_util.tree_map(
            lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), fresh, slots)
        weights = jnp.concatenate([fresh_weights, slot_weights])
        weights = weights / jnp.sum(weights)
        arrivals = Arrivals(staleness, scores, info.round,
                            self.algorithm.eval_variables(server))
        aggregate = stacked_aggregate(self.algorithm, server, entries, weights, arrivals)
        return self.algorithm.server_update(server, aggregate, info)

    def _timed_round(self, state: SimState) -> tuple[SimState, Dict[str, Any]]:
        """A round under the straggler model (engine/timing.py)."""
        t, st = state.round, state.timing
        if st.arrival is not None:  # a checkpoint's slots, perhaps of an earlier layout
            st = timing.resized(st, self._in_flight_slots())
            state = state._replace(timing=st)
        ids = self.sample(t)
        now = float(st.clock[0])
        plan = timing.plan(self.stragglers, now, np.asarray(st.free_at), ids,
                           self.stragglers.draw(self.seed, t, ids, self._slow,
                                                np.asarray(st.free_at)[ids] <= now))
        free_at = np.array(st.free_at, np.float64)
        free_at[ids[plan.active]] = now + 1.0 + plan.delays[plan.active]
        arriving = (np.zeros(0, bool) if st.arrival is None else np.asarray(st.arrival) == t)
        d = self.stragglers.max_delay
        if plan.used.all() and not arriving.any():
            # Nothing late, nobody busy: the synchronous round itself.
            new, stats = self._synchronous(state)
            staleness = np.zeros(len(ids), np.int64)
        else:
            new, stats, staleness = self._asynchronous(state, ids, plan, arriving)
            stats["download_bytes"] = self.download_bytes(state.server, ids[plan.active], t)
        clock = np.array([now + plan.duration])
        stats.update(sim_time=float(clock[0]),
                     sim_arrivals=timing.arrivals_by_staleness(staleness, d),
                     sim_busy=int((~plan.active).sum()),
                     sim_dropped=int((plan.active & ~plan.used & ~plan.kept).sum()))
        return new._replace(timing=new.timing._replace(clock=clock, free_at=free_at)), stats

    def _asynchronous(self, state: SimState, ids: np.ndarray, plan: timing.Plan,
                      arriving: np.ndarray) -> tuple:
        """A round some of whose outputs are late or arrive late: (state, statistics,
        staleness of each used output). Slots in flight are read (`arriving`), the round's
        clients trained, the server updated from what arrived (not at all if nothing did),
        and the late outputs stored in free slots."""
        t, st = state.round, state.timing
        flight = timing.Flight(st, arriving, t)
        arrived = np.concatenate([ids[plan.used], flight.arrived_ids])
        staleness = np.concatenate([np.zeros(plan.used.sum(), np.int64), flight.staleness])
        run = _Runner(self, state, ids)
        if self.algorithm.aggregator.stacked:
            server = self._stacked_arrivals(state.server, ids, plan, flight, run, arrived)
        else:
            server = self._streamed_arrivals(state.server, ids, plan, flight, run, arrived)
        new = SimState(server, run.state.client_states, t + 1, flight.stored())
        stats = self._statistics(run.results, np.concatenate(run.trained)) if run.results \
            else dict(_UNTRAINED)
        return new, stats, staleness

    def _stacked_arrivals(self, server, ids, plan, flight, run, arrived):
        """Stacked rule: every active client's entry; the fresh ones (padded to M) and the
        slots in flight in one stack, weights 0 where nothing arrives."""
        sel, m = plan.active, self.num_sampled
        n = int(sel.sum())
        if n:
            fresh = self._entries(server, run(sel).outputs)
        else:  # everyone sampled is busy: only slots in flight can arrive
            fresh = jax.tree_util.tree_map(lambda x: x[:0], flight.slots)
        if len(arrived):
            fresh_w = np.pad(np.where(plan.used[sel], self._weights(ids[sel]), 0.0), (0, m - n))
            padded = jax.tree_util.tree_map(
                lambda x: jnp.pad(x, [(0, m - n)] + [(0, 0)] * (x.ndim - 1)), fresh)
            slots = flight.slots if flight.slots is not None else jax.tree_util.tree_map(
                lambda x: x[:0], padded)
            stale = np.concatenate([np.zeros(m), flight.slot_staleness])
            server = self._stacked_update(
                server, padded, jnp.asarray(fresh_w, jnp.float32), slots,
                jnp.asarray(flight.slot_weights, jnp.float32), jnp.asarray(stale, jnp.int32),
                self._info(flight.round, arrived))
        positions = np.flatnonzero(sel)
        for j in np.flatnonzero(plan.kept[sel]):
            one = np.zeros(len(ids), bool)
            one[positions[j]] = True
            flight.keep(jax.tree_util.tree_map(lambda x: x[j], fresh), ids[one],
                        self._weights(ids[one]), int(plan.delays[positions[j]]))
        return server

    def _streamed_arrivals(self, server, ids, plan, flight, run, arrived):
        """Streaming rule: the round's fresh outputs summed in one run, each delay's late
        ones in a run of their own (one slot each), plus the sums arriving from flight."""
        total, mass = None, 0.0
        if plan.used.any():
            total = run(plan.used).output_sum
            mass = float(np.sum(self._weights(ids[plan.used])))
        for delay in range(1, self.stragglers.max_delay + 1):
            sel = plan.kept & (plan.delays == delay)
            if sel.any():
                flight.keep(run(sel).output_sum, ids[sel], self._weights(ids[sel]), delay)
        dropped = plan.active & ~plan.used & ~plan.kept
        if dropped.any() and run.state.client_states is not None:
            run(dropped)  # they trained (their states move on); the server ignores them
        for part, w in flight.arriving_entries():
            total = part if total is None else jax.tree_util.tree_map(
                lambda a, b: a + b, total, part)
            mass += w
        if mass > 0:
            server = self._server_update(server, total, jnp.asarray([mass], jnp.float32),
                                         self._info(flight.round, arrived))
        return server


class _Runner:
    """Trains subsets of a round's clients one executor run at a time, keeping each
    run's result and the client states it leaves (for `Simulation._asynchronous`)."""

    def __init__(self, sim: Simulation, state: SimState, ids: np.ndarray):
        self.sim, self.state, self.ids = sim, state, ids
        self.results: list = []
        self.trained: list = []

    def __call__(self, sel: np.ndarray) -> CohortResult:
        sub = self.ids[sel]
        result = self.sim.executor.run(self.state.server,
                                       self.sim.cohort(self.state, self.state.round, sub))
        self.state = self.state._replace(client_states=self.sim._store_states(
            self.state.client_states, sub, result.client_states))
        self.results.append(result)
        self.trained.append(sub)
        return result


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
