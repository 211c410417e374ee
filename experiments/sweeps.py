"""PAN paper Fig. 5 (bottom), Fig. 10 and Fig. 12 (left): FedAvg sweeps over the
non-i.i.d. level alpha, the PAN amplitude A and the shuffling of Alg. 2 (N_sf).

FedAvg with the paper's MLP on Fashion-MNIST (the paper: Cifar10 / Cinic10 with VGG9),
K = 100 clients, R = 0.1, E = 5, B = 64, SGD lr 0.05 momentum 0.9, Dirichlet alpha by
client, H = 200 rounds (Fig. 10's length); accuracy is the mean of the last five
evaluations (Fig. 10). Every cell runs with seeds 0, 1, 2; PANs on and off (and shuffled
and unshuffled) runs of a seed share the partition, cohorts and initial weights, so each
effect is reported as a paired difference to the cell's reference (same alpha, PANs off,
no shuffling) with its spread over seeds.

Presets:
  fig10    PANs off vs PANx (T = 1, A = 0.1) for alpha in {10, 1, 0.5, 0.1}: the gain
           should grow as alpha falls (24 runs)
  fig12    alpha = 0.1, PANx T = 1 with A in {0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0}: A near
           0.1 best (21 runs)
  fig5     PANs off: alpha in {10, 1, 0.1} without shuffling (the paper's horizontal lines)
           and alpha = 10 with Alg. 2's shuffling during local training, P_sf = 0.1,
           N_sf in {0.1, 0.2, 0.5, 1, 2, 5} (27 runs); R_kept of the local permutations for
           each N_sf (as experiments.r_kept, r = E * N_k / B steps)
  fig5_cpu fig5 at CPU length: alpha in {10, 0.1}, alpha = 10 with N_sf in {0.2, 1, 5},
           H = 20, seeds 0 and 1 (10 runs; on 2 CPU cores about 2 minutes a run, shuffled
           or not: about 10 minutes a seed)
  default  fig10 at CPU length: alpha in {10, 0.1}, H = 30 (12 runs, about 40 minutes on
           2 CPU cores)
  smoke    synthetic data, a 16-wide MLP, K = 6, R = 0.5, 2 rounds, seeds 0 and 1
Each preset writes sweeps_<preset>_runs.csv (one row per run), sweeps_<preset>.csv (per
cell: mean / std over seeds, paired difference to the reference), sweeps_<preset>.json and
fig<N>_<preset>.png. Runs go to runs/<cell>_s<seed>/ and are shared between presets: run
the presets into one --out with --resume and the common cells are trained once.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from experiments import common
from experiments.common import FLSetup, Pan
from fedjax_pan.run.experiment import paired_stats

PANX = Pan("mul", 1.0, 0.1)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One setting of the sweep: non-i.i.d. level, PAN setting, Alg. 2's expected shuffles."""

    alpha: float
    pan: Pan = common.PANS_OFF
    n_sf: float = 0.0

    @property
    def name(self) -> str:
        pan = "off" if not self.pan.on else (
            f"pan{'add' if self.pan.kind == 'add' else 'mul'}T{self.pan.period:g}"
            f"A{self.pan.amplitude:g}")
        return f"a{self.alpha:g}_{pan}" + (f"_nsf{self.n_sf:g}" if self.n_sf else "")

    @property
    def reference(self) -> "Cell":
        return Cell(self.alpha)


@dataclasses.dataclass(frozen=True)
class Settings:
    cells: Tuple[Cell, ...]
    figure: str  # what the figure's x axis sweeps: "alpha", "amplitude" or "n_sf"
    setup: FLSetup = FLSetup(num_clients=100, participation=0.1, epochs=5.0, rounds=200)
    p_sf: float = 0.1
    seeds: Tuple[int, ...] = (0, 1, 2)


def _fig10(alphas: Sequence[float]) -> Tuple[Cell, ...]:
    return tuple(Cell(a, pan) for a in alphas for pan in (common.PANS_OFF, PANX))


PRESETS = MappingProxyType({
    "fig10": Settings(_fig10((10.0, 1.0, 0.5, 0.1)), "alpha"),
    "fig12": Settings(tuple(Cell(0.1, Pan("mul", 1.0, a))
                            for a in (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)), "amplitude"),
    "fig5": Settings((Cell(10.0), Cell(1.0), Cell(0.1),
                      *(Cell(10.0, n_sf=n) for n in (0.1, 0.2, 0.5, 1.0, 2.0, 5.0))), "n_sf"),
    "fig5_cpu": Settings((Cell(10.0), Cell(0.1),
                          *(Cell(10.0, n_sf=n) for n in (0.2, 1.0, 5.0))), "n_sf",
                         setup=FLSetup(num_clients=100, participation=0.1, epochs=5.0,
                                       rounds=20),
                         seeds=(0, 1)),
    "default": Settings(_fig10((10.0, 0.1)), "alpha",
                        setup=FLSetup(num_clients=100, participation=0.1, epochs=5.0,
                                      rounds=30)),
    "smoke": Settings((Cell(1.0), Cell(1.0, PANX), Cell(1.0, n_sf=1.0)), "alpha",
                      setup=FLSetup(dataset="synthetic", hidden=(16, 16, 16), num_clients=6,
                                    participation=0.5, epochs=1.0, rounds=2, warmup="none",
                                    strategy="loop"),
                      seeds=(0, 1)),
})


def run_config(s: Settings, cell: Cell, seed: int) -> Any:
    """The library config of one run."""
    cfg = common.fl_config(dataclasses.replace(s.setup, alpha=cell.alpha), cell.pan, seed)
    cfg.shuffle.n_sf = float(cell.n_sf)
    cfg.shuffle.p_sf = float(s.p_sf)
    cfg.checkpoint_every = max(1, s.setup.rounds // 4)
    return cfg


def summarize(s: Settings, rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per cell: mean / std of the final accuracy over seeds, and the paired difference to
    its reference cell (same alpha, PANs off, no shuffling; same seed) where that ran."""
    by = {(r["cell"], r["seed"]): r for r in rows}
    out = []
    for cell in s.cells:
        mine = [by[(cell.name, seed)] for seed in s.seeds]
        row = {"cell": cell.name, "alpha": cell.alpha, "pan": cell.pan.label,
               "amplitude": cell.pan.amplitude if cell.pan.on else 0.0, "n_sf": cell.n_sf,
               **common.accuracy_stats(mine), "diff_mean": float("nan"),
               "diff_std": float("nan")}
        ref = cell.reference
        if ref != cell and ref in s.cells:
            # A diverged run's accuracy is NaN (`common.train_run`): its pair drops out.
            stats = paired_stats([by[(ref.name, seed)]["final_accuracy"] for seed in s.seeds],
                                 [r["final_accuracy"] for r in mine])
            row.update(diff_mean=stats["diff_mean"], diff_std=stats["diff_std"])
        out.append(row)
    return out


def r_kept(s: Settings, n_sfs: Sequence[float], seed: int, draws: int = 200
           ) -> Dict[float, float]:
    """Mean R_kept of the product of Alg. 2's permutations over one client's local training
    (r = E * N_k / B steps, N_k = N / K) for each N_sf, as Fig. 5 top."""
    from experiments.r_kept import r_kept_vs_nsf
    from fedjax_pan import data as data_lib

    ds = (data_lib.synthetic(seed=seed) if s.setup.dataset == "synthetic"
          else data_lib.load(s.setup.dataset))
    n = ds.num_train
    n = min(n, s.setup.train_limit or n)
    steps = max(1, round(s.setup.epochs * n / s.setup.num_clients / s.setup.batch_size))
    width = (s.setup.hidden or (1024,))[0]
    rng = np.random.default_rng(seed)
    curve = r_kept_vs_nsf(rng, width, s.p_sf, n_sfs, steps, draws).mean(axis=1)
    return {float(k): float(v) for k, v in zip(n_sfs, curve)}


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    keys = [(cell, seed) for cell in s.cells for seed in s.seeds]
    results = common.train_runs(ctx, [(f"{cell.name}_s{seed}", run_config(s, cell, seed))
                                      for cell, seed in keys])
    rows = [{"cell": cell.name, "alpha": cell.alpha, "pan": cell.pan.label,
             "amplitude": cell.pan.amplitude if cell.pan.on else 0.0, "n_sf": cell.n_sf,
             "seed": seed, "final_accuracy": summary["final_accuracy"],
             "best_accuracy": summary["best_accuracy"], "diverged": diverged,
             "wall_seconds": summary["wall_seconds"]}
            for (cell, seed), (summary, diverged, _) in zip(keys, results)]
    table = summarize(s, rows)
    kept = (r_kept(s, sorted({c.n_sf for c in s.cells}), s.seeds[0])
            if s.figure == "n_sf" else {})
    for r in table:
        r["r_kept"] = kept.get(r["n_sf"], float("nan"))
    name = f"sweeps_{ctx.preset}"
    common.write_csv(ctx.path(f"{name}_runs.csv"), rows)
    common.write_csv(ctx.path(f"{name}.csv"), table)
    common.write_json(ctx.path(f"{name}.json"), {"settings": s, "runs": rows, "table": table})
    number = {"alpha": 10, "amplitude": 12, "n_sf": 5}[s.figure]
    common.save_figure(plot(s, table), ctx.path(f"fig{number}_{ctx.preset}.png"))
    lines = [f"FedAvg, {s.setup.dataset}, K={s.setup.num_clients}, R={s.setup.participation:g}"
             f", E={s.setup.epochs:g}, H={s.setup.rounds}: final accuracy (%), mean +- std "
             f"over seeds {list(s.seeds)}; difference to the reference cell paired by seed:"]
    for r in table:
        diff = ("" if not np.isfinite(r["diff_mean"]) else
                f"  vs reference {100 * r['diff_mean']:+.2f} +- {100 * r['diff_std']:.2f}")
        kept_s = f"  R_kept {r['r_kept']:.3f}" if np.isfinite(r["r_kept"]) else ""
        lines.append(f"  {r['cell']:<22} {100 * r['mean']:6.2f} +- {100 * r['std']:.2f}"
                     f"{diff}{kept_s}" + (f"  ({r['diverged']} diverged)" if r["diverged"]
                                          else ""))
    return lines


def plot(s: Settings, table: Sequence[Mapping[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.0))
    ax = fig.subplots() if s.figure != "amplitude" else None
    title = (f"FedAvg, {s.setup.dataset}, K={s.setup.num_clients}, H={s.setup.rounds}, "
             f"{len(s.seeds)} seeds")
    if s.figure == "alpha":
        alphas = list(dict.fromkeys(r["alpha"] for r in table))
        x = np.arange(len(alphas))
        for i, (on, label, color) in enumerate(((False, "PANs off", "tab:blue"),
                                               (True, "PANs on", "tab:red"))):
            mine = [next((r for r in table if r["alpha"] == a and (r["amplitude"] > 0) == on
                          and not r["n_sf"]), None) for a in alphas]
            means = [100 * r["mean"] if r else np.nan for r in mine]
            stds = [100 * r["std"] if r else 0.0 for r in mine]
            ax.bar(x + (i - 0.5) * 0.38, means, 0.38, yerr=stds, capsize=3, color=color,
                   label=label)
            if on:
                for xi, r in zip(x, mine):
                    if r and np.isfinite(r["diff_mean"]):
                        ax.annotate(f"{100 * r['diff_mean']:+.2f}\n±{100 * r['diff_std']:.2f}",
                                    (xi + 0.19, 100 * r["mean"] + 100 * r["std"]),
                                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [f"alpha={a:g}" for a in alphas])
        low = np.nanmin([100 * r["mean"] for r in table])
        ax.set(ylabel="test accuracy (%)", ylim=(max(0.0, low - 10), None))
    elif s.figure == "amplitude":
        fig.set_size_inches(11.0, 4.0)
        ax, ax_diff = fig.subplots(1, 2)
        rows = sorted(table, key=lambda r: r["amplitude"])
        x = np.arange(len(rows))
        for axis, key, std, label in ((ax, "mean", "std", "test accuracy (%)"),
                                      (ax_diff, "diff_mean", "diff_std",
                                       "on - off, paired by seed (points)")):
            m = np.asarray([100 * r[key] for r in rows])
            sd = np.nan_to_num(np.asarray([100 * r[std] for r in rows]))
            axis.errorbar(x, m, yerr=sd, marker="o", capsize=3, color="tab:red",
                          label="PANx, T = 1")
            for xi, r in zip(x, rows):
                if r["diverged"]:
                    axis.annotate(f"{r['diverged']}/{r['seeds']}\ndiverged", (xi, 0.5),
                                  xycoords=("data", "axes fraction"), ha="center",
                                  fontsize=8)
            axis.set_xticks(x, [f"{r['amplitude']:g}" for r in rows])
            axis.set(xlabel="A", ylabel=label, xlim=(-0.5, len(rows) - 0.5))
        ax_diff.axhline(0.0, color="k", linewidth=0.8)
        ax_diff.grid(axis="y", alpha=0.3)
    else:
        colors = iter(("tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:gray"))
        for r in table:
            if not r["n_sf"]:
                ax.axhline(100 * r["mean"], linestyle=":", color=next(colors),
                           label=f"alpha={r['alpha']:g}")
        shuffled = sorted((r["n_sf"], 100 * r["mean"], 100 * r["std"], r["alpha"])
                          for r in table if r["n_sf"])
        n, m, sd, al = (np.asarray(v) for v in zip(*shuffled))
        ax.errorbar(np.arange(len(n)), m, yerr=sd, fmt="o", color="tab:red", capsize=3,
                    label=f"alpha={al[0]:g}, shuffled")
        ax.set_xticks(np.arange(len(n)), [f"{v:g}\n({r['r_kept']:.2f})" for v, r in zip(
            n, sorted((r for r in table if r["n_sf"]), key=lambda r: r["n_sf"]))])
        ax.set(xlabel="N_sf (R_kept)", ylabel="test accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("sweeps", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
