"""Mixed precision: the main job's FedAvg computed in bfloat16 (float32 master weights,
optimiser states and losses; `execution.precision`) against float32, paired by seed.

Each seed's two runs share the data split, the cohorts and the initial weights; only the
precision of the forward and backward passes differs (`fedjax_pan.models.precision`). The
check: bfloat16's final accuracy (the mean of the last 5 evaluations) ends within
`tolerance` points of float32's, on the mean over seeds.

Presets:
  cpu      configs/fmnist_mlp.py's compare preset with PANs off (its baseline): FedAvg,
           Fashion-MNIST, the paper's MLP, K = 100, R = 0.1, E = 5, B = 64, Dirichlet 0.1,
           12 rounds, seeds 0, 1, 2, float32 and bfloat16 (6 runs)
  paper    the same at 200 rounds, PANs off and on (PANx, T = 1, A = 0.1) (12 runs)
  default  the cpu preset
  smoke    synthetic data, a 64-wide MLP, K = 10, R = 0.5, alpha = 1, E = 2, no warm-up,
           4 rounds, seed 0
Outputs: precision_runs.csv (one row per run), precision.csv (per PAN setting: each
precision's mean and std, the paired difference, whether it is within the tolerance),
precision.json, precision.png (mean test accuracy against rounds).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

from experiments import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "fmnist_mlp.py")


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 12
    seeds: Tuple[int, ...] = (0, 1, 2)
    amplitudes: Tuple[float, ...] = (0.0,)  # PANx amplitudes; 0 = PANs off
    precisions: Tuple[str, ...] = ("float32", "bfloat16")  # the first is the reference
    tolerance: float = 0.5  # points of accuracy
    dataset: str = "fashion_mnist"
    num_clients: int = 100
    hidden: Optional[Tuple[int, ...]] = None  # None: the paper's 1024 x 3
    train_limit: Optional[int] = None
    # Further (dotted config key, value) pairs, e.g. a smoke run's shorter schedule.
    changes: Tuple[Tuple[str, Any], ...] = ()


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "paper": Settings(rounds=200, amplitudes=(0.0, 0.1)),
    "smoke": Settings(rounds=4, seeds=(0,), dataset="synthetic", num_clients=10,
                      hidden=(64,), train_limit=1000,
                      changes=(("participation", 0.5), ("partition.alpha", 1.0),
                               ("local.epochs", 2.0), ("optimizer.warmup", "none"))),
})


def _main_job(preset: str) -> Any:
    """configs/fmnist_mlp.py at `preset`: the main job's settings, read where they live."""
    spec = importlib.util.spec_from_file_location("fmnist_mlp", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def run_config(s: Settings, amplitude: float, precision: str, seed: int) -> Any:
    """The library config of one run: the compare preset's setting, one seed, no
    variants."""
    from fedjax_pan.config.defaults import set_keys
    from fedjax_pan.run.experiment import apply_overrides

    overrides: Dict[str, Any] = {
        "seed": seed, "rounds": s.rounds, "pan": {"amplitude": float(amplitude)},
        "dataset": {"name": s.dataset, "train_limit": s.train_limit},
        "partition": {"num_clients": s.num_clients},
        "execution": {"precision": precision},
        "checkpoint_every": max(1, s.rounds // 3)}
    cfg = apply_overrides(_main_job("compare"), overrides)
    if s.hidden:
        cfg.model.options = {"hidden": list(s.hidden)}
    return set_keys(cfg, dict(s.changes))


def run_name(amplitude: float, precision: str, seed: int) -> str:
    pan = "off" if not amplitude else f"panmul{amplitude:g}"
    return f"{pan}_{precision}_s{seed}"


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    keys = [(a, p, seed) for a in s.amplitudes for p in s.precisions for seed in s.seeds]
    results = common.train_runs(ctx, [(run_name(*k), run_config(s, *k)) for k in keys])
    rows = [{"pan_amplitude": a, "precision": p, "seed": seed,
             "final_accuracy": summary["final_accuracy"], "diverged": diverged,
             "wall_seconds": summary["wall_seconds"]}
            for (a, p, seed), (summary, diverged, _) in zip(keys, results)]
    common.write_csv(ctx.path("precision_runs.csv"), rows)
    table = summarize(rows, s)
    common.write_json(ctx.path("precision.json"), {
        "settings": s, "runs": rows, "table": table,
        "curves": {run_name(*k): curve for k, (_, _, curve) in zip(keys, results)}})
    common.write_csv(ctx.path("precision.csv"), table)
    plot(keys, [curve for _, _, curve in results], ctx.path("precision.png"), s)
    ref = s.precisions[0]
    lines = [f"final accuracy (mean of the last 5 evaluations) over seeds {list(s.seeds)}; "
             f"difference to {ref} paired by seed, tolerance {s.tolerance:g} points:"]
    for r in table:
        lines.append(f"  A = {r['pan_amplitude']:<4g} {r['precision']:<9} "
                     f"{100 * r['mean']:6.2f} +- {100 * r['std']:.2f}   "
                     f"{100 * r['diff_mean']:+6.2f} +- {100 * r['diff_std']:.2f}"
                     + ("" if r["precision"] == ref else
                        f"   {'within' if r['within'] else 'OUTSIDE'} tolerance"))
    return lines


def summarize(rows: Sequence[Dict[str, Any]], s: Settings) -> List[Dict[str, Any]]:
    """Per PAN setting and precision: mean and std (ddof 0) of the final accuracy over
    seeds, its difference to the reference precision paired by seed, and whether the
    mean difference lies within `s.tolerance` points."""
    from fedjax_pan.run.experiment import paired_stats

    out = []
    for a in s.amplitudes:
        def acc(p: str) -> List[float]:
            by_seed = {r["seed"]: r for r in rows
                       if r["pan_amplitude"] == a and r["precision"] == p}
            return [float("nan") if by_seed[seed]["diverged"] else
                    by_seed[seed]["final_accuracy"] for seed in s.seeds]
        for p in s.precisions:
            st = paired_stats(acc(s.precisions[0]), acc(p))
            out.append({"pan_amplitude": a, "precision": p, "seeds": st["pairs"],
                        "mean": st["on_mean"], "std": st["on_std"],
                        "diff_mean": st["diff_mean"], "diff_std": st["diff_std"],
                        "within": bool(abs(100 * st["diff_mean"]) <= s.tolerance)})
    return out


def plot(keys: Sequence[Tuple[float, str, int]],
         curves: Sequence[Sequence[Dict[str, Any]]], path: str, s: Settings) -> str:
    """Mean test accuracy against rounds, one line per PAN setting and precision."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for a in s.amplitudes:
        for p in s.precisions:
            mine = [c for (ka, kp, _), c in zip(keys, curves) if (ka, kp) == (a, p) and c]
            if not mine:
                continue
            rounds, mean = common.mean_curve(mine)
            pan = "PANs off" if not a else f"PANx A = {a:g}"
            ax.plot(rounds, mean, label=f"{pan}, {p}",
                    linestyle="-" if p == s.precisions[0] else "--")
    ax.set(xlabel="round", ylabel="test accuracy (%)",
           title=f"FedAvg in float32 and bfloat16 ({len(s.seeds)} seed(s))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("precision", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
