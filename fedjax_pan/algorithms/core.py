"""How algorithms register with the config: `AlgorithmEntry`. The contract itself (the
client/server function tuple, `ClientContext`, `RoundInfo`, `Aggregator`, the aggregation
rules) belongs to the engine, `fedjax_pan.engine.protocol`, and is re-exported here for
the algorithms written against it."""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from fedjax_pan.engine.protocol import (Aggregator, ClientContext, FederatedAlgorithm,
                                        PyTree, RoundInfo, median, tree_bytes, tree_map,
                                        trimmed_mean, weighted_mean, weighted_sum)
from fedjax_pan.references import Reference

__all__ = ["Aggregator", "ClientContext", "FederatedAlgorithm", "RoundInfo", "median",
           "tree_bytes", "tree_map", "trimmed_mean", "weighted_mean", "weighted_sum",
           "AlgorithmEntry", "no_client_state", "every_output", "server_model", "own_model"]


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
