"""How algorithms and cross-cutting features register with the config: `AlgorithmEntry`,
`FeatureEntry`. The contract itself (the
client/server function tuple, `ClientContext`, `RoundInfo`, `Aggregator`, the weighted
mean and sum) belongs to the engine, `fedjax_pan.engine.protocol`, and is re-exported here
for the algorithms written against it (the rules a config names:
`algorithms.aggregation`)."""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax.numpy as jnp

from fedjax_pan.engine.protocol import (Aggregator, ClientContext, FederatedAlgorithm,
                                        PyTree, RoundInfo, tree_bytes, tree_map,
                                        weighted_mean, weighted_sum)
from fedjax_pan.references import Reference

__all__ = ["Aggregator", "ClientContext", "FederatedAlgorithm", "RoundInfo",
           "tree_bytes", "tree_map", "weighted_mean", "weighted_sum",
           "AlgorithmEntry", "Build", "FeatureEntry", "no_client_state", "every_output",
           "server_model", "own_model", "federated_algorithm", "sends", "per_client",
           "set_rows"]


class AlgorithmEntry(NamedTuple):
    """How a config names and builds an algorithm: build(model, cfg, client_tx, server_tx),
    and the defaults and rules (`fedjax_pan.rules`) of its namespace config.<name>.

    An algorithm whose round cannot be one compiled federated round (FedMA: matching on
    the host, a model that grows) gives a
    `driver(model, cfg, client_tx, services)` (`engine.services.Services`: the federation,
    sampling, key streams, cohorts trained through cached executors, statistics)
    returning an `engine.protocol.Round` (init, round, evaluation, personal_evaluation,
    personal_groups, num_sampled, shapes_change), or None where this config runs as one
    compiled round after all (KT-pFL in the lagged order with one architecture); the engine
    runs it as it runs a Simulation.
    A driver of an algorithm with `public` also takes `public=`.
    """

    build: Callable[..., FederatedAlgorithm]
    options: Dict[str, Any]
    rules: Dict[str, Any]
    driver: Optional[Callable[..., Any]] = None
    # > 0: `build` also takes `public=` the unlabelled public images (N_pub, H, W, C),
    # normalised as the clients'; this many training examples are held out for them where
    # `config.dataset.public_size` is 0.
    public: int = 0
    # True: its result is a model per client (personal_variables / personal_adapt), which
    # only a test part of each client's own data can score (partition.test_fraction > 0).
    personal: bool = False
    # check(cfg) raises ValueError for options that conflict with the rest of the config
    # (checked with the schema, before any data loads).
    check: Optional[Callable[[Any], None]] = None
    # Further keyword arguments its driver takes from the assembly: 'public_labels' (the
    # public set's labels), 'client_evaluate' (each client's own test part scorer, None
    # without partition.test_fraction).
    driver_needs: Tuple[str, ...] = ()
    # True: what its clients send does not depend on their network, so clients may run
    # several (`model.architectures`; `engine.groups.Groups` runs them).
    heterogeneous: bool = False
    # True: `build` also takes `input_shape=` (H, W, C) of one example (an algorithm that
    # builds a network of its own beside the client's, e.g. a shared model).
    input_shape: bool = False
    # The paper and code it follows and its departures (`fedjax_pan.references`); the
    # fidelity test refuses an entry without one.
    reference: Optional[Reference] = None


class Build(NamedTuple):
    """What a feature's `wrap` may read besides the algorithm: the run's config, the model
    and its initial variables, the federation's size and classes, and the resolved
    cohort sampling (`algorithms.sampling.cohort_sampling`)."""

    cfg: Any
    model: Any
    variables: PyTree
    num_clients: int
    num_classes: int
    sampling: str


class FeatureEntry(NamedTuple):
    """A setting that cuts across algorithms (shuffling, attacks, compression, DP,
    stragglers), described once: the defaults and rules (`fedjax_pan.rules`) of its config
    section `config.<section>` (keys relative to it, dotted for nested ones), the settings
    that switch it off, its cross-checks, and how it changes a run. `algorithms.features`
    lists the entries in the order they wrap an algorithm; the default config, the schema,
    the docs and the assembly read that tuple.

    `off`: (key, value) pairs; the feature is on when any key differs from its value.
    `check(cfg)` raises ValueError (its text after 'config.') for settings that exclude
    each other. `wrap(algorithm, build)` returns the algorithm with the feature applied
    (called only when it is on; ValueError for an algorithm it cannot wrap).
    `needs_model(cfg)`: True where the feature as configured changes or reads the model a
    client's output stands for (`FederatedAlgorithm.model_view`). `simulation(cfg)`: the
    keyword arguments it gives the engine's `Simulation` (stragglers are the engine's).
    All of them run only when the feature is on, except `check`.
    A driver that applies a feature itself lists its section in `Round.features`; any
    other feature that is on is refused for drivers.
    """

    section: str
    options: Dict[str, Any]
    rules: Dict[str, Any]
    off: Tuple[Tuple[str, Any], ...]
    check: Optional[Callable[[Any], None]] = None
    wrap: Optional[Callable[[FederatedAlgorithm, Build], FederatedAlgorithm]] = None
    needs_model: Callable[[Any], bool] = lambda cfg: False
    simulation: Optional[Callable[[Any], Dict[str, Any]]] = None
    # round_fields(cfg, num_clients) -> {name: f(rounds)}: fields of each evaluated round's
    # row computed from its index alone (DP-FedAvg's epsilon).
    round_fields: Optional[Callable[[Any, int], Dict[str, Callable[[int], float]]]] = None
    # probes(cfg, test_images, test_labels) -> {name: (images, labels)}: further test sets
    # the global model is scored on each evaluation (a backdoor's success rate).
    probes: Optional[Callable[[Any, Any, Any], Dict[str, Tuple[Any, Any]]]] = None
    summary: str = ""

    def first_on(self, cfg: Any) -> Optional[Tuple[str, Any, Any]]:
        """(dotted key, its value, its value when off) of the first `off` setting that is
        on in `cfg`; None: the feature is off."""
        for key, off in self.off:
            value = cfg[self.section]
            for part in key.split("."):
                value = value[part]
            if value != off:
                return f"{self.section}.{key}", value, off
        return None


def no_client_state(server_state: PyTree) -> None:
    """`client_state_init` of algorithms that keep nothing per client."""
    del server_state
    return None


# The stacked aggregator that hands `server_update` every client's output as it was sent,
# in the cohort's order (`info.client_ids`): for servers that keep something per client.
every_output = Aggregator(lambda outs, weights, arrivals=None: outs, stacked=True)


def server_model(server_state: PyTree) -> PyTree:
    """`eval_variables` of a server state holding `params` and `model_state` (the
    initial model, where an algorithm has no global one)."""
    return {"params": server_state.params, **server_state.model_state}


def own_model(server_state: PyTree, client_state: PyTree) -> PyTree:
    """`personal_variables` of an algorithm whose client state is the client's model."""
    del server_state
    return client_state


def federated_algorithm(server_init: Callable[[PyTree], PyTree],
                        client_init: Callable[[PyTree, PyTree, Any], PyTree],
                        client_step: Callable[[PyTree, PyTree, PyTree], tuple],
                        client_output: Callable[[PyTree, PyTree], tuple],
                        server_update: Callable[[PyTree, PyTree, RoundInfo], PyTree], *,
                        client_state_init: Callable[[PyTree], PyTree] = no_client_state,
                        eval_variables: Callable[[PyTree], PyTree] = server_model,
                        **optional: Any) -> FederatedAlgorithm:
    """A `FederatedAlgorithm` from its round's five functions, in the order they run; by
    default a client keeps nothing between rounds (`no_client_state`) and the global model
    is the server state's `params` and `model_state` (`server_model`). `optional`: the
    tuple's other fields (aggregator, upload_bytes, personal_variables, personal_adapt,
    model_view, download_bytes)."""
    return FederatedAlgorithm(server_init, client_state_init, client_init, client_step,
                              client_output, server_update, eval_variables, **optional)


def sends(*parts: Any) -> Callable[[PyTree, Any, Any], int]:
    """`download_bytes` of an algorithm whose every client receives the same part of the
    server state each round: the fields named in `parts`, or what a part that is a
    function of the server state returns; e.g. `sends("protos", "present")`."""
    def download_bytes(server_state, client_ids, round_index):
        del client_ids, round_index
        return tree_bytes(tuple(getattr(server_state, p) if isinstance(p, str)
                                else p(server_state) for p in parts))
    return download_bytes


def per_client(tree: PyTree, num_clients: int) -> PyTree:
    """`num_clients` copies of `tree` stacked (leaves (K, ...)): a server's store of
    something per client, each client's starting as `tree`."""
    return tree_map(lambda x: jnp.broadcast_to(x, (num_clients, *x.shape)), tree)


def set_rows(store: PyTree, ids: Any, rows: PyTree, present: Any = None) -> PyTree:
    """`store` (leaves (K, ...)) with the rows of clients `ids` replaced by `rows` (leaves
    (M, ...)): what a server keeps per client after their round; with `present` (M,) bool,
    only where it is True (a slot without an output leaves its client's row)."""
    def one(s, r):
        if present is None:
            return s.at[ids].set(r)
        return s.at[ids].set(jnp.where(present.reshape((-1,) + (1,) * (r.ndim - 1)), r,
                                       s[ids]))
    return tree_map(one, store, rows)
