"""SCAFFOLD: round 1 is FedAvg's, the control variates by hand, the optimum of heterogeneous
quadratics, every execution strategy against the sequential reference, options."""

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from conftest import max_rel_err, reference_rounds, tiny_clients, tiny_fedavg
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.algorithms.fedavg_family.scaffold import OPTIONS, RULES, from_config, scaffold
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from quadratic import client_gradients, quadratic_clients, squared_loss

SIZES = [16, 24, 16, 32, 24, 8]  # whole batches: one compiled step shape
WORK = LocalWork(batch_size=8, epochs=1.5)
LR, MOMENTUM, WARMUP = 0.05, 0.9, 3


def _tiny_scaffold(norm="none"):
    model, variables, base = tiny_fedavg(norm=norm)  # lr 0.05, momentum 0.9, 'steps' warm-up 3
    algo = scaffold(model, client_optimizer(LR, MOMENTUM, 1e-5, 100.0, "steps", WARMUP), LR,
                    momentum=MOMENTUM)
    return variables, base, algo


def _total_step_size(steps):
    """A = sum_t lr_t (1 - b^(t+1)) / (1 - b), written out."""
    return sum(LR * min((t + 1) / WARMUP, 1.0) * (1 - MOMENTUM ** (t + 1)) / (1 - MOMENTUM)
               for t in range(steps))


def test_round_one_is_fedavg_and_the_control_variates_are_mean_gradients():
    _, cd = tiny_clients(SIZES)
    variables, base, algo = _tiny_scaffold()
    states = {}
    for name, a in (("fedavg", base), ("scaffold", algo)):
        ex = make_executor("loop", a, WORK, cd, variables, 3)
        sim = Simulation(a, cd, WORK, ex, participation=0.5, seed=11)
        state = sim.init(variables)
        states[name] = (sim, state, sim.round(state)[0])
    sim, state0, avg = states["fedavg"]
    _, _, sc = states["scaffold"]
    assert max_rel_err(sc.server.base, avg.server) < 1e-6  # params, BN statistics, round
    # c = c_k = 0 in round 1, so c_k+ = (x - y_k) / A, with y_k FedAvg's local model.
    ids = sim.sample(0)
    deltas = [o["delta"] for o in sim.client_updates(state0)]
    c_k = [jax.tree_util.tree_map(lambda d, s=s: -np.asarray(d) / _total_step_size(s), dk)
           for dk, s in zip(deltas, sim.steps[ids])]
    for k, ck in zip(ids, c_k):
        assert max_rel_err(jax.tree_util.tree_map(lambda x: x[k], sc.client_states.c),
                           ck, floor=1e-6) < 1e-4
    c = jax.tree_util.tree_map(lambda *x: len(ids) / len(SIZES) * np.mean(x, axis=0), *c_k)
    assert max_rel_err(sc.server.c, c, floor=1e-6) < 1e-4
    untouched = np.setdiff1d(np.arange(len(SIZES)), ids)
    assert all(np.all(np.asarray(x)[untouched] == 0)
               for x in jax.tree_util.tree_leaves(sc.client_states.c))


def _distances(algo, q, work, rounds):
    ex = make_executor("vmap", algo, work, q.data, q.variables, 4, block_size=4)
    sim = Simulation(algo, q.data, work, ex, participation=1.0)
    state, out = sim.init(q.variables), []
    for _ in range(rounds):
        state, _ = sim.round(state)
        w = np.asarray(algo.eval_variables(state.server)["params"]["w"])
        out.append(float(np.linalg.norm(w - q.optimum)))
    return out


def test_reaches_the_optimum_of_heterogeneous_quadratics_where_fedavg_is_biased():
    # 4 clients, d = 3, 8 examples each, full batches, 10 plain SGD steps of lr 0.05.
    q = quadratic_clients()
    work = LocalWork(batch_size=8, mode="steps", local_steps=10)
    tx = client_optimizer(0.05, momentum=0.0)
    avg = _distances(fedavg(q.model, tx, loss=squared_loss), q, work, 60)
    sc = _distances(scaffold(q.model, tx, 0.05, loss=squared_loss), q, work, 60)
    assert avg[-1] > 0.1 and abs(avg[-1] - avg[-2]) < 1e-5  # settled, 0.17 from the optimum
    assert sc[-1] < 1e-5  # measured 2e-7


def test_momentum_is_accounted_for_in_the_control_variates():
    # Momentum 0.9: with A = steps * lr (momentum=0 declared) the control variates are
    # ~4x too large and the iterates blow up; with the momentum-aware A they converge.
    q = quadratic_clients()
    work = LocalWork(batch_size=8, mode="steps", local_steps=10)
    tx = client_optimizer(0.01, momentum=0.9)
    sc = _distances(scaffold(q.model, tx, 0.01, momentum=0.9, loss=squared_loss), q, work, 40)
    naive = _distances(scaffold(q.model, tx, 0.01, loss=squared_loss), q, work, 10)
    assert sc[-1] < 1e-5  # measured 1.5e-7
    assert naive[-1] > 10.0  # measured 1.4e2 after 10 rounds, growing ~10x a round


def _run(strategy, algo, cd, variables, block_size=None, rounds=2):
    ex = make_executor(strategy, algo, WORK, cd, variables, 4, block_size=block_size)
    sim = Simulation(algo, cd, WORK, ex, participation=0.67, seed=7)  # 4 of 6 clients
    state = sim.init(variables)
    for _ in range(rounds):
        state, _ = sim.round(state)
    return sim, state


def check_strategies_against_reference(algo, variables, cd):
    """Server and all K client states after two rounds, per strategy, vs the reference."""
    runs = {f"{s}/{g}": _run(s, algo, cd, variables, g)
            for s, g in [("loop", None), ("vmap", 1), ("vmap", 3)]}  # vmap/3: a filler slot
    ref = reference_rounds(runs["loop/None"][0], algo, cd, variables, WORK.batch_size)
    for name, (_, state) in runs.items():
        assert max_rel_err(state.server, ref.server) < 1e-5, name
        assert max_rel_err(state.client_states, ref.client_states) < 1e-5, name
    # The states moved (not a comparison of untouched zeros).
    assert max(float(np.max(np.abs(x))) for x in
               jax.tree_util.tree_leaves(ref.client_states)) > 1e-3
    return ref


def test_strategies_match_the_sequential_reference():
    _, cd = tiny_clients(SIZES)
    variables, _, algo = _tiny_scaffold()
    ref = check_strategies_against_reference(algo, variables, cd)
    assert max(float(np.max(np.abs(x))) for x in jax.tree_util.tree_leaves(ref.server.c)) > 0


def test_options_and_config():
    assert set(OPTIONS) == set(RULES)
    assert all(RULES[k].check(v) is None for k, v in OPTIONS.items())
    assert RULES["server_lr"].check(0.0) and RULES["server_lr"].check(-1.0)
    model, _, _ = tiny_fedavg()
    tx = client_optimizer(0.05)
    with pytest.raises(ValueError, match="server_lr"):
        scaffold(model, tx, 0.05, server_lr=0.0)
    with pytest.raises(ValueError, match="lr"):
        scaffold(model, tx, 0.0)
    cfg = default_config()
    cfg.scaffold = ConfigDict(OPTIONS)
    assert from_config(model, cfg, tx, None).server_update is not None
    cfg.server.lr = 0.5
    with pytest.raises(ValueError, match="server_lr"):
        from_config(model, cfg, tx, None)


@pytest.mark.reference("algorithm", "scaffold")
def test_rounds_match_algorithm_one_option_two_written_in_numpy():
    """Alg. 1 (option II) of Karimireddy et al. in NumPy: y <- y - lr (g_k(y) + c - c_k),
    c_k+ = c_k - c + (x - y) / (steps lr), x += lr_g mean dy, c += |S|/K mean dc."""
    q = quadratic_clients()
    steps, lr, lr_g = 5, 0.05, 0.8
    work = LocalWork(batch_size=8, mode="steps", local_steps=steps)
    algo = scaffold(q.model, client_optimizer(lr, momentum=0.0), lr, server_lr=lr_g,
                    loss=squared_loss)
    ex = make_executor("loop", algo, work, q.data, q.variables, 2)
    sim = Simulation(algo, q.data, work, ex, participation=0.5, seed=3)
    state = sim.init(q.variables)
    grads, num = client_gradients(q), q.data.num_clients
    x, c = np.zeros(q.optimum.shape), np.zeros(q.optimum.shape)
    c_k = [np.zeros_like(x) for _ in range(num)]
    for r in range(3):
        ids = np.asarray(sim.sample(r))
        dys, dcs = [], []
        for k in ids:
            y = x.copy()
            for _ in range(steps):
                y = y - lr * (grads[k](y) + c - c_k[k])
            new = c_k[k] - c + (x - y) / (steps * lr)
            dys.append(y - x)
            dcs.append(new - c_k[k])
            c_k[k] = new
        x = x + lr_g * np.mean(dys, axis=0)
        c = c + len(ids) / num * np.mean(dcs, axis=0)
        state, _ = sim.round(state)
    np.testing.assert_allclose(state.server.base.params["w"], x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.server.c["w"], c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.client_states.c["w"], np.stack(c_k), rtol=1e-5,
                               atol=1e-6)
