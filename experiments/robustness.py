"""Stragglers and adversaries (paper 001's SageFlow and Byzantine slides): FedAvg breaks,
and which defences hold.

The SageFlow setting (Park et al., NeurIPS 2021; their code's defaults): K = 100 clients
with two label shards each (pathological, 2 classes), C = 0.2 of them a round, E local
epochs of B = 10 at SGD lr 0.01 momentum 0.9, 1,000 training examples held out at the
server as its public set; stragglers draw a delay of 0, 1 or 2 rounds; SageFlow's
E_th 1, delta 1, lambda 0.5 and gamma halving every 20 rounds (their Fashion-MNIST
schedule). Three scenarios:

  stragglers   no attack; FedAvg waiting for everyone, waiting for 50%, ignoring the
               late, FedAsync and SageFlow (both using late outputs with their staleness);
  adversaries  no stragglers; 20% of the clients poison their model (send -0.1 w), 20%
               poison their data (labels y + 1), or 10% plant a backdoor (12 pixels,
               target 2, x10 boost, from a third of the rounds on); FedAvg, RFA (geometric
               median), Multi-Krum and Zeno (both told f = b = the expected attackers a
               round) and SageFlow, beside FedAvg without attack;
  both         stragglers and model or data poisoning: FedAvg ignoring the late, FedAsync
               and SageFlow.

And the Byzantine table of seed 001 (Siren's setting: 10 clients, all in every round):
sign flipping (-4 x the update, Siren's code) and label flipping (y -> 9 - y) at 40% and
80% malicious clients, against no defence, Krum, the coordinate median and Siren (its
clients test on 10% of their data, its server on 100 held-out examples). (Krum needs
more than f + 2 clients a round: at 80% it cannot run, as the slide's footnote says.)

Reported per run and as mean +- std over seeds: the final test accuracy (mean of the last
5 evaluations), the backdoor's success rate (the patterned test images of other classes
classified as 2), and the simulated time to reach `target` test accuracy (rounds of
length 1; waiting for late clients makes a round longer).

Presets:
  cpu     30 rounds of E = 5, McMahan et al.'s 2NN (784-200-200-10), seeds 0 and 1:
          about an hour on 2 CPU cores
  paper   the authors' 150 rounds, the PAN paper's MLP, seeds 0-2
  default the cpu preset
  smoke   synthetic data, a 16-wide MLP, K = 10, 3 rounds, one run of each kind
  siren   the cpu preset's Byzantine Siren rows alone (8 runs)
  authors the SageFlow scenarios under the SageFlow authors' protocol (AUTHORS: attackers
          drawn per round, forced delays 0-2, their lr decay and backdoor settings), at
          the cpu preset's size; authors_sageflow: its SageFlow rows at seed 0
  sageflow the cpu preset's SageFlow rows alone (this library's protocol, 12 runs)
Outputs: robustness_runs.csv, robustness.csv, robustness.json, robustness.png (final
accuracy per scenario), robustness_curves.png (accuracy against simulated time).
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common

# method -> (aggregation rule, straggler policy or None)
STRAGGLER_METHODS = {"fedavg_wait": ("mean", "wait_all"),
                     "fedavg_wait50": ("mean", "wait_share"),
                     "fedavg_ignore": ("mean", "ignore"),
                     "fedasync": ("fedasync", "stale"),
                     "sageflow": ("sageflow", "stale")}
DEFENCES = ("fedavg", "rfa", "multi_krum", "zeno", "sageflow")
RULES = {"fedavg": "mean", "rfa": "geometric_median", "multi_krum": "multi_krum",
         "zeno": "zeno", "sageflow": "sageflow", "krum": "multi_krum", "median": "median",
         "fedasync": "fedasync", "siren": "mean"}
# attack -> config.attack overrides (start_round of the backdoor: a third of the rounds)
ATTACKS = {"model": {"kind": "model_poisoning", "fraction": 0.2},
           "data": {"kind": "label_shift", "fraction": 0.2},
           "backdoor": {"kind": "backdoor", "fraction": 0.1}}
BOTH = {"fedavg_ignore": ("mean", "ignore"), "fedasync": ("fedasync", "stale"),
        "sageflow": ("sageflow", "stale")}
BYZANTINE_ATTACKS = {"sign_flip": "sign_flip", "label_flip": "label_flip"}
BYZANTINE_SHARES = (0.4, 0.8)
BYZANTINE_DEFENCES = ("fedavg", "krum", "median", "siren")
CPU_HIDDEN = (200, 200)
LAST = 5


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 30
    epochs: float = 5.0
    seeds: Tuple[int, ...] = (0, 1)
    dataset: str = "fashion_mnist"
    hidden: Optional[Tuple[int, ...]] = CPU_HIDDEN  # None: the paper's 1024 x 3
    clients: int = 100
    participation: float = 0.2
    batch_size: int = 10
    public_size: int = 1000
    max_delay: int = 2
    target: float = 0.6  # test accuracy whose simulated time is reported
    scenarios: Tuple[str, ...] = ("stragglers", "adversaries", "both", "byzantine")
    defences: Tuple[str, ...] = DEFENCES
    attacks: Tuple[str, ...] = tuple(ATTACKS)
    byzantine_clients: int = 10
    byzantine_defences: Tuple[str, ...] = BYZANTINE_DEFENCES
    # The SageFlow authors' protocol (`run_config`, AUTHORS) in place of ours.
    authors: bool = False
    methods: Tuple[str, ...] = ()  # SageFlow scenarios' methods to run (empty: all)


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "paper": Settings(rounds=150, seeds=(0, 1, 2), hidden=None, target=0.7),
    "smoke": Settings(rounds=3, epochs=1.0, seeds=(0,), dataset="synthetic", hidden=(16, 16),
                      clients=10, participation=0.5, public_size=100, target=0.2,
                      defences=("fedavg", "sageflow"), attacks=("model",),
                      byzantine_clients=6),
    # The Byzantine table's Siren rows alone (the cpu preset's runs of them).
    "siren": Settings(scenarios=("byzantine",), byzantine_defences=("siren",)),
    # The SageFlow scenarios under the authors' protocol (AUTHORS), at the cpu preset's
    # 30 rounds and 2NN; `authors_sageflow`: its SageFlow rows at seed 0 alone.
    "authors": Settings(authors=True, scenarios=("stragglers", "adversaries", "both")),
    "authors_sageflow": Settings(authors=True, seeds=(0,), methods=("sageflow",),
                                 scenarios=("stragglers", "adversaries", "both")),
    "sageflow": Settings(methods=("sageflow",), scenarios=("stragglers", "adversaries", "both")),
})


@dataclasses.dataclass(frozen=True)
class Job:
    scenario: str
    attack: str  # 'none', an ATTACKS key, or '<byzantine attack>_<share>'
    method: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.scenario}_{self.attack}_{self.method}_s{self.seed}"


def jobs(s: Settings) -> List[Job]:
    out = []
    for seed in s.seeds:
        out += _sageflow_jobs(s, seed)
        if "byzantine" in s.scenarios:
            if "fedavg" in s.byzantine_defences:
                out.append(Job("byzantine", "none", "fedavg", seed))
            out += [Job("byzantine", f"{a}_{int(100 * share)}", m, seed)
                    for a in BYZANTINE_ATTACKS for share in BYZANTINE_SHARES
                    for m in s.byzantine_defences
                    if not (m == "krum" and not _krum_fits(s, share))]
    return out


def _sageflow_jobs(s: Settings, seed: int) -> List[Job]:
    """The SageFlow scenarios' runs of one seed (those of `s.methods` when set)."""
    out = []
    if "stragglers" in s.scenarios:
        out += [Job("stragglers", "none", m, seed) for m in STRAGGLER_METHODS]
    if "adversaries" in s.scenarios:
        out.append(Job("adversaries", "none", "fedavg", seed))
        out += [Job("adversaries", a, m, seed) for a in s.attacks for m in s.defences]
    if "both" in s.scenarios:
        out += [Job("both", a, m, seed) for a in s.attacks if a != "backdoor"
                for m in BOTH]
    return [j for j in out if not s.methods or j.method in s.methods]


def _attackers(fraction: float, per_round: int, authors: bool = False) -> int:
    """The malicious clients a round, what Multi-Krum and Zeno are told: expected under
    ours (a fixed set), exact under the authors' per-round draw (int(M fraction))."""
    return int(per_round * fraction) if authors else int(round(fraction * per_round))


# The SageFlow authors' protocol (savertm/Sageflow at e2b4204), per scenario, over ours:
# attackers exactly int(M ratio) of each round's cohort (`Sageflow_synchronous_setup.py`,
# `Sageflow.py`); the first three free clients of a round late by 0, 1, 2 (`Sageflow.py`);
# plain SGD (no weight decay, no clipping) at lr 0.01 momentum 0.9 (`update.py`); the
# adversaries-only run halves lr every 7 rounds (`scripts/Sageflow_only_ad.sh`, Fashion-
# MNIST: --lrdecay 7), the runs with stragglers do not (`Sageflow_both.sh`: 2000); the
# backdoor (`scripts/Sageflow_backdoor_only_ad.sh`, `backdoor_FL/options.py`): C 0.1,
# B 64, one local epoch for the honest (`backdoor_FL/Sageflow_synchronous_setup.py`:
# local_ep=1), weight decay 5e-4 (`backdoor_FL/update.py`), E_th 2 and delta 5, 10%
# attackers from round 10.
AUTHORS = {"attack.draw": "per_round", "optimizer.weight_decay": 0.0,
           "optimizer.grad_clip": 0.0}
AUTHORS_SYNC = {"optimizer.warmup": "halving", "optimizer.warmup_length": 7}
AUTHORS_BACKDOOR = {"participation": 0.1, "local.batch_size": 64, "local.epochs": 1.0,
                    "optimizer.weight_decay": 5e-4, "aggregation.sageflow.entropy_threshold":
                    2.0, "aggregation.sageflow.delta": 5.0, "attack.start_round": 10}


def _krum_fits(s: Settings, share: float) -> bool:
    n = s.byzantine_clients
    return n > _attackers(share, n) + 2


def run_config(s: Settings, job: Job):
    """The library config of one run."""
    from fedjax_pan.config.defaults import default_config, set_keys
    from fedjax_pan.engine.simulation import clients_per_round

    cfg = default_config()
    byz = job.scenario == "byzantine"
    keys = {"seed": job.seed, "rounds": s.rounds, "dataset.name": s.dataset,
            "local.epochs": float(s.epochs), "local.batch_size": s.batch_size,
            "optimizer.lr": 0.01, "optimizer.momentum": 0.9, "optimizer.warmup": "none",
            "pan.amplitude": 0.0, "checkpoint_every": max(1, s.rounds // 3),
            # An attacked FedAvg's loss may grow large before it breaks: only a loss that
            # is no longer finite ends a run (reported as diverged).
            "max_train_loss": 1e30,
            "partition.scheme": "pathological", "partition.classes_per_client": 2,
            "partition.num_clients": s.clients, "participation": s.participation,
            "dataset.public_size": s.public_size}
    if byz:  # Siren's: 10 clients, all every round, IID
        keys.update({"partition.scheme": "iid", "partition.num_clients": s.byzantine_clients,
                     "participation": 1.0, "dataset.public_size": 0,
                     "local.batch_size": 64})
    if s.hidden:
        keys["model.options"] = {"hidden": list(s.hidden)}
    authors = s.authors and not byz
    if authors:
        keys.update(AUTHORS)
        if job.scenario == "adversaries":
            keys.update(AUTHORS_BACKDOOR if job.attack == "backdoor" else AUTHORS_SYNC)
    per_round = clients_per_round(keys["participation"], keys["partition.num_clients"])
    if job.scenario == "stragglers":
        rule, policy = STRAGGLER_METHODS[job.method]
    elif job.scenario == "both":
        rule, policy = BOTH[job.method]
    else:
        rule, policy = RULES[job.method], None
    keys["aggregation.rule"] = rule
    if policy is not None:
        keys.update({"straggler.max_delay": s.max_delay, "straggler.policy": policy})
        if authors:
            keys["straggler.forced"] = tuple(range(s.max_delay + 1))
    if job.attack != "none":
        if byz:
            kind, share = job.attack.rsplit("_", 1)
            attack = {"kind": BYZANTINE_ATTACKS[kind], "fraction": int(share) / 100}
        else:
            attack = dict(ATTACKS[job.attack])
            if attack["kind"] == "backdoor" and not authors:
                attack["start_round"] = s.rounds // 3
        keys.update({f"attack.{k}": v for k, v in attack.items()})
        if rule in ("multi_krum", "zeno"):
            keys["aggregation.byzantine"] = _attackers(attack["fraction"], per_round,
                                                       authors)
    if job.method == "krum":
        keys["aggregation.krum_keep"] = 1
    if job.method == "siren":  # its clients keep 10% of their data to test on; root set 100
        keys.update({"algorithm": "siren", "partition.test_fraction": 0.1,
                     "dataset.public_size": 100})
    return set_keys(cfg, keys)


def time_to(curve: Sequence[Dict[str, Any]], target: float) -> float:
    """Simulated time (rounds without stragglers) when test accuracy first reaches
    `target`; NaN if it never does."""
    for r in curve:
        if r["test_accuracy"] >= target:
            return float(r.get("sim_time", r["round"]))
    return float("nan")


def run_row(job: Job, curve: Sequence[Dict[str, Any]], diverged: bool,
            target: float) -> Dict[str, Any]:
    last = list(curve)[-LAST:]
    nan = float("nan")
    row = {"scenario": job.scenario, "attack": job.attack, "method": job.method,
           "seed": job.seed, "diverged": diverged}
    row["accuracy"] = nan if diverged or not last else float(
        np.mean([r["test_accuracy"] for r in last]))
    row["backdoor_success"] = nan if diverged or "backdoor_success" not in (
        last[-1] if last else {}) else float(np.mean([r["backdoor_success"] for r in last]))
    row["time_to_target"] = nan if diverged else time_to(curve, target)
    row["sim_time"] = nan if diverged or not curve else float(
        curve[-1].get("sim_time", curve[-1]["round"]))
    return row


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    todo = jobs(s)
    results = common.train_runs(ctx, [(j.name, run_config(s, j)) for j in todo])
    rows = [run_row(j, curve, diverged, s.target)
            for j, (_, diverged, curve) in zip(todo, results)]
    common.write_csv(ctx.path("robustness_runs.csv"), rows)
    table = summarize(rows)
    common.write_csv(ctx.path("robustness.csv"), table)
    common.write_json(ctx.path("robustness.json"), {"settings": s, "runs": rows,
                                                    "table": table})
    plot(table, ctx.path("robustness.png"), s)
    plot_curves(todo, [c for _, _, c in results], ctx.path("robustness_curves.png"), s)
    lines = [f"final test accuracy (mean of the last {LAST} evaluations; mean +- std over "
             f"{len(s.seeds)} seed(s)), backdoor success, simulated time to "
             f"{100 * s.target:.0f}%:",
             f"  {'scenario':<12} {'attack':<14} {'method':<14} {'accuracy':>15} "
             f"{'backdoor':>9} {'time':>6}"]
    for r in table:
        bd = "" if np.isnan(r["backdoor_success"]) else f"{100 * r['backdoor_success']:8.1f}%"
        t = "never" if np.isnan(r["time_to_target"]) else f"{r['time_to_target']:6.1f}"
        acc = (f"{100 * r['accuracy']:7.2f} +- {100 * r['accuracy_std']:4.2f}"
               if np.isfinite(r["accuracy"]) else "diverged")
        if r["diverged"] and np.isfinite(r["accuracy"]):
            acc += f" ({r['diverged']} diverged)"
        lines.append(f"  {r['scenario']:<12} {r['attack']:<14} {r['method']:<14} "
                     f"{acc:>15} {bd:>9} {t:>6}")
    return lines


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per scenario, attack and method: means over seeds (`accuracy_std` the accuracy's
    std, ddof 0; time to target: the mean over the seeds that reached it)."""
    out = []
    for key in dict.fromkeys((r["scenario"], r["attack"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["scenario"], r["attack"], r["method"]) == key]
        acc = np.asarray([r["accuracy"] for r in mine], np.float64)
        reached = [r["time_to_target"] for r in mine if not np.isnan(r["time_to_target"])]
        bd = [r["backdoor_success"] for r in mine if not np.isnan(r["backdoor_success"])]
        out.append({"scenario": key[0], "attack": key[1], "method": key[2],
                    "seeds": len(mine), "diverged": sum(r["diverged"] for r in mine),
                    "accuracy": float(np.nanmean(acc)) if np.isfinite(acc).any() else
                    float("nan"),
                    "accuracy_std": float(np.nanstd(acc)) if np.isfinite(acc).any() else
                    float("nan"),
                    "backdoor_success": float(np.mean(bd)) if bd else float("nan"),
                    "time_to_target": float(np.mean(reached)) if reached else float("nan"),
                    "reached": len(reached)})
    return out


def plot(table: Sequence[Dict[str, Any]], path: str, s: Settings) -> str:
    """Final accuracy per (attack, method), one panel per scenario."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scenarios = list(dict.fromkeys(r["scenario"] for r in table))
    fig = Figure(figsize=(4.6 * len(scenarios), 4.4))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, len(scenarios), sharey=True))
    for ax, scenario in zip(axes, scenarios):
        recs = [r for r in table if r["scenario"] == scenario]
        labels = [f"{r['attack']}\n{r['method']}" for r in recs]
        x = np.arange(len(recs))
        ax.bar(x, [100 * r["accuracy"] for r in recs],
               yerr=[100 * r["accuracy_std"] for r in recs], capsize=2,
               color=["tab:gray" if r["method"].startswith("fedavg") else "tab:blue"
                      for r in recs])
        ax.set_xticks(x, labels, rotation=90, fontsize=6)
        ax.set_title(scenario)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("final test accuracy (%)")
    fig.suptitle(f"Stragglers and adversaries ({s.dataset}, {s.rounds} rounds, "
                 f"seeds {list(s.seeds)})")
    fig.tight_layout()
    return common.save_figure(fig, path)


def plot_curves(todo: Sequence[Job], curves: Sequence[Sequence[Dict[str, Any]]], path: str,
                s: Settings) -> str:
    """Test accuracy against simulated time, one panel per (scenario, attack), a line per
    method (the first seed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = list(dict.fromkeys((j.scenario, j.attack) for j in todo))
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.0 * cols, 3.2 * rows))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, (scenario, attack) in zip(axes, panels):
        for j, curve in zip(todo, curves):
            if (j.scenario, j.attack) != (scenario, attack) or j.seed != s.seeds[0] or not curve:
                continue
            ax.plot([r.get("sim_time", r["round"]) for r in curve],
                    [100 * r["test_accuracy"] for r in curve], label=j.method)
        ax.set(title=f"{scenario}: {attack}", xlabel="simulated time (rounds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("robustness", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
