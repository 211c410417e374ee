"""Quality-aware recruitment (fedjax_pan.algorithms.recruitment): the quality estimator
against histories summed by hand and in closed form, and the reverse auction against its
defining properties (truthful, individually rational, budget feasible, critical-value
payments found by bisection) and an instance solved by hand."""

import re

import numpy as np
import pytest

from fedjax_pan.algorithms import recruitment as rc
from fedjax_pan.references import check


def _instance(rng):
    """Random values, costs and budget for 2 to 12 clients; a third of the instances draw
    from a few integers, so that prices per unit quality tie."""
    k = int(rng.integers(2, 13))
    if rng.random() < 1 / 3:
        values = rng.integers(1, 4, k).astype(float)
        costs = 0.5 * rng.integers(1, 4, k)
    else:
        values = rng.uniform(0.1, 3.0, k)
        costs = rng.uniform(0.1, 2.0, k)
    return values, costs, float(rng.uniform(0.3, 1.2) * costs.sum())


def _outcome(bids, values, budget, i):
    """(won, payment) of client i."""
    r = rc.auction(bids, values, budget)
    where = np.flatnonzero(r.winners == i)
    return (True, float(r.payments[where[0]])) if where.size else (False, 0.0)


def _with(bids, i, bid):
    out = np.array(bids, dtype=float)
    out[i] = bid
    return out


def _breakpoints(values, bids, budget, i):
    """The bids at which client i's outcome can change, others fixed: v_i b_j / v_j for
    each other j, and B v_i / (v_i + V) for V each prefix sum of the others' values."""
    others = [j for j in range(len(bids)) if j != i]
    others.sort(key=lambda j: (bids[j] / values[j], j))
    ahead = np.concatenate([[0.0], np.cumsum([values[j] for j in others])])
    return np.concatenate([[values[i] * bids[j] / values[j] for j in others],
                           budget * values[i] / (values[i] + ahead)])


def test_reference_is_well_formed():
    check(rc.REFERENCE, "recruitment")
    assert "INFOCOM 2021" in rc.REFERENCE.paper and "TPDS" in rc.REFERENCE.paper
    assert "Singer" in rc.REFERENCE.paper and "Chen" in rc.REFERENCE.paper


# -- learning quality -------------------------------------------------------------------

def test_quality_of_a_hand_computed_history():
    # 4 clients, forgetting rho = 0.5; q = learned weight x number of winners that round.
    #   round 0: ids 0, 1 with weights 0.75, 0.25   -> q_0 = 1.5, q_1 = 0.5
    #   round 1: ids 0, 2 with weights 0.5, 0.5     -> q_0 = 1.0, q_2 = 1.0
    #   round 3: ids 0, 1, 2 with 0.2, 0.5, 0.3     -> q_0 = 0.6, q_1 = 1.5, q_2 = 0.9
    # At t = 3 the weights rho^(3 - s) are 0.125 (s=0), 0.25 (s=1), 1 (s=3):
    #   client 0: (0.125 1.5 + 0.25 1.0 + 0.6) / (0.125 + 0.25 + 1) = 1.0375 / 1.375 = 83/110
    #   client 1: (0.125 0.5 + 1.5) / (0.125 + 1) = 1.5625 / 1.125 = 25/18
    #   client 2: (0.25 1.0 + 0.9) / (0.25 + 1) = 1.15 / 1.25 = 0.92
    #   client 3: never measured -> the prior.
    state = rc.quality_init(4)
    state = rc.quality_update(state, np.array([0, 1]), np.array([0.75, 0.25]), 0, 0.5)
    state = rc.quality_update(state, np.array([0, 2]), np.array([0.5, 0.5]), 1, 0.5)
    state = rc.quality_update(state, np.array([0, 1, 2]), np.array([0.2, 0.5, 0.3]), 3, 0.5)
    np.testing.assert_allclose(rc.quality_estimate(state, prior=0.7),
                               [83 / 110, 25 / 18, 0.92, 0.7], rtol=1e-12)
    np.testing.assert_allclose(rc.quality_estimate(state), [83 / 110, 25 / 18, 0.92, 1.0],
                               rtol=1e-12)
    np.testing.assert_array_equal(state.last_round, [3, 3, 3, -1])


def test_unseen_clients_get_the_prior_and_an_average_winner_gets_one():
    state = rc.quality_init(5)
    np.testing.assert_array_equal(rc.quality_estimate(state, prior=0.3), np.full(5, 0.3))
    state = rc.quality_update(state, np.array([1, 3]), np.array([0.5, 0.5]), 0, 0.9)
    np.testing.assert_allclose(rc.quality_estimate(state, prior=0.3),
                               [0.3, 1.0, 0.3, 1.0, 0.3], rtol=1e-12)


@pytest.mark.parametrize("forgetting", [0.3, 0.8, 1.0])
def test_incremental_quality_equals_the_closed_form(forgetting):
    rng = np.random.default_rng(7)
    num_clients, state, records = 10, rc.quality_init(10), []
    rounds = np.sort(rng.choice(60, size=25, replace=False))  # some rounds skipped
    for t in rounds:
        ids = rng.choice(num_clients, size=int(rng.integers(1, 6)), replace=False)
        alpha = rng.dirichlet(np.ones(ids.size))
        state = rc.quality_update(state, ids, alpha, int(t), forgetting)
        records += [(i, int(t), a * ids.size) for i, a in zip(ids, alpha)]
    now = int(rounds[-1])
    expected = np.full(num_clients, -1.0)
    for i in range(num_clients):
        mine = [(s, q) for j, s, q in records if j == i]
        if mine:
            w = np.array([forgetting ** (now - s) for s, _ in mine])
            expected[i] = np.sum(w * [q for _, q in mine]) / np.sum(w)
    np.testing.assert_allclose(rc.quality_estimate(state, prior=-1.0), expected, rtol=1e-10)
    if forgetting == 1.0:  # the plain mean
        mean_0 = np.mean([q for j, _, q in records if j == 0])
        np.testing.assert_allclose(rc.quality_estimate(state)[0], mean_0, rtol=1e-12)


def test_quality_update_leaves_its_input_unchanged():
    state = rc.quality_update(rc.quality_init(3), np.array([0]), np.array([1.0]), 0, 0.5)
    copy = tuple(a.copy() for a in state)
    rc.quality_update(state, np.array([0, 2]), np.array([0.4, 0.6]), 2, 0.5)
    assert all(np.array_equal(a, b) for a, b in zip(state, copy))


def test_forgetting_favours_recent_rounds():
    state = rc.quality_init(1)
    state = rc.quality_update(state, np.array([0]), np.array([2.0]), 0, 0.5)
    state = rc.quality_update(state, np.array([0]), np.array([0.5]), 1, 0.5)
    # (0.5 2 + 0.5) / 1.5 = 1 < the plain mean 1.25: the newer, lower record weighs more.
    np.testing.assert_allclose(rc.quality_estimate(state), [1.0], rtol=1e-12)


# -- the auction ------------------------------------------------------------------------

@pytest.mark.reference("recruitment", "fair")
def test_auction_of_a_hand_solved_instance():
    # v = (2, 1, 3, 2), b = (1, 1, 2, 3), B = 10.
    # Order by b/v: client 0 (0.5), client 2 (2/3), client 1 (1), client 3 (1.5);
    # running sums of v: 2, 5, 6, 8. Prefix check b_k <= B v_k / V_k:
    #   0: 1 <= 10 2/2 = 10 yes;  2: 2 <= 10 3/5 = 6 yes;  1: 1 <= 10 1/6 = 1.67 yes;
    #   3: 3 <= 10 2/8 = 2.5 no   -> winners {0, 1, 2}.
    # Payment theta_i = max_j min(v_i b_j / v_j, B v_i / (v_i + V_{<j})), j over the
    # positions of i among the others in their order (the last with no first term):
    #   client 0 (v 2; others 2, 1, 3 with b/v 2/3, 1, 1.5 and v 3, 1, 2):
    #     min(4/3, 20/2) = 4/3, min(2, 20/5) = 2, min(3, 20/6) = 3, 20/8 = 2.5  -> 3
    #   client 1 (v 1; others 0, 2, 3 with b/v 0.5, 2/3, 1.5 and v 2, 3, 2):
    #     min(0.5, 10) = 0.5, min(2/3, 10/3) = 2/3, min(1.5, 10/6) = 1.5, 10/8  -> 1.5
    #   client 2 (v 3; others 0, 1, 3 with b/v 0.5, 1, 1.5 and v 2, 1, 2):
    #     min(1.5, 10) = 1.5, min(3, 30/5) = 3, min(4.5, 30/6) = 4.5, 30/8     -> 4.5
    # Spent 3 + 1.5 + 4.5 = 9 <= 10. Client 0 bidding 3.01 falls behind client 3 and then
    # needs 3.01 <= 20/8: it loses; at 2.99 it stays ahead and 2.99 <= 20/6: it wins.
    values, bids = np.array([2.0, 1.0, 3.0, 2.0]), np.array([1.0, 1.0, 2.0, 3.0])
    r = rc.auction(bids, values, 10.0)
    np.testing.assert_array_equal(r.winners, [0, 1, 2])
    np.testing.assert_allclose(r.payments, [3.0, 1.5, 4.5], rtol=1e-12)
    assert r.spent == pytest.approx(9.0, rel=1e-12)
    assert _outcome(_with(bids, 0, 2.99), values, 10.0, 0)[0]
    assert not _outcome(_with(bids, 0, 3.01), values, 10.0, 0)[0]


def test_auction_winners_follow_the_rule_read_literally():
    rng = np.random.default_rng(1)
    for _ in range(300):
        values, bids, budget = _instance(rng)
        order = sorted(range(len(bids)), key=lambda i: (bids[i] / values[i], i))
        winners, total = [], 0.0
        for i in order:
            total += values[i]
            if bids[i] > budget * values[i] / total:
                break
            winners.append(i)
        np.testing.assert_array_equal(rc.auction(bids, values, budget).winners,
                                      sorted(winners))


def test_auction_is_individually_rational_and_budget_feasible():
    rng = np.random.default_rng(2)
    for _ in range(500):
        values, bids, budget = _instance(rng)
        r = rc.auction(bids, values, budget)
        assert np.all(r.payments >= bids[r.winners] * (1 - 1e-12))
        assert r.spent <= budget * (1 + 1e-12)
        assert r.spent == pytest.approx(r.payments.sum(), rel=1e-12)
        # each payment is within the winner's proportional share B v_i / V(winners)
        share = budget * values[r.winners] / values[r.winners].sum()
        assert np.all(r.payments <= share * (1 + 1e-12))


@pytest.mark.reference("recruitment", "fair")
def test_auction_is_truthful():
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(200):
        values, costs, budget = _instance(rng)
        for i in range(len(costs)):
            won, pay = _outcome(costs, values, budget, i)
            truthful = pay - costs[i] if won else 0.0
            marks = _breakpoints(values, costs, budget, i)
            if won:
                marks = np.append(marks, pay)
            # the grid, and each breakpoint and just above it (below it the outcome is
            # the breakpoint's or a grid point's, the mechanism being monotone)
            lies = np.unique(np.concatenate([costs[i] * np.geomspace(0.1, 10.0, 60), marks,
                                             marks * (1 + 1e-9)]))
            for lie in lies:
                won_l, pay_l = _outcome(_with(costs, i, lie), values, budget, i)
                utility = pay_l - costs[i] if won_l else 0.0
                assert utility <= truthful + 1e-9 * budget, (values, costs, budget, i, lie)
                checked += 1
    assert checked > 50_000


def test_payment_is_the_critical_bid_found_by_bisection():
    rng = np.random.default_rng(4)
    winners_checked = 0
    for _ in range(60):
        values, bids, budget = _instance(rng)
        r = rc.auction(bids, values, budget)
        for i, pay in zip(r.winners, r.payments):
            lo, hi = bids[i], 2.0 * budget  # wins at lo; above B nobody can win
            assert not _outcome(_with(bids, i, hi), values, budget, i)[0]
            for _ in range(80):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if _outcome(_with(bids, i, mid), values, budget, i)[0] \
                    else (lo, mid)
            assert pay == pytest.approx(lo, rel=1e-7)
            assert not _outcome(_with(bids, i, pay * (1 + 1e-7)), values, budget, i)[0]
            assert _outcome(_with(bids, i, pay * (1 - 1e-7)), values, budget, i)[0]
            winners_checked += 1
    assert winners_checked > 100


def _chen_payment(values, bids, budget, i):
    """Chen, Gravin & Lu's threshold, read literally: over the others in their order
    without i, o_1..o_m, with k' the others' own winning prefix, the max over j <= k'+1 of
    min(v_i b_{o_j} / v_{o_j}, B v_i / (v_i + sum_{l<j} v_{o_l})) (b_{o_{m+1}} = inf)."""
    others = sorted((j for j in range(len(bids)) if j != i),
                    key=lambda j: (bids[j] / values[j], j))
    k_others, total = 0, 0.0
    for j in others:
        total += values[j]
        if bids[j] > budget * values[j] / total:
            break
        k_others += 1
    best, ahead = 0.0, 0.0
    for pos in range(k_others + 1):
        price = bids[others[pos]] / values[others[pos]] if pos < len(others) else np.inf
        best = max(best, min(values[i] * price, budget * values[i] / (values[i] + ahead)))
        if pos < len(others):
            ahead += values[others[pos]]
    return best


def test_payments_equal_chens_maximum_over_positions():
    rng = np.random.default_rng(8)
    winners_checked = 0
    for _ in range(500):
        values, bids, budget = _instance(rng)
        r = rc.auction(bids, values, budget)
        for i, pay in zip(r.winners, r.payments):
            assert pay == pytest.approx(_chen_payment(values, bids, budget, i), rel=1e-12)
            winners_checked += 1
    assert winners_checked > 1000


def test_a_winner_who_lowers_its_bid_still_wins_and_is_paid_the_same():
    rng = np.random.default_rng(5)
    for _ in range(200):
        values, bids, budget = _instance(rng)
        r = rc.auction(bids, values, budget)
        for i, pay in zip(r.winners, r.payments):
            won, pay_lower = _outcome(_with(bids, i, bids[i] * rng.uniform()), values,
                                      budget, i)
            assert won
            assert pay_lower == pytest.approx(pay, rel=1e-12)


def test_auction_floors_values_and_handles_edge_cases():
    # A client of quality 0 is valued at the floor: it ranks behind the others.
    r = rc.auction(np.array([1.0, 1.0]), np.array([0.0, 1.0]), 1.5)
    np.testing.assert_array_equal(r.winners, [1])
    # Client 1 ahead of client 0 wins up to min(1 x 1 / 1e-6, 1.5 x 1 / 1): the budget.
    assert r.payments[0] == pytest.approx(1.5, rel=1e-12)
    negative = rc.auction(np.array([1.0, 1.0]), np.array([-2.0, 1.0]), 1.5)  # floored too
    np.testing.assert_array_equal(negative.winners, r.winners)
    np.testing.assert_array_equal(negative.payments, r.payments)
    # Every value floored: prices b / 1e-6 still rank by bid. Client 1 (bid 1) fits
    # (1 <= 3); client 0 then needs 2 <= 3 / 2: it loses. Client 1 is paid
    # max(min(1e-6 x 2 / 1e-6, 3), 3 / 2) = 2, with no division by a zero sum of values.
    r = rc.auction(np.array([2.0, 1.0]), np.zeros(2), 3.0)
    np.testing.assert_array_equal(r.winners, [1])
    assert r.payments[0] == pytest.approx(2.0, rel=1e-12)
    # A lone client is paid the whole budget; one bidding above it loses.
    assert rc.auction(np.array([0.5]), np.array([1.0]), 2.0).payments.tolist() == [2.0]
    assert rc.auction(np.array([3.0]), np.array([1.0]), 2.0).winners.size == 0
    assert rc.auction(np.zeros(0), np.zeros(0), 1.0).spent == 0.0
    # Equal prices: the lower client id comes first.
    np.testing.assert_array_equal(
        rc.auction(np.array([1.0, 1.0]), np.array([1.0, 1.0]), 1.5).winners, [0])


# -- baseline and bid simulation --------------------------------------------------------

@pytest.mark.reference("recruitment", "random")
def test_random_baseline_stays_within_budget_and_is_reproducible():
    rng = np.random.default_rng(6)
    outcomes = set()
    for _ in range(200):
        _, bids, budget = _instance(rng)
        r = rc.random_within_budget(bids, budget, np.random.default_rng(11))
        again = rc.random_within_budget(bids, budget, np.random.default_rng(11))
        np.testing.assert_array_equal(r.winners, again.winners)
        assert r.spent == again.spent <= budget
        np.testing.assert_array_equal(r.payments, bids[r.winners])  # paid its bid
        assert r.spent == pytest.approx(bids[r.winners].sum(), rel=1e-12)
        # no loser would have fitted what is left (it did not when its turn came)
        losers = np.setdiff1d(np.arange(bids.size), r.winners)
        assert np.all(bids[losers] > budget - r.spent)
    bids = np.ones(8)
    for seed in range(20):
        outcomes.add(tuple(rc.random_within_budget(bids, 3.0,
                                                   np.random.default_rng(seed)).winners))
    assert len(outcomes) > 1  # the order is random


def test_strategic_bids_raise_costs_by_exactly_the_markup():
    costs = rc.draw_costs(np.random.default_rng(0), 50, 0.5, 2.0)
    np.testing.assert_array_equal(costs, rc.draw_costs(np.random.default_rng(0), 50, 0.5, 2.0))
    assert costs.shape == (50,) and np.all((costs >= 0.5) & (costs < 2.0))
    np.testing.assert_allclose(rc.strategic_bids(costs, 0.2) / costs, 1.2, rtol=1e-15)
    np.testing.assert_array_equal(rc.strategic_bids(costs, 0.0), costs)
    markup = np.where(np.arange(50) % 2 == 0, 0.5, 0.0)  # only even clients strategic
    np.testing.assert_allclose(rc.strategic_bids(costs, markup), costs * (1 + markup),
                               rtol=1e-15)


# -- bad input --------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: rc.auction(np.array([1.0, -0.5]), np.ones(2), 1.0), "-0.5"),
    (lambda: rc.auction(np.ones(2), np.ones(2), 0.0), "budget.*0.0"),
    (lambda: rc.auction(np.ones(2), np.ones(2), -3.0), "-3.0"),
    (lambda: rc.auction(np.ones(3), np.ones(2), 1.0), "3 bids"),
    (lambda: rc.auction(np.ones(2), np.array([1.0, np.nan]), 1.0), "nan"),
    (lambda: rc.random_within_budget(np.array([-2.0]), 1.0, np.random.default_rng(0)),
     "-2.0"),
    (lambda: rc.random_within_budget(np.ones(2), 0.0, np.random.default_rng(0)), "0.0"),
    (lambda: rc.quality_update(rc.quality_init(3), np.array([0]), np.ones(1), 0, 0.0),
     "forgetting.*0.0"),
    (lambda: rc.quality_update(rc.quality_init(3), np.array([0]), np.ones(1), 0, 1.5),
     "forgetting.*1.5"),
    (lambda: rc.quality_update(rc.quality_init(3), np.array([0, 1]), np.ones(1), 0, 0.5),
     r"\(2,\) and \(1,\)"),
    (lambda: rc.quality_update(rc.quality_init(3), np.array([3]), np.ones(1), 0, 0.5),
     r"\[3\]"),
    (lambda: rc.quality_update(
        rc.quality_update(rc.quality_init(3), np.array([1]), np.ones(1), 4, 0.5),
        np.array([1]), np.ones(1), 2, 0.5), "round_index 2"),
    (lambda: rc.draw_costs(np.random.default_rng(0), 3, 2.0, 1.0), "low=2.0, high=1.0"),
    (lambda: rc.strategic_bids(np.ones(2), -2.0), "-2.0"),
])
def test_bad_input_raises_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- In a run: config.recruitment, the engine's Recruiter -------------------------------

def _options(**changes):
    import ml_collections
    return ml_collections.ConfigDict({**rc.FEATURE.options, "policy": "fair", **changes})


def test_fair_recruiter_runs_the_auction_on_the_estimates_within_the_budget():
    r = rc.recruiter(_options(budget=5.0, strategic_share=0.5, markup=0.5), seed=3)
    state = r.init(12)
    ids, new, fields = r.select(state, 7)
    again, _, _ = r.select(state, 7)  # pure: a resumed run recruits the same clients
    assert ids.tolist() == again.tolist() == fields["recruit_clients"]
    costs, bids = rc.round_bids(_options(strategic_share=0.5, markup=0.5), 3, 7, 12)
    assert set(np.round(bids / costs, 12)) == {1.0, 1.5}  # strategic clients ask 50% more
    want = rc.auction(bids, np.ones(12), 5.0)  # no history: every estimate is the prior
    assert ids.tolist() == want.winners.tolist()
    np.testing.assert_allclose(fields["recruit_payments"], want.payments)
    assert fields["recruit_bids"] == bids[ids].tolist()
    assert fields["recruit_costs"] == costs[ids].tolist()
    assert fields["recruit_spent"] == pytest.approx(sum(fields["recruit_payments"]))
    assert fields["recruit_spent"] <= 5.0
    assert fields["recruit_budget_left"] == pytest.approx(5.0 - fields["recruit_spent"])
    assert float(new["spent_total"][0]) == pytest.approx(fields["recruit_spent"])
    assert float(state["spent_total"][0]) == 0.0  # the input state is not changed


def test_learned_weights_become_qualities_that_steer_the_next_auction():
    r = rc.recruiter(_options(forgetting=0.5, budget=100.0), seed=0)
    state = r.init(4)
    state, fields = r.observe(state, np.array([0, 2]), {"weights": np.array([0.75, 0.25])}, 0)
    assert fields["recruit_learned"] == [1.5, 0.5]  # alpha x the round's winners
    np.testing.assert_allclose(rc.quality_estimate(rc._quality(state), 1.0), [1.5, 1, 0.5, 1])
    _, _, chosen = r.select(state, 1)
    q = dict(zip(chosen["recruit_clients"], chosen["recruit_quality"]))
    assert all(q[i] == {0: 1.5, 1: 1.0, 2: 0.5, 3: 1.0}[i] for i in q)
    # A rule that learns nothing (no report) leaves the estimates as they are.
    same, nothing = r.observe(state, np.array([1]), {}, 1)
    assert nothing == {} and same is state


def test_the_random_baseline_is_seeded_and_within_the_budget():
    r = rc.recruiter(_options(policy="random", budget=4.0), seed=1)
    state = r.init(20)
    a, b = r.select(state, 2)[2], r.select(state, 2)[2]
    assert a == b and a["recruit_spent"] <= 4.0
    assert a["recruit_payments"] == a["recruit_bids"]  # paid what it asked
    assert r.select(state, 3)[2]["recruit_clients"] != a["recruit_clients"]


def _config(**changes):
    import importlib.util
    import os
    from conftest import ROOT
    from fedjax_pan.config import defaults
    spec = importlib.util.spec_from_file_location(
        "fmnist_mlp", os.path.join(ROOT, "configs", "fmnist_mlp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("smoke")
    cfg.dataset.name = "synthetic"
    cfg.model.options = {"hidden": [32, 32]}
    base = {"recruitment.policy": "fair", "recruitment.budget": 6.0,
            "aggregation.rule": "auto_weights", "dataset.public_size": 200}
    return defaults.set_keys(cfg, {**base, **{k.replace("__", "."): v
                                              for k, v in changes.items()}})


@pytest.mark.parametrize("changes,match", [
    (dict(aggregation__rule="mean"), "aggregation.rule='auto_weights'"),
    (dict(straggler__max_delay=2), "straggler.max_delay=0"),
    (dict(sampling="poisson"), "sampling='uniform'"),
    (dict(recruitment__cost_low=3.0, recruitment__cost_high=2.0), "cost_low"),
    (dict(recruitment__budget=0.0), "recruitment.budget"),
    (dict(recruitment__policy="greedy"), "greedy"),
    (dict(algorithm="fedma", pan__amplitude=0.0), "recruitment.policy"),
])
def test_settings_recruitment_cannot_run_with_are_refused_in_one_line(tmp_path, changes, match):
    from fedjax_pan.run import experiment
    workdir = tmp_path / "w"
    with pytest.raises(experiment.ConfigError, match=re.escape(match)) as e:
        experiment.train(_config(**changes), str(workdir), progress=False)
    assert "\n" not in str(e.value)
    assert not workdir.exists()


@pytest.mark.slow  # two runs and a resume (the engine's saved and restored selection: default run)
def test_fair_from_a_config_logs_its_recruits_and_resumes_exactly(tmp_path):
    import json
    import os
    import shutil
    from fedjax_pan.run import experiment

    def rows(workdir):
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in f]

    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(_config(rounds=4, checkpoint_every=2), full, progress=False)
    experiment.train(_config(rounds=3, checkpoint_every=2), part, progress=False)
    shutil.rmtree(os.path.join(part, "checkpoints", "3"))  # crashed before round 3's
    experiment.train(_config(rounds=4, checkpoint_every=2), part, resume=True, progress=False)
    got = rows(full)
    assert rows(part) == got  # the estimates and the money spent came back from round 2
    total = 0.0
    for row in got:
        assert row["recruit_count"] == len(row["recruit_clients"]) > 0
        assert row["recruit_spent"] <= 6.0 + 1e-9
        assert all(p >= b for p, b in zip(row["recruit_payments"], row["recruit_bids"]))
        assert len(row["recruit_learned"]) == row["recruit_count"]
        assert sum(row["recruit_learned"]) == pytest.approx(row["recruit_count"], rel=1e-5)
        total += row["recruit_spent"]
        assert row["recruit_spent_total"] == pytest.approx(total)


@pytest.mark.parametrize("flag,named", [
    ("--config.recruitment.budget=-1", "config.recruitment.budget"),
    ("--config.recruitment.forgetting=0", "config.recruitment.forgetting"),
    ("--config.recruitment.policy=auction", "config.recruitment.policy"),
    ("--config.aggregation.auto_weights.steps=0", "config.aggregation.auto_weights.steps"),
])
def test_a_bad_value_on_the_command_line_is_one_error_line_and_exit_2(tmp_path, capsys, flag,
                                                                      named):
    from fedjax_pan.run import main
    workdir = tmp_path / "w"
    assert main.main(["prog", "--config=configs/fmnist_mlp.py:smoke", f"--workdir={workdir}",
                      "--config.recruitment.policy=fair",
                      "--config.aggregation.rule=auto_weights", flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    assert not workdir.exists()


@pytest.mark.slow  # two short runs
def test_fair_composes_with_attacks_and_compression(tmp_path):
    import json
    import os
    from fedjax_pan.run import experiment
    for name, changes in (("attack", dict(attack__kind="model_poisoning", attack__fraction=0.3)),
                          ("compression", dict(compression__upload__method="top_k"))):
        workdir = str(tmp_path / name)
        experiment.train(_config(rounds=3, **changes), workdir, progress=False)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        assert len(rows) == 3 and all(r["recruit_spent"] <= 6.0 + 1e-9 for r in rows)
        assert all(len(r["recruit_learned"]) == r["recruit_count"] for r in rows)
