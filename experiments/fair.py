"""FAIR (Deng et al., INFOCOM 2021; IEEE TPDS 33(12), 2022): quality-aware client
recruitment within a budget and auto-weighted aggregation, among clients of unequal quality
and cost.

A share of the clients (`noisy_share`, drawn from the seed: `fedjax_pan.data.noisy_clients`)
train on labels of which `noise_rate` are replaced by uniformly random ones; a Dirichlet
split by client (`partition.balance=false`) gives them skewed data sizes. Every round each
client has a private cost, uniform in [cost_low, cost_high); a `strategic_share` of them
(drawn once per seed) bid `markup` above it, the others bid their cost. Per noise rate and
seed, five runs share data split, noisy clients, costs, bids and initial weights:

  fair                 FAIR: reverse auction on the estimated qualities within `budget` a
                       round, aggregation with the weights learned on the server's public set
  random_budget        FedAvg recruiting in a random order while bids fit the same budget
                       (winners paid their bids)
  all_clients          FedAvg with every client every round. No auction prices it: its money
                       is what paying every client its cost would take (the sum of all the
                       clients' costs of each round), and so its utilities are 0
  fair_selection       FAIR's recruitment alone: the weights are learned (and estimate the
                       qualities) but the aggregate takes the size weights
  auto_weights_random  FAIR's aggregation alone: random recruitment within the budget
FedAvg's and the learned weights' starting point weigh clients by their number of examples.

Reported per run and as means over seeds: the final test accuracy (mean of the last 5
rounds), the money spent in all, the clients recruited a round, the share of noisy clients
among the recruited (and in the population), each client's utility (payments less costs,
summed over rounds) and its mean over truthful, strategic, noisy and clean clients, and the
accuracy at equal money (the last round whose money spent so far is at most the least any
variant of that noise rate and seed spends in all).

Presets:
  cpu      Fashion-MNIST, K = 20 (Dirichlet 0.5 by client, skewed sizes), 40% noisy at
           noise rates 0.2, 0.5 and 0.8, costs uniform in [1, 2), 20% strategic (+50%),
           budget 10 a round (FAIR recruits about 5, the random order about 6), 500 public
           examples, E = 1, B = 64, SGD 0.05, McMahan et al.'s 2NN (784-200-200-10),
           30 rounds, seeds 0-4: 75 runs
  default  the cpu preset
  paper    K = 100, budget 20 a round, 1,000 public examples, 200 rounds, seeds 0-2 (for
           an accelerator)
  smoke    synthetic data, a 16-wide MLP, K = 8, budget 4, noise rate 0.8, 4 rounds,
           seed 0 (17 s)
Outputs: rounds.csv (a row per run and round), clients.csv (each client's utility per run),
summary.csv and summary.json (per variant and noise rate), fair.png (a row per noise rate:
accuracy against rounds and against money spent, the share of noisy clients recruited a
round, and the utility of clean and noisy clients), runs/<variant>_n<rate>_s<seed>/ (each
library run: config, metrics.jsonl with the recruits, bids, costs and payments).
Runtime on 2 CPU cores: the 5 runs of one noise rate and seed take 35 s (3.5-9 s a run,
all_clients the longest), so the cpu preset takes about 9 minutes, more on a busy machine.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import common

# variant -> its config keys over the common ones (`run_config`)
VARIANTS = MappingProxyType({
    "fair": {"recruitment.policy": "fair", "aggregation.rule": "auto_weights"},
    "random_budget": {"recruitment.policy": "random", "aggregation.rule": "mean"},
    "all_clients": {"recruitment.policy": "none", "participation": 1.0,
                    "aggregation.rule": "mean"},
    "fair_selection": {"recruitment.policy": "fair", "aggregation.rule": "auto_weights",
                       "aggregation.auto_weights.apply": False},
    "auto_weights_random": {"recruitment.policy": "random",
                            "aggregation.rule": "auto_weights"},
})
# FAIR's parts alone dashed, beside the whole (same colour): they share its recruits or
# the random baseline's.
STYLES = MappingProxyType({"fair": ("tab:blue", "-"), "random_budget": ("tab:orange", "-"),
                           "all_clients": ("tab:green", "-"),
                           "fair_selection": ("tab:blue", "--"),
                           "auto_weights_random": ("tab:orange", "--")})
LABELS = MappingProxyType({
    "fair": "FAIR", "random_budget": "FedAvg, random within budget",
    "all_clients": "FedAvg, all clients", "fair_selection": "FAIR selection, size weights",
    "auto_weights_random": "auto-weights, random within budget"})
LAST = 5


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 30
    seeds: Tuple[int, ...] = (0, 1, 2, 3, 4)
    noise_rates: Tuple[float, ...] = (0.2, 0.5, 0.8)
    variants: Tuple[str, ...] = tuple(VARIANTS)
    dataset: str = "fashion_mnist"
    hidden: Tuple[int, ...] = (200, 200)
    clients: int = 20
    alpha: float = 0.5
    noisy_share: float = 0.4
    epochs: float = 1.0
    batch_size: int = 64
    lr: float = 0.05
    budget: float = 10.0
    cost_low: float = 1.0
    cost_high: float = 2.0
    strategic_share: float = 0.2
    markup: float = 0.5
    forgetting: float = 0.5
    public_size: int = 500
    weight_steps: int = 10
    weight_lr: float = 1.0


PRESETS = MappingProxyType({
    "cpu": Settings(),
    "default": Settings(),
    "paper": Settings(rounds=200, seeds=(0, 1, 2), clients=100, budget=20.0,
                      public_size=1000),
    "smoke": Settings(rounds=4, seeds=(0,), noise_rates=(0.8,), dataset="synthetic",
                      hidden=(16, 16), clients=8, budget=4.0, public_size=100,
                      weight_steps=3),
})


@dataclasses.dataclass(frozen=True)
class Job:
    variant: str
    noise_rate: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}_n{self.noise_rate:g}_s{self.seed}"


def jobs(s: Settings) -> List[Job]:
    return [Job(v, rate, seed) for seed in s.seeds for rate in s.noise_rates
            for v in s.variants]


def run_config(s: Settings, job: Job):
    """The library config of one run."""
    from fedjax_pan.config.defaults import default_config, set_keys

    keys = {"seed": job.seed, "rounds": s.rounds, "dataset.name": s.dataset,
            "dataset.public_size": s.public_size,  # held out in every variant alike
            "model.options": {"hidden": list(s.hidden)}, "pan.amplitude": 0.0,
            "partition.scheme": "dirichlet_by_client", "partition.alpha": s.alpha,
            "partition.balance": False, "partition.num_clients": s.clients,
            "partition.noisy_share": s.noisy_share, "partition.noise_rate": job.noise_rate,
            "local.epochs": float(s.epochs), "local.batch_size": s.batch_size,
            "optimizer.lr": s.lr, "optimizer.warmup": "none",
            "aggregation.weights": "num_examples",
            "aggregation.auto_weights.steps": s.weight_steps,
            "aggregation.auto_weights.lr": s.weight_lr,
            "recruitment.budget": s.budget, "recruitment.cost_low": s.cost_low,
            "recruitment.cost_high": s.cost_high,
            "recruitment.strategic_share": s.strategic_share,
            "recruitment.markup": s.markup, "recruitment.forgetting": s.forgetting,
            "eval.every": 1, "checkpoint_every": max(1, s.rounds // 3)}
    keys.update(VARIANTS[job.variant])
    return set_keys(default_config(), keys)


# ----------------------------------------------------------------------------------------
# Rows from a run's metrics (pure).
# ----------------------------------------------------------------------------------------

def round_costs(cfg: Any, round_index: int, num_clients: int) -> Tuple[np.ndarray, np.ndarray]:
    """(costs, bids) of every client in round `round_index` (0-based) of a run of `cfg`:
    the recruiter's own draw, whatever its policy."""
    from fedjax_pan.algorithms import recruitment
    return recruitment.round_bids(cfg.recruitment, cfg.seed, round_index, num_clients)


def recruits(row: Dict[str, Any], num_clients: int) -> np.ndarray:
    """The clients that took part in a metrics row's round: its recruits, or every client
    in a run without recruitment."""
    if "recruit_clients" in row:
        return np.asarray(row["recruit_clients"], np.int64)
    return np.arange(num_clients)


def curve_rows(curve: Sequence[Dict[str, Any]], noisy: np.ndarray,
               everyone_costs: Optional[Sequence[float]] = None) -> List[Dict[str, Any]]:
    """Per round: test accuracy, money spent so far, clients recruited and the share of
    them that are noisy. A run without recruitment took every client (`noisy`'s length)
    and is priced at `everyone_costs` (each round's sum of all the clients' costs)."""
    rows, spent = [], 0.0
    for n, r in enumerate(curve):
        ids = recruits(r, len(noisy))
        spent = (float(r["recruit_spent_total"]) if "recruit_spent_total" in r else
                 spent + float(everyone_costs[n]))
        rows.append({"round": r["round"], "test_accuracy": r["test_accuracy"],
                     "spent_total": spent, "recruited": int(ids.size),
                     "noisy_share_selected": float(noisy[ids].mean()) if ids.size else
                     float("nan")})
    return rows


def client_utilities(curve: Sequence[Dict[str, Any]], num_clients: int
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """(utility, rounds taking part) per client: payment less cost summed over the rounds
    it won (a run without recruitment: every client every round, paid its cost)."""
    utility, count = np.zeros(num_clients), np.zeros(num_clients, np.int64)
    for r in curve:
        ids = recruits(r, num_clients)
        if "recruit_payments" in r:
            np.add.at(utility, ids, np.subtract(r["recruit_payments"], r["recruit_costs"]))
        np.add.at(count, ids, 1)
    return utility, count


def accuracy_at(rows: Sequence[Dict[str, Any]], money: float) -> float:
    """Test accuracy of the last round whose money spent so far is at most `money` (NaN if
    the first round already spent more)."""
    within = [r["test_accuracy"] for r in rows if r["spent_total"] <= money * (1 + 1e-12)]
    return float(within[-1]) if within else float("nan")


def _group_mean(values: np.ndarray, mask: np.ndarray) -> float:
    return float(values[mask].mean()) if mask.any() else float("nan")


def run_summary(job: Job, rows: Sequence[Dict[str, Any]], utility: np.ndarray,
                noisy: np.ndarray, strategic: np.ndarray) -> Dict[str, Any]:
    """One run's figures (`summarize` averages them over seeds)."""
    recruited = np.asarray([r["recruited"] for r in rows], np.float64)
    share = np.asarray([r["noisy_share_selected"] for r in rows], np.float64)
    return {"variant": job.variant, "noise_rate": job.noise_rate, "seed": job.seed,
            "final_accuracy": float(np.mean([r["test_accuracy"] for r in rows[-LAST:]])),
            "spent_total": rows[-1]["spent_total"],
            "recruited_per_round": float(recruited.mean()),
            # Over every recruit of the run: rounds weighted by how many they took.
            "noisy_selected": float(np.nansum(share * recruited) / recruited.sum()),
            "noisy_population": float(noisy.mean()),
            "utility_truthful": _group_mean(utility, ~strategic),
            "utility_strategic": _group_mean(utility, strategic),
            "utility_noisy": _group_mean(utility, noisy),
            "utility_clean": _group_mean(utility, ~noisy)}


def with_equal_money(runs: List[Dict[str, Any]], curves: Sequence[Sequence[Dict[str, Any]]]
                     ) -> List[Dict[str, Any]]:
    """`runs` with `equal_money` (the least money any variant of the same noise rate and seed
    spent in all) and `accuracy_at_equal_money` (`accuracy_at` that money)."""
    out = []
    for run, rows in zip(runs, curves):
        key = (run["noise_rate"], run["seed"])
        money = min(r["spent_total"] for r in runs if (r["noise_rate"], r["seed"]) == key)
        out.append({**run, "equal_money": money,
                    "accuracy_at_equal_money": accuracy_at(rows, money)})
    return out


SUMMED = ("final_accuracy", "spent_total", "recruited_per_round", "noisy_selected",
          "noisy_population", "utility_truthful", "utility_strategic", "utility_noisy",
          "utility_clean", "equal_money", "accuracy_at_equal_money")


def summarize(runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per variant and noise rate: the mean over seeds of each figure (NaN-aware: a group
    with no member, e.g. no strategic client, is left out), and the accuracy's std."""
    out = []
    for key in dict.fromkeys((r["variant"], r["noise_rate"]) for r in runs):
        mine = [r for r in runs if (r["variant"], r["noise_rate"]) == key]
        acc = [r["final_accuracy"] for r in mine]
        row = {"variant": key[0], "noise_rate": key[1], "seeds": len(mine),
               "final_accuracy_std": float(np.std(acc))}
        with warnings.catch_warnings():  # a figure no seed has: NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            row.update({k: float(np.nanmean([r[k] for r in mine])) for k in SUMMED})
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------------------

def run_rows(job: Job, cfg: Any, summary: Dict[str, Any], curve: Sequence[Dict[str, Any]]
             ) -> Tuple[List[Dict[str, Any]], Dict[str, Any], List[Dict[str, Any]]]:
    """(round rows, run summary, client rows) of one finished run."""
    from fedjax_pan import data as data_lib
    from fedjax_pan.algorithms import recruitment

    # The split may drop clients too small to keep (a diverged run's summary has no count).
    k = int(summary.get("num_clients", cfg.partition.num_clients))
    noisy = data_lib.noisy_clients(k, cfg.partition.noisy_share, job.seed)
    strategic = recruitment.strategic_clients(cfg.recruitment, cfg.seed, k)
    everyone = ([float(round_costs(cfg, r["round"] - 1, k)[0].sum()) for r in curve]
                if cfg.recruitment.policy == "none" else None)
    rows = curve_rows(curve, noisy, everyone)
    utility, count = client_utilities(curve, k)
    tag = {"variant": job.variant, "noise_rate": job.noise_rate, "seed": job.seed}
    clients = [{**tag, "client": i, "noisy": bool(noisy[i]), "strategic": bool(strategic[i]),
                "rounds_taking_part": int(count[i]), "utility": float(utility[i])}
               for i in range(k)]
    return ([{**tag, **r} for r in rows], run_summary(job, rows, utility, noisy, strategic),
            clients)


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    todo = jobs(s)
    configs = [run_config(s, j) for j in todo]
    results = common.train_runs(ctx, [(j.name, cfg) for j, cfg in zip(todo, configs)])
    rounds, runs, clients, curves = [], [], [], []
    for job, cfg, (summary, _, curve) in zip(todo, configs, results):
        r, one, c = run_rows(job, cfg, summary, curve)
        rounds += r
        runs.append(one)
        clients += c
        curves.append(r)
    runs = with_equal_money(runs, curves)
    table = summarize(runs)
    common.write_csv(ctx.path("rounds.csv"), rounds)
    common.write_csv(ctx.path("clients.csv"), clients)
    common.write_csv(ctx.path("summary.csv"), table)
    common.write_json(ctx.path("summary.json"), {
        "settings": s, "summary": table, "runs": runs,
        "all_clients_money": "the sum of every client's cost of each round: what paying "
                             "everyone its cost would take (no auction prices it)"})
    plot(table, rounds, s, ctx.path("fair.png"))
    return report(table, s)


def report(table: Sequence[Dict[str, Any]], s: Settings) -> List[str]:
    """The printed table."""
    lines = [f"FAIR on {s.dataset}: K = {s.clients}, {100 * s.noisy_share:g}% noisy, budget "
             f"{s.budget:g} a round (costs in [{s.cost_low:g}, {s.cost_high:g})), "
             f"{s.rounds} rounds, seeds {list(s.seeds)}; all_clients' money: every cost paid",
             f"  {'variant':<20}{'noise':>6}{'final':>8}{'money':>9}{'recruits':>9}"
             f"{'noisy %':>9}{'u truth':>9}{'u strat':>9}{'at equal $':>11}"]
    for r in table:
        lines.append(f"  {r['variant']:<20}{r['noise_rate']:6.2f}"
                     f"{100 * r['final_accuracy']:8.2f}{r['spent_total']:9.1f}"
                     f"{r['recruited_per_round']:9.2f}{100 * r['noisy_selected']:9.1f}"
                     f"{r['utility_truthful']:9.2f}{r['utility_strategic']:9.2f}"
                     f"{100 * r['accuracy_at_equal_money']:11.2f}")
    return lines


def _mean_by_round(rows: Sequence[Dict[str, Any]], key: str) -> Tuple[np.ndarray, np.ndarray]:
    """(rounds, mean of `key` over the seeds at each round)."""
    rounds = sorted({r["round"] for r in rows})
    return np.asarray(rounds), np.asarray(
        [np.mean([r[key] for r in rows if r["round"] == n]) for n in rounds])


def plot(table: Sequence[Dict[str, Any]], rounds: Sequence[Dict[str, Any]], s: Settings,
         path: str) -> str:
    """A row per noise rate: accuracy against rounds and against money spent, the share
    of noisy clients recruited a round, and the mean utility of clean and noisy clients
    (means over seeds)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(17, 3.6 * len(s.noise_rates)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(s.noise_rates), 4, squeeze=False)
    for (ax_r, ax_m, ax_n, ax_u), rate in zip(axes, s.noise_rates):
        for v in s.variants:
            mine = [r for r in rounds if r["variant"] == v and r["noise_rate"] == rate]
            x, acc = _mean_by_round(mine, "test_accuracy")
            _, money = _mean_by_round(mine, "spent_total")
            _, share = _mean_by_round(mine, "noisy_share_selected")
            color, ls = STYLES[v]
            style = {"color": color, "ls": ls, "lw": 1.2, "label": LABELS[v]}
            ax_r.plot(x, 100 * acc, **style)
            ax_m.plot(money, 100 * acc, **style)
            ax_n.plot(x, 100 * share, **style)
        recs = [r for r in table if r["noise_rate"] == rate]
        population = 100 * float(np.mean([r["noisy_population"] for r in recs]))
        ax_n.axhline(population, color="grey", lw=0.8, ls=":")
        x = np.arange(len(recs))
        ax_u.bar(x - 0.2, [r["utility_clean"] for r in recs], 0.4, label="clean")
        ax_u.bar(x + 0.2, [r["utility_noisy"] for r in recs], 0.4, label="noisy")
        ax_u.set_xticks(x, [r["variant"] for r in recs], rotation=30, fontsize=7)
        ax_r.set(xlabel="round", ylabel="test accuracy (%)", title=f"noise rate {rate:g}")
        ax_m.set(xlabel="money spent so far", ylabel="test accuracy (%)",
                 title="accuracy against money")
        ax_n.set(xlabel="round", ylabel="noisy among recruited (%)",
                 title=f"noisy clients recruited ({population:.0f}% of all: dotted)")
        ax_u.set(ylabel="payment - cost, summed over rounds", title="mean utility per client")
        for ax in (ax_r, ax_m, ax_n, ax_u):
            ax.grid(alpha=0.3)
        ax_r.legend(fontsize=6)
        ax_u.legend(fontsize=6)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("fair", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
