"""Local optimiser and warm-up against PyTorch-style SGD written out by hand."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_pan.algorithms import local


def test_client_optimizer_is_pytorch_sgd():
    """clip grad norm -> + wd * p -> momentum buffer b = m b + g -> p -= lr b."""
    lr, m, wd, clip = 0.1, 0.9, 0.01, 1.0
    tx = local.client_optimizer(lr, m, wd, clip)
    p = jnp.asarray([1.0, -2.0])
    state = tx.init(p)
    p_hand, buf = np.array([1.0, -2.0]), np.zeros(2)
    for g in [np.array([3.0, 4.0]), np.array([0.1, -0.2])]:
        upd, state = tx.update(jnp.asarray(g), state, p)
        p = optax.apply_updates(p, upd)
        g = g * min(1.0, clip / np.linalg.norm(g)) + wd * p_hand
        buf = m * buf + g
        p_hand = p_hand - lr * buf
        np.testing.assert_allclose(np.asarray(p), p_hand, rtol=1e-6)


@pytest.mark.parametrize("r,want", [(0, 0.1), (4, 0.5), (9, 1.0), (30, 1.0)])
def test_round_warmup(r, want):
    assert float(local.round_lr_scale(jnp.int32(r), "rounds", 10)) == pytest.approx(want)
    assert float(local.round_lr_scale(jnp.int32(r), "steps", 10)) == 1.0


def test_masked_cross_entropy_ignores_padding():
    logits = jnp.asarray([[2.0, 0.0], [0.0, 2.0], [5.0, -5.0]])
    labels = jnp.asarray([0, 0, 1])
    mask = jnp.asarray([1.0, 1.0, 0.0])
    want = np.log1p(np.exp(-2.0)) + np.log1p(np.exp(2.0))
    assert float(local.masked_cross_entropy(logits, labels, mask)) == pytest.approx(want, rel=1e-6)


def test_split_variables():
    params, rest = local.split_variables({"params": 1, "batch_stats": 2})
    assert params == 1 and rest == {"batch_stats": 2}
