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


@pytest.mark.parametrize("kind,length", [("rounds", 10), ("steps", 3), ("none", 3),
                                         ("rounds", 0)])
def test_warmup_scales_each_step_as_pytorch_with_a_changed_lr(kind, length):
    """Round r, local step t: lr x min((r + 1) / L, 1) ('rounds') or lr x min((t + 1) / L,
    1) ('steps'), the momentum buffer unscaled, as PyTorch's SGD after setting its lr."""
    lr, m = 0.1, 0.9
    tx = local.client_optimizer(lr, m, warmup=kind, warmup_length=length)
    grads = [np.array([3.0, 4.0]), np.array([0.1, -0.2]), np.array([1.0, 1.0]),
             np.array([-2.0, 0.5]), np.array([0.3, 0.3])]
    for r in (0, 4, 9, 30):
        p = jnp.asarray([1.0, -2.0])
        state = local.start_round(tx.init(p), r)
        sched = local.schedule(tx, r)
        p_hand, buf = np.array([1.0, -2.0]), np.zeros(2)
        for t, g in enumerate(grads):
            factor = 1.0
            if kind == "rounds" and length:
                factor = min((r + 1) / length, 1.0)
            if kind == "steps":
                factor = min((t + 1) / length, 1.0)
            assert float(local.warmup_factor(state)) == pytest.approx(factor)
            assert float(local.warmup_factor(sched)) == pytest.approx(factor)
            upd, state = tx.update(jnp.asarray(g), state, p)
            p = optax.apply_updates(p, upd)
            sched = local.tick(sched)
            buf = m * buf + g
            p_hand = p_hand - lr * factor * buf
            np.testing.assert_allclose(np.asarray(p), p_hand, rtol=1e-6, atol=1e-6)


def test_unknown_warmup_is_refused():
    with pytest.raises(ValueError, match="'linear'"):
        local.client_optimizer(0.1, warmup="linear", warmup_length=3)


def test_masked_cross_entropy_ignores_padding():
    logits = jnp.asarray([[2.0, 0.0], [0.0, 2.0], [5.0, -5.0]])
    labels = jnp.asarray([0, 0, 1])
    mask = jnp.asarray([1.0, 1.0, 0.0])
    want = np.log1p(np.exp(-2.0)) + np.log1p(np.exp(2.0))
    assert float(local.masked_cross_entropy(logits, labels, mask)) == pytest.approx(want, rel=1e-6)


def test_split_variables():
    params, rest = local.split_variables({"params": 1, "batch_stats": 2})
    assert params == 1 and rest == {"batch_stats": 2}
