"""The MLP bench per execution strategy against a naive per-client loop and the
FedJAX-style loop, and computed in bfloat16."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import jax.numpy as jnp

from benchmarks.fedjax_style import FedJaxStyleFedAvg
from benchmarks.harness import (FedJaxStyleLoop, Log, Settings, add_naive_ratios,
                                auto_summary, measure_matmul, mlp_workload, summarize,
                                time_engine, time_naive, time_strategies)
from benchmarks.roofline import Roof
from fedjax_pan.engine import resolve_strategy


def mlp_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """The MLP bench per strategy, the naive loop, their agreement after round 0, the
    FedJAX-style loop on the same cohorts, and `auto` in bfloat16 (a row, no target)."""
    w = mlp_workload(settings, settings.mlp_clients)
    configs, extra, sim = time_strategies(w, settings.mlp_per_round, settings, roof, log,
                                           "mlp")
    loop = FedJaxStyleLoop(FedJaxStyleFedAvg(w.model, settings.learning_rate,
                                             settings.momentum, w.work.batch_size,
                                             int(w.work.epochs)), w.naive(settings))
    fm = time_naive(loop, w, sim, settings.warmup, settings.naive_reps, settings.seed)
    fedjax = summarize(fm, w.flops_per_example, roof)
    add_naive_ratios({"fedjax-style loop": fedjax}, extra["naive"])
    log(f"[mlp] fedjax-style loop: {fedjax['seconds_per_round']:.3f} s/round")
    return {"workload": w.describe(settings.mlp_per_round), "strategies": configs, **extra,
            "fedjax_style": fedjax, "bfloat16": bfloat16_row(settings, roof, extra, log),
            "auto": auto_summary(configs, w.variables)}


def bfloat16_row(settings: Settings, roof: Roof, extra: Dict[str, Any],
                 log: Log) -> Optional[Dict[str, Any]]:
    """`auto`'s MLP-bench round computed in bfloat16 on float32 weights, its roofline
    against the bfloat16 matmul rate measured now; None where the library has no
    mixed precision."""
    try:
        w = mlp_workload(settings, settings.mlp_clients, precision="bfloat16")
    except ImportError:
        log("[mlp] no fedjax_pan.models.precision: no bfloat16 row")
        return None
    strategy = resolve_strategy("auto", w.variables)
    sim = w.simulation(w.executor(strategy, settings.mlp_per_round, settings),
                       settings.mlp_per_round, settings.seed)
    m = time_engine(sim, w.variables, w.evaluator(settings.eval_batch_size), settings.warmup,
                    settings.reps, settings.slow_round_s)
    bf16 = measure_matmul(settings.matmul_size, settings.matmul_reps, jnp.bfloat16)["gflops"]
    rec = summarize(m, w.flops_per_example, dataclasses.replace(roof, peak_gflops_bf16=bf16),
                    dtype="bfloat16")
    rec.update(strategy=strategy, matmul_gflops_bf16=bf16)
    add_naive_ratios({"bfloat16": rec}, extra["naive"])
    log(f"[mlp] {strategy} bfloat16: {rec['seconds_per_round']:.3f} s/round")
    return rec
