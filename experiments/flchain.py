"""FLChain (slides 001): a tampering central server against a ledger whose validators
recompute the aggregate, and what consensus costs.

Part 1, tampering. One seed, three runs of the same federation and training:
  honest    FLChain with 4 validators, none faulty (the ledger only records)
  central   one validator (a central server) that from round index `tamper_from` on commits
            `tamper_scale` x the aggregate: its blocks commit, accuracy collapses
  chain     4 validators (f = 1), validator 0 tampering the same way from the same round:
            its proposals are rejected (the next proposer commits), accuracy is the honest
            run's to the bit
Each run's ledger is then audited (`flchain_cli.verify`) against the trust anchor
its summary records (validator keys, each channel's head hash and height): the central
server's first tampered block is located.

Part 2, cost. Honest FLChain for `cost_rounds` rounds at each number of validators and
channels (the devices split over the channels, which share the validators' links and
time), and with f = (n - 1) // 3 tampering validators on one channel over n rounds (each
validator proposing first once, so f (f + 1) / 2n rejections a round): the simulated
seconds a round takes (`flchain.round_seconds`: pool, consensus, download; block interval
0 so the protocol's own cost shows), the rejected proposals and the ledger's bytes a round.

Presets:
  cpu      Fashion-MNIST, K = 20 (Dirichlet 0.5), 10 a round, E = 1, B = 64, lr 0.05,
           McMahan et al.'s 2NN, 30 rounds, tampering from the 11th round (x -1); cost over
           n in {1, 4, 7, 10, 13, 16} x channels {1, 2, 4}, 2 rounds each, seed 0
  default  the cpu preset
  smoke    synthetic data, a 16-wide MLP, 5 rounds, tampering from the 3rd, n in {1, 4},
           channels {1, 2}
Outputs: flchain_tamper.csv, flchain_cost.csv, flchain.json, flchain.png.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 30
    dataset: str = "fashion_mnist"
    hidden: Tuple[int, ...] = (200, 200)
    clients: int = 20
    participation: float = 0.5
    alpha: float = 0.5
    epochs: float = 1.0
    batch_size: int = 64
    lr: float = 0.05
    tamper_from: int = 10
    tamper_scale: float = -1.0
    validators: int = 4
    cost_validators: Tuple[int, ...] = (1, 4, 7, 10, 13, 16)
    cost_channels: Tuple[int, ...] = (1, 2, 4)
    cost_rounds: int = 2


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "smoke": Settings(rounds=5, dataset="synthetic", hidden=(16, 16), tamper_from=2,
                      cost_validators=(1, 4), cost_channels=(1, 2)),
})
TAMPER_RUNS = ("honest", "central", "chain")


def run_config(s: Settings, seed: int, **flchain: Any):
    """The library config of one FLChain run (`flchain` sets its options)."""
    from fedjax_pan.config.defaults import default_config, set_keys

    keys = {"seed": seed, "algorithm": "flchain", "rounds": s.rounds,
            "dataset.name": s.dataset, "local.epochs": float(s.epochs),
            "local.batch_size": s.batch_size, "optimizer.lr": s.lr,
            "optimizer.warmup": "none", "pan.amplitude": 0.0,
            "partition.scheme": "dirichlet_by_client", "partition.alpha": s.alpha,
            "partition.num_clients": s.clients, "participation": s.participation,
            "model.options": {"hidden": list(s.hidden)},
            "checkpoint_every": max(1, s.rounds // 3), "max_train_loss": 1e30}
    keys.update({f"flchain.{k}": v for k, v in flchain.items()})
    return set_keys(default_config(), keys)


def tamper_configs(s: Settings, seed: int) -> List[Tuple[str, Any]]:
    tamper = {"faulty": 1, "tamper": "scale", "tamper_from": s.tamper_from,
              "tamper_scale": s.tamper_scale}
    return [("honest", run_config(s, seed, validators=s.validators)),
            ("central", run_config(s, seed, validators=1, **tamper)),
            ("chain", run_config(s, seed, validators=s.validators, **tamper))]


def cost_configs(s: Settings, seed: int) -> List[Tuple[str, Any]]:
    out = []
    short = dataclasses.replace(s, rounds=s.cost_rounds)
    for c in s.cost_channels:
        for n in s.cost_validators:
            out.append((f"cost_n{n}_c{c}", run_config(short, seed, validators=n, channels=c,
                                                      block_interval=0.0)))
    for n in s.cost_validators:
        f = (n - 1) // 3
        if f:  # n rounds: every validator proposes first once (a full rotation)
            rotation = dataclasses.replace(s, rounds=max(n, s.cost_rounds))
            out.append((f"cost_n{n}_c1_faulty", run_config(
                rotation, seed, validators=n, block_interval=0.0, faulty=f, tamper="scale")))
    return out


def audit(run_dir: str, anchor: Optional[Dict[str, Any]] = None) -> str:
    """'verified' (against `anchor`, the run's summary's, where given), or the audit's one
    line locating the fault."""
    from fedjax_pan.algorithms.robust import ledger
    from fedjax_pan.algorithms.robust import flchain_cli
    try:
        flchain_cli.verify(run_dir, anchor=anchor)
        return "verified"
    except ledger.LedgerError as e:
        return str(e).replace(os.path.join(run_dir, ""), "")


def block_rows(run_dir: str) -> List[Dict[str, Any]]:
    """Every committed block's header fields the cost table reads."""
    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, "ledger", "channel_*", "*.json"))):
        with open(path) as f:
            h = json.load(f)["header"]
        if h["height"]:
            rows.append({"channel": h["channel"], "round": h["round"],
                         "bytes": os.path.getsize(path), **h["sim"]})
    return rows


def object_bytes(run_dir: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(run_dir, "ledger",
                                                                  "objects", "*")))


def tamper_row(name: str, curve: Sequence[Dict[str, Any]], s: Settings,
               verdict: str) -> Dict[str, Any]:
    before = [r["test_accuracy"] for r in curve if r["round"] <= s.tamper_from]
    after = [r["test_accuracy"] for r in curve if r["round"] > s.tamper_from]
    return {"run": name, "accuracy_before": before[-1] if before else float("nan"),
            "final_accuracy": curve[-1]["test_accuracy"],
            "min_accuracy_after": min(after) if after else float("nan"),
            "rejected": int(sum(r["sim_rejected"] for r in curve)),
            "sim_seconds": curve[-1]["sim_time"], "audit": verdict}


def cost_row(name: str, cfg: Any, run_dir: str, curve: Sequence[Dict[str, Any]]
             ) -> Dict[str, Any]:
    blocks = block_rows(run_dir)
    rounds = max(1, len(curve))
    mean = lambda key: float(np.mean([b[key] for b in blocks])) if blocks else float("nan")
    return {"run": name, "validators": cfg.flchain.validators,
            "channels": cfg.flchain.channels, "faulty": cfg.flchain.faulty,
            "round_seconds": float(np.mean([r["sim_round_seconds"] for r in curve])),
            "pool_seconds": mean("pool_seconds"), "consensus_seconds": mean("consensus_seconds"),
            "download_seconds": mean("download_seconds"),
            "rejected_per_round": sum(r["sim_rejected"] for r in curve) / rounds,
            "block_bytes": mean("bytes"), "stored_bytes_per_round": object_bytes(run_dir) / rounds}


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    tamper = tamper_configs(s, ctx.seed)
    cost = cost_configs(s, ctx.seed)
    results = common.train_runs(ctx, tamper + cost)
    curves = {name: c for (name, _), (_, _, c) in zip(tamper + cost, results)}
    anchors = {name: summary.get("ledger_anchor")
               for (name, _), (summary, _, _) in zip(tamper + cost, results)}
    runs = lambda name: ctx.path(os.path.join("runs", name))
    rows = [tamper_row(name, curves[name], s, audit(runs(name), anchors[name]))
            for name, _ in tamper]
    costs = [cost_row(name, cfg, runs(name), curves[name]) for name, cfg in cost]
    common.write_csv(ctx.path("flchain_tamper.csv"), rows)
    common.write_csv(ctx.path("flchain_cost.csv"), costs)
    common.write_json(ctx.path("flchain.json"), {"settings": s, "tamper": rows,
                                                 "cost": costs, "curves": curves})
    plot(curves, costs, s, ctx.path("flchain.png"))
    lines = [f"FLChain on {s.dataset}: K = {s.clients}, {s.participation:g} a round, "
             f"{s.rounds} rounds; tampering (x {s.tamper_scale:g} the aggregate) from round "
             f"{s.tamper_from + 1}",
             f"  {'run':<9}{'before':>8}{'final':>8}{'min after':>11}{'rejected':>10}  audit"]
    for r in rows:
        lines.append(f"  {r['run']:<9}{100 * r['accuracy_before']:8.2f}"
                     f"{100 * r['final_accuracy']:8.2f}{100 * r['min_accuracy_after']:11.2f}"
                     f"{r['rejected']:10d}  {r['audit']}")
    lines.append(f"Cost a round (simulated seconds; {s.cost_rounds} rounds each, n with "
                 f"faults)")
    lines.append(f"  {'n':>3}{'ch':>4}{'faulty':>7}{'round':>9}{'pool':>8}{'consensus':>11}"
                 f"{'rejected':>10}{'block B':>9}")
    for r in costs:
        lines.append(f"  {r['validators']:3d}{r['channels']:4d}{r['faulty']:7d}"
                     f"{r['round_seconds']:9.3f}{r['pool_seconds']:8.3f}"
                     f"{r['consensus_seconds']:11.4f}{r['rejected_per_round']:10.2f}"
                     f"{r['block_bytes']:9.0f}")
    return lines


def plot(curves: Dict[str, Sequence[Dict[str, Any]]], costs: Sequence[Dict[str, Any]],
         s: Settings, path: str) -> str:
    """Accuracy against rounds for the tampering runs; consensus seconds a block against
    validators, per channel count (and with f faulty)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_acc, ax_cost = fig.subplots(1, 2)
    labels = {"honest": "FLChain, honest",
              "central": "central server, tampering",
              "chain": f"FLChain, n = {s.validators}, proposer 0 tampering"}
    styles = {"honest": "-", "central": "-", "chain": "--"}
    for name in TAMPER_RUNS:
        c = curves[name]
        ax_acc.plot([r["round"] for r in c], [100 * r["test_accuracy"] for r in c],
                    styles[name], label=labels[name])
    ax_acc.axvline(s.tamper_from + 0.5, color="grey", lw=0.8, ls=":")
    ax_acc.set(xlabel="round", ylabel="test accuracy (%)",
               title=f"tampering from round {s.tamper_from + 1}")
    for c in s.cost_channels:
        mine = [r for r in costs if r["channels"] == c and not r["faulty"]]
        ax_cost.plot([r["validators"] for r in mine], [r["consensus_seconds"] for r in mine],
                     marker="o", label=f"{c} channel(s)")
    faulty = [r for r in costs if r["faulty"]]
    if faulty:
        ax_cost.plot([r["validators"] for r in faulty],
                     [r["consensus_seconds"] for r in faulty], marker="x", ls="--",
                     label="1 channel, f faulty")
    ax_cost.set(xlabel="validators n", ylabel="consensus seconds a block (simulated)",
                title="cost of consensus")
    for ax in (ax_acc, ax_cost):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("flchain", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
