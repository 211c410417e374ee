"""PAN paper Fig. 9: PANs across FL algorithms (FedAvg, FedProx, FedAvgM, Scaffold, MOON,
FedDyn), each with PANs off (A = 0) and on (PAN+ A = 0.05, PANx A = 0.05, PANx A = 0.1).

Fashion-MNIST, the paper's MLP, K = 100 clients, R = 0.1, E = 5, B = 64, Dirichlet
alpha = 0.1 by client, SGD lr 0.05 momentum 0.9 (the library's defaults). Every run goes
through the library's training loop into `runs/<algorithm>_<pan>_s<seed>/` (metrics,
summary, checkpoints; each can be continued alone with `python -m fedjax_pan`). Fig. 9
plots, per algorithm, the best PAN setting against A = 0; here with mean and std over seeds.

Presets:
  paper  H = 1000 rounds, all four PAN settings, 3 seeds (an accelerator's work)
  cpu    H = 20 rounds, A = 0 vs PANx A = 0.1, 2 seeds: about 80 minutes on 2 CPU cores
  default  the cpu preset
  smoke  FedAvg and MOON, synthetic data, a 16-wide MLP, K = 6, 1 round, A = 0 vs PANx
         A = 0.1, 1 seed
Outputs: universal_runs.csv (one row per run), universal.csv (mean/std per algorithm and PAN
setting), universal.json, fig9_universal.png.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common
from experiments.common import Pan

# name -> config overrides; FedAvgM is FedAvg with server momentum (SPEC 4: lr_g 0.5, 0.9).
ALGORITHMS: Dict[str, Dict[str, Any]] = {
    "fedavg": {"algorithm": "fedavg"},
    "fedprox": {"algorithm": "fedprox"},
    "fedavgm": {"algorithm": "fedavg", "server": {"optimizer": "sgd", "lr": 0.5,
                                                  "momentum": 0.9}},
    "scaffold": {"algorithm": "scaffold"},
    "moon": {"algorithm": "moon"},
    "feddyn": {"algorithm": "feddyn"},
}
PAN_SETTINGS = (Pan("mul", 1.0, 0.0), Pan("add", 1.0, 0.05), Pan("mul", 1.0, 0.05),
                Pan("mul", 1.0, 0.1))


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 20
    seeds: Tuple[int, ...] = (0, 1)
    pans: Tuple[Pan, ...] = (PAN_SETTINGS[0], PAN_SETTINGS[3])
    algorithms: Tuple[str, ...] = tuple(ALGORITHMS)
    dataset: str = "fashion_mnist"
    num_clients: int = 100
    hidden: Optional[Tuple[int, ...]] = None  # None: the paper's 1024 x 3
    train_limit: Optional[int] = None


PRESETS = MappingProxyType({
    "paper": Settings(rounds=1000, seeds=(0, 1, 2), pans=PAN_SETTINGS),
    "cpu": Settings(),
    "default": Settings(),
    # Two algorithms (one stateful) keep the test quick; every algorithm's config run is
    # tested with the library (tests/test_experiment.py, tests/test_fedprox.py).
    "smoke": Settings(rounds=1, seeds=(0,), algorithms=("fedavg", "moon"),
                      dataset="synthetic", num_clients=6, hidden=(16, 16, 16)),
})


def pan_name(pan: Pan) -> str:
    return "off" if not pan.on else f"pan{'add' if pan.kind == 'add' else 'mul'}{pan.amplitude:g}"


def run_config(s: Settings, algorithm: str, pan: Pan, seed: int):
    """The library config of one run."""
    from fedjax_pan.run.experiment import apply_overrides
    from fedjax_pan.config.defaults import default_config

    cfg = default_config()
    cfg.seed = seed
    cfg.rounds = s.rounds
    cfg.dataset.name = s.dataset
    cfg.dataset.train_limit = s.train_limit
    cfg.partition.num_clients = s.num_clients
    if s.hidden:
        cfg.model.options.hidden = list(s.hidden)
    cfg.pan.kind, cfg.pan.period = pan.kind, float(pan.period)
    cfg.pan.amplitude = float(pan.amplitude) if pan.on else 0.0
    cfg.checkpoint_every = max(1, s.rounds // 3)
    return apply_overrides(cfg, ALGORITHMS[algorithm])


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    keys = [(algorithm, pan, seed) for algorithm in s.algorithms for pan in s.pans
            for seed in s.seeds]
    results = common.train_runs(ctx, [(f"{a}_{pan_name(p)}_s{seed}", run_config(s, a, p, seed))
                                      for a, p, seed in keys])
    rows = [{"algorithm": algorithm, "pan": pan_name(pan), "seed": seed,
             "final_accuracy": summary["final_accuracy"],
             "best_accuracy": summary["best_accuracy"], "diverged": diverged,
             "wall_seconds": summary["wall_seconds"]}
            for (algorithm, pan, seed), (summary, diverged, _) in zip(keys, results)]
    common.write_csv(ctx.path("universal_runs.csv"), rows)
    table = summarize(rows)
    common.write_csv(ctx.path("universal.csv"), table)
    common.write_json(ctx.path("universal.json"), {"settings": s, "runs": rows,
                                                   "table": table})
    plot(table, ctx.path("fig9_universal.png"), s)
    lines = ["final accuracy (mean of the last 5 evaluations), mean +- std over seeds:"]
    for r in table:
        lines.append(f"  {r['algorithm']:<9} {r['pan']:<10} {100 * r['mean']:6.2f} +- "
                     f"{100 * r['std']:.2f}  ({r['seeds']} seeds)")
    return lines


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Mean and std (ddof 0) of the final accuracy per algorithm and PAN setting, over the
    runs that did not diverge (`diverged` counts the others)."""
    out = []
    for algorithm, pan in dict.fromkeys((r["algorithm"], r["pan"]) for r in rows):
        mine = [r for r in rows if r["algorithm"] == algorithm and r["pan"] == pan]
        out.append({"algorithm": algorithm, "pan": pan, **common.accuracy_stats(mine)})
    return out


def best_vs_off(table: Sequence[Dict[str, Any]]) -> Dict[str, Tuple[Dict, Dict]]:
    """Per algorithm: (its A = 0 row, its best PAN row), as Fig. 9 compares them."""
    out = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in table):
        mine = [r for r in table if r["algorithm"] == algorithm]
        off = next(r for r in mine if r["pan"] == "off")
        on = max((r for r in mine if r["pan"] != "off"), key=lambda r: r["mean"])
        out[algorithm] = (off, on)
    return out


def plot(table: Sequence[Dict[str, Any]], path: str, s: Settings) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pairs = best_vs_off(table)
    fig = Figure(figsize=(8, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    x = np.arange(len(pairs))
    for i, (label, color) in enumerate((("A = 0", "tab:blue"), ("best PANs", "tab:red"))):
        means = [100 * pair[i]["mean"] for pair in pairs.values()]
        stds = [100 * pair[i]["std"] for pair in pairs.values()]
        ax.bar(x + (i - 0.5) * 0.38, means, 0.38, yerr=stds, capsize=3, color=color,
               label=label)
    ax.set_xticks(x, [f"{a}\n({pairs[a][1]['pan']})" for a in pairs])
    low = min(100 * min(p[0]["mean"], p[1]["mean"]) for p in pairs.values())
    ax.set(ylabel="test accuracy (%)", ylim=(max(0, low - 10), None),
           title=f"PANs across FL algorithms ({s.dataset}, {s.rounds} rounds, "
                 f"{len(s.seeds)} seed{'s' if len(s.seeds) > 1 else ''})")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("universal", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
