"""Neuron alignment: the assignment against hand-solved cases, hidden permutations recovered
exactly, and alignment of unrelated models keeping their function while bringing them closer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_init
from fedjax_pan.pan import matching
from fedjax_pan import models
from fedjax_pan.pan import permutation as P
from test_permutation import _model

SHAPE = (32, 32, 3)


def test_assignment_against_hand_solved_cases():
    # Greedy (row by row) takes 9 then 1 (13 with the 3); the optimum takes 8 + 7 + 3 = 18.
    sim = np.array([[9.0, 8.0, 0.0],
                    [7.0, 1.0, 0.0],
                    [0.0, 0.0, 3.0]])
    np.testing.assert_array_equal(matching.assignment(sim), [1, 0, 2])
    # Two groups of two: the best cross-group pair (10) is forbidden.
    sim = np.array([[0.0, 1.0, 10.0, 0.0],
                    [2.0, 0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0, 5.0],
                    [0.0, 0.0, 4.0, 0.0]])
    np.testing.assert_array_equal(matching.assignment(sim, groups=2), [1, 0, 3, 2])
    np.testing.assert_array_equal(matching.assignment(sim), [2, 0, 3, 1])
    with pytest.raises(ValueError, match="divisible by 3 groups"):
        matching.assignment(sim, groups=3)
    with pytest.raises(ValueError, match="non-finite"):
        matching.assignment(np.full((2, 2), np.nan))


def _inputs(n=16, seed=3):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, *SHAPE)), jnp.float32)


CASES = [("mlp", "none"), ("vgg9", "none"), ("vgg11", "group(4)"), ("resnet20", "batch")]


@pytest.mark.parametrize("name,norm,by", [  # each network and each criterion by default
    pytest.param(n, norm, by, marks=() if by == matching.BY[i % 2] else pytest.mark.slow)
    for i, (n, norm) in enumerate(CASES) for by in matching.BY])
def test_a_hidden_permutation_is_recovered_exactly(name, norm, by):
    model, a = _model(name, norm)
    spec = P.spec_for(model, a)
    hidden = P.random_permutations(spec, np.random.default_rng(7), p_sf=1.0)
    b = P.apply_permutation(spec, hidden, a)
    if by == "weights":
        found = matching.weight_matching(spec, a, b)
    else:
        found = matching.activation_matching(model, spec, a, b, _inputs())
    for k in spec.names:  # b[j] = a[hidden[j]], so the answer is hidden's inverse
        np.testing.assert_array_equal(found[k], np.argsort(hidden[k]), err_msg=k)
    aligned = matching.align(model, a, b, by=by, inputs=_inputs())
    for x, y in zip(jax.tree_util.tree_leaves(aligned), jax.tree_util.tree_leaves(a)):
        np.testing.assert_array_equal(x, y)
    # ... so averaging a with its aligned copy gives a back, where plain averaging does not.
    mean = jax.tree_util.tree_map(lambda x, y: (x + y) / 2, a, aligned)
    for x, y in zip(jax.tree_util.tree_leaves(mean), jax.tree_util.tree_leaves(a)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    x = _inputs(4, seed=9)
    naive = jax.tree_util.tree_map(lambda x, y: (x + y) / 2, a, b)
    assert not np.allclose(model.apply(naive, x), model.apply(a, x), rtol=1e-3, atol=1e-4)


def _distance(a, b):
    return float(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)
                     for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))))


@pytest.mark.parametrize("by", matching.BY)
def test_aligning_unrelated_models_keeps_the_function_and_closes_the_distance(by):
    model = models.build("vgg9", 10, width=0.25)
    a, b = random_init(model, SHAPE, seed=0), random_init(model, SHAPE, seed=1)
    aligned = matching.align(model, a, b, by=by, inputs=_inputs(32))
    x = _inputs(4, seed=9)
    out, out_aligned = np.asarray(model.apply(b, x)), np.asarray(model.apply(aligned, x))
    assert np.max(np.abs(out_aligned - out)) <= 1e-5 * np.max(np.abs(out))
    assert _distance(a, aligned) < _distance(a, b)
    if by == "weights":  # the objective weight matching ascends: sum of <a, P(b)>
        dot = lambda u, v: sum(float(np.vdot(np.asarray(p, np.float64), q)) for p, q in zip(  # noqa: E731
            jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(v)))
        assert dot(a, aligned) > dot(a, b)


def test_bad_requests_say_what_is_wrong():
    model, a = _model("mlp", "none")
    with pytest.raises(ValueError, match="'weight'"):
        matching.align(model, a, a, by="weight")
    with pytest.raises(ValueError, match="needs `inputs`"):
        matching.align(model, a, a, by="activations")
    grouped = models.build("mlp", 10, hidden=[20, 20, 20], grouped={"groups": 5, "depth": 3})
    g = models.init(grouped, jax.random.PRNGKey(0), (4, 4, 1))
    with pytest.raises(ValueError, match="grouped"):
        matching.align(grouped, g, g)


def _members(m):
    """{frozenset of (client, neuron)}: which neurons share a global one, -> its weights."""
    out = {}
    for j, assign in enumerate(m.assignments):
        for row, g in enumerate(assign):
            out.setdefault(int(g), set()).add((j, row))
    return {frozenset(v): m.weights[g] for g, v in out.items()}


def test_bbp_map_against_a_hand_solved_case():
    # Client 0's neurons e1 and e2 (times 10); client 1 holds a copy of e2 (10.2) and e3, which
    # nobody else has. Gains (sigma = sigma0 = 1, gamma = 7, J = 2): joining e2's global
    # neuron 20.2^2/3 - 10^2/2 = 86.0; e3 joining either 200/3 - 50 = 16.7; e3 opening a new
    # neuron 10^2/2 + 2 log(7/2) = 52.5: so e2's copy joins, e3 is added. Posterior means:
    # sum of members / (members + 1) (the N(0, 1) prior counts as one member).
    a = np.array([[10.0, 0, 0], [0, 10.0, 0]])
    b = np.array([[0, 10.2, 0], [0, 0, 10.0]])
    want = {frozenset({(0, 0)}): [5.0, 0, 0], frozenset({(0, 1), (1, 0)}): [0, 20.2 / 3, 0],
            frozenset({(1, 1)}): [0, 0, 5.0]}
    for seed in range(3):  # whatever order the sweeps take
        m = matching.bbp_map([a, b], rng=np.random.default_rng(seed))
        got = _members(m)
        assert set(got) == set(want) and sorted(m.counts) == [1, 1, 2]
        for k, w in want.items():
            np.testing.assert_allclose(got[k], w)
    # Swapping the clients swaps the labels only.
    swapped = _members(matching.bbp_map([b, a]))
    assert set(swapped) == {frozenset((1 - j, r) for j, r in k) for k in want}


def test_bbp_map_groups_noisy_copies_and_never_exceeds_the_total_width():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(6, 8)) * 5
    clients = [centres[rng.permutation(6)[:k]] + 0.05 * rng.normal(size=(k, 8))
               for k in (6, 5, 4, 6)]
    m = matching.bbp_map(clients, rng=np.random.default_rng(1))
    assert len(m.weights) == 6 <= sum(len(c) for c in clients)  # one global neuron per centre
    assert m.counts.sum() == sum(len(c) for c in clients)
    for c, assign in zip(clients, m.assignments):  # a client's neurons go to distinct ones
        assert len(set(assign.tolist())) == len(c)
    member = {}
    for c, assign in zip(clients, m.assignments):
        for row, g in zip(c, assign):
            member.setdefault(int(g), []).append(row)
    for rows in member.values():  # the members of a global neuron are copies of one centre
        rows = np.asarray(rows)
        assert np.max(np.abs(rows - rows.mean(0))) < 0.5
    with pytest.raises(ValueError, match="one D"):
        matching.bbp_map([np.zeros((2, 3)), np.zeros((2, 4))])


def test_bbp_map_caps_the_new_neurons_as_ibm_does():
    # IBM's pfnm.py: a client of L_j neurons against L global ones may open
    # min(L_j, max(700 - L, 1)) new ones; never so few that one of its neurons has no place.
    assert matching.new_neurons(5, 100, 700) == 5
    assert matching.new_neurons(5, 698, 700) == 2
    assert matching.new_neurons(5, 700, 700) == 1 and matching.new_neurons(5, 900, 700) == 1
    assert matching.new_neurons(5, 2, 3) == 3  # L + added must reach L_j
    assert matching.new_neurons(5, 900, None) == 5
    # Four clients of 6 unrelated neurons each: uncapped, the layer grows to 13; capped at
    # 8, after the first client each opens at most 2, then 1, then 1.
    rng = np.random.default_rng(0)
    clients = [rng.normal(size=(6, 5)) * 10 for _ in range(4)]
    free = matching.bbp_map(clients, iterations=0, cap=None)
    assert len(free.weights) == 13
    capped = matching.bbp_map(clients, iterations=0, cap=8)
    assert len(capped.weights) <= 6 + 2 + 1 + 1
    for c, assign in zip(clients, capped.assignments):
        assert len(set(assign.tolist())) == len(c)  # distinct places, all in range
        assert assign.max() < len(capped.weights)
    # Sweeps re-match a client against the others' layer: it may open one more each time.
    swept = matching.bbp_map(clients, iterations=3, cap=8, rng=np.random.default_rng(1))
    assert len(swept.weights) < len(free.weights) and swept.counts.sum() == 24
