"""FedCP: the ensemble output and MMD against numpy, the server's heads and CPN as the
mean of the clients' uploads, the personal model CPNet scores, loop/vmap/reference
agreement, options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms.personal.fedcp import (BANDWIDTHS, CPNet, ensemble_logits, fedcp, init_cs,
                                         mmd_rbf)
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.local import WithFeatures


def _np_ensemble(h, head_p, head_g, cs, context, tau, noise):
    gate_in = h * (context / np.linalg.norm(context))
    z = gate_in @ cs["kernel"] + cs["bias"]
    mu, var = z.mean(-1, keepdims=True), z.var(-1, keepdims=True)
    z = np.maximum((z - mu) / np.sqrt(var + 1e-5) * cs["scale"] + cs["shift"], 0)
    d = h.shape[1]
    a_p, a_g = (z[:, :d] + noise[:, 0]) / tau, (z[:, d:] + noise[:, 1]) / tau
    s = np.exp(a_p) / (np.exp(a_p) + np.exp(a_g))
    return (h * s) @ head_p["kernel"] + head_p["bias"] + (h * (1 - s)) @ head_g["kernel"] + \
        head_g["bias"]


def _np_mmd(x, y):
    def sq(a, b):
        return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    k = lambda d: sum(np.exp(-0.5 * d / a) for a in BANDWIDTHS)  # noqa: E731
    return np.mean(k(sq(x, x)) + k(sq(y, y)) - 2 * k(sq(x, y)))


@pytest.mark.reference("algorithm", "fedcp")
def test_ensemble_and_mmd_match_numpy():
    rng = np.random.default_rng(0)
    b, d, c = 5, 4, 3
    h = rng.normal(size=(b, d)).astype(np.float32)
    cs = {k: np.asarray(v) for k, v in init_cs(jax.random.PRNGKey(1), d).items()}
    cs["scale"] = (1 + 0.1 * rng.normal(size=2 * d)).astype(np.float32)
    cs["shift"] = (0.1 * rng.normal(size=2 * d)).astype(np.float32)
    head_p = {"kernel": rng.normal(size=(d, c)).astype(np.float32),
              "bias": rng.normal(size=c).astype(np.float32)}
    head_g = {"kernel": rng.normal(size=(d, c)).astype(np.float32),
              "bias": rng.normal(size=c).astype(np.float32)}
    context = rng.uniform(size=d).astype(np.float32)
    noise = rng.gumbel(size=(b, 2, d)).astype(np.float32)
    for tau, nz in ((1.0, noise), (0.5, noise), (1.0, None)):
        got = ensemble_logits(jnp.asarray(h), head_p, head_g, cs, jnp.asarray(context), tau,
                              None if nz is None else jnp.asarray(nz))
        want = _np_ensemble(h, head_p, head_g, cs, context, tau,
                            np.zeros_like(noise) if nz is None else nz)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    x = rng.normal(size=(6, d)).astype(np.float32) * 2
    y = rng.normal(size=(6, d)).astype(np.float32) * 2
    mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
    # Padded rows (mask 0) count nowhere: garbage in them changes nothing.
    y_pad = y.copy()
    y_pad[4:] = 100.0
    got = float(mmd_rbf(jnp.asarray(x), jnp.asarray(y_pad), jnp.asarray(mask)))
    assert abs(got - _np_mmd(x[:4], y[:4])) < 1e-5
    assert abs(float(mmd_rbf(jnp.asarray(x), jnp.asarray(x), jnp.ones(6)))) < 1e-5


@pytest.mark.slow
def test_server_averages_uploads_and_clients_keep_personal_heads():
    cd, model, variables, tx = pfl_setup()
    algo = fedcp(model, tx, lam=1.0, seed=3)
    sim, states, _ = pfl_rounds(algo, cd, variables, rounds=1)
    # Client states are donated to the next round: round 1's are copied first.
    first = jax.device_get(states[1])
    second, stats = sim.round(states[1])
    states = [states[0], first, second]
    assert np.isfinite(stats["train_loss"]) and "train_mmd" in stats
    for r, (before, after) in enumerate(((states[0], first), (first, second))):
        ids = sim.sample(r)
        w = cd.sizes[ids] / cd.sizes[ids].sum()
        heads = jax.tree_util.tree_map(lambda v: np.asarray(v)[ids],
                                       after.client_states["head"])
        # Global head: mean over the round's clients of 0.5 own head + 0.5 received head.
        want = jax.tree_util.tree_map(
            lambda g, p: 0.5 * np.asarray(g) + 0.5 * np.tensordot(w, p, 1),
            before.server.params["head"], heads)
        assert max_rel_err(after.server.params["head"], want) < 1e-5
        trained = np.asarray(after.client_states["trained"])
        assert set(np.flatnonzero(trained)) >= set(ids.tolist())
    trained = np.asarray(states[2].client_states["trained"])
    untouched = np.flatnonzero(trained == 0)
    assert len(untouched), "some client never sampled in two rounds"
    for k in untouched:  # never trained: the initial head
        assert max_rel_err(jax.tree_util.tree_map(lambda v: v[k],
                                                  states[2].client_states["head"]),
                           variables["params"]["head"]) == 0
    assert max_rel_err(states[2].server.params["fc1"], variables["params"]["fc1"]) > 1e-4


def test_a_step_trains_the_cpn_once_the_heads_differ():
    """While the personal head equals the global one, s cancels out of the output (the
    CPN's gradient is 0, as in PFLlib's first round); once they differ the CPN learns."""
    cd, model, variables, tx = pfl_setup()
    algo = fedcp(model, tx, seed=0)
    server = algo.server_init(variables)
    state = algo.client_state_init(server)
    key = jax.random.PRNGKey(5)
    state = {"head": jax.tree_util.tree_map(
        lambda v: v + 0.3 * jax.random.normal(key, v.shape), state["head"]),
        "trained": jnp.float32(1)}
    ctx = ClientContext(key, 4, 27, 0, 0, jnp.ones(10))
    local = jax.jit(algo.client_init)(server, state, ctx)
    np.testing.assert_allclose(local.context, np.asarray(state["head"]["kernel"]).sum(1),
                               rtol=1e-6)
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    new, metrics = jax.jit(algo.client_step)(local, batch, server)
    assert max_rel_err(new.train.params["cs"], server.cs) > 1e-4
    assert float(metrics["mmd_sum"]) == 0.0  # the extractor is still the global one
    out, kept = jax.jit(algo.client_output)(new, server)
    head_p = new.train.params["model"]["head"]
    want = jax.tree_util.tree_map(lambda p, g: 0.5 * (p - g), head_p, server.params["head"])
    assert max_rel_err(out["delta"]["params"]["head"], want) < 1e-6
    assert max_rel_err(kept["head"], head_p) == 0


@pytest.mark.slow
def test_personal_model_is_the_noise_free_ensemble():
    cd, model, variables, tx = pfl_setup()
    algo = fedcp(model, tx, seed=1)
    sim, states, _ = pfl_rounds(algo, cd, variables, rounds=1)
    mine = sim.personal_evaluation(states[1])
    server = states[1].server
    x = cd.images[:7]
    net = CPNet(model)
    for k in (int(sim.sample(0)[0]), int(np.flatnonzero(
            np.asarray(states[1].client_states["trained"]) == 0)[0])):
        own = jax.tree_util.tree_map(lambda v: v[k], mine)
        head = jax.tree_util.tree_map(lambda v: v[k], states[1].client_states["head"])
        trained = float(states[1].client_states["trained"][k])
        context = np.asarray(head["kernel"]).sum(1) if trained else np.asarray(server.context0)
        _, h = WithFeatures(model).apply({"params": server.params}, x)
        cs = jax.tree_util.tree_map(np.asarray, server.cs)
        want = _np_ensemble(np.asarray(h), jax.tree_util.tree_map(np.asarray, head),
                            jax.tree_util.tree_map(np.asarray, server.params["head"]), cs,
                            context, 1.0, np.zeros((7, 2, h.shape[1])))
        np.testing.assert_allclose(net.apply(own, x), want, rtol=1e-4, atol=1e-5)
    # Without the 'fedcp' collection CPNet is the bare model (the global evaluation).
    glob = algo.eval_variables(server)
    np.testing.assert_array_equal(net.apply(glob, x), model.apply(glob, x))


def test_bad_options_raise():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match="-1"):
        fedcp(model, tx, lam=-1.0)
    with pytest.raises(ValueError, match="0.001"):
        fedcp(model, tx, tau=0.001)
    from fedjax_pan.algorithms import registry
    from fedjax_pan.config.defaults import default_config
    cfg = default_config()
    cfg.algorithm, cfg.fedcp.tau = "fedcp", 0.0
    with pytest.raises(ValueError, match="0.0"):
        registry.from_config(model, cfg)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedcp(model, tx, lam=0.5, seed=2)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]


@pytest.mark.slow
def test_sgd_server_is_the_mean():
    """server_tx = sgd(1) takes the weighted mean of the uploads as the new model."""
    cd, model, variables, tx = pfl_setup()
    a = pfl_rounds(fedcp(model, tx, seed=2), cd, variables, rounds=1)[1]
    b = pfl_rounds(fedcp(model, tx, optax.sgd(0.5), seed=2), cd, variables, rounds=1)[1]
    half = jax.tree_util.tree_map(lambda x0, x1: 0.5 * (x0 + x1), a[0].server.params,
                                  a[1].server.params)
    assert max_rel_err(b[1].server.params, half) < 1e-5
