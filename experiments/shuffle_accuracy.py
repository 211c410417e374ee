"""PAN paper Fig. 4: test accuracy of trained networks after shuffling their neurons.

The MLP (784-1024-1024-1024-10) is trained centrally on Fashion-MNIST (the paper: MLP on
Mnist) with SGD (lr 0.05, momentum 0.9, B = 64) with PANs off and on; then every hidden
layer is shuffled with Alg. 1 at P_sf in {0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0} (several
permutation draws, the same draws for every variant) and the test accuracy is measured.
Fig. 4 first panel: accuracy of each variant unshuffled; the other: accuracy vs P_sf. With
PANs off the network is permutation invariant and the accuracy stays flat; with PANs on it
drops, PANx (multiplicative) faster than PAN+.

Presets: default (off, PAN+ A in {0.05, 0.25}, PANx A in {0.1, 0.75}, T = 1; 2 epochs;
3 draws), paper (off, PAN+ A in {0.01, 0.25}, PANx A in {0.05, 0.75}, T in {1, 8};
20 epochs; 10 draws), smoke (synthetic data, a 128-wide MLP, the default's first three).
Outputs: shuffle_accuracy.csv, shuffle_accuracy.json, fig4_shuffle_accuracy.png.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import List, Optional, Sequence, Tuple

import jax
import numpy as np
from matplotlib.figure import Figure

from experiments import common
from experiments.common import Pan
from fedjax_pan import models
from fedjax_pan.pan import permutation


@dataclasses.dataclass(frozen=True)
class Settings:
    dataset: str = "fashion_mnist"
    train_limit: Optional[int] = None
    test_limit: Optional[int] = None
    hidden: Optional[Tuple[int, ...]] = None  # None: the paper's 1024 x 3
    variants: Tuple[Pan, ...] = (common.PANS_OFF, Pan("add", 1.0, 0.05), Pan("mul", 1.0, 0.1),
                                 Pan("add", 1.0, 0.25), Pan("mul", 1.0, 0.75))
    epochs: int = 2
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    p_sfs: Tuple[float, ...] = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)
    draws: int = 3


PRESETS = MappingProxyType({
    "default": Settings(),
    "paper": Settings(variants=(common.PANS_OFF,
                                *(Pan("add", t, a) for a in (0.01, 0.25) for t in (1.0, 8.0)),
                                *(Pan("mul", t, a) for a in (0.05, 0.75) for t in (1.0, 8.0))),
                      epochs=20, draws=10),
    # Narrow MLPs at the N(0, 0.01) init learn slowly: 128 wide, B=32 so the smoke run learns.
    "smoke": Settings(dataset="synthetic", train_limit=1000, test_limit=200,
                      hidden=(128, 128, 128), variants=(common.PANS_OFF, Pan("add", 1.0, 0.05),
                                                        Pan("mul", 1.0, 0.1)),
                      epochs=6, batch_size=32, p_sfs=(0.0, 0.5, 1.0), draws=2),
})


def _plot(s: Settings, base: Sequence[float], acc: np.ndarray) -> Figure:
    """acc: (variants, p_sfs, draws)."""
    fig = Figure(figsize=(11.0, 3.9))
    ax_bar, ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.0, 1.6]})
    labels = [v.label for v in s.variants]
    colors = [f"C{i}" for i in range(len(labels))]
    ax_bar.bar(range(len(labels)), 100 * np.asarray(base), color=colors)
    ax_bar.set_xticks(range(len(labels)))
    ax_bar.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    lo = 100 * min(base)
    ax_bar.set(ylabel="test accuracy (%)", ylim=(max(0.0, lo - 5), min(100.0, 100 * max(base) + 2)),
               title="trained (unshuffled)")
    for i, b in enumerate(base):
        ax_bar.text(i, 100 * b, f"{100 * b:.1f}", ha="center", va="bottom", fontsize=8)
    for i, label in enumerate(labels):
        mean, std = 100 * acc[i].mean(axis=1), 100 * acc[i].std(axis=1)
        ax.errorbar(s.p_sfs, mean, yerr=std, marker="o", ms=3, capsize=2, label=label,
                    color=colors[i])
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set(xlabel="$P_{sf}$", ylabel="test accuracy (%)",
           title=f"after shuffling (mean of {s.draws} draws)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run(s: Settings, ctx: common.Context) -> List[str]:
    data = common.load_data(s.dataset, ctx.seed, s.train_limit, s.test_limit)
    options = {"hidden": s.hidden} if s.hidden else {}
    rows, base, acc, summary = [], [], [], {}
    for i, pan in enumerate(s.variants):
        model = models.build("mlp", data.num_classes, pan=pan.as_dict(), **options)
        variables = models.init(model, jax.random.PRNGKey(ctx.seed), data.input_shape)
        variables, losses = common.train_centralised(
            model, variables, data.train_x, data.train_y, epochs=s.epochs,
            batch_size=s.batch_size, lr=s.lr, momentum=s.momentum, seed=ctx.seed,
            show_progress=ctx.progress, desc=pan.label)
        accuracy = common.make_accuracy(model, data)
        spec = permutation.spec_for(model, variables)
        base.append(accuracy(variables))
        # The same seeded draws for every variant: they differ only in their PANs.
        rng = np.random.default_rng([ctx.seed, 1])
        grid = np.zeros((len(s.p_sfs), s.draws))
        jobs = [(j, d) for j in range(len(s.p_sfs)) for d in range(s.draws)]
        for j, d in common.progress(jobs, ctx.progress, f"{pan.label} shuffles"):
            perms = permutation.random_permutations(spec, rng, s.p_sfs[j])
            grid[j, d] = accuracy(permutation.apply_permutation(spec, perms, variables))
            rows.append({"variant": pan.label, "kind": pan.kind if pan.on else "off",
                         "period": pan.period, "amplitude": pan.amplitude,
                         "p_sf": s.p_sfs[j], "draw": d, "accuracy": grid[j, d],
                         "unshuffled_accuracy": base[-1]})
        acc.append(grid)
        summary[pan.label] = {
            "pan": pan, "train_loss": losses, "unshuffled_accuracy": base[-1],
            "accuracy_mean": dict(zip(map(str, s.p_sfs), grid.mean(axis=1))),
            "accuracy_std": dict(zip(map(str, s.p_sfs), grid.std(axis=1))),
            "drop_at_max_p_sf": base[-1] - float(grid[-1].mean())}
    acc_arr = np.array(acc)
    common.write_csv(ctx.path("shuffle_accuracy.csv"), rows)
    common.write_json(ctx.path("shuffle_accuracy.json"),
                      {"dataset": s.dataset, "epochs": s.epochs, "p_sfs": s.p_sfs,
                       "draws": s.draws, "variants": summary})
    common.save_figure(_plot(s, base, acc_arr), ctx.path("fig4_shuffle_accuracy.png"))
    head = "  " + f"{'variant':<20} {'trained':>8} " + " ".join(f"{p:>6g}" for p in s.p_sfs)
    lines = [f"test accuracy (%) after shuffling with P_sf ({s.dataset}, {s.epochs} epochs, "
             f"mean of {s.draws} draws):", head]
    for label, b, grid in zip(summary, base, acc_arr):
        lines.append(f"  {label:<20} {100 * b:>8.2f} " +
                     " ".join(f"{100 * m:>6.2f}" for m in grid.mean(axis=1)))
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("shuffle_accuracy", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
