"""Fed2 (paper 003) Fig. 10 / Psi-Net Eq. 5: the sharing depth from layer-wise total variance.

A plain network is briefly pre-trained centrally; the total variance (TV, Eq. 17) of its
neurons' class-preference vectors is measured layer by layer on test samples. TV stays
low in the shallow layers, whose features serve every class, and rises in the deep ones:
the layers before the first whose TV exceeds the threshold (by default halfway between
the lowest and the highest TV) stay shared, the rest become grouped, and the script
reports the resulting `GroupedConfig.depth`.

Presets:
  default  Fashion-MNIST, VGG9 at width 0.5, 2 epochs of SGD (lr 0.05, momentum 0.9,
           B = 64) on 20,000 examples, TV on 2,000 test samples, preference vectors
           normalised by their L1 norm (see `Settings.normalize`)
  paper    CIFAR-10, VGG9, 50 epochs (the paper's pre-training), TV on 10,000 test samples,
           Eq. 17's normalisation by the signed sum
  smoke    synthetic data, a 64-wide 3-layer MLP, 1 epoch, 200 test samples
Outputs: sharing_depth.csv (TV per layer), sharing_depth.json (TVs, threshold, shared
layers, grouped depth, pre-training losses), fig10_sharing_depth.png.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, List, Optional, Sequence, Tuple

import jax

from experiments import common


@dataclasses.dataclass(frozen=True)
class Settings:
    dataset: str = "fashion_mnist"
    model: str = "vgg9"
    options: Tuple[Tuple[str, Any], ...] = (("width", 0.5),)  # models.build options
    train_limit: Optional[int] = 20000
    test_limit: Optional[int] = 2000
    epochs: int = 2
    lr: float = 0.05
    relative: float = 0.5  # threshold = min + relative * (max - min) of the TVs
    # Eq. 17 divides each preference vector by its signed sum, which can be near 0 and then
    # dominates the layer's TV (smoke run: one layer at 1002, the others at 2-27); 'l1'
    # divides by the sum of magnitudes, bounding each term by 2.
    normalize: str = "l1"


PRESETS = MappingProxyType({
    "default": Settings(),
    "paper": Settings(dataset="cifar10", options=(), train_limit=None, test_limit=None,
                      epochs=50, normalize="sum"),
    "smoke": Settings(dataset="synthetic", model="mlp", options=(("hidden", (64, 64, 64)),),
                      train_limit=1000, test_limit=200, epochs=1),
})


def run(s: Settings, ctx: common.Context) -> List[str]:
    from fedjax_pan import models
    from fedjax_pan.analysis import preference

    data = common.load_data(s.dataset, ctx.seed, s.train_limit, s.test_limit)
    model = models.build(s.model, data.num_classes, **{k: v for k, v in s.options})
    variables = models.init(model, jax.random.PRNGKey(ctx.seed), data.input_shape)
    variables, losses = common.train_centralised(
        model, variables, data.train_x, data.train_y, epochs=s.epochs, lr=s.lr, seed=ctx.seed,
        show_progress=ctx.progress, desc="pre-training")
    hidden = [name for name in model.weight_layers() if name != "head"]
    tv = preference.layerwise_total_variance(model, variables, data.test_x, data.test_y,
                                             hidden, data.num_classes,
                                             normalize=s.normalize)
    shared, threshold = preference.sharing_depth(tv, relative=s.relative)
    depth = preference.grouped_depth(model.weight_layers(), shared)
    rows = [{"layer": name, "total_variance": value, "shared": i < shared}
            for i, (name, value) in enumerate(tv.items())]
    common.write_csv(ctx.path("sharing_depth.csv"), rows)
    common.write_json(ctx.path("sharing_depth.json"), {
        "settings": s, "total_variance": tv, "threshold": threshold, "shared_layers": shared,
        "grouped_depth": depth, "pretraining_losses": losses})
    plot(tv, threshold, shared, depth, s, ctx.path("fig10_sharing_depth.png"))
    return [f"{name:<6} TV {value:.4f}{'  (shared)' if i < shared else ''}"
            for i, (name, value) in enumerate(tv.items())] + [
        f"threshold {threshold:.4f}: share {shared} layers, grouped depth {depth} "
        f"(config.model.options.grouped.depth={depth})"]


def plot(tv, threshold: float, shared: int, depth: int, s: Settings, path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = list(tv)
    ax.bar(names, [tv[n] for n in names],
           color=["tab:blue" if i < shared else "tab:red" for i in range(len(names))])
    ax.axhline(threshold, color="k", linestyle="--", linewidth=1, label="threshold")
    ax.set(ylabel="total variance of preferences",
           title=f"{s.model} on {s.dataset}: shared (blue) vs grouped (red), depth {depth}")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("sharing_depth", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
