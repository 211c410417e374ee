"""PAN paper Fig. 2 and Fig. 5 (top): how many neurons a random shuffle leaves in place.

Fig. 2 left: R_kept = mean(diag(Pi)) of Alg. 1's random permutation of J = 100 neurons vs
P_sf in [0, 1], mean over draws (the paper averages 10), for Alg. 1 (partner drawn from
j+1..J-1) and for the released code's window variant (partner from j..j + floor(J * w)).
Fig. 2 right: one permutation matrix drawn by Alg. 1 with P_sf = 0.1.
Fig. 5 top: R_kept of the product of the permutations Alg. 2 applies during one client's
local training (at each of r local steps shuffle with probability N_sf / r, each shuffle an
Alg. 1 permutation) vs N_sf, for P_sf in {0.01, 0.1}; r = 50 (about E * N_k / B = 5 * 600 / 64).

Presets: paper (10 draws, P_sf step 0.05), default (200 draws), smoke (a few draws, coarse
grids). Outputs: r_kept_vs_psf.csv, r_kept_vs_nsf.csv, permutation_demo.csv, r_kept.json,
fig2_r_kept.png, fig5_r_kept_nsf.png. Pure numpy: no model, no data.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from experiments import common
from fedjax_pan.pan import permutation


@dataclasses.dataclass(frozen=True)
class Settings:
    size: int = 100  # J
    draws: int = 200
    p_sfs: Tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(21))
    window: float = 0.1  # the window variant's w (fraction of J)
    demo_p_sf: float = 0.1
    n_sfs: Tuple[float, ...] = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
    fl_p_sfs: Tuple[float, ...] = (0.01, 0.1)
    steps: int = 50  # r: local steps per round


PRESETS = MappingProxyType({
    "paper": Settings(draws=10),
    "default": Settings(),
    "smoke": Settings(size=30, draws=4, p_sfs=(0.0, 0.1, 0.5, 1.0),
                      n_sfs=(0.0, 1.0, 5.0), steps=10),
})


def r_kept_vs_psf(rng: np.random.Generator, size: int, p_sfs: Sequence[float], draws: int,
                  window: Optional[float]) -> np.ndarray:
    """(len(p_sfs), draws) R_kept of single Alg. 1 permutations."""
    return np.array([[permutation.r_kept(permutation.shuffle_permutation(rng, size, p, window))
                      for _ in range(draws)] for p in p_sfs])


def r_kept_vs_nsf(rng: np.random.Generator, size: int, p_sf: float, n_sfs: Sequence[float],
                  steps: int, draws: int) -> np.ndarray:
    """(len(n_sfs), draws) R_kept of Alg. 2's product of permutations over `steps` steps."""
    return np.array([[permutation.r_kept(permutation.fl_shuffle_product(rng, size, p_sf, n,
                                                                        steps))
                      for _ in range(draws)] for n in n_sfs])


def _plot_fig2(s: Settings, curves: Dict[str, np.ndarray], demo: np.ndarray) -> Figure:
    fig = Figure(figsize=(9.0, 3.8))
    ax, ax_m = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.4, 1.0]})
    for label, values in curves.items():
        mean, std = values.mean(axis=1), values.std(axis=1)
        ax.plot(s.p_sfs, mean, marker="o", ms=3, label=label)
        ax.fill_between(s.p_sfs, mean - std, mean + std, alpha=0.2)
    ax.set(xlabel="$P_{sf}$", ylabel="$R_{kept}$", ylim=(-0.02, 1.02),
           title=f"neurons kept in place (J={s.size}, {s.draws} draws)")
    ax.grid(alpha=0.3)
    ax.legend()
    q = np.zeros((len(demo), len(demo)))
    q[np.arange(len(demo)), demo] = 1
    ax_m.imshow(q, cmap=ListedColormap(["white", "black"]), interpolation="nearest")
    ax_m.set(title=f"$P_{{sf}}$={s.demo_p_sf:g}, $R_{{kept}}$={permutation.r_kept(demo):.2f}",
             xlabel="old position", ylabel="new position")
    fig.tight_layout()
    return fig


def _plot_fig5(s: Settings, curves: Dict[float, np.ndarray]) -> Figure:
    fig = Figure(figsize=(5.0, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    for p_sf, values in curves.items():
        mean, std = values.mean(axis=1), values.std(axis=1)
        ax.errorbar(s.n_sfs, mean, yerr=std, marker="o", ms=3, capsize=2,
                    label=f"$P_{{sf}}$={p_sf:g}")
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set(xlabel="$N_{sf}$ (expected shuffles per round)", ylabel="$R_{kept}$",
           ylim=(-0.02, 1.02), title=f"Alg. 2 product over r={s.steps} steps (J={s.size})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def run(s: Settings, ctx: common.Context) -> List[str]:
    rng = np.random.default_rng(ctx.seed)
    variants = {"Alg. 1": None, f"window w={s.window:g}": s.window}
    curves = {label: r_kept_vs_psf(rng, s.size, s.p_sfs, s.draws, w)
              for label, w in common.progress(variants.items(), ctx.progress, "P_sf sweep")}
    demo = permutation.shuffle_permutation(rng, s.size, s.demo_p_sf)
    fl = {p: r_kept_vs_nsf(rng, s.size, p, s.n_sfs, s.steps, s.draws)
          for p in common.progress(s.fl_p_sfs, ctx.progress, "N_sf sweep")}

    rows = [{"variant": label, "p_sf": float(p), "r_kept_mean": float(v.mean()),
             "r_kept_std": float(v.std()), "draws": s.draws}
            for label, values in curves.items() for p, v in zip(s.p_sfs, values)]
    common.write_csv(ctx.path("r_kept_vs_psf.csv"), rows)
    fl_rows = [{"p_sf": float(p), "n_sf": float(n), "steps": s.steps,
                "r_kept_mean": float(v.mean()), "r_kept_std": float(v.std()), "draws": s.draws}
               for p, values in fl.items() for n, v in zip(s.n_sfs, values)]
    common.write_csv(ctx.path("r_kept_vs_nsf.csv"), fl_rows)
    common.write_csv(ctx.path("permutation_demo.csv"),
                     [{"position": j, "old_position": int(i)} for j, i in enumerate(demo)])
    summary = {
        "r_kept_vs_psf": {label: dict(zip(map(str, s.p_sfs), values.mean(axis=1)))
                          for label, values in curves.items()},
        "r_kept_vs_nsf": {str(p): dict(zip(map(str, s.n_sfs), values.mean(axis=1)))
                          for p, values in fl.items()},
        "demo_r_kept": permutation.r_kept(demo),
    }
    common.write_json(ctx.path("r_kept.json"), summary)
    common.save_figure(_plot_fig2(s, curves, demo), ctx.path("fig2_r_kept.png"))
    common.save_figure(_plot_fig5(s, fl), ctx.path("fig5_r_kept_nsf.png"))

    lines = [f"R_kept vs P_sf (J={s.size}, {s.draws} draws):"]
    for label, values in curves.items():
        pts = ", ".join(f"{p:g}: {m:.3f}" for p, m in zip(s.p_sfs, values.mean(axis=1))
                        if p in (0.0, 0.1, 0.5, 1.0))
        lines.append(f"  {label:<14} {pts}")
    lines.append(f"R_kept of Alg. 2's product vs N_sf (r={s.steps}):")
    for p, values in fl.items():
        pts = ", ".join(f"{n:g}: {m:.3f}" for n, m in zip(s.n_sfs, values.mean(axis=1)))
        lines.append(f"  P_sf={p:g}: {pts}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("r_kept", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
