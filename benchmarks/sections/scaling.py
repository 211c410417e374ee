"""Seconds per round as the clients per round grow."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks.harness import Log, Settings, mlp_workload, summarize, time_engine
from fedjax_pan.engine import resolve_strategy


def scaling_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """MLP-bench round time against clients per round, with `auto`'s strategy.

    Each setting gets its own executor and warm-up; `compiles_timed` must be 0.
    `per_client_vs_first` is (t/M) / (t_first/M_first): 1.0 means linear cost.
    """
    per_round = [m for m in settings.scaling_per_round]
    w = mlp_workload(settings, max(settings.mlp_clients, max(per_round)))
    strategy = resolve_strategy("auto", w.variables)
    points = []
    for m_per in per_round:
        sim = w.simulation(w.executor(strategy, m_per, settings), m_per, settings.seed)
        m = time_engine(sim, w.variables, None, settings.warmup, settings.scaling_reps,
                        settings.slow_round_s)
        rec = summarize(m, w.flops_per_example, ceiling)
        rec = {"clients_per_round": m_per, **{k: rec[k] for k in (
            "seconds_per_round", "round_seconds", "reps", "examples_per_second", "gflops",
            "fraction_of_ceiling", "compiles_warmup", "compile_seconds_warmup",
            "compiles_timed")}}
        rec["seconds_per_client"] = rec["seconds_per_round"] / m_per
        points.append(rec)
        log(f"[scaling] {m_per} clients/round: {rec['seconds_per_round']:.3f} s/round, "
            f"{rec['compiles_timed']} compiles after warm-up")
    for p in points:
        p["per_client_vs_first"] = p["seconds_per_client"] / points[0]["seconds_per_client"]
    return {"strategy": strategy, "workload": w.describe(per_round[0]), "points": points,
            "compiles_after_warmup": sum(p["compiles_timed"] for p in points)}
