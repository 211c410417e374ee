"""Client-level differential privacy (DP-FedAvg, McMahan et al. 2018): accuracy against
epsilon for a few noise multipliers.

Many clients with little data each (what client-level DP needs: the noise is divided by
the expected number of clients a round), Poisson sampling at rate q, one local epoch,
updates clipped to `clip` (fixed) or adaptively (Andrew et al. 2021: from 0.1 towards the
median update norm), Gaussian noise of std z x clip on the sum, server SGD with momentum
0.9 (as the DP-FedAvg paper's server). Epsilon at `delta` from the RDP accountant
(`fedjax_pan.algorithms.uploads.privacy`) after every evaluated round. The rows: no clipping and no noise
(FedAvg), then each noise multiplier z (z = 0: clipping alone), and z with adaptive
clipping.

Presets:
  cpu      Fashion-MNIST, K = 3,000 clients (20 examples each), q = 0.1 (300 a round
           expected), one local epoch at lr 0.1, McMahan et al.'s 2NN, 100 rounds,
           z in {0, 0.7, 1.0, 1.5} with clip 0.3 and z = 1 adaptive, delta 1e-4, seed 0
           (12 minutes on 2 CPU cores)
  paper    300 rounds, z in {0, 0.5, 0.7, 1.0, 1.5}, adaptive z in {0.7, 1.0}, seeds 0-2
  default  the cpu preset
  smoke    synthetic data, a 16-wide MLP, K = 50, 3 rounds, z in {0, 1}, adaptive z 0.5
Outputs: privacy_runs.csv, privacy.csv, privacy.json, privacy.png (accuracy against
epsilon, and against rounds).
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common

LAST = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 100
    seeds: Tuple[int, ...] = (0,)
    dataset: str = "fashion_mnist"
    hidden: Tuple[int, ...] = (200, 200)
    clients: int = 3000
    rate: float = 0.1  # q: each client's chance to take part in a round
    epochs: float = 1.0
    batch_size: int = 64
    lr: float = 0.1
    server_lr: float = 1.0
    server_momentum: float = 0.9
    clip: float = 0.3
    noise: Tuple[float, ...] = (0.0, 0.7, 1.0, 1.5)
    adaptive_noise: Tuple[float, ...] = (1.0,)
    delta: float = 1e-4
    eval_every: int = 5


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "paper": Settings(rounds=300, seeds=(0, 1, 2), noise=(0.0, 0.5, 0.7, 1.0, 1.5),
                      adaptive_noise=(0.7, 1.0), eval_every=10),
    "smoke": Settings(rounds=3, dataset="synthetic", hidden=(16, 16), clients=50, rate=0.2,
                      delta=1e-3,
                      noise=(0.0, 1.0), adaptive_noise=(0.5,), eval_every=1),
})


@dataclasses.dataclass(frozen=True)
class Job:
    mode: str  # 'none' (FedAvg), 'fixed' or 'adaptive' clipping
    noise: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.mode}_z{self.noise:g}_s{self.seed}"


def jobs(s: Settings) -> List[Job]:
    out = []
    for seed in s.seeds:
        out.append(Job("none", 0.0, seed))
        out += [Job("fixed", z, seed) for z in s.noise]
        out += [Job("adaptive", z, seed) for z in s.adaptive_noise]
    return out


def run_config(s: Settings, job: Job):
    from fedjax_pan.config.defaults import default_config, set_keys

    keys = {"seed": job.seed, "rounds": s.rounds, "dataset.name": s.dataset,
            "local.epochs": float(s.epochs), "local.batch_size": s.batch_size,
            "optimizer.lr": s.lr, "optimizer.warmup": "none", "pan.amplitude": 0.0,
            "partition.scheme": "iid", "partition.num_clients": s.clients,
            "participation": s.rate, "sampling": "poisson",
            "server.lr": s.server_lr, "server.momentum": s.server_momentum,
            "model.options": {"hidden": list(s.hidden)}, "eval.every": s.eval_every,
            "checkpoint_every": max(s.eval_every, s.rounds // 3), "max_train_loss": 1e30}
    if job.mode != "none":
        keys.update({"privacy.clip": s.clip if job.mode == "fixed" else 0.1,
                     "privacy.noise_multiplier": job.noise, "privacy.delta": s.delta,
                     "privacy.adaptive": job.mode == "adaptive"})
    return set_keys(default_config(), keys)


def _epsilon(row: Dict[str, Any]) -> float:
    """A row's epsilon; metrics.jsonl holds null where it is infinite (no noise)."""
    value = row.get("dp_epsilon")
    return float("inf") if value is None else float(value)


def run_row(job: Job, curve: Sequence[Dict[str, Any]], diverged: bool) -> Dict[str, Any]:
    last = list(curve)[-LAST:]
    acc = float("nan") if diverged or not last else float(
        np.mean([r["test_accuracy"] for r in last]))
    eps = _epsilon(curve[-1]) if curve else float("nan")
    return {"mode": job.mode, "noise_multiplier": job.noise, "seed": job.seed,
            "diverged": diverged, "accuracy": acc, "epsilon": eps}


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    todo = jobs(s)
    results = common.train_runs(ctx, [(j.name, run_config(s, j)) for j in todo])
    curves = [c for _, _, c in results]
    rows = [run_row(j, c, d) for j, (_, d, c) in zip(todo, results)]
    common.write_csv(ctx.path("privacy_runs.csv"), rows)
    table = []
    for key in dict.fromkeys((r["mode"], r["noise_multiplier"]) for r in rows):
        mine = [r for r in rows if (r["mode"], r["noise_multiplier"]) == key]
        acc = [r["accuracy"] for r in mine]
        table.append({"mode": key[0], "noise_multiplier": key[1], "seeds": len(mine),
                      "accuracy": float(np.mean(acc)), "accuracy_std": float(np.std(acc)),
                      "epsilon": mine[0]["epsilon"]})
    common.write_csv(ctx.path("privacy.csv"), table)
    common.write_json(ctx.path("privacy.json"), {"settings": s, "runs": rows, "table": table,
                                                 "curves": {j.name: c for j, c in
                                                            zip(todo, curves)}})
    plot(todo, curves, ctx.path("privacy.png"), s)
    lines = [f"DP-FedAvg on {s.dataset}: K = {s.clients}, q = {s.rate}, {s.rounds} rounds, "
             f"delta = {s.delta:g} (accuracy: mean of the last {LAST} evaluations, over "
             f"{len(s.seeds)} seed(s))",
             f"  {'clipping':<10}{'z':>6}{'epsilon':>10}{'accuracy':>18}"]
    for r in table:
        clip = {"none": "none", "fixed": f"{s.clip:g}", "adaptive": "adaptive"}[r["mode"]]
        eps = "inf" if not np.isfinite(r["epsilon"]) else f"{r['epsilon']:.2f}"
        lines.append(f"  {clip:<10}{r['noise_multiplier']:6.2f}{eps:>10}"
                     f"{100 * r['accuracy']:10.2f} +- {100 * r['accuracy_std']:4.2f}")
    return lines


def plot(todo: Sequence[Job], curves: Sequence[Sequence[Dict[str, Any]]], path: str,
         s: Settings) -> str:
    """Accuracy against epsilon (each run's curve over its rounds), and against rounds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_eps, ax_rounds = fig.subplots(1, 2)
    for j, curve in zip(todo, curves):
        if j.seed != s.seeds[0] or not curve:
            continue
        label = "FedAvg (no DP)" if j.mode == "none" else f"{j.mode} clip, z = {j.noise:g}"
        acc = [100 * r["test_accuracy"] for r in curve]
        ax_rounds.plot([r["round"] for r in curve], acc, label=label)
        eps = [_epsilon(r) for r in curve]
        if np.isfinite(eps).any():
            ax_eps.plot(eps, acc, marker=".", label=label)
    ax_eps.set(xlabel=f"epsilon (delta = {s.delta:g})", ylabel="test accuracy (%)",
               xscale="log", title="accuracy against privacy spent")
    ax_rounds.set(xlabel="round", ylabel="test accuracy (%)", title="accuracy against rounds")
    for ax in (ax_eps, ax_rounds):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("privacy", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
