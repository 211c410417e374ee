"""FedDyn: what alpha -> 0 is (and is not), the optimum of heterogeneous quadratics, every
execution strategy against the sequential reference, options."""

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from conftest import max_rel_err, tiny_clients, tiny_fedavg
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.algorithms.feddyn import OPTIONS, RULES, feddyn, from_config
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.simulation import SimState
from fedjax_pan.defaults import default_config
from quadratic import quadratic_clients, squared_loss
from test_scaffold import SIZES, WORK, _distances, check_strategies_against_reference

tree_map = jax.tree_util.tree_map


def _tiny_feddyn(alpha):
    model, variables, base = tiny_fedavg()  # lr 0.05, momentum 0.9, 'steps' warm-up 3
    algo = feddyn(model, client_optimizer(0.05, 0.9, 1e-5, 100.0), alpha=alpha,
                  warmup="steps", warmup_length=3)
    return variables, base, algo


def _mean_delta(sim, state):
    return tree_map(lambda *d: np.mean(np.stack(d), axis=0),
                    *[o["delta"] for o in sim.client_updates(state)])


def test_tiny_alpha_gives_fedavgs_local_models_but_not_its_server_step():
    _, cd = tiny_clients(SIZES)
    variables, base, algo = _tiny_feddyn(1e-6)
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
