"""APPLE: two local steps (core model and DR vector) against numpy on a tiny linear model,
the schedule and data shares, rounds on the engine, loop / vmap / reference agreement,
options."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.personal.apple import apple, data_shares, regularizer_weight
from fedjax_pan.algorithms.core import ClientContext, tree_bytes
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.config.defaults import default_config




class Linear(nn.Module):
    @nn.compact
    def __call__(self, x, train=False, mask=None):
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _np_grad(w, b, x, y, mask):
    """(mean masked cross-entropy, its gradient in w and b), in float64."""
    x = x.reshape(len(x), -1).astype(np.float64)
    z = x @ w + b
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = mask.sum()
    onehot = np.eye(3)[y]
    dz = (prob - onehot) * mask[:, None] / n
    ce = -np.log(prob[np.arange(len(y)), y])
    return float((ce * mask).sum() / n), x.T @ dz, dz.sum(axis=0)


@pytest.mark.reference("algorithm", "apple")
def test_two_local_steps_follow_the_update_by_hand():
    rng = np.random.default_rng(1)
    k, d, me = 3, 6, 1
    lr, dr_lr, mu, last, r = 0.1, 0.7, 0.4, 4, 1
    cores = [{"kernel": 0.3 * rng.normal(size=(d, 3)), "bias": 0.1 * rng.normal(size=3)}
             for _ in range(k)]
    p = np.array([0.2, 0.5, 0.3])
    sizes = np.array([10.0, 0.0, 30.0])  # client 1's own size comes from its context
    x = rng.normal(size=(10, 2, 3, 1)).astype(np.float32)
    y = rng.integers(0, 3, size=10).astype(np.int32)
    mask = np.ones(10, np.float32)
    mask[-2:] = 0

    model = Linear()
    algo = apple(model, client_optimizer(lr, 0.0), lr, k, dr_lr=dr_lr, mu=mu,
                 schedule_rounds=last)
    f32 = lambda t: jnp.asarray(t, jnp.float32)
    server = algo.server_init({"params": {"Dense_0": jax.tree_util.tree_map(f32, cores[0])}})
    stack = {n: jnp.stack([f32(c[n]) for c in cores]) for n in ("kernel", "bias")}
    server = server._replace(cores={"Dense_0": stack}, sizes=f32(sizes))
    state = {"p": f32(p), "model_state": {}}
    local = algo.client_init(server, state, ClientContext(jax.random.PRNGKey(0), 2, 20, me, r,
                                                          jnp.ones(3)))

    p0 = np.array([10.0, 20.0, 30.0]) / 60.0
    lam = (1 + math.cos(math.pi * r / last)) / 2
    own = {n: cores[me][n].copy() for n in ("kernel", "bias")}
    for part in (slice(0, 6), slice(6, 10)):
        pad = 6 - len(x[part])
        batch = {"x": jnp.asarray(np.pad(x[part], ((0, pad), (0, 0), (0, 0), (0, 0)))),
                 "y": jnp.asarray(np.pad(y[part], (0, pad))),
                 "mask": jnp.asarray(np.pad(mask[part], (0, pad)))}
        local, metrics = algo.client_step(local, batch, server)
        # numpy: the personalised model, its gradient, the core step, then the DR step.
        cs = [own if j == me else cores[j] for j in range(k)]
        w = sum(p[j] * cs[j]["kernel"] for j in range(k))
        b = sum(p[j] * cs[j]["bias"] for j in range(k))
        ce, gw, gb = _np_grad(w, b, x[part], y[part], mask[part])
        own = {"kernel": own["kernel"] - lr * k * p[me] * gw,
               "bias": own["bias"] - lr * k * p[me] * gb}
        cs = [own if j == me else cores[j] for j in range(k)]
        grad_p = np.array([(np.mean(gw * c["kernel"]) + np.mean(gb * c["bias"])) / 2
                           for c in cs])
        p = p - dr_lr * (grad_p + lam * mu * (p - p0))
        np.testing.assert_allclose(metrics["loss_sum"], ce * mask[part].sum(), rtol=1e-5)
        np.testing.assert_allclose(local.p, p, rtol=1e-5, atol=1e-7)
        for n in own:
            np.testing.assert_allclose(local.core["Dense_0"][n], own[n], rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(p - [0.2, 0.5, 0.3])) > 1e-3  # the DR vector moved
    output, new_state = algo.client_output(local, server)
    assert float(output["size"]) == 20
    np.testing.assert_allclose(new_state["p"], p, rtol=1e-5, atol=1e-7)


def test_schedule_and_data_shares():
    got = [float(regularizer_weight(r, 4)) for r in range(6)]
    want = [(1 + math.cos(math.pi * r / 4)) / 2 if r < 4 else 0.0 for r in range(6)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert float(regularizer_weight(0, 0)) == 0.0
    np.testing.assert_allclose(data_shares(jnp.asarray([10.0, 0.0, 30.0, 0.0])),
                               np.array([10, 20, 30, 20]) / 80, rtol=1e-6)
    np.testing.assert_allclose(data_shares(jnp.zeros(4)), np.full(4, 0.25))


@pytest.mark.slow
def test_rounds_train_only_the_sampled_clients_cores_and_dr_vectors():
    cd, model, variables, tx = pfl_setup()
    k = cd.num_clients
    sim, states, stats = pfl_rounds(apple(model, tx, 0.05, k, dr_lr=1.0), cd, variables,
                                    rounds=2, on_host=True)
    one = tree_bytes(variables["params"])
    assert [s["download_bytes"] for s in stats] == [3.0 * k * one] * 2
    for r in (0, 1):
        before, after = states[r], states[r + 1]
        sampled = set(int(i) for i in sim.sample(r))
        for i in range(k):
            core = jax.tree_util.tree_map(lambda c: c[i], after.server.cores)
            was = jax.tree_util.tree_map(lambda c: c[i], before.server.cores)
            p, p_was = after.client_states["p"][i], before.client_states["p"][i]
            if i in sampled:
                assert max_rel_err(core, was) > 1e-4 and np.max(np.abs(p - p_was)) > 1e-5
                assert float(after.server.sizes[i]) == cd.sizes[i]
            else:
                assert max_rel_err(core, was) == 0 and np.all(p == p_was)
                assert float(after.server.sizes[i]) == float(before.server.sizes[i])
    # Each client's personal model is its DR mix of the current cores.
    mine = sim.personal_evaluation(states[-1])
    last = states[-1]
    for i in range(k):
        want = jax.tree_util.tree_map(
            lambda c: np.tensordot(np.asarray(last.client_states["p"][i]), np.asarray(c), 1),
            last.server.cores)
        assert max_rel_err(jax.tree_util.tree_map(lambda v: v[i], mine["params"]), want) < 1e-5


@pytest.mark.slow
def test_a_zero_dr_rate_keeps_every_client_on_the_mean_of_the_cores():
    cd, model, variables, tx = pfl_setup()
    k = cd.num_clients
    sim, states, _ = pfl_rounds(apple(model, tx, 0.05, k, dr_lr=0.0, mu=1.0,
                                      schedule_rounds=2), cd, variables)
    last = states[-1]
    assert np.all(np.asarray(last.client_states["p"]) == np.float32(1.0 / k))
    mean = sim.evaluation(last.server)[1]["params"]
    assert max_rel_err(mean, variables["params"]) > 1e-4  # the cores trained
    mine = sim.personal_evaluation(last)
    for i in range(k):
        assert max_rel_err(jax.tree_util.tree_map(lambda v: v[i], mine["params"]), mean) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["none", "batch"])
def test_loop_vmap_and_reference_agree(norm):
    cd, model, variables, tx = pfl_setup(norm=norm)
    algo = apple(model, tx, 0.05, cd.num_clients, dr_lr=1.0, mu=0.5, schedule_rounds=3)
    sim, loop, ref = strategies_agree(algo, cd, variables, rounds=3)[:3]


def test_options_are_checked():
    _, model, variables, tx = pfl_setup()
    with pytest.raises(ValueError, match=r"apple.dr_lr must be a number in .*got -1.0"):
        apple(model, tx, 0.05, 6, dr_lr=-1.0)
    cfg = default_config()
    cfg.algorithm, cfg.apple.l_share, cfg.rounds = "apple", 0.5, 8
    cfg.apple.mu, cfg.partition.num_clients = 0.2, 6
    algo = registry.from_config(model, cfg)
    server = algo.server_init(variables)
    assert algo.download_bytes(server, jnp.arange(2), 0) == 6 * tree_bytes(variables["params"])
    ctx = ClientContext(jax.random.PRNGKey(0), 2, 20, 0, 4, jnp.ones(10))
    # L = 0.5 x 8 = 4 rounds of the proximal term: none left in round 4.
    assert float(algo.client_init(server, algo.client_state_init(server), ctx).reg) == 0.0
    ctx = ctx._replace(round=2)
    np.testing.assert_allclose(
        float(algo.client_init(server, algo.client_state_init(server), ctx).reg), 0.2 * 0.5,
        rtol=1e-6)
