"""Fed2 (paper 003) against FedAvg, each with PANs off and on, on pathological N x C splits.

N clients each hold C classes (`pathological` partition), every client trains in every
round. Methods: `fedavg` (the plain network), `fed2` (G groups over the last `depth`
layers, GroupNorm in the grouped layers, feature paired averaging), both with PANx
(T = 1, A = 0.1): `fedavg_pans`, `fed2_pans`, and `psinet` (Fed2 whose clients trim the
groups of classes they lack, paper 004: smaller uploads). Every run goes through the library's training
loop into `runs/<method>_c<C>_s<seed>/`.

Presets:
  cpu      Fashion-MNIST, VGG9 at width 0.25 (convs 8-16-32-32-64-64, FCs 128; grouped
           widths rounded up to multiples of G = 10) with GroupNorm (4 groups) in the
           shared layers of every method, N = 10, C in {2, 5}, 6,000 training examples (600
           per client), E = 1, B = 32, no learning-rate warm-up, 16 rounds, 2 seeds; about
           7-11 s per round, 55 minutes on 2 CPU cores. (Without normalisation the plain VGG9
           stayed at chance for 20 rounds here, and diverged at C = 2.)
  default  the cpu preset
  paper    CIFAR-10, VGG9, N = 10, C in {3, 4, 5, 10}, E = 5, 100 rounds, 3 seeds (Table 1;
           an accelerator's work)
  smoke    synthetic data, FedAvg and Fed2 + PANs with a (grouped) 3-layer MLP, N = 4,
           C = 2, 1 round, 1 seed
Outputs: fed2_runs.csv (one row per run), fed2_compare.csv (mean/std of the final accuracy
per method and C, with each method's mean upload per client and round), fed2_compare.json,
fed2_compare.png (accuracy curves, mean over seeds, one panel per C).
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common

METHODS = ("fedavg", "fed2", "fedavg_pans", "fed2_pans", "psinet")


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 16
    seeds: Tuple[int, ...] = (0, 1)
    classes: Tuple[int, ...] = (2, 5)  # C values
    num_clients: int = 10  # N
    dataset: str = "fashion_mnist"
    model: str = "vgg9"
    model_options: Tuple[Tuple[str, Any], ...] = (("width", 0.25),)
    norm: Optional[str] = "group(4)"  # the shared layers' (all layers' for the plain model)
    groups: int = 10
    depth: int = 6
    epochs: float = 1.0
    batch_size: int = 32
    warmup: str = "none"
    train_limit: Optional[int] = 6000
    methods: Tuple[str, ...] = METHODS


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "paper": Settings(rounds=100, seeds=(0, 1, 2), classes=(3, 4, 5, 10), dataset="cifar10",
                      model_options=(), norm=None, epochs=5.0, batch_size=64,
                      warmup="rounds", train_limit=None),
    "smoke": Settings(rounds=1, seeds=(0,), classes=(2,), num_clients=4, dataset="synthetic",
                      model="mlp", model_options=(("hidden", (20, 20, 20)),), norm=None,
                      groups=5,
                      depth=3, train_limit=None, methods=("fedavg", "fed2_pans")),
})


def run_config(s: Settings, method: str, classes: int, seed: int):
    """The library config of one run."""
    from fedjax_pan.config.defaults import default_config

    cfg = default_config()
    cfg.seed, cfg.rounds = seed, s.rounds
    cfg.dataset.name, cfg.dataset.train_limit = s.dataset, s.train_limit
    cfg.model.name, cfg.model.norm = s.model, s.norm
    for key, value in s.model_options:
        cfg.model.options[key] = list(value) if isinstance(value, tuple) else value
    cfg.partition.scheme, cfg.partition.num_clients = "pathological", s.num_clients
    cfg.partition.alpha, cfg.partition.classes_per_client = None, classes
    cfg.participation = 1.0
    cfg.local.epochs, cfg.local.batch_size = s.epochs, s.batch_size
    cfg.optimizer.warmup = s.warmup
    cfg.pan.amplitude = 0.1 if method.endswith("_pans") else 0.0
    if method.startswith("fed2") or method == "psinet":
        cfg.algorithm = "fed2"
        cfg.model.options.grouped = {"groups": s.groups, "depth": s.depth}
        cfg.fed2.trim = method == "psinet"
    cfg.checkpoint_every = max(1, s.rounds // 3)
    return cfg


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    keys = [(method, classes, seed) for classes in s.classes for method in s.methods
            for seed in s.seeds]
    results = common.train_runs(ctx, [(f"{m}_c{c}_s{seed}", run_config(s, m, c, seed))
                                      for m, c, seed in keys])
    rows, curves = [], {}
    for (method, classes, seed), (summary, diverged, curve) in zip(keys, results):
        curves[(method, classes, seed)] = curve
        rows.append({"method": method, "classes": classes, "seed": seed,
                     "final_accuracy": summary["final_accuracy"],
                     "best_accuracy": summary["best_accuracy"],
                     "diverged": diverged, "rounds_logged": len(curve),
                     "upload_bytes_per_client": float(np.mean(
                         [r["upload_bytes"] for r in curve])) / s.num_clients,
                     "wall_seconds": summary["wall_seconds"]})
    common.write_csv(ctx.path("fed2_runs.csv"), rows)
    table = summarize(rows)
    common.write_csv(ctx.path("fed2_compare.csv"), table)
    common.write_json(ctx.path("fed2_compare.json"), {"settings": s, "runs": rows,
                                                      "table": table})
    plot(curves, s, ctx.path("fed2_compare.png"))
    lines = ["final accuracy (mean of the last 5 evaluations), mean +- std over seeds; "
             "upload per client and round:"]
    for r in table:
        lines.append(f"  N={s.num_clients} C={r['classes']:<3} {r['method']:<12} "
                     f"{100 * r['mean']:6.2f} +- {100 * r['std']:.2f}  "
                     f"({r['seeds']} seeds{', %d diverged' % r['diverged'] if r['diverged'] else ''})"
                     f"  {r['upload_mib']:.3f} MiB")
    return lines


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Mean and std (ddof 0) of the final accuracy per C and method over the runs that did
    not diverge (`diverged` counts the others), and its mean upload."""
    out = []
    for classes, method in dict.fromkeys((r["classes"], r["method"]) for r in rows):
        mine = [r for r in rows if r["classes"] == classes and r["method"] == method]
        out.append({"classes": classes, "method": method, **common.accuracy_stats(mine),
                    "upload_mib": float(np.mean([r["upload_bytes_per_client"]
                                                 for r in mine])) / 2**20})
    return out


def plot(curves: Dict[Tuple[str, int, int], List[Dict[str, Any]]], s: Settings,
         path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5 * len(s.classes), 3.6))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, len(s.classes), squeeze=False)[0])
    for ax, classes in zip(axes, s.classes):
        for method in s.methods:
            rounds, acc = common.mean_curve([curves[(method, classes, seed)]
                                             for seed in s.seeds])
            ax.plot(rounds, acc, label=method, linestyle="--" if "pans" in method else "-",
                    color={"fedavg": "tab:blue", "fed2": "tab:red"}.get(
                        method.split("_")[0], "tab:green"))
        ax.set(xlabel="round", ylabel="test accuracy (%)",
               title=f"{s.dataset}, N={s.num_clients} x C={classes}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("fed2_compare", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
