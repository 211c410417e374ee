"""FedDyn: what alpha -> 0 is (and is not), the optimum of heterogeneous quadratics, every
execution strategy against the sequential reference, options."""

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from conftest import max_rel_err, tiny_clients, tiny_fedavg
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.algorithms.fedavg_family.feddyn import OPTIONS, RULES, feddyn, from_config
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.simulation import SimState
from fedjax_pan.config.defaults import default_config
from quadratic import client_gradients, quadratic_clients, squared_loss
from test_scaffold import SIZES, WORK, _distances, check_strategies_against_reference

tree_map = jax.tree_util.tree_map


def _tiny_feddyn(alpha, log_term=False):
    model, variables, base = tiny_fedavg()  # lr 0.05, momentum 0.9, 'steps' warm-up 3
    algo = feddyn(model, client_optimizer(0.05, 0.9, 1e-5, 100.0, "steps", 3), alpha=alpha,
                  log_term=log_term)
    return variables, base, algo


def _mean_delta(sim, state):
    return tree_map(lambda *d: np.mean(np.stack(d), axis=0),
                    *[o["delta"] for o in sim.client_updates(state)])


def test_tiny_alpha_gives_fedavgs_local_models_but_not_its_server_step():
    _, cd = tiny_clients(SIZES)
    variables, base, algo = _tiny_feddyn(1e-6, log_term=True)
    sims = {name: Simulation(a, cd, WORK, make_executor("loop", a, WORK, cd, variables, 3),
                             participation=0.5, seed=11)
            for name, a in (("fedavg", base), ("feddyn", algo))}
    f = 3 / 6  # |S| / K
    dyn, avg = sims["feddyn"], sims["fedavg"]
    s0 = dyn.init(variables)
    theta0 = s0.server.base.params
    d1 = _mean_delta(dyn, s0)
    # Round 1 (g_k = 0): the local models are FedAvg's up to the alpha-term.
    assert max_rel_err(d1, _mean_delta(avg, avg.init(variables))) < 1e-4
    s1, stats = dyn.round(s0)
    assert stats["train_dyn"] > 0  # alpha/2 ||theta - theta0||^2 after the first step
    # ... but h/alpha = -f * mean delta: the server moves (1 + f) times FedAvg's step.
    theta1 = tree_map(lambda t, d: t + (1 + f) * d, theta0, d1)
    assert max_rel_err(s1.server.base.params, theta1) < 1e-4
    fedavg_step = tree_map(lambda t, d: t + d, theta0, d1)
    assert max_rel_err(s1.server.base.params, fedavg_step) > 1e-2
    # Round 2: g_k = -alpha delta_k ~ 0, so the local models are FedAvg's from theta1 ...
    d2 = _mean_delta(dyn, s1)
    assert max_rel_err(d2, _mean_delta(avg, SimState(s1.server.base, None, 1))) < 1e-4
    # ... and the server adds the running sum of past mean deltas:
    # theta2 = theta1 + (1 + f) mean delta^2 + f mean delta^1, whatever alpha.
    s2, _ = dyn.round(s1)
    theta2 = tree_map(lambda t, a, b: t + (1 + f) * a + f * b, s1.server.base.params, d2, d1)
    assert max_rel_err(s2.server.base.params, theta2) < 1e-4


def test_reaches_the_optimum_of_heterogeneous_quadratics_where_fedavg_is_biased():
    # 4 clients, d = 3, 8 examples each, full batches, 10 plain SGD steps of lr 0.05.
    q = quadratic_clients()
    work = LocalWork(batch_size=8, mode="steps", local_steps=10)
    tx = client_optimizer(0.05, momentum=0.0)
    avg = _distances(fedavg(q.model, tx, loss=squared_loss), q, work, 60)
    dyn = _distances(feddyn(q.model, tx, alpha=1.0, loss=squared_loss), q, work, 80)
    assert avg[-1] > 0.1 and abs(avg[-1] - avg[-2]) < 1e-5  # settled, 0.17 from the optimum
    assert dyn[-1] < 1e-5  # measured ~3e-7


@pytest.mark.reference("algorithm", "feddyn")
def test_rounds_match_algorithm_one_written_in_numpy():
    """Acar et al.'s Alg. 1 in NumPy (plain SGD on the client objective, full batches):
    g_k <- g_k - alpha (theta_k - theta), h <- h - alpha/K sum_S (theta_k - theta),
    theta <- mean_S theta_k - h / alpha."""
    q = quadratic_clients()
    steps, lr, alpha = 5, 0.05, 0.5
    work = LocalWork(batch_size=8, mode="steps", local_steps=steps)
    algo = feddyn(q.model, client_optimizer(lr, momentum=0.0), alpha=alpha, loss=squared_loss)
    sim = Simulation(algo, q.data, work, make_executor("loop", algo, work, q.data,
                                                       q.variables, 2),
                     participation=0.5, seed=3)
    state = sim.init(q.variables)
    grads, num = client_gradients(q), q.data.num_clients
    theta, h = np.zeros(q.optimum.shape), np.zeros(q.optimum.shape)
    g = [np.zeros_like(theta) for _ in range(num)]
    for r in range(3):
        ids = np.asarray(sim.sample(r))
        models = []
        for k in ids:
            w = theta.copy()
            for _ in range(steps):
                w = w - lr * (grads[k](w) - g[k] + alpha * (w - theta))
            g[k] = g[k] - alpha * (w - theta)
            models.append(w)
        h = h - alpha / num * np.sum([w - theta for w in models], axis=0)
        theta = np.mean(models, axis=0) - h / alpha
        state, _ = sim.round(state)
    np.testing.assert_allclose(state.server.base.params["w"], theta, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.server.h["w"], h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.client_states.grad["w"], np.stack(g), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.reference("algorithm", "feddyn")
def test_a_step_is_a_step_on_the_whole_objective():
    """The closed-form gradient of the dynamic term against autodiff of
    L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta_s||^2, and the logged term's value."""
    from fedjax_pan.algorithms import local as local_lib
    from fedjax_pan.algorithms.fedavg_family.feddyn import FedDynLocal
    from fedjax_pan.algorithms.core import ClientContext

    alpha = 0.3
    model, variables, _ = tiny_fedavg()
    tx = client_optimizer(0.05, 0.9)
    rng = np.random.default_rng(0)
    noise = lambda x: x + 0.1 * rng.normal(size=x.shape).astype(x.dtype)  # noqa: E731
    algo = feddyn(model, tx, alpha=alpha, log_term=True)
    server = algo.server_init(variables)
    ctx = ClientContext(jax.random.PRNGKey(0), 5, 8, 0, 0, np.ones(10, np.float32))
    local = algo.client_init(server, algo.client_state_init(server), ctx)
    # A client away from the broadcast, with a non-zero g_k.
    local = FedDynLocal(local.train._replace(params=tree_map(noise, local.train.params)),
                        tree_map(lambda p: 0.2 * rng.normal(size=p.shape).astype(p.dtype),
                                 local.train.params))
    x = rng.normal(size=(8, 6, 6, 1)).astype(np.float32)
    batch = {"x": x, "y": rng.integers(0, 10, 8).astype(np.int32),
             "mask": np.array([1] * 6 + [0] * 2, np.float32)}
    new, metrics = algo.client_step(local, batch, server)

    theta, g = server.base.params, local.grad

    def term(p):
        return sum(0.5 * alpha * np.sum((a - b) ** 2) - np.sum(c * a) for a, b, c in zip(
            *(jax.tree_util.tree_leaves(t) for t in (p, theta, g))))

    def objective(p):
        dyn = sum(0.5 * alpha * jax.numpy.sum((a - b) ** 2) - jax.numpy.sum(c * a)
                  for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (p, theta, g))))
        logits, _ = local_lib.forward(model, p, local.train.model_state, batch, train=True)
        return local_lib.masked_cross_entropy(logits, batch["y"], batch["mask"]) / 6 + dyn
    grads = jax.grad(objective)(local.train.params)
    updates, _ = tx.update(grads, local.train.opt_state, local.train.params)
    want = tree_map(lambda p, u: p + u, local.train.params, updates)
    assert max_rel_err(new.train.params, want) < 1e-5
    np.testing.assert_allclose(metrics["dyn_sum"], 6 * term(local.train.params), rtol=1e-4)
    # Without logging: the same step, and no term in the metrics.
    quiet, quiet_metrics = feddyn(model, tx, alpha=alpha).client_step(local, batch, server)
    assert "dyn_sum" not in quiet_metrics
    assert max_rel_err(quiet.train.params, new.train.params) == 0.0


def test_strategies_match_the_sequential_reference():
    _, cd = tiny_clients(SIZES)
    variables, _, algo = _tiny_feddyn(0.1)
    ref = check_strategies_against_reference(algo, variables, cd)
    assert max(float(np.max(np.abs(x))) for x in jax.tree_util.tree_leaves(ref.server.h)) > 0


def test_options_and_config():
    assert set(OPTIONS) == set(RULES)
    assert all(RULES[k].check(v) is None for k, v in OPTIONS.items())
    assert RULES["alpha"].check(0.0) and RULES["alpha"].check(-0.1)
    model, _, _ = tiny_fedavg()
    tx = client_optimizer(0.05)
    with pytest.raises(ValueError, match="alpha"):
        feddyn(model, tx, alpha=0.0)
    cfg = default_config()
    cfg.feddyn = ConfigDict(OPTIONS)
    assert from_config(model, cfg, tx, None).server_update is not None
    cfg.aggregation.weights = "num_examples"
    with pytest.raises(ValueError, match="uniform"):
        from_config(model, cfg, tx, None)
    cfg.aggregation.weights, cfg.aggregation.rule = "uniform", "median"
    with pytest.raises(ValueError, match="uniform"):
        from_config(model, cfg, tx, None)
