"""Which clients a round takes, as the config names it: `config.sampling`.

'uniform': round(R K) clients without replacement; 'poisson': each client independently
with probability R (the engine's `SAMPLINGS`); 'auto': Poisson under DP-FedAvg
(`privacy.clip > 0`; its privacy analysis samples each client independently,
`fedjax_pan.algorithms.uploads.privacy`), else uniform.
"""

from __future__ import annotations

from typing import Any

from fedjax_pan.engine.simulation import SAMPLINGS, clients_per_round

CHOICES = ("auto",) + SAMPLINGS


def cohort_sampling(cfg: Any) -> str:
    """The sampling `config.sampling` names, 'auto' resolved."""
    if cfg.sampling == "auto":
        return "poisson" if cfg.privacy.clip > 0 else "uniform"
    return cfg.sampling


def expected_clients(cfg: Any, num_clients: int) -> float:
    """Clients a round takes in expectation: R K under Poisson sampling, else the fixed
    cohort max(1, round(R K)) (DP-FedAvg's denominator)."""
    if cohort_sampling(cfg) == "poisson":
        return cfg.participation * num_clients
    return float(clients_per_round(cfg.participation, num_clients))


__all__ = ["CHOICES", "cohort_sampling", "expected_clients"]
