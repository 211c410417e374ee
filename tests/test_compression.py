"""Transforms of what a client sends: each against its definition (top-k's kept set, the
grids of QSGD and b-bit quantisation, the scaled sign), unbiasedness over many keys,
error feedback's conservation, and every format's bytes worked out by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan.algorithms.uploads import compression as comp

KEY = jax.random.PRNGKey(0)


def _leaf(d=1000, seed=0, shape=None):
    x = np.random.default_rng(seed).normal(size=d).astype(np.float32)
    return jnp.asarray(x.reshape(shape or (d,)))


def _run(t, x, state=None, key=KEY, reference=None):
    return comp.apply(t, x, state, key, reference)


@pytest.mark.reference("compression", "top_k", "magnitude_mask")
def test_top_k_keeps_exactly_the_k_largest_magnitudes_of_each_leaf():
    tree = {"a": _leaf(1000, 1, (40, 25)), "b": _leaf(37, 2)}
    out, _ = _run(comp.top_k(0.1), tree)
    for name, k in (("a", 100), ("b", 4)):  # ceil(0.1 d)
        x, y = np.asarray(tree[name]).ravel(), np.asarray(out[name]).ravel()
        want = np.argsort(-np.abs(x))[:k]
        assert set(np.flatnonzero(y)) == set(want)
        np.testing.assert_array_equal(y[want], x[want])


def test_top_k_of_a_sparse_message_keeps_k_of_the_values_sent():
    x = _leaf(1000)
    t = comp.chain(comp.top_k(0.5), comp.top_k(0.1))  # 500, then 50 of them
    out, _ = _run(t, x)
    assert np.count_nonzero(np.asarray(out)) == 50
    assert comp.layouts(t, x).count == 50


@pytest.mark.reference("compression", "importance_mask")
def test_importance_scores_are_the_update_times_the_weight():
    w = jnp.asarray([1.0, -2.0, 0.5, 3.0])
    ref = jnp.asarray([0.0, -2.5, -1.0, 3.1])  # |(w - ref) w| = 1, 1, 0.75, 0.3
    out, _ = _run(comp.top_k(0.5, "importance"), w, reference=ref)
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.0, 0.0])
    by_magnitude, _ = _run(comp.top_k(0.5), w)
    np.testing.assert_array_equal(by_magnitude, [0.0, -2.0, 0.0, 3.0])


@pytest.mark.reference("compression", "random_k")
def test_random_k_keeps_k_positions_from_the_key_and_unbiased_is_unbiased():
    x = _leaf(200)
    a, _ = _run(comp.random_k(0.1), x, key=jax.random.PRNGKey(1))
    b, _ = _run(comp.random_k(0.1), x, key=jax.random.PRNGKey(1))
    c, _ = _run(comp.random_k(0.1), x, key=jax.random.PRNGKey(2))
    np.testing.assert_array_equal(a, b)
    assert np.count_nonzero(np.asarray(a)) == 20 and not np.array_equal(a, c)
    kept = np.flatnonzero(np.asarray(a))
    np.testing.assert_array_equal(np.asarray(a)[kept], np.asarray(x)[kept])
    t = comp.random_k(0.1, unbiased=True)
    keys = jax.random.split(KEY, 4000)
    # One key at a time (lax.map): a vmap would hold 4,000 of the select's histograms.
    mean = jax.jit(lambda ks: jax.lax.map(lambda k: _run(t, x, key=k)[0], ks))(keys).mean(0)
    # Each coordinate is 10 x_i with probability 0.1: std of the mean 3 |x_i| / sqrt(4000).
    assert np.all(np.abs(np.asarray(mean - x)) <= 6 * 3 * np.abs(np.asarray(x)) / np.sqrt(4000))


@pytest.mark.reference("compression", "error_feedback")
def test_error_feedback_conserves_the_sum_over_rounds():
    t = comp.error_feedback(comp.top_k(0.05))
    xs = [_leaf(500, s) for s in range(4)]
    state = t.init(xs[0])
    np.testing.assert_array_equal(state.residual, np.zeros(500))
    for r, x in enumerate(xs):
        old = state.residual
        sent, state = _run(t, x, state, key=jax.random.PRNGKey(r))
        # sent + new residual = input + old residual (to float32 rounding of one add).
        np.testing.assert_allclose(sent + state.residual, x + old, rtol=0, atol=1e-6)
        assert np.count_nonzero(np.asarray(sent)) == 25
    assert np.abs(np.asarray(state.residual)).sum() > 0


@pytest.mark.reference("compression", "qsgd")
def test_qsgd_is_unbiased_and_lands_on_its_grid():
    x = _leaf(64, 3)
    s = 4
    t = comp.qsgd(s)
    keys = jax.random.split(KEY, 20000)
    samples = jax.vmap(lambda k: _run(t, x, key=k)[0])(keys)
    norm = float(jnp.linalg.norm(x))
    levels = np.asarray(samples) / norm * s
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)  # norm * l / s
    assert np.all(np.sign(np.asarray(samples)) * np.sign(np.asarray(x)) >= 0)
    # Var of one coordinate <= (norm / s)^2 / 4: the mean of N is within 5 sigma.
    tol = 5 * (norm / s) / 2 / np.sqrt(len(keys))
    assert np.max(np.abs(np.asarray(samples.mean(0) - x))) <= tol
    zero, _ = _run(t, jnp.zeros(8))
    np.testing.assert_array_equal(zero, np.zeros(8))


@pytest.mark.reference("compression", "sign")
def test_scaled_sign_by_hand():
    x = jnp.asarray([0.5, -1.5, 2.0, -1.0])
    out, _ = _run(comp.sign(), x)
    np.testing.assert_allclose(out, [1.25, -1.25, 1.25, -1.25])  # mean |x| = 1.25
    sparse, _ = _run(comp.chain(comp.top_k(0.5), comp.sign()), x)
    np.testing.assert_allclose(sparse, [0.0, -1.75, 1.75, 0.0])  # scale over the 2 sent


@pytest.mark.reference("compression", "quantize")
def test_uniform_quantisation_grid_nearest_and_unbiased():
    x = jnp.asarray([-1.0, -0.2, 0.1, 0.7, 2.0])
    near, _ = _run(comp.quantize(2, stochastic=False), x)  # levels -1, 0, 1, 2
    np.testing.assert_allclose(near, [-1.0, 0.0, 0.0, 1.0, 2.0])
    t = comp.quantize(2)
    samples = jax.vmap(lambda k: _run(t, x, key=k)[0])(jax.random.split(KEY, 20000))
    assert set(np.unique(np.asarray(samples)).tolist()) <= {-1.0, 0.0, 1.0, 2.0}
    np.testing.assert_allclose(samples.mean(0), x, atol=5 * 0.5 / np.sqrt(20000))


@pytest.mark.parametrize("transform, want", [
    (comp.identity(), 4000),
    (comp.top_k(0.1), 400 + 125),  # 100 values; bitmap 125 < 400 index bytes
    (comp.top_k(0.01), 40 + 40),  # 10 values; 40 index bytes < 125
    (comp.random_k(0.1), 400 + 4),  # values and the seed
    (comp.qsgd(16), 4 + 750),  # norm; 1000 x (1 + ceil(log2 17)) bits
    (comp.qsgd(1), 4 + 250),  # 2 bits a value
    (comp.sign(), 4 + 125),  # scale; 1000 bits
    (comp.quantize(8), 8 + 1000),  # min and max; 8 bits a value
    (comp.chain(comp.top_k(0.1), comp.qsgd(16)), 125 + 75 + 4),
    (comp.chain(comp.top_k(0.1), comp.quantize(4)), 125 + 50 + 8),
    (comp.error_feedback(comp.sign()), 129),
])
def test_bytes_by_hand(transform, want):
    assert comp.message_bytes(transform, jnp.zeros(1000)) == want
    tree = {"w": jnp.zeros((10, 100)), "b": jnp.zeros(1000)}
    assert comp.message_bytes(transform, tree) == 2 * want


def test_bytes_of_odd_sizes_round_up():
    x = jax.ShapeDtypeStruct((13,), jnp.float32)
    assert comp.message_bytes(comp.sign(), x) == math.ceil(13 / 8) + 4
    assert comp.message_bytes(comp.top_k(0.5), x) == 7 * 4 + 2  # 7 kept; 2-byte bitmap
    assert comp.message_bytes(comp.qsgd(2), x) == math.ceil(13 * 3 / 8) + 4


def test_clip_by_norm():
    x = {"a": jnp.asarray([3.0, 0.0]), "b": jnp.asarray([4.0])}
    clipped, norm = comp.clip_by_norm(x, 1.0)
    assert float(norm) == 5.0
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0])
    np.testing.assert_allclose(clipped["b"], [0.8])
    same, _ = comp.clip_by_norm(x, 10.0)
    np.testing.assert_array_equal(same["a"], x["a"])


def test_from_name_and_bad_values():
    assert comp.from_name("top_k", 0.1, feedback=True).name == "ef(top_k(0.1))"
    assert comp.from_name("qsgd", levels=4, quantize_bits=0).name == "qsgd(4)"
    assert comp.from_name("random_k", 0.2, quantize_bits=4).name == "random_k(0.2) + quantize(4)"
    with pytest.raises(ValueError, match="unknown compression 'topk'"):
        comp.from_name("topk")
    with pytest.raises(ValueError, match="ratio in"):
        comp.top_k(0.0)
    with pytest.raises(ValueError, match="levels >= 1"):
        comp.qsgd(0)


def test_top_k_mask_equals_a_stable_sort_with_ties_and_edge_values():
    rng = np.random.default_rng(5)
    big = comp.SMALL_LEAF + 1000  # the radix select's path; the others lax.top_k's
    cases = [rng.normal(size=3000) ** 2, rng.normal(size=big) ** 2,
             rng.integers(0, 5, size=2000).astype(np.float64),  # many ties
             rng.integers(0, 5, size=big).astype(np.float64),
             np.concatenate([[np.inf, 0.0, 1e-38, 3e38], rng.random(60)]),
             np.concatenate([[np.inf, 0.0, 1e-38, 3e38], rng.random(big)]),
             np.zeros(50), np.zeros(big)]
    for scores in cases:
        scores = scores.astype(np.float32)
        for k in (1, 7, len(scores) // 10, len(scores) - 1, len(scores)):
            got = np.asarray(comp.top_k_mask(jnp.asarray(scores), k))
            want = np.zeros(len(scores), bool)
            want[np.argsort(-scores, kind="stable")[:k]] = True
            np.testing.assert_array_equal(got, want)
