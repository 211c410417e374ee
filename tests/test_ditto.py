"""Ditto: the global model is FedAvg's; the personal model spans Local (lambda = 0) to the
received global model (lambda -> infinity)."""

import jax
import numpy as np
import optax
import pytest
from flax import traverse_util

from conftest import PFL_LR as LR
from conftest import max_rel_err, pfl_setup as _setup
from conftest import pfl_rounds
from fedjax_pan.algorithms import fedavg
from fedjax_pan.algorithms.personal.ditto import ditto
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from test_personal import np_flat, np_grads, tiny_net_setup, tiny_sim


def _run(algo, cd, variables, strategy="vmap", rounds=2):
    return pfl_rounds(algo, cd, variables, strategy, rounds)[:2]


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


@pytest.mark.parametrize("lam,warmup", [(0.0, "none"), (1.0, "none"), (1.0, "rounds")])
def test_global_model_is_fedavgs(lam, warmup):
    cd, model, variables, tx = _setup(warmup=warmup)
    _, d = _run(ditto(model, tx, LR, lam=lam), cd, variables)
    _, f = _run(fedavg(model, tx), cd, variables)
    # Two programs: equal to rounding under the suite's compile flags (conftest), and bit
    # for bit under XLA's defaults; Ditto's personal step leaking into the global model
    # would show at 1e-2.
    assert max_rel_err(d[-1].server.params, f[-1].server.params) < 1e-6


def test_lambda_zero_is_local_training():
    cd, model, variables, tx = _setup()
    _, d = _run(ditto(model, tx, LR, lam=0.0), cd, variables)
    _, loc = _run(partial_sharing(model, tx, PERSONAL["local"]), cd, variables)
    mine, theirs = _flat(d[-1].client_states["params"]), loc[-1].client_states["params"]
    assert set(mine) == set(theirs)
    for key in mine:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-6, atol=1e-7)
    assert max(np.max(np.abs(mine[k] - _flat(variables["params"])[k])) for k in mine) > 1e-3


def test_lambda_to_infinity_is_the_received_global_model():
    cd, model, variables, tx = _setup()
    sim, d = _run(ditto(model, tx, LR, lam=1e9), cd, variables)
    received = _flat(d[1].server.params)  # what round 1's clients received
    mine = _flat(d[2].client_states["params"])
    for k in sim.sample(1):
        for key in received:
            np.testing.assert_allclose(mine[key][k], received[key], rtol=1e-5, atol=1e-6)
    # Mid-range lambda lands in between: neither the received model nor the local one.
    _, mid = _run(ditto(model, tx, LR, lam=1.0), cd, variables)
    k = sim.sample(1)[0]
    gap = max(np.max(np.abs(_flat(mid[2].client_states["params"])[key][k] - received[key]))
              for key in received)
    assert gap > 1e-4


def test_loop_and_vmap_agree_and_personal_models_are_evaluated():
    cd, model, variables, tx = _setup()
    algo = ditto(model, tx, LR, lam=0.5)
    sim, a = _run(algo, cd, variables, "loop")
    _, b = _run(algo, cd, variables, "vmap")
    assert max_rel_err(a[-1].server, b[-1].server) < 1e-5
    assert max_rel_err(a[-1].client_states, b[-1].client_states) < 1e-5
    mine = sim.personal_evaluation(a[-1])
    assert max_rel_err(mine, a[-1].client_states) == 0


@pytest.mark.reference("algorithm", "ditto")
def test_rounds_match_ditto_written_in_numpy():
    """Li et al.'s Alg. 1 in NumPy with plain SGD: the global copy takes SGD steps on f_k,
    the personal model v a gradient step on f_k then the proximal step of
    lambda/2 ||v - w^t||^2, v <- (v_half + lr lambda w^t) / (1 + lr lambda); the server
    adds the mean delta."""
    model, variables, cd, data = tiny_net_setup()
    steps, lr, lam = 3, 0.1, 2.0
    algo = ditto(model, optax.sgd(lr), lr, lam=lam)
    sim = tiny_sim(algo, cd, variables, steps)
    state = sim.init(variables)
    g = np_flat(variables["params"])
    own = [dict(g) for _ in data]
    for r in range(2):
        deltas = []
        for k in np.asarray(sim.sample(r)):
            w, v = dict(g), own[k]
            for _ in range(steps):
                gw, gv = np_grads(w, *data[k]), np_grads(v, *data[k])
                w = {key: w[key] - lr * gw[key] for key in w}
                v = {key: (v[key] - lr * gv[key] + lr * lam * g[key]) / (1 + lr * lam)
                     for key in v}
            own[k] = v
            deltas.append({key: w[key] - g[key] for key in g})
        g = {key: g[key] + np.mean([d[key] for d in deltas], axis=0) for key in g}
        state, _ = sim.round(state)
    got, mine = np_flat(state.server.params), np_flat(state.client_states["params"])
    for key in g:
        np.testing.assert_allclose(got[key], g[key], rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(mine[key], np.stack([o[key] for o in own]), rtol=1e-5,
                                   atol=1e-6, err_msg=key)
