"""The MLP bench per execution strategy against a naive per-client loop."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks.harness import Log, Settings, auto_summary, mlp_workload, time_strategies


def mlp_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """The MLP bench per strategy, the naive loop, and their agreement after round 0."""
    w = mlp_workload(settings, settings.mlp_clients)
    configs, extra, _ = time_strategies(w, settings.mlp_per_round, settings, ceiling, log,
                                         "mlp")
    return {"workload": w.describe(settings.mlp_per_round), "strategies": configs, **extra,
            "auto": auto_summary(configs, w.variables)}
