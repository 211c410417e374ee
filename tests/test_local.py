"""Local optimiser and warm-up against PyTorch-style SGD written out by hand."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_pan import models
from fedjax_pan.algorithms import local
from fedjax_pan.config.defaults import default_config


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



class _Linear(nn.Module):
    """A linear model called as the engine calls one (no 'features' sown)."""

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        return nn.Dense(2)(x.reshape(x.shape[0], -1))


def test_apply_gradients_is_sgd_steps_update():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    model = _Linear()
    tx = local.client_optimizer(0.1, 0.9)
    state = local.init_local(tx, model.init(jax.random.PRNGKey(0), x), 0)
    batch = {"x": x, "y": jnp.asarray([0, 1, 1, 0]), "mask": jnp.ones(4)}
    stepped, _ = local.sgd_step(model, tx, state, batch)
    grads = jax.grad(lambda p: local.mean_loss(model, p, {}, batch)[0])(state.params)
    by_hand = local.apply_gradients(tx, state, grads, {})
    for a, b in zip(jax.tree_util.tree_leaves(stepped), jax.tree_util.tree_leaves(by_hand)):
        np.testing.assert_array_equal(a, b)
    assert local.model_variables(by_hand) == {"params": by_hand.params}


def test_with_features_reads_the_sown_representation_and_names_a_model_without_one():
    model = models.build("mlp", 10, hidden=[8])
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    x = jnp.ones((2, 6, 6, 1))
    logits, features = local.WithFeatures(model).apply(variables, x)
    _, state = model.apply(variables, x, mutable=["intermediates"])
    np.testing.assert_array_equal(features, state["intermediates"][local.FEATURES])
    np.testing.assert_array_equal(logits, model.apply(variables, x))
    bare = _Linear()
    with pytest.raises(ValueError, match=r"'features' .*_Linear sows none"):
        local.WithFeatures(bare).apply(bare.init(jax.random.PRNGKey(0), x), x)


def test_epochs_share_is_the_options_share_of_local_epochs():
    cfg = default_config()
    cfg.local.epochs, cfg.fedrep.head_epochs = 2.0, 0.5
    share = local.epochs_share("fedrep", "head_epochs", "the head's epochs are")
    assert share(cfg) == 0.25
    cfg.fedrep.head_epochs = 2.0
    with pytest.raises(ValueError, match=r"fedrep.head_epochs .*local.epochs \(2\).*got 2"):
        share(cfg)
