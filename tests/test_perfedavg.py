"""Per-FedAvg: one local step against its closed form on least squares (first-order and
Hessian-free), the personal model as one adaptation step, options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PFL_LR, max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.personal.perfedavg import perfedavg
from fedjax_pan.config.defaults import default_config
from quadratic import quadratic_clients, squared_loss

ALPHA, BETA = 0.1, 0.05


def _grad(a, b, w):
    """Gradient of (1/2n) ||a w - b||^2, and its Hessian."""
    return a.T @ (a @ w - b) / len(b), a.T @ a / len(b)


def _one_step(hessian_free):
    q = quadratic_clients(dim=3, size=12)
    algo = perfedavg(q.model, ALPHA, beta=BETA, hessian_free=hessian_free, loss=squared_loss)
    server = algo.server_init({"params": {"w": jnp.asarray([0.3, -0.2, 0.5])}})
    ctx = ClientContext(jax.random.PRNGKey(0), 1, 12, 0, 0, jnp.ones(1))
    local = algo.client_init(server, None, ctx)
    x = np.asarray(q.data.images)[:12]
    batch = {"x": jnp.asarray(x), "y": jnp.zeros(12, jnp.int32), "mask": jnp.ones(12)}
    local, metrics = algo.client_step(local, batch, server)
    return np.asarray(local.params["w"]), x[:, :, 0, 0].astype(np.float64), metrics


@pytest.mark.reference("algorithm", "perfedavg")
@pytest.mark.parametrize("hessian_free", [False, True])
def test_one_step_matches_the_closed_form(hessian_free):
    got, x, metrics = _one_step(hessian_free)
    parts = 3 if hessian_free else 2
    a = [x[i * 12 // parts:(i + 1) * 12 // parts, :3] for i in range(parts)]
    b = [x[i * 12 // parts:(i + 1) * 12 // parts, 3] for i in range(parts)]
    w = np.asarray([0.3, -0.2, 0.5])
    w_tmp = w - ALPHA * _grad(a[0], b[0], w)[0]
    g = _grad(a[1], b[1], w_tmp)[0]
    if hessian_free:
        g = g - ALPHA * _grad(a[2], b[2], w)[1] @ g
    np.testing.assert_allclose(got, w - BETA * g, rtol=1e-5, atol=1e-6)
    assert float(metrics["num_examples"]) == 12 // parts
    # First order and Hessian-free differ (the Hessian term is not negligible here).
    assert max(abs(got - _one_step(not hessian_free)[0])) > 1e-4


def test_personal_model_is_one_step_on_a_training_batch():
    cd, model, variables, _ = pfl_setup()
    algo = perfedavg(model, PFL_LR)
    sim, states, _ = pfl_rounds(algo, cd, variables, rounds=1)
    server = states[-1].server
    batches = sim.adaptation_batches(1)
    personal = sim.personal_evaluation(states[-1])
    for k in range(cd.num_clients):
        batch = jax.tree_util.tree_map(lambda v: v[k], batches)
        n = int(cd.sizes[k])
        assert float(batch["mask"].sum()) == min(n, 8)
        rows = set(np.asarray(cd.index_table)[k, :n].tolist())
        x = np.asarray(batch["x"])[np.asarray(batch["mask"]) > 0]
        images = np.asarray(cd.images)
        assert all(any(np.array_equal(xi, images[r]) for r in rows) for xi in x)  # its own

        def loss(p):
            logits = model.apply({"params": p}, batch["x"])
            ce = -jax.nn.log_softmax(logits)[jnp.arange(len(batch["y"])), batch["y"]]
            return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])
        want = jax.tree_util.tree_map(lambda p, g: p - PFL_LR * g, server.params,
                                      jax.grad(loss)(server.params))
        mine = jax.tree_util.tree_map(lambda v: v[k], personal["params"])
        assert max_rel_err(mine, want) < 1e-5
    # Another round's batches are drawn anew.
    assert max_rel_err(sim.adaptation_batches(2)["x"], batches["x"]) > 0


def test_options_are_checked():
    cd, model, variables, _ = pfl_setup()
    with pytest.raises(ValueError, match=r"perfedavg.beta must be a number in \(0, 100\], got 0.0"):
        perfedavg(model, 0.1, beta=0.0)
    cfg = default_config()
    cfg.algorithm, cfg.perfedavg.hessian_free, cfg.local.batch_size = "perfedavg", True, 2
    with pytest.raises(ValueError, match="3 parts; local.batch_size 2 is too small"):
        registry.from_config(model, cfg)


def test_a_padded_batch_splits_as_the_batch_unpadded():
    q = quadratic_clients(dim=3, size=8)
    algo = perfedavg(q.model, ALPHA, beta=BETA, hessian_free=True, loss=squared_loss)
    server = algo.server_init({"params": {"w": jnp.asarray([0.3, -0.2, 0.5])}})
    ctx = ClientContext(jax.random.PRNGKey(0), 1, 8, 0, 0, jnp.ones(1))
    x = jnp.asarray(np.asarray(q.data.images)[:7])
    plain = {"x": x, "y": jnp.zeros(7, jnp.int32), "mask": jnp.ones(7)}
    padded = {"x": jnp.concatenate([x, jnp.ones((3, *x.shape[1:]))]),
              "y": jnp.zeros(10, jnp.int32), "mask": jnp.arange(10) < 7}
    padded["mask"] = padded["mask"].astype(jnp.float32)
    a, _ = algo.client_step(algo.client_init(server, None, ctx), plain, server)
    b, _ = algo.client_step(algo.client_init(server, None, ctx), padded, server)
    np.testing.assert_allclose(a.params["w"], b.params["w"], rtol=1e-6)
    assert max(abs(np.asarray(a.params["w"]) - [0.3, -0.2, 0.5])) > 1e-3
