"""What the engine gives an algorithm's driver: the federation and the machinery of a round.

A driver is server logic that cannot be one compiled round (FedMA matches neurons on the
host; KT-pFL over several networks steps one coefficient matrix across groups). It holds
that logic only and asks `Services` for the rest: which clients a round samples (from the
seed alone), their key streams, their cohort, training them with any algorithm through
executors built once and cached, and the round's statistics. Every number therefore
comes out as it would from `Simulation`: same samples, batch orders and keys. What the
run's config selects by name arrives resolved (the assembly resolves it): the server
optimiser, the cohort sampling, and the attack that puts the config's attackers among an
algorithm's clients; a driver never reads the registry.

    services = Services(client_data, local_work, participation=0.1, seed=0)
    ids = services.sample(r)
    result = services.train("local", algorithm, variables, services.cohort(ids, r, states))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Hashable, Optional

import jax
import numpy as np
import optax

from fedjax_pan.engine.clients import ClientData, LocalWork, client_keys, real_examples
from fedjax_pan.engine.execution import (UPLOAD_MIB, Cohort, CohortResult, make_executor,
                                         pop_upload_bytes)
from fedjax_pan.engine.protocol import FederatedAlgorithm, PyTree, RoundDefaults
from fedjax_pan.engine.simulation import (SimState, clients_per_round, sample_clients,
                                          stream_keys, train_metrics, untrained)
from fedjax_pan.engine.timing import available_memory

# available_memory: what a driver sizing its own state (FLChain's channels) checks against.
__all__ = ["Services", "SimState", "Cohort", "CohortResult", "RoundDefaults",
           "available_memory"]


@dataclasses.dataclass
class Services:
    """The engine's services for a driver over `data`'s clients doing `work` each round."""

    data: ClientData
    work: LocalWork
    participation: float = 1.0
    seed: int = 0
    strategy: str = "auto"  # execution.strategy
    block_size: Optional[int] = None  # execution.block_size
    # The server's optimiser (FedAvg's sgd(1) by default: the mean of the clients' updates).
    server_tx: optax.GradientTransformation = optax.sgd(1.0)
    # The run's resolved cohort sampling (simulation.SAMPLINGS), for draws that follow the
    # run's cohorts (a per-round attackers' table); `sample` itself draws uniform cohorts,
    # the only ones a driver runs.
    sampling: str = "uniform"
    # attack(algorithm, malicious): `algorithm` with the run's attackers among its clients,
    # given their (K,) or (R, K) table; None when the run has no attack.
    attack: Optional[Callable[[FederatedAlgorithm, np.ndarray], FederatedAlgorithm]] = None

    def __post_init__(self):
        self.num_clients = self.data.num_clients
        self.num_sampled = clients_per_round(self.participation, self.num_clients)
        self._data_key, self._algo_key = stream_keys(self.seed)
        self._executors: Dict[Hashable, Any] = {}

    def sample(self, round_index: int) -> np.ndarray:
        """The sorted ids of round `round_index`'s clients (as `Simulation` samples them)."""
        return sample_clients(self.seed, self.num_clients, self.num_sampled, round_index)

    def cohort(self, ids: np.ndarray, round_index: int, client_states: PyTree, *,
               work: Optional[LocalWork] = None, stage: int = 0,
               rows: Optional[np.ndarray] = None) -> Cohort:
        """Clients `ids` of round `round_index` with their stacked `client_states`: their
        local steps under `work` (default the federation's), batch-order keys of the
        round's stream (`stage` > 0: a stream of its own, for a second training of the same
        round) and client_init keys. `rows`: where the executor's data holds them (default
        `ids`; a group's own rows when it runs on `subset(ids)`)."""
        ids = np.asarray(ids)
        work = self.work if work is None else work
        data_key = self._data_key if stage == 0 else jax.random.fold_in(self._data_key, stage)
        return Cohort(ids if rows is None else np.asarray(rows),
                      work.num_steps(self.data.sizes[ids]), np.ones(len(ids)),
                      client_keys(data_key, round_index, ids),
                      client_keys(self._algo_key, round_index, ids), client_states,
                      round_index)

    def subset(self, ids: np.ndarray) -> ClientData:
        """The clients `ids` alone, as a federation of their own (rows 0..len(ids)-1)."""
        return dataclasses.replace(self.data, index_table=self.data.index_table[ids],
                                   sizes=self.data.sizes[ids],
                                   label_counts=self.data.label_counts[ids])

    def executor(self, key: Hashable, algorithm: FederatedAlgorithm, variables: PyTree, *,
                 work: Optional[LocalWork] = None, data: Optional[ClientData] = None,
                 per_round: Optional[int] = None) -> Any:
        """The executor cached under `key`, built on first use for `algorithm` (whose
        models are shaped like `variables`) as `strategy` and `block_size` say."""
        if key not in self._executors:
            self._executors[key] = make_executor(
                self.strategy, algorithm, self.work if work is None else work,
                self.data if data is None else data, variables,
                self.num_sampled if per_round is None else per_round, self.block_size)
        return self._executors[key]

    def train(self, key: Hashable, algorithm: FederatedAlgorithm, variables: PyTree,
              cohort: Cohort, server: PyTree = None, **executor_options: Any) -> CohortResult:
        """`cohort` trained with `algorithm` from the broadcast `server` state, through
        the executor cached under `key` (`executor`)."""
        return self.executor(key, algorithm, variables, **executor_options).run(server, cohort)

    def real_examples(self, ids: np.ndarray, work: Optional[LocalWork] = None) -> int:
        """Real (unpadded) examples clients `ids` process under `work` in one round."""
        return real_examples(self.work if work is None else work, self.data.sizes[ids])

    untrained = staticmethod(untrained)  # a round in which no client trained

    @staticmethod
    def statistics(sums: Dict[str, Any], **fields: Any) -> Dict[str, Any]:
        """A round's statistics: per-example means of an executor's metric sums
        (`train_loss`, `train_<name>`), the bytes its clients sent (`upload_bytes`, unless
        `fields` gives it), plus `fields` (real_examples, computed_examples, ...)."""
        sums = dict(sums)
        if UPLOAD_MIB in sums:
            fields.setdefault("upload_bytes", pop_upload_bytes(sums))
        return {**train_metrics(sums), **fields}
