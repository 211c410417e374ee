"""PAN paper Fig. 30 and Table 3: what PANs cost in centralised training.

The network is trained on the whole training set with SGD (lr 0.05, momentum 0.9) and with
Adam (lr 3e-4), B = 64, the learning rate warmed up over the first 100 steps (App. C), PANs
off and on (T = 1, PAN+ and PANx over a range of A), each from the same initial weights for
a seed; test accuracy after the last epoch. Table 3 is the PANs-off row (the upper bound of
FL); Fig. 30 is accuracy against A. Every variant is run with the same seeds, so the effect
of a PAN setting is reported as the paired difference (on - off, same seed and optimiser)
with its spread.

Presets:
  default  Fashion-MNIST, the paper's MLP (784-1024x3-10), 5 epochs (the paper: 30 on
           FeMnist), PAN+ A in {0.05, 0.1, 0.25}, PANx A in {0.1, 0.25, 0.5, 0.75}, seeds
           0, 1, 2 (48 runs, 43 minutes on 2 CPU cores)
  paper    30 epochs, PAN+ A in {0.01, 0.05, 0.1, 0.25}, PANx A in {0.05, 0.1, 0.25, 0.5,
           0.75}, seeds 0, 1, 2
  smoke    synthetic data, a 64-wide MLP, 1 epoch, one A per kind, seed 0
Outputs: centralised_runs.csv (one row per run), centralised.csv (per optimiser and
variant: mean / std of the accuracy and of the paired difference to PANs off),
centralised.json, fig30_centralised.png.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from experiments import common
from experiments.common import Pan
from fedjax_pan import models
from fedjax_pan.run.experiment import paired_stats

OPTIMIZERS = {"sgd": 0.05, "adam": 3e-4}  # App. F.1's learning rates for the MLP / VGG


@dataclasses.dataclass(frozen=True)
class Settings:
    dataset: str = "fashion_mnist"
    train_limit: Optional[int] = None
    hidden: Optional[Tuple[int, ...]] = None  # None: the paper's 1024 x 3
    add_amplitudes: Tuple[float, ...] = (0.05, 0.1, 0.25)
    mul_amplitudes: Tuple[float, ...] = (0.1, 0.25, 0.5, 0.75)
    optimizers: Tuple[str, ...] = ("sgd", "adam")
    epochs: int = 5
    batch_size: int = 64
    warmup_steps: int = 100
    seeds: Tuple[int, ...] = (0, 1, 2)

    @property
    def variants(self) -> Tuple[Pan, ...]:
        return (common.PANS_OFF, *(Pan("add", 1.0, a) for a in self.add_amplitudes),
                *(Pan("mul", 1.0, a) for a in self.mul_amplitudes))


PRESETS = MappingProxyType({
    "default": Settings(),
    "paper": Settings(add_amplitudes=(0.01, 0.05, 0.1, 0.25),
                      mul_amplitudes=(0.05, 0.1, 0.25, 0.5, 0.75), epochs=30),
    "smoke": Settings(dataset="synthetic", train_limit=600, hidden=(64, 64, 64),
                      add_amplitudes=(0.25,), mul_amplitudes=(0.75,), epochs=1,
                      warmup_steps=5, seeds=(0,)),
})


def run(s: Settings, ctx: common.Context) -> List[str]:
    options = {"hidden": s.hidden} if s.hidden else {}
    rows = []
    jobs = [(seed, opt, pan) for seed in s.seeds for opt in s.optimizers for pan in s.variants]
    data = {seed: common.load_data(s.dataset, seed, s.train_limit) for seed in s.seeds}
    for n, (seed, opt, pan) in enumerate(jobs, start=1):
        d = data[seed]
        model = models.build("mlp", d.num_classes, pan=pan.as_dict(), **options)
        # Encodings are constants: every variant of a seed starts from the same weights.
        variables = models.init(model, jax.random.PRNGKey(seed), d.input_shape)
        variables, losses = common.train_centralised(
            model, variables, d.train_x, d.train_y, epochs=s.epochs, batch_size=s.batch_size,
            lr=OPTIMIZERS[opt], seed=seed, optimizer=opt, warmup_steps=s.warmup_steps,
            show_progress=ctx.progress, desc=f"[{n}/{len(jobs)}] {opt} {pan.label} s{seed}")
        rows.append({"optimizer": opt, "variant": pan.label, "kind": pan.kind if pan.on
                     else "off", "amplitude": pan.amplitude if pan.on else 0.0, "seed": seed,
                     "test_accuracy": common.make_accuracy(model, d)(variables),
                     "final_train_loss": losses[-1]})
    table = summarize(rows)
    common.write_csv(ctx.path("centralised_runs.csv"), rows)
    common.write_csv(ctx.path("centralised.csv"), table)
    common.write_json(ctx.path("centralised.json"), {"settings": s, "runs": rows,
                                                     "table": table})
    common.save_figure(plot(table, s), ctx.path("fig30_centralised.png"))
    lines = [f"centralised test accuracy (%), {s.dataset}, {s.epochs} epochs, mean +- std "
             f"over seeds {list(s.seeds)}; on - off paired by seed:"]
    for r in table:
        diff = ("" if r["kind"] == "off" else
                f"  on - off {100 * r['diff_mean']:+.2f} +- {100 * r['diff_std']:.2f}")
        lines.append(f"  {r['optimizer']:<5} {r['variant']:<18} {100 * r['mean']:6.2f} +- "
                     f"{100 * r['std']:.2f}{diff}")
    return lines


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per optimiser and variant: mean and std (ddof 0) of the accuracy over seeds, and of
    the paired difference to PANs off (same optimiser and seed)."""
    off = {(r["optimizer"], r["seed"]): r["test_accuracy"] for r in rows if r["kind"] == "off"}
    out = []
    for opt, variant in dict.fromkeys((r["optimizer"], r["variant"]) for r in rows):
        mine = [r for r in rows if r["optimizer"] == opt and r["variant"] == variant]
        acc = np.asarray([r["test_accuracy"] for r in mine])
        paired = [r for r in mine if (opt, r["seed"]) in off]
        diff = paired_stats([off[(opt, r["seed"])] for r in paired],
                            [r["test_accuracy"] for r in paired])
        out.append({"optimizer": opt, "variant": variant, "kind": mine[0]["kind"],
                    "amplitude": mine[0]["amplitude"], "seeds": len(mine),
                    "mean": float(acc.mean()), "std": float(acc.std()),
                    "diff_mean": diff["diff_mean"], "diff_std": diff["diff_std"]})
    return out


def plot(table: Sequence[Dict[str, Any]], s: Settings) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * len(s.optimizers), 3.8))
    axes = fig.subplots(1, len(s.optimizers), squeeze=False)[0]
    for ax, opt in zip(axes, s.optimizers):
        mine = [r for r in table if r["optimizer"] == opt]
        base = next(r for r in mine if r["kind"] == "off")
        ax.axhline(100 * base["mean"], color="k", linestyle=":", label="PANs off")
        for kind, label, color in (("add", "PAN+", "tab:blue"), ("mul", "PANx", "tab:red")):
            pts = sorted((r["amplitude"], r["mean"], r["std"]) for r in mine
                         if r["kind"] == kind)
            if pts:
                a, m, sd = (np.asarray(v) for v in zip(*pts))
                ax.errorbar(a, 100 * m, yerr=100 * sd, marker="o", capsize=3, label=label,
                            color=color)
        ax.set(xlabel="A (T = 1)", ylabel="test accuracy (%)",
               title=f"{s.dataset}, {opt}, {s.epochs} epochs")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("centralised", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
