"""Clients that answer late, as the config describes them (`config.straggler`); the
engine's `engine.timing` simulates them (delays, the server's policy) inside `Simulation`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp

from fedjax_pan import models
from fedjax_pan.algorithms import aggregation
from fedjax_pan.algorithms.core import Build, FeatureEntry, FederatedAlgorithm
from fedjax_pan.algorithms.sampling import cohort_sampling
from fedjax_pan.data import sources
from fedjax_pan.engine.protocol import tree_bytes
from fedjax_pan.engine.simulation import clients_per_round
from fedjax_pan.engine.timing import DELAYS, POLICIES, Stragglers, forced_error, in_flight_error
from fedjax_pan.rules import Rule, between, one_of


def _straggler_check(cfg: Any) -> None:
    st = cfg.straggler
    if not all(d <= st.max_delay for d in st.forced):
        raise ValueError(f"straggler.forced delays must be at most straggler.max_delay = "
                         f"{st.max_delay}, got {tuple(st.forced)}")
    if cohort_sampling(cfg) != "uniform" and st.max_delay > 0:
        raise ValueError("sampling='poisson' needs straggler.max_delay=0")
    if st.max_delay > 0 and st.policy == "stale":
        model = model_bytes(cfg)
        k = cfg.partition.num_clients
        error = None if model is None else in_flight_error(
            st.max_delay, clients_per_round(cfg.participation, k), k, _stacked(cfg), model)
        if error is not None:
            raise ValueError(error)


def model_bytes(cfg: Any) -> Optional[int]:
    """Bytes of the variables of `cfg`'s model, from their shapes alone (no data, no
    computation); None where the dataset's input is not known before its load or the
    model cannot be built (the assembly says why)."""
    if cfg.dataset.name not in sources.SHAPES:
        return None
    input_shape, classes = sources.SHAPES[cfg.dataset.name]
    try:
        model = models.build(cfg.model.name, classes,
                             pan=None if not cfg.pan.amplitude else cfg.pan.to_dict(),
                             norm=cfg.model.norm, **cfg.model.options.to_dict())
        variables = jax.eval_shape(lambda key: models.init(model, key, input_shape),
                                   jax.ShapeDtypeStruct((2,), jnp.uint32))
    except (TypeError, ValueError):
        return None
    return tree_bytes(variables)


def _stacked(cfg: Any) -> bool:
    """The aggregation rule of `cfg` sees the outputs stacked (else it streams them)."""
    try:
        return aggregation.RULES[cfg.aggregation.rule].build(
            cfg.aggregation, aggregation.RuleContext(late=True)).stacked
    except (KeyError, TypeError, ValueError):
        return True  # the more slots


def _straggler_wrap(algorithm: FederatedAlgorithm, build: Build) -> FederatedAlgorithm:
    # Late outputs are left out of the round they miss: an aggregation of its own that
    # needs every output cannot.
    if algorithm.aggregator.stacked and build.cfg.aggregation.rule == "mean":
        raise ValueError(f"late clients need an aggregation that can leave out outputs not "
                         f"yet arrived, and {build.cfg.algorithm!r} aggregates its own way: "
                         f"set straggler.max_delay=0")
    return algorithm


def _stragglers(cfg: Any) -> Dict[str, Any]:
    st = cfg.straggler
    return {"stragglers": Stragglers(st.max_delay, st.policy, st.delays, st.slow_share,
                                     st.wait_share, tuple(st.forced))}


FEATURE = FeatureEntry(
    "straggler",
    options={"max_delay": 0, "delays": "uniform", "slow_share": 0.2, "policy": "stale",
             "wait_share": 0.5, "forced": ()},
    rules={"max_delay": between(0, 100, integer=True), "delays": one_of(DELAYS),
           "slow_share": between(0, 1), "policy": one_of(POLICIES),
           "wait_share": between(0, 1, lo_open=True), "forced": Rule(forced_error)},
    off=(("max_delay", 0),), check=_straggler_check, wrap=_straggler_wrap,
    simulation=_stragglers,
    summary="clients that answer late (engine/timing.py): delays uniform over "
            "{0..max_delay}, or 'slow': a slow_share of the clients always max_delay late; "
            "the server waits for all (wait_all), for wait_share (wait_share), ignores late "
            "outputs (ignore) or uses them stale (stale). forced: delays given to the first "
            "free clients of each round in a random order from (seed, round) (the SageFlow "
            "authors' (0, 1, 2): every staleness group gets one), the rest drawn")


def late(cfg: Any) -> bool:
    """Clients can answer late in `cfg` (the feature is on)."""
    return FEATURE.first_on(cfg) is not None


__all__ = ["FEATURE", "late", "model_bytes"]
