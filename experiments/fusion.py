"""PAN paper Fig. 31 (App. F): one-shot model fusion, plain averaging against optimal-transport
alignment, with PANs off and on.

The training set is split into two uniform random halves; model A trains on one and model B
on the other, from different initialisations (SGD, lr 0.05, momentum 0.9, B = 64). The test
accuracy of the interpolation (1 - mu) A + mu B' is measured for mu in [0, 1], where B' is

  Avg           B itself;
  OT+Avg        B with its neurons aligned to A's (`fedjax_pan.pan.matching.align`: exact OT
                between neurons, a Hungarian assignment per layer);
  PANs+Avg      B itself, both models trained with PANs (PANx, T = 1, A = 0.1);
  PANs+OT+Avg   the PAN-trained B aligned to A.

Aligning B permutes its parameters but not the PAN encodings (constants), so with PANs on an
alignment that moves neurons changes B's function; `moved` reports the fraction of hidden
neurons each alignment moves (PANs bind neurons to positions: OT should move few).

Presets:
  default  Fashion-MNIST; the MLP (784-1024-1024-1024-10) and VGG9 at width 0.25; 2 epochs
           per model; alignment by weights; mu in 0, 0.1, ..., 1; 2 seeds
  paper    the default's models on all of Fashion-MNIST for 10 epochs, 3 seeds
  smoke    synthetic data, a 128-wide MLP, 12 epochs (its plateau lasts ~8), mu in 0, 0.5, 1, 1 seed
Outputs: fusion.csv (one row per model, method, seed and mu), fusion.json (accuracy at
mu = 0.5 per method, mean and std over seeds; the fraction of neurons moved),
fig31_fusion.png (one panel per model: accuracy against mu, mean over seeds).
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from matplotlib.figure import Figure

from experiments import common
from experiments.common import Pan
from fedjax_pan.pan import matching, permutation
from fedjax_pan import models

METHODS = ("Avg", "OT+Avg", "PANs+Avg", "PANs+OT+Avg")


@dataclasses.dataclass(frozen=True)
class Settings:
    dataset: str = "fashion_mnist"
    train_limit: Optional[int] = None
    test_limit: Optional[int] = None
    # (label, model name, build options)
    networks: Tuple[Tuple[str, str, Tuple[Tuple[str, Any], ...]], ...] = (
        ("MLP", "mlp", ()), ("VGG9 (width 0.25)", "vgg9", (("width", 0.25),)))
    epochs: int = 2
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    pan_on: Pan = common.PANS_ON
    align_by: str = "weights"
    align_inputs: int = 512  # training examples the activation matching looks at
    mus: Tuple[float, ...] = tuple(np.round(np.linspace(0.0, 1.0, 11), 2))
    seeds: Tuple[int, ...] = (0, 1)


PRESETS = MappingProxyType({
    "default": Settings(),
    "paper": Settings(epochs=10, seeds=(0, 1, 2)),
    "smoke": Settings(dataset="synthetic", train_limit=1000, test_limit=200,
                      networks=(("MLP", "mlp", (("hidden", (128, 128, 128)),)),), epochs=12,
                      batch_size=32, mus=(0.0, 0.5, 1.0), seeds=(0,)),
})


def interpolate(a: Any, b: Any, mu: float) -> Any:
    """(1 - mu) a + mu b, leaf by leaf."""
    return jax.tree_util.tree_map(lambda x, y: (1.0 - mu) * x + mu * y, a, b)


def fuse_pair(s: Settings, data: common.ArrayData, net: Tuple[str, str, Any], pan: Pan,
              seed: int, ctx: common.Context) -> Dict[str, Any]:
    """Trains A and B on the two halves; returns accuracies along mu for B and aligned B."""
    label, name, options = net
    model = models.build(name, data.num_classes, pan=pan.as_dict(), **{
        k: list(v) if isinstance(v, tuple) else v for k, v in options})
    half = np.random.default_rng([seed, 7]).permutation(len(data.train_y))
    halves = np.array_split(half, 2)
    trained = []
    for i, idx in enumerate(halves):
        init = models.init(model, jax.random.PRNGKey(seed * 100 + i), data.input_shape)
        variables, _ = common.train_centralised(
            model, init, data.train_x[np.sort(idx)], data.train_y[np.sort(idx)],
            epochs=s.epochs, batch_size=s.batch_size, lr=s.lr, momentum=s.momentum,
            seed=seed * 100 + i, show_progress=ctx.progress,
            desc=f"{label} {'PANs' if pan.on else 'plain'} s{seed} {'AB'[i]}")
        trained.append(variables)
    a, b = trained
    inputs = data.train_x[halves[0][:s.align_inputs]]
    spec = permutation.spec_for(model, b)
    perms = matching.match(model, a, b, by=s.align_by, inputs=inputs, spec=spec)
    aligned = permutation.apply_permutation(spec, perms, b)
    accuracy = common.make_accuracy(model, data)
    return {"plain": [accuracy(interpolate(a, b, mu)) for mu in s.mus],
            "aligned": [accuracy(interpolate(a, aligned, mu)) for mu in s.mus],
            "moved": float(np.mean(np.concatenate(
                [p != np.arange(len(p)) for p in perms.values()])))}


def run(s: Settings, ctx: common.Context) -> List[str]:
    data = common.load_data(s.dataset, ctx.seed, s.train_limit, s.test_limit)
    rows, curves, moved = [], {}, {}
    for net in s.networks:
        for seed in s.seeds:
            for pan in (common.PANS_OFF, s.pan_on):
                out = fuse_pair(s, data, net, pan, seed, ctx)
                prefix = "PANs+" if pan.on else ""
                for kind, method in (("plain", prefix + "Avg"), ("aligned", prefix + "OT+Avg")):
                    curves[(net[0], method, seed)] = out[kind]
                    rows += [{"network": net[0], "method": method, "seed": seed, "mu": mu,
                              "accuracy": acc} for mu, acc in zip(s.mus, out[kind])]
                moved[(net[0], "PANs" if pan.on else "plain", seed)] = out["moved"]
    common.write_csv(ctx.path("fusion.csv"), rows)
    half = int(np.argmin(np.abs(np.asarray(s.mus) - 0.5)))
    summary = {}
    for net in s.networks:
        summary[net[0]] = {}
        for method in METHODS:
            at_half = np.asarray([curves[(net[0], method, seed)][half] for seed in s.seeds])
            summary[net[0]][method] = {"accuracy_at_half_mean": float(at_half.mean()),
                                       "accuracy_at_half_std": float(at_half.std()),
                                       "accuracy_at_ends_mean": float(np.mean(
                                           [curves[(net[0], method, sd)][i] for sd in s.seeds
                                            for i in (0, -1)]))}
        for kind in ("plain", "PANs"):
            summary[net[0]][f"moved_{kind}"] = float(np.mean(
                [moved[(net[0], kind, seed)] for seed in s.seeds]))
    common.write_json(ctx.path("fusion.json"), {"settings": s, "mu_half": s.mus[half],
                                                "summary": summary})
    common.save_figure(_plot(s, curves), ctx.path("fig31_fusion.png"))
    lines = [f"test accuracy (%) of (1 - mu) A + mu B' at mu = {s.mus[half]:g} "
             f"(mean +- std over {len(s.seeds)} seeds; A and B at mu = 0 and 1):"]
    for net, per in summary.items():
        for method in METHODS:
            r = per[method]
            lines.append(f"  {net:<20} {method:<12} {100 * r['accuracy_at_half_mean']:6.2f} +- "
                         f"{100 * r['accuracy_at_half_std']:.2f}   ends "
                         f"{100 * r['accuracy_at_ends_mean']:6.2f}")
        lines.append(f"  {net:<20} neurons moved by OT: {100 * per['moved_plain']:.1f}% plain, "
                     f"{100 * per['moved_PANs']:.1f}% with PANs")
    return lines


def _plot(s: Settings, curves: Dict[Tuple[str, str, int], List[float]]) -> Figure:
    nets = [n[0] for n in s.networks]
    fig = Figure(figsize=(5.0 * len(nets), 3.8))
    axes = np.atleast_1d(fig.subplots(1, len(nets), squeeze=False)[0])
    style = {"Avg": ("tab:blue", "--"), "OT+Avg": ("tab:blue", "-"),
             "PANs+Avg": ("tab:red", "--"), "PANs+OT+Avg": ("tab:red", "-")}
    for ax, net in zip(axes, nets):
        for method in METHODS:
            acc = 100 * np.mean([curves[(net, method, seed)] for seed in s.seeds], axis=0)
            color, ls = style[method]
            ax.plot(s.mus, acc, color=color, linestyle=ls, marker="o", ms=3, label=method)
        ax.set(xlabel=r"$\mu$", ylabel="test accuracy (%)",
               title=f"{net}: (1 - $\\mu$) A + $\\mu$ B ({s.dataset})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("fusion", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
