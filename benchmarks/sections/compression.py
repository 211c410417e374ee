"""What compressing and privatising the clients' messages costs: the MLP bench round
(training and aggregation, no evaluation) with each upload transform and DP-FedAvg's
clipping, against FedAvg's round in the same cohort, and the bytes each sends."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks.harness import Log, Settings, mlp_workload, summarize, time_engine
from benchmarks.roofline import Roof
from benchmarks.sections.algorithms import _bench_config
from fedjax_pan.config.defaults import set_keys

# name -> config changes
METHODS = {
    "fedavg": {},
    "top_k 10%": {"compression.upload.method": "top_k"},
    "top_k 10%, error feedback": {"compression.upload.method": "top_k",
                                  "compression.upload.error_feedback": True},
    "random_k 10%": {"compression.upload.method": "random_k"},
    "qsgd 16 levels": {"compression.upload.method": "qsgd"},
    "sign, error feedback": {"compression.upload.method": "sign",
                             "compression.upload.error_feedback": True},
    "quantize 8 bits": {"compression.upload.method": "quantize"},
    "magnitude mask 50%": {"compression.upload.method": "magnitude_mask",
                           "compression.upload.ratio": 0.5},
    "top_k 10% up and down": {"compression.upload.method": "top_k",
                              "compression.download.method": "top_k"},
    "dp clipping (z = 1)": {"privacy.clip": 1.0, "privacy.noise_multiplier": 1.0},
    "dp adaptive clipping (z = 0.1)": {"privacy.clip": 1.0, "privacy.noise_multiplier": 0.1,
                                       "privacy.adaptive": True},
}
# What the quick suite (tests) times, and what the targets judge.
QUICK = ("fedavg", "top_k 10%", "qsgd 16 levels", "dp clipping (z = 1)")


def compression_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """Seconds per round of each of `METHODS` (`QUICK` in the quick suite) on the MLP
    bench, its ratio to FedAvg's and its bytes up and down in the round."""
    from fedjax_pan.run.assembly import make_round

    w = mlp_workload(settings, settings.mlp_clients)
    per_round = settings.mlp_per_round
    base = _bench_config(settings, w, per_round)
    reps = 1 if settings.quick else settings.reps
    rows: Dict[str, Any] = {}
    for name, changes in METHODS.items():
        if settings.quick and name not in QUICK:
            continue
        cfg = set_keys(base.copy_and_resolve_references(), changes)
        sim = make_round(cfg, w.model, w.variables, w.data, w.work)
        m = time_engine(sim, w.variables, None, settings.warmup, reps, settings.slow_round_s,
                        cost=not settings.quick)
        rec = summarize(m, w.flops_per_example, roof)
        state = sim.init(w.variables)
        _, stats = sim.round(state)
        rows[name] = {"seconds_per_round": rec["seconds_per_round"], "reps": rec["reps"],
                      "compiles_timed": rec["compiles_timed"],
                      "fraction_of_roofline": rec["fraction_of_roofline"],
                      "upload_mib": stats["upload_bytes"] / 2**20,
                      "download_mib": stats["download_bytes"] / 2**20}
    first = rows["fedavg"]["seconds_per_round"]
    for name, rec in rows.items():
        rec["vs_fedavg"] = rec["seconds_per_round"] / first
        log(f"[compression] {name}: {rec['seconds_per_round']:.3f} s/round "
            f"({rec['vs_fedavg']:.2f}x), {rec['upload_mib']:.2f} MiB up")
    return {"workload": w.describe(per_round), "methods": rows}
