"""Quality-aware recruitment under a budget, after FAIR (Deng et al., INFOCOM 2021; IEEE TPDS
33(12), 2022): estimate each client's learning quality from its history, then recruit by a
reverse auction within a per-round budget B. Pure NumPy; every function is pure.

1. Learning quality. The server reads a winner's quality back from the aggregation weight
   it learned for it: in round s, with n_s winners and learned weights alpha^s,

       q_i^s = alpha_i^s * n_s                 (1.0: an average client of that round)

   and estimates, over the rounds s in which i was measured, with forgetting rho in (0, 1],

       q_i = sum_s rho^(t - s) q_i^s / sum_s rho^(t - s)        (rho = 1: the plain mean)

   A never-measured client gets `prior`. The two sums are kept per client and decayed by
   rho^(t - last round seen) when it is next measured, which equals decaying them every
   round, and keeps the weight sum >= 1 (no underflow for a client long unseen).

2. Reverse auction: Singer's proportional-share mechanism for additive valuations
   (Singer, FOCS 2010) with the threshold payments of Chen, Gravin & Lu (SODA 2011).
   Clients bid b_i; with values v_i (the estimated qualities) sort by b_i / v_i increasing
   (v_i / b_i decreasing), ties by client id; the winners are the longest prefix 1..k with

       b_j <= B v_j / sum_{l <= j} v_l      for every j <= k,

   and winner i is paid its critical value, the supremum of the bids at which it still
   wins, the others' bids fixed. Chen et al. write it over the others o_1, o_2, ... in
   their order without i as

       theta_i = max_j min(v_i b_{o_j} / v_{o_j}, B v_i / (v_i + sum_{l < j} v_{o_l})):

   placed just ahead of o_j (a bid up to v_i b_{o_j} / v_{o_j}), i wins iff its bid is at
   most the second term, since the winning condition holds on a prefix of the order. For
   additive values the maximum is at i's place just ahead of the first loser k+1, where
   the second term is B v_i / V, so

       theta_i = min(v_i b_{k+1} / v_{k+1}, B v_i / V),     V = sum of the winners' values

   (B v_i / V where all win): further ahead the first term is at most both (a winner o_j
   has b_{o_j} / v_{o_j} <= b_{k+1} / v_{k+1} and <= B / V); further behind the second
   term is at most B v_i / (V + v_{k+1}) < v_i b_{k+1} / v_{k+1}, the first loser having
   failed its test. The allocation is monotone, so with these payments the mechanism is
   truthful and individually rational (Myerson); each theta_i <= B v_i / V, so the
   payments sum to at most B (budget feasible). O(K log K).

Baseline and simulation: `random_within_budget` takes clients in a random order while their
bids fit (paid their bids, not truthful); `draw_costs` and `strategic_bids` simulate
private per-round costs and marked-up bids.

In a run (`config.recruitment`, `FEATURE`): the engine asks a `Recruiter` for each round's
clients instead of sampling them; `recruitment.policy` is one of

    fair     the reverse auction on the estimated qualities, which the aggregation rule
             auto_weights feeds back (its learned weights)
    random   clients in a random order while their bids fit the budget, each paid its
             bid (the baseline under the same budget)

Each round's costs are drawn from (seed, round); a `strategic_share` of the clients, drawn
once per seed, bid `markup` above their costs. Rows of metrics.jsonl gain the round's
recruits, their bids, costs, payments and estimated and learned qualities, the money spent
and left.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple, Union

import numpy as np

from fedjax_pan.algorithms import stragglers
from fedjax_pan.algorithms.core import FeatureEntry
from fedjax_pan.algorithms.sampling import cohort_sampling
from fedjax_pan.engine.protocol import Recruiter
from fedjax_pan.references import Reference
from fedjax_pan.rules import between, one_of

# A client of estimated quality <= 0 (a learned weight of 0) still needs a finite price per
# unit quality: it is valued at this floor, so its price is high but finite.
VALUE_FLOOR = 1e-6

REFERENCE = Reference(
    "Deng et al., 'FAIR: Quality-Aware Federated Learning with Precise User Incentive and "
    "Model Aggregation', IEEE INFOCOM 2021, and 'Improving Federated Learning With "
    "Quality-Aware User Incentive and Auto-Weighted Model Aggregation', IEEE TPDS 33(12), "
    "2022 (components 1 and 2: learning-quality estimation with exponential forgetting, and "
    "a truthful, individually rational reverse auction within a budget); the mechanism is "
    "Singer, 'Budget Feasible Mechanisms', FOCS 2010 (proportional share, additive "
    "valuations), with the threshold payments of Chen, Gravin & Lu, 'On the Approximability "
    "of Budget Feasible Mechanisms', SODA 2011",
    None,
    ("the FAIR papers' full text was not available: every choice below is ours, made "
     "where the abstracts leave it open",
     "measured quality = learned aggregation weight x number of winners that round (1.0: "
     "an average client of the round); the TPDS abstract reads quality back from the "
     "learned weight but the map is not in the available text",
     "freshness: sum_s rho^(t-s) q_s / sum_s rho^(t-s), rho = forgetting in (0, 1], over "
     "every round the client was measured; the papers' exponential forgetting function's "
     "form, rate, normalisation and window are not in the available text",
     "a never-measured client's quality is `prior` (default 1.0, an average client); the "
     "papers' cold start is not in the available text",
     "winner rule and payments: Singer's proportional-share mechanism with Chen et al.'s "
     "critical-value payments, which for additive values reduce to min(v_i b_{k+1} / "
     "v_{k+1}, B v_i / V) (truthful, individually rational, budget feasible); FAIR's "
     "own auction is not in the available text, and its abstracts list truthfulness, "
     "individual rationality and efficiency but not budget feasibility",
     f"values (estimated qualities) below {VALUE_FLOOR:g} are raised to {VALUE_FLOOR:g} "
     "so that every price per unit quality is finite",
     "one sealed bid per client per round, order ties broken by client id",
     "simulated costs uniform in [low, high) per client and round, strategic bids cost x "
     "(1 + markup), and the random-order baseline `random_within_budget` are ours; the "
     "papers' cost model, settings and baselines are not in the available text"))


RANDOM_REFERENCE = Reference(
    "the baseline of budget-constrained recruitment (Deng et al., FAIR, INFOCOM 2021 / TPDS "
    "2022, compare FAIR with recruiting within the same budget without quality): clients "
    "in a uniformly random order, each taken while its bid fits what is left of the budget",
    None,
    ("the FAIR papers' full text was not available: the baselines' exact definitions are "
     "ours",
     "each winner is paid its bid (first-price): not truthful, a strategic client gains by "
     "bidding above its cost, which `strategic_share` and `markup` simulate"))
REFERENCES = {"fair": REFERENCE, "random": RANDOM_REFERENCE}

class QualityState(NamedTuple):
    """Per-client quality history over K clients: `weighted_sum` = sum_s w_s q^s and
    `weight_sum` = sum_s w_s with w_s = rho^(last_round - s), `last_round` the last round
    the client was measured (-1: never)."""

    weighted_sum: np.ndarray
    weight_sum: np.ndarray
    last_round: np.ndarray


class Recruitment(NamedTuple):
    """A round's recruits: `winners` (client ids, increasing), `payments` (one per winner,
    same order) and `spent` (their sum)."""

    winners: np.ndarray
    payments: np.ndarray
    spent: float


def quality_init(num_clients: int) -> QualityState:
    """No client measured yet."""
    if int(num_clients) != num_clients or num_clients < 0:
        raise ValueError(f"num_clients must be an integer >= 0, got {num_clients}")
    return QualityState(np.zeros(num_clients), np.zeros(num_clients),
                        np.full(num_clients, -1, dtype=np.int64))


def quality_update(state: QualityState, ids: np.ndarray, learned_weights: np.ndarray,
                   round_index: int, forgetting: float) -> QualityState:
    """Records round `round_index`'s winners `ids` with their learned aggregation weights:
    q_i = alpha_i * len(ids), added with weight 1 after both sums are decayed by
    rho^(round_index - last_round_i), rho = `forgetting` in (0, 1]."""
    if not 0.0 < forgetting <= 1.0:
        raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
    num_clients = state.weight_sum.shape[0]
    ids = np.asarray(ids)
    ids = ids.astype(np.int64) if ids.size == 0 else ids
    alpha = np.asarray(learned_weights, dtype=np.float64)
    if ids.ndim != 1 or alpha.shape != ids.shape:
        raise ValueError(f"ids and learned_weights must be 1-D of one length, got shapes "
                         f"{ids.shape} and {alpha.shape}")
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0
                     or ids.max() >= num_clients or np.unique(ids).size != ids.size):
        raise ValueError(f"ids must be distinct client ids in [0, {num_clients}), got {ids}")
    if not np.all(np.isfinite(alpha)):
        raise ValueError(f"learned_weights must be finite, got {alpha}")
    if int(round_index) != round_index or round_index < 0:
        raise ValueError(f"round_index must be an integer >= 0, got {round_index}")
    seen = state.last_round[ids]
    if np.any(seen > round_index):
        raise ValueError(f"round_index {round_index} is before client "
                         f"{ids[np.argmax(seen)]}'s last measured round {seen.max()}")
    decay = np.where(seen >= 0, float(forgetting) ** (round_index - seen), 0.0)
    weighted_sum, weight_sum, last_round = (a.copy() for a in state)
    weighted_sum[ids] = decay * weighted_sum[ids] + alpha * ids.size
    weight_sum[ids] = decay * weight_sum[ids] + 1.0
    last_round[ids] = round_index
    return QualityState(weighted_sum, weight_sum, last_round)


def quality_estimate(state: QualityState, prior: float = 1.0) -> np.ndarray:
    """(K,) estimated qualities: weighted_sum / weight_sum, or `prior` where never measured."""
    measured = state.weight_sum > 0
    return np.where(measured, state.weighted_sum / np.where(measured, state.weight_sum, 1.0),
                    float(prior))


def _check_bids(bids: np.ndarray, budget: float) -> np.ndarray:
    bids = np.asarray(bids, dtype=np.float64)
    if bids.ndim != 1:
        raise ValueError(f"bids must be 1-D, got shape {bids.shape}")
    bad = ~np.isfinite(bids) | (bids < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"bids must be finite and >= 0, got {bids[i]} from client {i}")
    if not (np.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be finite and > 0, got {budget}")
    return bids


def auction(bids: np.ndarray, values: np.ndarray, budget: float) -> Recruitment:
    """Singer's proportional-share reverse auction with critical-value payments (module
    docstring); values below VALUE_FLOOR are raised to it. O(K log K): one sort."""
    bids = _check_bids(bids, budget)
    values = np.asarray(values, dtype=np.float64)
    if values.shape != bids.shape:
        raise ValueError(f"bids and values must have one length, got {bids.shape[0]} bids "
                         f"and values of shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"values must be finite, got {values}")
    num_clients = bids.shape[0]
    v = np.maximum(values, VALUE_FLOOR)
    price = bids / v  # per unit of quality
    order = np.lexsort((np.arange(num_clients), price))  # by price, then client id
    running = np.cumsum(v[order])
    fits = bids[order] <= budget * v[order] / running
    k = num_clients if fits.all() else int(np.argmin(fits))
    winners = np.sort(order[:k])
    first_loser = price[order[k]] if k < num_clients else np.inf
    share = budget / running[k - 1] if k else 0.0  # B / V
    payments = np.minimum(v[winners] * first_loser, v[winners] * share)
    return Recruitment(winners, payments, float(payments.sum()))


def random_within_budget(bids: np.ndarray, budget: float,
                         rng: np.random.Generator) -> Recruitment:
    """Baseline: clients in a random order (`rng`), each taken while its bid fits what is
    left of the budget and paid its bid. Not truthful: a winner gains by bidding higher."""
    bids = _check_bids(bids, budget)
    winners, spent = [], 0.0
    for i in rng.permutation(bids.shape[0]):
        if spent + bids[i] <= budget:
            winners.append(int(i))
            spent += bids[i]
    winners = np.sort(np.asarray(winners, dtype=np.int64))
    return Recruitment(winners, bids[winners], spent)


def draw_costs(rng: np.random.Generator, num_clients: int, low: float,
               high: float) -> np.ndarray:
    """(K,) private per-round costs, i.i.d. uniform in [low, high)."""
    if not 0.0 <= low <= high < np.inf:
        raise ValueError(f"costs need 0 <= low <= high < inf, got low={low}, high={high}")
    return rng.uniform(low, high, size=num_clients)


def strategic_bids(costs: np.ndarray, markup: Union[float, np.ndarray]) -> np.ndarray:
    """Bids cost x (1 + markup): a strategic client asks `markup` above its cost (0:
    truthful); `markup` is one number or one per client, each >= -1."""
    costs = np.asarray(costs, dtype=np.float64)
    markup = np.asarray(markup, dtype=np.float64)
    if np.any(~np.isfinite(markup) | (markup < -1)):
        raise ValueError(f"markup must be finite and >= -1, got {markup}")
    return costs * (1.0 + markup)


# Streams of the seed (apart from sampling's and training's): each round's costs, the
# strategic clients, the baseline's order.
_COSTS, _STRATEGIC, _ORDER = 0x46414952, 0x46414953, 0x46414954
POLICIES = ("none", "fair", "random")


def strategic_clients(options: Any, seed: int, num_clients: int) -> np.ndarray:
    """(K,) bool: the clients that bid `options.markup` above their costs, each with
    probability `options.strategic_share`, drawn once from `seed`."""
    return (np.random.default_rng([seed, _STRATEGIC]).random(num_clients)
            < options.strategic_share)


def round_bids(options: Any, seed: int, round_index: int, num_clients: int
               ) -> Tuple[np.ndarray, np.ndarray]:
    """(costs, bids) of every client in round `round_index` of a run of `seed` under
    `config.recruitment` (`options`): what its recruiter sees, whatever its policy."""
    costs = draw_costs(np.random.default_rng([seed, _COSTS, round_index]), num_clients,
                       options.cost_low, options.cost_high)
    strategic = strategic_clients(options, seed, num_clients)
    return costs, strategic_bids(costs, np.where(strategic, options.markup, 0.0))


def _quality(state: Dict[str, np.ndarray]) -> QualityState:
    return QualityState(np.asarray(state["weighted_sum"], np.float64),
                        np.asarray(state["weight_sum"], np.float64),
                        np.asarray(state["last_round"], np.int64))


def recruiter(options: Any, seed: int) -> Recruiter:
    """The engine's `Recruiter` for `config.recruitment` (`options`) and the run's seed:
    FAIR's auction on the estimated qualities, or the random baseline, within
    `options.budget` a round."""
    if options.policy not in POLICIES[1:]:
        raise ValueError(f"recruitment.policy must be one of {POLICIES[1:]}, got "
                         f"{options.policy!r}")

    def init(num_clients: int) -> Dict[str, np.ndarray]:
        return {**quality_init(num_clients)._asdict(), "spent_total": np.zeros(1)}

    def select(state, round_index):
        q = quality_estimate(_quality(state), options.prior)
        costs, bids = round_bids(options, seed, round_index, q.shape[0])
        if options.policy == "fair":
            won = auction(bids, q, options.budget)
        else:
            won = random_within_budget(
                bids, options.budget, np.random.default_rng([seed, _ORDER, round_index]))
        total = float(np.asarray(state["spent_total"])[0]) + won.spent
        w = won.winners
        fields = {"recruit_clients": w.tolist(), "recruit_bids": bids[w].tolist(),
                  "recruit_costs": costs[w].tolist(), "recruit_payments": won.payments.tolist(),
                  "recruit_quality": q[w].tolist(), "recruit_count": int(w.size),
                  "recruit_spent": won.spent, "recruit_budget_left": options.budget - won.spent,
                  "recruit_spent_total": total}
        return w, {**state, "spent_total": np.asarray([total])}, fields

    def observe(state, ids, report, round_index):
        if "weights" not in report or not len(ids):
            return state, {}
        alpha = np.asarray(report["weights"], np.float64)
        quality = quality_update(_quality(state), ids, alpha, round_index, options.forgetting)
        return ({**state, **quality._asdict()},
                {"recruit_learned": (alpha * len(ids)).tolist()})

    return Recruiter(init, select, observe)


def _check(cfg: Any) -> None:
    o = cfg.recruitment
    if o.policy == "none":
        return
    if o.cost_low > o.cost_high:
        raise ValueError(f"recruitment.cost_low = {o.cost_low} must be at most "
                         f"recruitment.cost_high = {o.cost_high}")
    if stragglers.late(cfg):
        raise ValueError(f"recruitment.policy={o.policy!r} recruits the clients of each "
                         f"round and waits for none: set straggler.max_delay=0")
    if cohort_sampling(cfg) != "uniform":
        raise ValueError(f"recruitment.policy={o.policy!r} replaces sampling: set "
                         f"sampling='uniform' and privacy.clip=0")
    if o.policy == "fair" and cfg.aggregation.rule != "auto_weights":
        raise ValueError("recruitment.policy='fair' reads each client's quality from the "
                         "weights aggregation.rule='auto_weights' learns: set it "
                         "(aggregation.auto_weights.apply=false keeps the round's weights)")


FEATURE = FeatureEntry(
    "recruitment",
    options={"policy": "none", "budget": 10.0, "cost_low": 1.0, "cost_high": 2.0,
             "strategic_share": 0.0, "markup": 0.5, "forgetting": 0.5, "prior": 1.0},
    rules={"policy": one_of(POLICIES), "budget": between(0, 1e12, lo_open=True),
           "cost_low": between(0, 1e9), "cost_high": between(0, 1e9),
           "strategic_share": between(0, 1), "markup": between(0, 100),
           "forgetting": between(0, 1, lo_open=True), "prior": between(0, 1e3, lo_open=True)},
    off=(("policy", "none"),), check=_check,
    simulation=lambda cfg: {"recruiter": recruiter(cfg.recruitment, cfg.seed)},
    summary="the server recruits each round's clients within a per-round budget instead of "
            "sampling them (FAIR, Deng et al. 2021/2022): 'fair' by a truthful reverse "
            "auction on qualities estimated from the weights aggregation.rule="
            "'auto_weights' learns, 'random' in a random order while bids fit; costs "
            "uniform in [cost_low, cost_high) each round, a strategic_share bidding "
            "markup above cost")


__all__ = ["VALUE_FLOOR", "REFERENCE", "RANDOM_REFERENCE", "REFERENCES", "QualityState", "Recruitment", "quality_init",
           "quality_update", "quality_estimate", "auction", "random_within_budget",
           "draw_costs", "strategic_bids", "strategic_clients", "round_bids", "POLICIES",
           "recruiter", "FEATURE"]
