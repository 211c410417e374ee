"""FedDBE: one local step (PRBM, MR, running mean) against numpy on a tiny linear model,
round 0 as FedAvg's, the global mean's estimation and freezing, the personal model,
communication, loop / vmap / reference agreement, options."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import fedavg, registry
from fedjax_pan.algorithms.core import ClientContext, tree_bytes
from fedjax_pan.algorithms.personal.feddbe import feddbe
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.config.defaults import default_config
from fedjax_pan.models import layers

MOMENTUM, KAPPA, LR = 0.3, 2.0, 0.1


class Tiny(nn.Module):
    """f = x A (sown as 'features'), logits = f W + b: a step can be done by hand."""

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        f = nn.Dense(4, use_bias=False, name="body")(x.reshape(x.shape[0], -1))
        return nn.Dense(3, name="head")(layers.sow(self, "features", f))


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.reference("algorithm", "feddbe")
def test_a_local_step_follows_the_formulas_by_hand():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 2, 3, 1)).astype(np.float32)
    y = np.array([0, 2, 1, 2, 0], np.int32)
    mask = np.array([1, 1, 1, 1, 0], np.float32)  # one padded example
    a = 0.3 * rng.normal(size=(6, 4))
    w, b = 0.3 * rng.normal(size=(4, 3)), 0.1 * rng.normal(size=3)
    c, r0, g = 0.2 * rng.normal(size=4), 0.5 * rng.normal(size=4), 0.5 * rng.normal(size=4)
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    variables = {"params": {"body": {"kernel": f32(a)}, "head": {"kernel": f32(w),
                                                                 "bias": f32(b)}}}
    algo = feddbe(Tiny(), client_optimizer(LR, 0.0), momentum=MOMENTUM, kl_weight=KAPPA)
    server = algo.server_init(variables)
    server = server._replace(base=server.base._replace(round=jnp.int32(1)),
                             global_mean=f32(g))
    local = algo.client_init(server, {"client_mean": f32(c)},
                             ClientContext(jax.random.PRNGKey(0), 3, 4, 0, 1, jnp.ones(3)))
    local = local._replace(running=f32(r0))  # as after earlier steps of the round
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y), "mask": jnp.asarray(mask)}
    new, metrics = algo.client_step(local, batch, server)

    # numpy, float64, over the 4 real examples.
    xs, ys = x[:4].reshape(4, -1).astype(np.float64), y[:4]
    feats = xs @ a
    p = _softmax((feats + c) @ w + b)
    onehot = np.eye(3)[ys]
    ce = -np.log(p[np.arange(4), ys]).sum()
    running = (1 - MOMENTUM) * r0 + MOMENTUM * feats.mean(axis=0)
    reg = np.mean(0.5 * (running - g) ** 2)
    d_logits = (p - onehot) / 4  # d mean-CE / d logits
    grad_a = xs.T @ (d_logits @ w.T) + KAPPA * MOMENTUM / 4 * np.outer(
        xs.mean(axis=0), running - g)
    grad_w = (feats + c).T @ d_logits
    grad_b = d_logits.sum(axis=0)
    grad_c = w @ d_logits.sum(axis=0)
    np.testing.assert_allclose(float(metrics["loss_sum"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["mean_reg_sum"]), 4 * reg, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new.running), running, rtol=1e-5, atol=1e-6)
    p_new = new.train.params
    np.testing.assert_allclose(np.asarray(p_new["model"]["body"]["kernel"]), a - LR * grad_a,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(p_new["model"]["head"]["kernel"]), w - LR * grad_w,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(p_new["model"]["head"]["bias"]), b - LR * grad_b,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(p_new["client_mean"]), c - LR * grad_c,
                               rtol=1e-5, atol=1e-6)
    # Before a global mean exists (round 0) neither the PRBM nor the MR applies.
    off = algo.client_init(algo.server_init(variables), {"client_mean": f32(c)},
                           ClientContext(jax.random.PRNGKey(0), 3, 4, 0, 0, jnp.ones(3)))
    off, metrics = algo.client_step(off, batch, algo.server_init(variables))
    np.testing.assert_array_equal(off.train.params["client_mean"], f32(c))
    np.testing.assert_allclose(float(metrics["loss_sum"]),
                               -np.log(_softmax(feats @ w + b)[np.arange(4), ys]).sum(),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(off.running), MOMENTUM * feats.mean(axis=0),
                               rtol=1e-5, atol=1e-6)
    # The personal model h(f + c) is the architecture with head bias b + c W.
    mine = algo.personal_variables(server, {"client_mean": f32(c)})
    np.testing.assert_allclose(np.asarray(Tiny().apply(mine, jnp.asarray(x))),
                               (x.reshape(5, -1) @ a + c) @ w + b, rtol=1e-5, atol=1e-6)




@pytest.mark.slow
@pytest.mark.parametrize("mean_rounds", [1, 2])
def test_round_zero_is_fedavg_and_the_global_mean_is_estimated_then_frozen(mean_rounds):
    cd, model, variables, tx = pfl_setup()
    algo = feddbe(model, tx, kl_weight=1.0, mean_rounds=mean_rounds)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=3, on_host=True)
    _, avg, _ = pfl_rounds(fedavg(model, tx), cd, variables, rounds=1, on_host=True)
    assert max_rel_err(states[1].server.base.params, avg[1].server.params) < 1e-6
    # Round 0: no PRBM yet; later rounds' clients learn theirs.
    assert np.all(np.asarray(states[1].client_states["client_mean"]) == 0)
    means = np.asarray(states[3].client_states["client_mean"])
    later = set(int(k) for r in (1, 2) for k in sim.sample(r))
    for k in range(cd.num_clients):
        assert (np.max(np.abs(means[k])) > 0) == (k in later), k
    g = [np.asarray(s.server.global_mean) for s in states]
    assert np.all(g[0] == 0) and np.max(np.abs(g[1])) > 1e-3
    assert (np.max(np.abs(g[2] - g[1])) > 0) == (mean_rounds == 2)
    np.testing.assert_array_equal(g[3], g[2])  # frozen after the estimation rounds
    # Downloads: the model, plus the global mean from round 1; uploads: rbar while
    # estimated.
    m, model_bytes, d = len(sim.sample(0)), tree_bytes(variables), g[0].size
    assert [s["download_bytes"] for s in stats] == [
        m * model_bytes, m * (model_bytes + 4 * d), m * (model_bytes + 4 * d)]
    up = [s["upload_bytes"] for s in stats]
    assert up[0] - up[2] == m * 4 * d and up[1] == up[0 if mean_rounds == 2 else 2]
    # Clients evaluate the global model with their own head bias.
    mine = sim.personal_evaluation(states[3])
    head = states[3].server.base.params["head"]
    want = head["bias"][None] + means @ np.asarray(head["kernel"])
    np.testing.assert_allclose(np.asarray(mine["params"]["head"]["bias"]), want, rtol=1e-6)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = feddbe(model, tx, kl_weight=1.0, mean_rounds=2)
    sim, loop, ref = strategies_agree(algo, cd, variables, rounds=3)[:3]


def test_options_are_checked():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match=r"feddbe.momentum must be a number in \[0, 1\], got 1.5"):
        feddbe(model, tx, momentum=1.5)
    with pytest.raises(ValueError, match=r"feddbe.kl_weight must be a number in .*got -1"):
        feddbe(model, tx, kl_weight=-1)
    with pytest.raises(ValueError, match=r"feddbe.mean_rounds must be an integer in \[1, .*got 0"):
        feddbe(model, tx, mean_rounds=0)
    cfg = default_config()
    cfg.algorithm = "feddbe"
    cfg.feddbe.kl_weight = 0.5
    algo = registry.from_config(model, cfg)
    assert algo.personal_variables is not None
