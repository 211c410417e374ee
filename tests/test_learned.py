"""FAIR's auto-weighted aggregation (`aggregation.learned`): `learn_weights` against a NumPy
float64 gradient descent whose gradient is taken by central differences, absent slots,
a bad model losing weight, and the rule from a config."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan.algorithms import aggregation
from fedjax_pan.algorithms.aggregation import learned, robust
from fedjax_pan.config import schema
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine.protocol import Aggregator, Arrivals
from fedjax_pan.errors import ConfigError

DEFAULTS = aggregation.RULES["auto_weights"].options["auto_weights"]


class Hidden(nn.Module):
    """One tanh hidden layer: the public loss is not convex in the mixing weights."""

    @nn.compact
    def __call__(self, x, train=False):
        h = jnp.tanh(nn.Dense(5)(x.reshape(x.shape[0], -1)))
        return nn.Dense(3)(h)


def _public(n=11, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 2, 2, 1)).astype(np.float32), rng.integers(0, 3, size=n)


def _stack(trees):
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *trees)


def _models(count, seed=1):
    x, _ = _public()
    return _stack([Hidden().init(jax.random.PRNGKey(seed + i), x[:1]) for i in range(count)])


def _numpy_loss(models, alpha, x, y):
    """Float64 mean cross-entropy of `Hidden` with every leaf mixed by alpha."""
    p = {k: {n: np.tensordot(alpha, np.asarray(v, np.float64), axes=1)
             for n, v in layer.items()} for k, layer in models["params"].items()}
    h = np.tanh(x.reshape(len(x), -1) @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    z = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
    z = z - z.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return -logp[np.arange(len(y)), y].mean()


def _numpy_learn(models, weights, x, y, steps, lr, eps=1e-6):
    softmax = lambda t: np.exp(t - t.max()) / np.exp(t - t.max()).sum()  # noqa: E731
    theta = np.log(np.asarray(weights, np.float64))
    for _ in range(steps):
        grad = np.zeros_like(theta)
        for i in range(len(theta)):
            e = np.zeros_like(theta)
            e[i] = eps
            grad[i] = (_numpy_loss(models, softmax(theta + e), x, y)
                       - _numpy_loss(models, softmax(theta - e), x, y)) / (2 * eps)
        theta = theta - lr * grad
    return softmax(theta)


def _loss_fn(x, y, batch_size=4):  # batches 4, 4, 3 (+1 masked): the scorer's scan
    score = robust.public_scorer(Hidden(), x, y, batch_size=batch_size)
    return lambda variables: score(variables)["loss"]


@pytest.mark.reference("aggregation", "auto_weights")
def test_learn_weights_is_gradient_descent_on_the_public_loss():
    x, y = _public()
    models = _models(4)
    weights = jnp.asarray([0.1, 0.2, 0.3, 0.4])
    got = jax.jit(learned.learn_weights, static_argnums=(2, 3, 4))(
        models, weights, _loss_fn(x, y), 6, 2.0)
    want = _numpy_learn(models, weights, x, y, 6, 2.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
    assert np.abs(want - np.asarray(weights)).max() > 0.02  # the weights did move
    assert _numpy_loss(models, want, x, y) < _numpy_loss(models, np.asarray(weights), x, y)
    # The rule mixes every leaf with the learned alpha.
    mixed = learned.auto_weights(6, 2.0, robust.public_scorer(Hidden(), x, y, 4)).finalize(
        models, weights, None)
    np.testing.assert_allclose(mixed["params"]["Dense_1"]["kernel"],
                               np.tensordot(want, models["params"]["Dense_1"]["kernel"], 1),
                               atol=1e-4)


def test_absent_slots_get_weight_0_and_change_nothing():
    x, y = _public()
    models = _models(4)
    weights = jnp.asarray([0.1, 0.2, 0.3, 0.4])
    # Slots 1 and 4 hold no model this round: weight 0 and anything (here huge values).
    slots = jax.tree_util.tree_map(
        lambda m: jnp.concatenate([m[:1], jnp.full((1,) + m.shape[1:], 1e6), m[1:3],
                                   jnp.full((1,) + m.shape[1:], -1e6), m[3:]]), models)
    w_slots = jnp.asarray([0.1, 0.0, 0.2, 0.3, 0.0, 0.4])
    loss_fn = _loss_fn(x, y)
    alone = learned.learn_weights(models, weights, loss_fn, 6, 2.0)
    alpha = learned.learn_weights(slots, w_slots, loss_fn, 6, 2.0)
    assert float(alpha[1]) == 0.0 and float(alpha[4]) == 0.0
    np.testing.assert_allclose(alpha[jnp.asarray([0, 2, 3, 5])], alone, rtol=1e-5, atol=1e-7)
    rule = learned.auto_weights(6, 2.0, robust.public_scorer(Hidden(), x, y, 4))
    np.testing.assert_allclose(rule.finalize(slots, w_slots)["params"]["Dense_0"]["kernel"],
                               rule.finalize(models, weights)["params"]["Dense_0"]["kernel"],
                               rtol=1e-5, atol=1e-6)


def _trained(x, y, seed, steps=150):
    """A softmax-regression model (Dense(3)) trained by full-batch gradient descent."""
    model = nn.Dense(3)
    flat = x.reshape(len(x), -1)
    params = model.init(jax.random.PRNGKey(seed), flat[:1])

    def loss(p):
        logp = jax.nn.log_softmax(model.apply(p, flat))
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(y)[:, None], axis=1))
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda a, g: a - 0.5 * g, p,
                                                    jax.grad(loss)(p)))
    for _ in range(steps):
        params = step(params)
    return params


class Linear(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("bad", ["shuffled_labels", "sign_flip"])
def test_a_bad_model_loses_weight_and_the_mix_beats_the_mean(bad):
    # Three classes around separated centres; three clean clients train on their own 60
    # examples, the fourth on shuffled labels, or sends a clean model sign-flipped.
    rng = np.random.default_rng(0)
    centres = 2.0 * rng.normal(size=(3, 4))
    y = rng.integers(0, 3, size=340)
    x = (centres[y] + rng.normal(size=(340, 4))).astype(np.float32).reshape(340, 2, 2, 1)
    clean = [_trained(x[60 * i:60 * i + 60], y[60 * i:60 * i + 60], i) for i in range(3)]
    if bad == "shuffled_labels":
        worst = _trained(x[180:240], rng.permutation(y[180:240]), 3)
    else:
        worst = jax.tree_util.tree_map(lambda a: -a, clean[0])
    models = _stack([{"params": {"Dense_0": m["params"]}} for m in clean + [worst]])
    public_x, public_y = x[240:], y[240:]
    score = robust.public_scorer(Linear(), public_x, public_y)
    weights = jnp.full(4, 0.25)
    alpha = learned.learn_weights(models, weights, lambda v: score(v)["loss"],
                                  DEFAULTS["steps"], DEFAULTS["lr"])
    assert float(alpha[3]) < 0.25 and float(alpha[3]) < float(jnp.min(alpha[:3]))
    mean = score(learned.mix(models, weights))["loss"]
    assert float(score(learned.mix(models, alpha))["loss"]) < float(mean)


def test_the_rule_refuses_no_steps_and_builds_from_a_config():
    cfg = default_config()
    cfg.aggregation.rule = "auto_weights"
    schema.validate(cfg)
    assert (cfg.aggregation.auto_weights.steps, cfg.aggregation.auto_weights.lr) == (10, 1.0)
    cfg.aggregation.auto_weights.steps = 0
    with pytest.raises(ConfigError, match=r"config\.aggregation\.auto_weights\.steps must be"):
        schema.validate(cfg)
    with pytest.raises(ValueError, match="steps >= 1"):
        learned.auto_weights(0, 1.0, lambda v: {"loss": jnp.zeros(())})
    cfg.aggregation.auto_weights.steps = 3
    x, y = _public()
    rule = aggregation.from_config(cfg, Hidden(), x, y)
    assert isinstance(rule, Aggregator) and rule.stacked and rule.space == "model"
    models = _models(3)
    weights = jnp.full(3, 1 / 3)
    arrivals = Arrivals(jnp.zeros(3, jnp.int32), {}, jnp.int32(0),
                        jax.tree_util.tree_map(lambda m: m[0], models))
    got = jax.jit(rule.finalize)(models, weights, arrivals)
    alpha = learned.learn_weights(models, weights, _loss_fn(x, y, 1000), 3, 1.0)
    np.testing.assert_allclose(got["params"]["Dense_0"]["bias"],
                               learned.mix(models, alpha)["params"]["Dense_0"]["bias"],
                               rtol=1e-5, atol=1e-6)
    # `report` is finalize and the learned weights from one descent.
    mixed, found = jax.jit(rule.report)(models, weights, arrivals)
    np.testing.assert_allclose(mixed["params"]["Dense_0"]["bias"],
                               got["params"]["Dense_0"]["bias"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(found["weights"], alpha, rtol=1e-5, atol=1e-6)
    # apply=False reports the learned weights and mixes with the round's own.
    plain = learned.auto_weights(3, 1.0, robust.public_scorer(Hidden(), x, y), apply=False)
    mixed, found = jax.jit(plain.report)(models, weights, arrivals)
    np.testing.assert_allclose(mixed["params"]["Dense_0"]["bias"],
                               learned.mix(models, weights)["params"]["Dense_0"]["bias"],
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(found["weights"], alpha, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_one_round_of_fedavg_from_a_config():
    from fedjax_pan.run import experiment
    from test_experiment import config
    exp = experiment.build(config(rounds=1, aggregation__rule="auto_weights",
                                  dataset__public_size=200))
    state, stats = exp.simulation.round(exp.simulation.init(exp.variables))
    assert np.isfinite(stats["train_loss"])
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(state.server))


def test_a_step_with_a_gradient_that_is_not_finite_is_skipped():
    # sqrt of a negative mix: the loss and its gradient are NaN at every theta, so no step
    # is taken and alpha stays the round's weights, normalised.
    models = {"w": jnp.asarray([[-1.0, -2.0], [-3.0, -1.0], [-2.0, -2.0]])}
    weights = jnp.asarray([1.0, 2.0, 1.0])
    alpha = learned.learn_weights(models, weights, lambda v: jnp.sum(jnp.sqrt(v["w"])), 5, 1.0)
    np.testing.assert_allclose(np.asarray(alpha), [0.25, 0.5, 0.25], rtol=1e-6)
