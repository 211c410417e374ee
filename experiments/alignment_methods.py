"""Neuron alignment in FL, the PAN paper's Tables 1-2 analogue: FedAvg, FedAvg + PANs,
FedMA and Fed2 at the settings (K, R, alpha, E) = (16, 1.0, 0.5, 20), (16, 1.0, 0.1, 20)
and (16, 0.4, 0.5, 20).

K clients from FedMA's "hetero-dir" split (`dirichlet_by_class`: per class Dir(alpha)
over clients, redrawn until every client holds >= 10 examples), R of them per round, E
local epochs. Methods: `fedavg`; `fedavg_pans` (PANx, T = 1, A = 0.1); `fedma` (BBP-MAP
layer matching with sigma = sigma0 = 1, gamma = 7, 5 sweeps, mu0 = 0.1 on biases, and E
retraining epochs after each matched layer, as IBM's run.sh); `fed2` (G = 10 groups on the
last `depth` weight layers, feature paired averaging). Every method gets the same number
of communication rounds; a FedMA round holds one local training and one retraining per
hidden layer, so it trains (1 + hidden layers) x E epochs. Every run goes through the
library's training loop into `runs/<setting>_<method>_s<seed>/`.

Presets:
  cpu      Fashion-MNIST, the PAN MLP narrowed to 784-256-256-256-10 (BBP-MAP's Hungarian
           steps and FedMA's per-layer retraining at width 1024 cost minutes per round
           here), 6,000 training examples (375 per client), B = 64, SGD lr 0.01 with
           momentum 0.9 (IBM's FedMA settings), no warm-up, 10 rounds (IBM's comm_round),
           seeds 0, 1, 2; Fed2 groups the last hidden layer and the head (depth 2). About
           an hour on 2 CPU cores, most of it FedMA's.
  default  the cpu preset
  paper    CIFAR-10, VGG9 (no normalisation, as FedMA's), the full training set, 50
           rounds, 3 seeds (an accelerator's work; configs/cifar10_alignment.py runs one
           setting as a config)
  smoke    synthetic data, a 3-layer MLP of width 12, K = 4, the first setting with E = 1,
           1 round, 1 seed
Outputs: alignment_runs.csv (one row per run), alignment_methods.csv (mean / std of the
final accuracy per setting and method, with seconds per round and MiB sent up and down per
round), alignment_methods.json, alignment_methods.png (accuracy curves, mean over seeds).
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common

METHODS = ("fedavg", "fedavg_pans", "fedma", "fed2")
# (K, R, alpha, E) of the paper's Tables 1-2 (FedMA's settings).
SETTINGS = ((16, 1.0, 0.5, 20.0), (16, 1.0, 0.1, 20.0), (16, 0.4, 0.5, 20.0))


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 10
    seeds: Tuple[int, ...] = (0, 1, 2)
    settings: Tuple[Tuple[int, float, float, float], ...] = SETTINGS
    dataset: str = "fashion_mnist"
    model: str = "mlp"
    model_options: Tuple[Tuple[str, Any], ...] = (("hidden", (256, 256, 256)),)
    fed2_depth: int = 2
    batch_size: int = 64
    lr: float = 0.01
    train_limit: Optional[int] = 6000
    methods: Tuple[str, ...] = METHODS


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "paper": Settings(rounds=50, dataset="cifar10", model="vgg9", model_options=(),
                      fed2_depth=6, train_limit=None),
    "smoke": Settings(rounds=1, seeds=(0,), settings=((4, 1.0, 0.5, 1.0),),
                      dataset="synthetic", model_options=(("hidden", (12, 12, 12)),),
                      train_limit=None),
})


def setting_name(setting: Tuple[int, float, float, float]) -> str:
    k, r, alpha, e = setting
    return f"K{k}_R{r:g}_a{alpha:g}_E{e:g}"


def run_config(s: Settings, method: str, setting: Tuple[int, float, float, float],
               seed: int):
    """The library config of one run."""
    from fedjax_pan.config.defaults import default_config

    k, r, alpha, e = setting
    cfg = default_config()
    cfg.seed, cfg.rounds = seed, s.rounds
    cfg.dataset.name, cfg.dataset.train_limit = s.dataset, s.train_limit
    cfg.model.name = s.model
    for key, value in s.model_options:
        cfg.model.options[key] = list(value) if isinstance(value, tuple) else value
    cfg.partition.scheme, cfg.partition.num_clients = "dirichlet_by_class", k
    cfg.partition.alpha = alpha
    cfg.participation = r
    cfg.local.epochs, cfg.local.batch_size = e, s.batch_size
    cfg.optimizer.lr, cfg.optimizer.warmup = s.lr, "none"
    cfg.pan.amplitude = 0.1 if method.endswith("_pans") else 0.0
    if method == "fedma":
        cfg.algorithm = "fedma"
        cfg.fedma.retrain_epochs = e
    elif method == "fed2":
        cfg.algorithm = "fed2"
        cfg.model.options.grouped = {"groups": 10, "depth": s.fed2_depth}
    cfg.checkpoint_every = max(1, s.rounds // 2)
    return cfg


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    keys = [(setting, method, seed) for setting in s.settings for method in s.methods
            for seed in s.seeds]
    results = common.train_runs(ctx, [(f"{setting_name(st)}_{m}_s{seed}",
                                       run_config(s, m, st, seed)) for st, m, seed in keys])
    rows, curves = [], {}
    for (setting, method, seed), (summary, diverged, curve) in zip(keys, results):
        curves[(setting, method, seed)] = curve
        # FedAvg-like methods download the model they upload (its delta's size).
        up = [r["upload_bytes"] for r in curve]
        down = [r.get("download_bytes", r["upload_bytes"]) for r in curve]
        rows.append({"setting": setting_name(setting), "method": method, "seed": seed,
                     "final_accuracy": summary["final_accuracy"],
                     "best_accuracy": summary["best_accuracy"],
                     "diverged": diverged, "rounds_logged": len(curve),
                     "seconds_per_round": float(np.mean([r["seconds"]
                                                         for r in curve])),
                     "upload_bytes_per_round": float(np.mean(up)),
                     "download_bytes_per_round": float(np.mean(down)),
                     "wall_seconds": summary["wall_seconds"],
                     # FedMA's grown hidden widths after the last round.
                     "hidden_widths": "-".join(
                         str(int(v)) for k, v in curve[-1].items()
                         if k.startswith("train_width_")) if curve else ""})
    common.write_csv(ctx.path("alignment_runs.csv"), rows)
    table = summarize(rows)
    common.write_csv(ctx.path("alignment_methods.csv"), table)
    common.write_json(ctx.path("alignment_methods.json"), {"settings": s, "runs": rows,
                                                           "table": table})
    plot(curves, s, ctx.path("alignment_methods.png"))
    lines = ["final accuracy (mean of the last 5 evaluations), mean +- std over seeds; "
             "seconds and MiB up / down per round:"]
    for r in table:
        lines.append(f"  {r['setting']:<22} {r['method']:<12} {100 * r['mean']:6.2f} +- "
                     f"{100 * r['std']:.2f}  ({r['seeds']} seeds"
                     f"{', %d diverged' % r['diverged'] if r['diverged'] else ''})  "
                     f"{r['seconds_per_round']:7.1f} s  {r['upload_mib']:7.2f} / "
                     f"{r['download_mib']:7.2f} MiB")
    return lines


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per setting and method: mean and std (ddof 0) of the final accuracy over the runs
    that did not diverge (`diverged` counts the others), and mean per-round costs."""
    out = []
    for setting, method in dict.fromkeys((r["setting"], r["method"]) for r in rows):
        mine = [r for r in rows if r["setting"] == setting and r["method"] == method]
        mean = lambda key: float(np.mean([r[key] for r in mine]))  # noqa: E731
        out.append({"setting": setting, "method": method, **common.accuracy_stats(mine),
                    "seconds_per_round": mean("seconds_per_round"),
                    "upload_mib": mean("upload_bytes_per_round") / 2**20,
                    "download_mib": mean("download_bytes_per_round") / 2**20})
    return out


def plot(curves: Dict[Any, List[Dict[str, Any]]], s: Settings, path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5 * len(s.settings), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(s.settings), squeeze=False)[0]
    colors = {"fedavg": "tab:blue", "fedavg_pans": "tab:blue", "fedma": "tab:green",
              "fed2": "tab:red"}
    for ax, setting in zip(axes, s.settings):
        for method in s.methods:
            rounds, acc = common.mean_curve([curves[(setting, method, seed)]
                                             for seed in s.seeds])
            ax.plot(rounds, acc, label=method, color=colors.get(method),
                    linestyle="--" if method.endswith("_pans") else "-", marker=".")
        k, r, alpha, e = setting
        ax.set(xlabel="round", ylabel="test accuracy (%)",
               title=f"K={k}, R={r:g}, alpha={alpha:g}, E={e:g}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{s.dataset}, {s.model}")
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("alignment_methods", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
