"""Communication compression (paper 001's efficiency slides): what each method keeps of
FedAvg's accuracy, and the bytes it saves.

The layout of the slides' table: for each method and data split (IID, Dirichlet 0.75, 0.5
and 0.25 by client, and pathological with 2 classes a client), the final accuracy, the
rounds it takes to reach `target` x FedAvg's final accuracy on the same split and seed
(the table's "Conv."; accuracy is the global model's on the test set, or for the
personalised rows the clients' own models' on their test parts), and the communication volume (bytes up and down over the whole
run) relative to FedAvg's. Methods (`fedjax_pan.algorithms.uploads.compression`, `algorithms/uploads/compressed.py`):

  fedavg            dense float32 both ways
  top_k_10          the 10% largest update entries of each layer
  top_k_10_ef       the same with error feedback (Stich et al. 2018)
  random_k_10_ef    10% random positions from a seed, with error feedback
  qsgd_4            QSGD with 4 levels (4 bits a value and a norm)
  quantize_8        uniform 8-bit quantisation (stochastic rounding)
  sign_ef           scaled sign with error feedback (EF-signSGD)
  sign_vote         signs and majority vote (signSGD-MV)
  magnitude_50      the slides' post-training magnitude mask: 50% of each layer's weights
                    (the pruned model is sent, not its update)
  importance_50     post-training importance mask |dL/dw * w| (the round's summed
                    gradient), 50%
  premask_50        the slides' pre-training mask (magnitude, L1 1e-4 on the weights it
                    would prune) then the post-training magnitude mask, 50%
  top_k_10_both     top-k 10% with error feedback up, and down (the server's update)
  pfedeff_K         the slides' personalised masked aggregation (`algorithm=pfedeff`,
                    lambda_2 0.5): each client keeps K% of its model's weights and
                    uploads K% of its update, K = 75, 50, 25 (the table's pFedEff-K);
                    scored by the mean accuracy of the clients' own models on their test
                    parts (every run keeps 20% of each client's data for one)

Presets:
  cpu      Fashion-MNIST, K = 20 clients, 10 a round, E = 1, B = 64, McMahan et al.'s 2NN
           (784-200-200-10), 30 rounds, seed 0 (18 minutes on 2 CPU cores)
  paper    MNIST (where its files exist) and Fashion-MNIST, 200 rounds (the slides'
           horizon), seeds 0-2
  default  the cpu preset
  smoke    synthetic data, a 16-wide MLP, K = 10, 3 rounds, two splits, five methods
Outputs: compression_runs.csv, compression.csv (the table), compression.json,
compression.png (accuracy against bytes sent and received).
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common

# method -> config overrides (dotted keys under config.compression)
METHODS: Dict[str, Dict[str, Any]] = {
    "fedavg": {},
    "top_k_10": {"upload.method": "top_k", "upload.ratio": 0.1},
    "top_k_10_ef": {"upload.method": "top_k", "upload.ratio": 0.1,
                    "upload.error_feedback": True},
    "random_k_10_ef": {"upload.method": "random_k", "upload.ratio": 0.1,
                       "upload.error_feedback": True},
    "qsgd_4": {"upload.method": "qsgd", "upload.levels": 4},
    "quantize_8": {"upload.method": "quantize", "upload.bits": 8},
    "sign_ef": {"upload.method": "sign", "upload.error_feedback": True},
    "sign_vote": {"upload.method": "sign", "vote": True},
    "magnitude_50": {"upload.method": "magnitude_mask", "upload.ratio": 0.5},
    "importance_50": {"upload.method": "importance_mask", "upload.ratio": 0.5},
    "premask_50": {"upload.method": "magnitude_mask", "upload.ratio": 0.5,
                   "mask_before": "magnitude"},
    "top_k_10_both": {"upload.method": "top_k", "upload.ratio": 0.1,
                      "upload.error_feedback": True, "download.method": "top_k",
                      "download.ratio": 0.1, "download.error_feedback": True},
    # The slides' personalised masked aggregation: each client keeps K of its model and
    # uploads K of its update (algorithm pfedeff; scored on the clients' own test parts).
    **{f"pfedeff_{k}": {"upload.method": "top_k", "upload.ratio": k / 100}
       for k in (75, 50, 25)},
}
# Methods whose accuracy is the clients' own models' on their test parts.
PERSONAL = {f"pfedeff_{k}": k / 100 for k in (75, 50, 25)}
# split -> config.partition overrides
SPLITS: Dict[str, Dict[str, Any]] = {
    "iid": {"scheme": "iid"},
    "dir75": {"scheme": "dirichlet_by_client", "alpha": 0.75},
    "dir50": {"scheme": "dirichlet_by_client", "alpha": 0.5},
    "dir25": {"scheme": "dirichlet_by_client", "alpha": 0.25},
    "pat": {"scheme": "pathological", "classes_per_client": 2},
}
LAST = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 30
    epochs: float = 1.0
    seeds: Tuple[int, ...] = (0,)
    datasets: Tuple[str, ...] = ("fashion_mnist",)
    hidden: Tuple[int, ...] = (200, 200)
    clients: int = 20
    participation: float = 0.5
    batch_size: int = 64
    lr: float = 0.05
    test_fraction: float = 0.2
    target: float = 0.95  # of FedAvg's final accuracy: the convergence round's bar
    methods: Tuple[str, ...] = tuple(METHODS)
    splits: Tuple[str, ...] = tuple(SPLITS)


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "paper": Settings(rounds=200, seeds=(0, 1, 2), datasets=("mnist", "fashion_mnist")),
    "smoke": Settings(rounds=3, seeds=(0,), datasets=("synthetic",), hidden=(16, 16),
                      clients=10, methods=("fedavg", "top_k_10_ef", "qsgd_4", "magnitude_50",
                                           "pfedeff_50"),
                      splits=("iid", "pat")),
})


@dataclasses.dataclass(frozen=True)
class Job:
    dataset: str
    split: str
    method: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.dataset}_{self.split}_{self.method}_s{self.seed}"


def available(name: str) -> Optional[str]:
    """None if dataset `name` loads here, else why not."""
    if name == "synthetic":
        return None
    from fedjax_pan.data import sources
    try:
        sources.load(name)
    except (sources.DataError, OSError) as e:
        return str(e).splitlines()[0]
    return None


def jobs(s: Settings, datasets: Sequence[str]) -> List[Job]:
    return [Job(d, split, m, seed) for d in datasets for split in s.splits
            for m in s.methods for seed in s.seeds]


def run_config(s: Settings, job: Job):
    """The library config of one run."""
    from fedjax_pan.config.defaults import default_config, set_keys

    keys = {"seed": job.seed, "rounds": s.rounds, "dataset.name": job.dataset,
            "local.epochs": float(s.epochs), "local.batch_size": s.batch_size,
            "optimizer.lr": s.lr, "optimizer.warmup": "none", "pan.amplitude": 0.0,
            "partition.num_clients": s.clients, "participation": s.participation,
            "model.options": {"hidden": list(s.hidden)},
            # Every run keeps a test part per client: personalised methods are scored there
            # (and every run trains on the same 80%).
            "partition.test_fraction": s.test_fraction,
            "checkpoint_every": max(1, s.rounds // 3), "max_train_loss": 1e30}
    keys.update({f"partition.{k}": v for k, v in SPLITS[job.split].items()})
    keys.update({f"compression.{k}": v for k, v in METHODS[job.method].items()})
    if job.method in PERSONAL:
        keys.update({"algorithm": "pfedeff", "pfedeff.keep": PERSONAL[job.method]})
    return set_keys(default_config(), keys)


def accuracy_key(method: str) -> str:
    """The metric a method is scored by: the global model's test accuracy, or for a
    personalised method the mean of its clients' own models on their test parts."""
    return "client_accuracy_mean" if method in PERSONAL else "test_accuracy"


def rounds_to(curve: Sequence[Dict[str, Any]], target: float,
              key: str = "test_accuracy") -> float:
    """The first round whose accuracy (`key`) reaches `target`; NaN if none does."""
    for r in curve:
        if r[key] >= target:
            return float(r["round"])
    return float("nan")


def run_rows(todo: Sequence[Job], results: Sequence[Tuple[Any, bool, list]], s: Settings
             ) -> List[Dict[str, Any]]:
    """One row per run: accuracy, rounds to `target` x FedAvg's accuracy, bytes."""
    def final(curve, key="test_accuracy"):
        return float(np.mean([r[key] for r in curve[-LAST:]])) if curve else float("nan")
    base = {(j.dataset, j.split, j.seed): (final(c), c[-1] if c else None)
            for j, (_, _, c) in zip(todo, results) if j.method == "fedavg"}
    rows = []
    for j, (_, diverged, curve) in zip(todo, results):
        key = accuracy_key(j.method)
        acc = float("nan") if diverged else final(curve, key)
        ref_acc, ref_last = base.get((j.dataset, j.split, j.seed), (float("nan"), None))
        last = curve[-1] if curve else {}
        up, down = last.get("upload_bytes_total", np.nan), last.get("download_bytes_total", np.nan)
        ref = (ref_last["upload_bytes_total"] + ref_last["download_bytes_total"]
               if ref_last else float("nan"))
        rows.append({"dataset": j.dataset, "split": j.split, "method": j.method,
                     "seed": j.seed, "diverged": diverged, "accuracy": acc,
                     "accuracy_kept": acc / ref_acc,
                     "scored_by": key,
                     "rounds_to_target": rounds_to(curve, s.target * ref_acc, key),
                     "upload_bytes": float(up), "download_bytes": float(down),
                     "volume": float((up + down) / ref),
                     "upload_volume": float(up / ref_last["upload_bytes_total"])
                     if ref_last else float("nan")})
    return rows


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per dataset, split and method: means over seeds (the convergence round over the
    seeds that reached the bar, with how many did)."""
    out = []
    for key in dict.fromkeys((r["dataset"], r["split"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["dataset"], r["split"], r["method"]) == key]
        reached = [r["rounds_to_target"] for r in mine if np.isfinite(r["rounds_to_target"])]
        out.append({"dataset": key[0], "split": key[1], "method": key[2], "seeds": len(mine),
                    **{k: float(np.mean([r[k] for r in mine]))
                       for k in ("accuracy", "accuracy_kept", "volume", "upload_volume",
                                 "upload_bytes", "download_bytes")},
                    "accuracy_std": float(np.std([r["accuracy"] for r in mine])),
                    "rounds_to_target": float(np.mean(reached)) if reached else float("nan"),
                    "reached": len(reached)})
    return out


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    missing = {d: why for d in s.datasets if (why := available(d))}
    datasets = [d for d in s.datasets if d not in missing]
    if not datasets:
        from fedjax_pan.data import DataError
        raise DataError(f"no dataset of {list(s.datasets)} is available here: "
                        f"{'; '.join(missing.values())}")
    todo = jobs(s, datasets)
    results = common.train_runs(ctx, [(j.name, run_config(s, j)) for j in todo])
    rows = run_rows(todo, results, s)
    common.write_csv(ctx.path("compression_runs.csv"), rows)
    table = summarize(rows)
    common.write_csv(ctx.path("compression.csv"), table)
    common.write_json(ctx.path("compression.json"), {"settings": s, "not_run": missing,
                                                     "runs": rows, "table": table})
    plot(table, ctx.path("compression.png"), s)
    return report(table, s, missing)


def report(table: Sequence[Dict[str, Any]], s: Settings, missing: Dict[str, str]
           ) -> List[str]:
    """The slides' layout: accuracy, convergence round and volume per method and split,
    then each method's accuracy kept and bytes saved over all splits."""
    lines = [f"not run: {d} ({why})" for d, why in missing.items()]
    for d in dict.fromkeys(r["dataset"] for r in table):
        splits = list(dict.fromkeys(r["split"] for r in table if r["dataset"] == d))
        cell = {(r["split"], r["method"]): r for r in table if r["dataset"] == d}
        methods = list(dict.fromkeys(r["method"] for r in table if r["dataset"] == d))
        head = "".join(f"{x:>9}" for x in splits)
        for title, key, fmt in (("accuracy (%)", "accuracy", lambda v: f"{100 * v:9.2f}"),
                                (f"rounds to {100 * s.target:.0f}% of FedAvg's accuracy",
                                 "rounds_to_target",
                                 lambda v: "    never" if np.isnan(v) else f"{v:9.0f}"),
                                ("communication volume / FedAvg's", "volume",
                                 lambda v: f"{v:9.4f}")):
            lines.append(f"{d}: {title}")
            lines.append(f"  {'method':<16}{head}")
            for m in methods:
                lines.append(f"  {m:<16}" + "".join(fmt(cell[(sp, m)][key]) for sp in splits))
        lines.append(f"{d}: over the {len(splits)} splits")
        lines.append(f"  {'method':<16}{'accuracy kept':>14}{'bytes saved':>13}"
                     f"{'upload saved':>14}")
        for m in methods:
            mine = [cell[(sp, m)] for sp in splits]
            lines.append(f"  {m:<16}{100 * np.mean([r['accuracy_kept'] for r in mine]):13.1f}%"
                         f"{100 * (1 - np.mean([r['volume'] for r in mine])):12.1f}%"
                         f"{100 * (1 - np.mean([r['upload_volume'] for r in mine])):13.1f}%")
    return lines


def plot(table: Sequence[Dict[str, Any]], path: str, s: Settings) -> str:
    """Accuracy against bytes (up + down, whole run), one panel per dataset and split."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = list(dict.fromkeys((r["dataset"], r["split"]) for r in table))
    cols = min(5, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.6 * cols, 3.4 * rows))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    methods = list(dict.fromkeys(r["method"] for r in table))
    from matplotlib import colormaps
    from matplotlib.ticker import ScalarFormatter
    palette = colormaps["tab20"]
    colors = {m: palette(i % 20) for i, m in enumerate(methods)}
    markers = "os^vD<>phX*P"
    for ax, (d, split) in zip(axes, panels):
        for i, m in enumerate(methods):
            r = next(x for x in table if (x["dataset"], x["split"], x["method"]) == (d, split, m))
            ax.scatter((r["upload_bytes"] + r["download_bytes"]) / 2**20, 100 * r["accuracy"],
                       color=colors[m], marker=markers[i % len(markers)], label=m)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="x", which="both", labelsize=6)
        ax.set(title=f"{d}: {split}", xlabel="MiB sent and received (whole run)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final accuracy (%; pfedeff: clients' own models)")
    axes[0].legend(fontsize=6)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Compression: accuracy against bytes ({s.rounds} rounds, seeds "
                 f"{list(s.seeds)})")
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("compression", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
