"""Each aggregation rule's round against FedAvg's (the mean), on the MLP bench at 10 and
50 clients a round, and the straggler machinery's (outputs kept in flight)."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks.harness import Log, Settings, mlp_workload, summarize, time_engine
from benchmarks.roofline import Roof
from benchmarks.sections.algorithms import _bench_config
from fedjax_pan.algorithms import aggregation
from fedjax_pan.config.defaults import set_keys

PER_ROUND = (10, 50)
PUBLIC = aggregation.PUBLIC_SIZE  # SageFlow's and Zeno's server-side examples
# name -> config changes: every rule of the table (`algorithms.aggregation.RULES`), those
# told of byzantine clients with f = b = a fifth of the round (SageFlow's 20% attackers)
RULES = {
    "mean (FedAvg)": {},
    **{name: {"aggregation.rule": name,
              **({"byzantine": 0.2} if "byzantine" in entry.options else {})}
       for name, entry in aggregation.RULES.items() if name != "mean"},
    "mean, stragglers (stale, D = 2)": {"straggler.max_delay": 2},
    "sageflow, stragglers (stale, D = 2)": {"aggregation.rule": "sageflow",
                                            "straggler.max_delay": 2},
}


# What the quick suite (tests) times: one rule of each kind, the stragglers' round.
QUICK = ("mean (FedAvg)", "multi_krum", "sageflow", "mean, stragglers (stale, D = 2)")


def defences_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """Seconds per round (training and aggregation, no evaluation) of each rule in
    `RULES` (`QUICK` only, in the quick suite) at each cohort size of `PER_ROUND` (capped
    at the bench's clients), and its ratio to FedAvg's mean in the same cohort."""
    from fedjax_pan.run.assembly import make_round

    w = mlp_workload(settings, settings.mlp_clients)
    public = (w.data.images[:PUBLIC], w.data.labels[:PUBLIC])
    reps = 1 if settings.quick else settings.reps
    out: Dict[str, Any] = {}
    for per_round in sorted({min(m, w.data.num_clients) for m in PER_ROUND}):
        base = _bench_config(settings, w, per_round)
        rows: Dict[str, Any] = {}
        for name, changes in RULES.items():
            if settings.quick and name not in QUICK:
                continue
            changes = dict(changes)
            if "byzantine" in changes:
                changes["aggregation.byzantine"] = max(1, round(changes.pop("byzantine")
                                                                * per_round))
            cfg = set_keys(base.copy_and_resolve_references(), changes)
            sim = make_round(cfg, w.model, w.variables, w.data, w.work, *public)
            m = time_engine(sim, w.variables, None, settings.warmup, reps,
                            settings.slow_round_s, cost=not settings.quick)
            rec = summarize(m, w.flops_per_example, roof)
            rows[name] = {"seconds_per_round": rec["seconds_per_round"], "reps": rec["reps"],
                          "compiles_timed": rec["compiles_timed"],
                          "fraction_of_roofline": rec["fraction_of_roofline"]}
        first = rows["mean (FedAvg)"]["seconds_per_round"]
        for name, rec in rows.items():
            rec["vs_fedavg"] = rec["seconds_per_round"] / first
            log(f"[defences] {per_round} clients, {name}: {rec['seconds_per_round']:.3f} "
                f"s/round ({rec['vs_fedavg']:.2f}x)")
        out[str(per_round)] = rows
    return {"workload": w.describe(settings.mlp_per_round), "per_round": out}
