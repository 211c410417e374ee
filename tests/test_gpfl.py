"""GPFL: the CoV, the GCE's cosine loss and the alignment norm against numpy, a local
step's loss and weight decay, the server's state over rounds, the personal model GNet
scores, loop/vmap/reference agreement, options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.gpfl import (GNet, batch_norm2, conditional_inputs, cov_apply,
                                        gce_loss_sum, gpfl, init_cov)
from fedjax_pan.algorithms.local import WithFeatures


def _np_ln(z):
    return (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-5)


def _np_cov(cov, f, c):
    def branch(p):
        return _np_ln(np.maximum(c @ p["kernel"] + p["bias"], 0)) * p["scale"] + p["shift"]
    return np.maximum(f * (1 + branch(cov["gamma"])) + branch(cov["beta"]), 0)


def _np(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


@pytest.mark.reference("algorithm", "gpfl")
def test_pieces_match_numpy():
    rng = np.random.default_rng(0)
    b, d, c = 6, 5, 4
    cov = _np(init_cov(jax.random.PRNGKey(2), d))
    cov["beta"]["shift"] = (0.3 * rng.normal(size=d)).astype(np.float32)
    f = np.maximum(rng.normal(size=(b, d)), 0).astype(np.float32)
    cond = rng.normal(size=d).astype(np.float32)
    np.testing.assert_allclose(cov_apply(cov, jnp.asarray(f), jnp.asarray(cond)),
                               _np_cov(cov, f, cond), rtol=1e-5, atol=1e-6)
    gce = rng.normal(size=(c, d)).astype(np.float32)
    share = np.array([0.5, 0.25, 0.25, 0.0], np.float32)
    g, p = conditional_inputs(jnp.asarray(gce), jnp.asarray(share))
    np.testing.assert_allclose(g, gce.mean(0), rtol=1e-6)
    np.testing.assert_allclose(p, 0.5 * gce[0] + 0.25 * gce[1] + 0.25 * gce[2], rtol=1e-5)
    y = np.array([0, 1, 2, 3, 1, 0])
    mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
    cos = (f / np.linalg.norm(f, axis=1, keepdims=True)) @ \
        (gce / np.linalg.norm(gce, axis=1, keepdims=True)).T
    logp = cos - np.log(np.exp(cos).sum(1, keepdims=True))
    want = -sum(logp[i, y[i]] for i in range(4))
    got = float(gce_loss_sum(jnp.asarray(f), jnp.asarray(gce), jnp.asarray(y),
                             jnp.asarray(mask)))
    assert abs(got - want) < 1e-5
    diff = f - gce[y]
    assert abs(float(batch_norm2(jnp.asarray(diff), jnp.asarray(mask))) -
               np.linalg.norm(diff[:4])) < 1e-5
    grad = jax.grad(lambda x: batch_norm2(x, jnp.ones(2)))(jnp.zeros((2, 3)))
    assert np.all(np.isfinite(grad))


@pytest.mark.slow
def test_a_step_follows_the_objective_and_decays_gce_and_cov():
    cd, model, variables, tx = pfl_setup()
    import optax
    lr, lam, mu = 0.1, 0.7, 0.3
    algo = gpfl(model, optax.sgd(lr), lam=lam, mu=mu, seed=1)
    server = algo.server_init(variables)
    server = server._replace(round=jnp.int32(1))  # conditional inputs from gce_prev
    counts = jnp.asarray(np.bincount(np.asarray(cd.labels[:27]), minlength=10), jnp.float32)
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 4, 27, 0, 1, counts))
    share = np.asarray(counts) / float(counts.sum())
    gce = np.asarray(server.gce_prev)
    np.testing.assert_allclose(local.personal, share @ gce, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(local.generic, gce.mean(0), rtol=1e-5, atol=1e-6)
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    net = WithFeatures(model)
    y = np.asarray(batch["y"])

    def objective(params):  # the three terms written out again, independently
        _, f = net.apply({"params": params["model"]}, batch["x"], train=True)
        h = params["model"]["head"]
        out = cov_apply(params["cov"], f, local.personal) @ h["kernel"] + h["bias"]
        ce = -jnp.mean(jax.nn.log_softmax(out)[jnp.arange(8), y])
        fg = cov_apply(params["cov"], f, local.generic)
        cos = (fg / jnp.linalg.norm(fg, axis=1, keepdims=True)) @ \
            (params["gce"] / jnp.linalg.norm(params["gce"], axis=1, keepdims=True)).T
        gl = -jnp.mean(jax.nn.log_softmax(cos)[jnp.arange(8), y])
        return ce + gl + lam * jnp.sqrt(jnp.sum((fg - server.gce[y]) ** 2))
    params = local.train.params
    g = jax.grad(objective)(params)
    want = jax.tree_util.tree_map(lambda w, gw: w - lr * gw, params, g)
    for name in ("gce", "cov"):
        want[name] = jax.tree_util.tree_map(lambda w, gw: w - lr * (gw + mu * w),
                                            params[name], g[name])
    new, metrics = algo.client_step(local, batch, server)
    assert max_rel_err(new.train.params, want) < 1e-5
    assert max_rel_err(new.train.params, params) > 1e-3


@pytest.mark.slow
def test_rounds_keep_heads_average_the_rest_and_score_gnet():
    cd, model, variables, tx = pfl_setup()
    algo = gpfl(model, tx, lam=0.5, seed=3)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=2)
    assert np.isfinite(stats[-1]["train_loss"]) and "train_gce" in stats[-1]
    s0, s1, s2 = (s.server for s in states)
    # gce_prev is the GCE one aggregation old; the GCE, CoV and extractor moved.
    assert max_rel_err(s2.gce_prev, s1.gce) == 0 and max_rel_err(s1.gce_prev, s0.gce) == 0
    for a, b in ((s2.gce, s1.gce), (s2.cov, s0.cov), (s2.params["fc1"], s0.params["fc1"])):
        assert max_rel_err(a, b) > 1e-5
    # The head slot of the server is never averaged: heads are personal.
    assert max_rel_err(s2.params["head"], variables["params"]["head"]) == 0
    cs = states[2].client_states
    sampled = set(sim.sample(0).tolist()) | set(sim.sample(1).tolist())
    for k in range(cd.num_clients):
        head = jax.tree_util.tree_map(lambda v: v[k], cs["head"])
        moved = max_rel_err(head, variables["params"]["head"]) > 0
        assert moved == (k in sampled), k
        if k in sampled:
            counts = np.asarray(cd.label_counts[k])
            np.testing.assert_allclose(cs["share"][k], counts / counts.sum(), rtol=1e-6)
    mine = sim.personal_evaluation(states[2])
    x = cd.images[:5]
    _, f = WithFeatures(model).apply({"params": s2.params}, x)
    last = np.asarray(cs["last"])
    assert set(np.flatnonzero(last == 1)) == set(sim.sample(1).tolist())
    assert max_rel_err(cs["gce"][int(sim.sample(1)[0])], s2.gce_prev) > 1e-5
    only_first = set(sim.sample(0).tolist()) - set(sim.sample(1).tolist())
    for k in (int(sim.sample(1)[0]), min(only_first or sampled),
              min(set(range(cd.num_clients)) - sampled)):
        own = jax.tree_util.tree_map(lambda v: v[k], mine)
        head = _np(jax.tree_util.tree_map(lambda v: v[k], cs["head"]))
        # Trained in round 1: its own GCE; else the global GCE one aggregation old.
        source = cs["gce"][k] if int(cs["last"][k]) == 1 else s2.gce_prev
        p = np.asarray(cs["share"][k]) @ np.asarray(source)
        want = _np_cov(_np(s2.cov), np.asarray(f), p) @ head["kernel"] + head["bias"]
        np.testing.assert_allclose(GNet(model).apply(own, x), want, rtol=1e-4, atol=1e-5)
    glob = algo.eval_variables(s2)
    np.testing.assert_array_equal(GNet(model).apply(glob, x), model.apply(glob, x))


def test_bad_options_raise():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match="-2"):
        gpfl(model, tx, lam=-2.0)
    with pytest.raises(ValueError, match="500"):
        gpfl(model, tx, mu=500.0)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = gpfl(model, tx, lam=0.5, mu=0.1, seed=2)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
