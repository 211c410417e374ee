"""Clients of several architectures in one federation (PFLlib's heterogeneous-model
clients): `Groups`, a `protocol.Round` on the engine's services.

Client n runs network `models[arch[n]]`. Each architecture's clients form a group with
that network's build of the algorithm and executors of their own, on the group's rows of
the data. An algorithm runs this way when what its clients send does not depend on their
network (prototypes, per-class logits, a shared model of one architecture): every
group's outputs make one aggregate, and every group's server state takes the same server
update from it. Sampling, batch orders and keys follow global client ids, so
one group over every client gives `Simulation`'s numbers exactly.

Inside a group, `ClientContext.client_id` is the client's row in its group (0..n_a - 1).
A streaming aggregator's sums are added over groups; a stacked one (in output space) gets
every output in the cohort's order. The global evaluation shows architecture 0's
`eval_variables`; each client is scored on its own network's `personal_variables`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.engine.protocol import (Arrivals, FederatedAlgorithm, PyTree, RoundDefaults,
                                        RoundInfo, tree_bytes)
from fedjax_pan.engine.services import Services
from fedjax_pan.engine.simulation import SimState

__all__ = ["Groups"]


@dataclasses.dataclass
class Groups(RoundDefaults):
    """A round over clients of several networks (module docstring); `algorithms[a]` is
    the algorithm built for `models[a]`, starting from `initial[a]`; `weights`:
    'uniform' or 'num_examples' (the aggregation weights)."""

    models: Sequence[nn.Module]
    initial: Sequence[PyTree]
    arch: np.ndarray  # (N,) client -> index into `models`
    algorithms: Sequence[FederatedAlgorithm]
    services: Services
    weights: str = "uniform"

    def __post_init__(self):
        self.arch = np.asarray(self.arch, np.int64)
        n = self.services.num_clients
        if self.arch.shape != (n,) or self.arch.min() < 0 or \
                self.arch.max() >= len(self.models):
            raise ValueError(f"arch must give each of the {n} clients an index into the "
                             f"{len(self.models)} architectures, got {self.arch}")
        if not len(self.models) == len(self.initial) == len(self.algorithms):
            raise ValueError("one initial model and one algorithm per architecture")
        if any(a.aggregator.space != "output" or a.aggregator.score is not None
               for a in self.algorithms):
            raise ValueError("clients of several networks combine outputs, not models: "
                             "this algorithm's aggregator combines models")
        self.stacked = self.algorithms[0].aggregator.stacked
        self.num_clients, self.num_sampled = n, self.services.num_sampled
        self.ids: List[np.ndarray] = []
        self.executors = []
        for a, (algorithm, variables) in enumerate(zip(self.algorithms, self.initial)):
            ids = np.flatnonzero(self.arch == a)
            if not len(ids):
                raise ValueError(f"no client has architecture {a}: there are {n} clients for "
                                 f"{len(self.models)} architectures")
            self.ids.append(ids)
            per_round = max(1, -(-self.num_sampled * len(ids) // n))
            # Keyed by this object too: another Groups on the same services has groups of
            # its own.
            self.executors.append(self.services.executor(
                ("groups", id(self), a), algorithm, variables,
                data=self.services.subset(ids), per_round=per_round))
        self._check_outputs()
        self._updates = [jax.jit(a.server_update) for a in self.algorithms]
        self._finalize = jax.jit(self.algorithms[0].aggregator.finalize)
        self._model_bytes: Dict[int, int] = {}
        self._scatter = jax.jit(lambda all_, rows, new: jax.tree_util.tree_map(
            lambda x, y: x.at[rows].set(y), all_, new))

    def _check_outputs(self) -> None:
        """Every network's clients must send outputs of one structure (their sum is the
        aggregate): refused here otherwise, naming the first that differs."""
        from fedjax_pan.engine.protocol import placeholder_context
        num_classes = int(self.services.data.label_counts.shape[1])
        shapes = []
        for algorithm, variables in zip(self.algorithms, self.initial):
            def output(v, algorithm=algorithm):
                server = algorithm.server_init(v)
                local = algorithm.client_init(server, algorithm.client_state_init(server),
                                              placeholder_context(num_classes))
                return algorithm.client_output(local, server)[0]
            shapes.append(jax.eval_shape(output, variables))
        for a, s in enumerate(shapes[1:], start=1):
            if jax.tree_util.tree_structure(s) != jax.tree_util.tree_structure(shapes[0]) or \
                    [x.shape for x in jax.tree_util.tree_leaves(s)] != \
                    [x.shape for x in jax.tree_util.tree_leaves(shapes[0])]:
                raise ValueError(f"architecture {a} ({type(self.models[a]).__name__}) sends "
                                 f"outputs shaped {jax.tree_util.tree_map(lambda x: x.shape, s)}"
                                 f", architecture 0 "
                                 f"{jax.tree_util.tree_map(lambda x: x.shape, shapes[0])}: "
                                 f"their sum is undefined (e.g. feature widths differ)")

    def init(self, variables: PyTree) -> SimState:
        """Round 0's state (`variables` unused: each network starts from `initial`): a
        server state and the stacked client states per group."""
        del variables
        servers, states = [], []
        for algorithm, v, ids in zip(self.algorithms, self.initial, self.ids):
            server = algorithm.server_init(v)
            one = algorithm.client_state_init(server)
            servers.append(server)
            states.append(None if one is None else jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(x, (len(ids), *np.shape(x))), one))
        return SimState(tuple(servers), tuple(states), 0)

    def sample(self, round_index: int) -> np.ndarray:
        return self.services.sample(round_index)

    def evaluation(self, server: Tuple[PyTree, ...]) -> Tuple[nn.Module, PyTree]:
        """Architecture 0's network and its algorithm's evaluated variables."""
        return self.models[0], self.algorithms[0].eval_variables(server[0])

    def personal_evaluation(self, state: SimState) -> None:
        """Clients are scored group by group (`personal_groups`)."""
        del state
        return None

    def personal_groups(self, state: SimState) -> List[Tuple[nn.Module, np.ndarray, PyTree]]:
        """(network, client ids, their own models stacked) for each architecture."""
        out = []
        for a, ids in enumerate(self.ids):
            algorithm, server, states = (self.algorithms[a], state.server[a],
                                         state.client_states[a])
            if algorithm.personal_variables is None:
                models = jax.tree_util.tree_map(
                    lambda x: jnp.broadcast_to(x, (len(ids), *np.shape(x))),
                    algorithm.eval_variables(server))
            else:
                models = jax.vmap(algorithm.personal_variables, in_axes=(None, 0))(server,
                                                                                 states)
            out.append((self.models[a], ids, models))
        return out

    def _weights(self, ids: np.ndarray) -> np.ndarray:
        if self.weights == "num_examples":
            return self.services.data.sizes[ids].astype(np.float64)
        return np.ones(len(ids))

    def _download(self, a: int, server: PyTree, rows: np.ndarray, r: int) -> float:
        count = self.algorithms[a].download_bytes
        if count is None:  # the group's model, whose size never changes: counted once
            if a not in self._model_bytes:
                self._model_bytes[a] = tree_bytes(
                    jax.eval_shape(self.algorithms[a].eval_variables, server))
            return float(len(rows) * self._model_bytes[a])
        each = np.asarray(count(server, jnp.asarray(rows, jnp.int32), jnp.int32(r)), np.int64)
        return float(np.broadcast_to(each, (len(rows),)).sum())

    def round(self, state: SimState) -> Tuple[SimState, Dict[str, Any]]:
        """Round `state.round`: every group trains its sampled clients, their weighted
        outputs are summed over groups, and each group's server takes the update."""
        r = state.round
        ids = self.sample(r)
        weights = self._weights(ids)
        states = list(state.client_states)
        total, sums, computed, download = None, {}, 0, 0.0
        stacked, order = [], []  # stacked aggregators: each group's outputs, their ids
        for a, group in enumerate(self.ids):
            chosen = np.isin(ids, group)
            mine = ids[chosen]
            if not len(mine):
                continue
            rows = np.searchsorted(group, mine)
            cohort = self.services.cohort(
                mine, r, None if states[a] is None else jax.tree_util.tree_map(
                    lambda x: jnp.asarray(x)[rows], states[a]), rows=rows)
            cohort = cohort._replace(weights=weights[chosen])
            download += self._download(a, state.server[a], rows, r)
            result = self.executors[a].run(state.server[a], cohort)
            if states[a] is not None:
                states[a] = self._scatter(states[a], jnp.asarray(rows), result.client_states)
            if self.stacked:
                stacked.append(result.outputs)
                order.append(mine)
            else:
                total = result.output_sum if total is None else jax.tree_util.tree_map(
                    jnp.add, total, result.output_sum)
            for k, v in jax.device_get(result.metrics).items():
                sums[k] = sums.get(k, 0.0) + float(v)
            computed += result.computed_examples
        w = jnp.asarray(weights, jnp.float32)
        info = RoundInfo(jnp.int32(r), jnp.asarray(ids, jnp.int32), w / jnp.sum(w),
                         self.num_clients)
        if self.stacked:  # every output, in the cohort's (sorted id) order
            where = np.argsort(np.concatenate(order))
            outputs = jax.tree_util.tree_map(
                lambda *xs: jnp.concatenate(xs)[where], *stacked)
            arrivals = Arrivals(jnp.zeros(len(ids), jnp.int32), {}, info.round,
                                self.algorithms[0].eval_variables(state.server[0]))
            aggregate = self._finalize(outputs, info.weights, arrivals)
        else:
            aggregate = self._finalize(total, jnp.sum(w))
        servers = tuple(update(server, aggregate, info)
                        for update, server in zip(self._updates, state.server))
        stats = self.services.statistics(
            sums, real_examples=self.services.real_examples(ids), computed_examples=computed,
            download_bytes=download, clients=len(ids))
        return SimState(servers, tuple(states), r + 1), stats
