"""Neuron alignment: the assignment against hand-solved cases, hidden permutations recovered
exactly, and alignment of unrelated models keeping their function while bringing them closer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan import matching, models
from fedjax_pan import permutation as P
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


@pytest.mark.parametrize("by", matching.BY)
@pytest.mark.parametrize("name,norm", CASES)
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
    a = models.init(model, jax.random.PRNGKey(0), SHAPE)
    b = models.init(model, jax.random.PRNGKey(1), SHAPE)
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
