"""FedPAC: the simplex QP against scipy, the statistics and combination matrix against
numpy, the server's step on hand-made outputs, the two phases of a client's round,
personal models, loop/vmap/reference agreement, options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import minimize

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms.core import ClientContext, RoundInfo
from fedjax_pan.algorithms.personal.fedpac import (combination_matrix, fedpac, simplex_qp,
                                          statistics)


def _slsqp(p):
    n = p.shape[0]
    res = minimize(lambda a: a @ p @ a, np.full(n, 1.0 / n), jac=lambda a: 2 * p @ a,
                   bounds=[(0, None)] * n, method="SLSQP", options={"ftol": 1e-14,
                                                                     "maxiter": 1000},
                   constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1}])
    return res.x


@pytest.mark.reference("algorithm", "fedpac")
def test_simplex_qp_matches_scipy():
    rng = np.random.default_rng(0)
    for n, rank in ((3, 3), (5, 2), (6, 6)):
        a = rng.normal(size=(n, rank))
        p = (a @ a.T + np.diag(rng.uniform(0, 0.5, n))).astype(np.float32)
        got = np.asarray(simplex_qp(jnp.asarray(p)))
        want = _slsqp(p.astype(np.float64))
        assert got.min() >= 0 and abs(got.sum() - 1) < 1e-5
        assert got @ p @ got <= want @ p @ want + 1e-5
        np.testing.assert_allclose(got, want, atol=2e-3)
    # Restricted to some coordinates: the others 0, the optimum over the allowed face.
    allowed = np.array([True, False, True, True, False, True])
    got = np.asarray(simplex_qp(jnp.asarray(p), jnp.asarray(allowed)))
    assert np.all(got[~allowed] == 0)
    np.testing.assert_allclose(got[allowed], _slsqp(p[np.ix_(allowed, allowed)]), atol=2e-3)


@pytest.mark.reference("algorithm", "fedpac")
def test_statistics_and_combination_matrix_match_numpy():
    rng = np.random.default_rng(1)
    c, d, n = 4, 3, 11
    y = np.array([0, 0, 1, 1, 1, 3, 3, 3, 3, 0, 1])
    f = rng.normal(size=(n, d)).astype(np.float32)
    share = np.bincount(y, minlength=c) / n
    count = np.bincount(y, minlength=c).astype(np.float32)
    sums = np.stack([f[y == k].sum(0) if np.any(y == k) else np.zeros(d) for k in range(c)])
    sq = np.array([(f[y == k] ** 2).sum() for k in range(c)])
    v, h = statistics(jnp.asarray(count), jnp.asarray(sums, jnp.float32),
                      jnp.asarray(sq, jnp.float32), jnp.asarray(share, jnp.float32),
                      jnp.float32(n))
    # PFLlib's statistics_extraction, written out.
    want_v, want_h = 0.0, np.zeros((c, d))
    for k in range(c):
        fk = f[y == k]
        if len(fk):
            mu = fk.mean(0)
            want_h[k] = share[k] * mu
            want_v += share[k] * np.trace(fk.T @ fk / len(fk)) - share[k] ** 2 * (mu * mu).sum()
    assert abs(float(v) - want_v / n) < 1e-5
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
    m = 3
    vs = rng.uniform(size=m).astype(np.float32)
    hs = rng.normal(size=(m, c, d)).astype(np.float32)
    got = np.asarray(combination_matrix(jnp.asarray(vs), jnp.asarray(hs)))
    for i in range(m):
        want = np.diag(vs).astype(np.float64)
        for j1 in range(m):
            for j2 in range(m):
                want[j1, j2] += sum((hs[i, k] - hs[j1, k]) @ (hs[i, k] - hs[j2, k])
                                    for k in range(c))
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.reference("algorithm", "fedpac")
@pytest.mark.slow
def test_server_step_on_hand_made_outputs():
    cd, model, variables, tx = pfl_setup()
    algo = fedpac(model, tx, 6)
    server = algo.server_init(variables)
    rng = np.random.default_rng(2)
    m, c, d = 3, 10, 16
    ids = np.array([4, 1, 2])
    w = np.array([0.5, 0.3, 0.2], np.float32)
    head = variables["params"]["head"]
    outs = {
        "delta": jax.tree_util.tree_map(
            lambda x: jnp.asarray(rng.normal(size=(m, *x.shape)), jnp.float32),
            {k: v for k, v in variables["params"].items() if k != "head"}),
        "model_state": {},
        "head": jax.tree_util.tree_map(
            lambda x: jnp.asarray(rng.normal(size=(m, *x.shape)), jnp.float32), head),
        "v": jnp.asarray(rng.uniform(0.1, 1, m), jnp.float32),
        "h": jnp.asarray(rng.normal(size=(m, c, d)) * 0.3, jnp.float32),
        "protos": jnp.asarray(rng.normal(size=(m, c, d)), jnp.float32),
        "has": jnp.asarray(rng.uniform(size=(m, c)) < 0.6, jnp.float32)}
    outs["has"] = outs["has"].at[:, 0].set(0.0)  # a class nobody holds
    outs["protos"] = outs["protos"] * outs["has"][..., None]
    new = algo.server_update(server, outs, RoundInfo(0, jnp.asarray(ids), jnp.asarray(w), 6))
    for k in ("fc1", "fc2"):
        want = jax.tree_util.tree_map(lambda p, dd: p + np.tensordot(w, dd, 1),
                                      variables["params"][k], outs["delta"][k])
        assert max_rel_err(new.params[k], want) < 1e-6
    assert max_rel_err(new.params["head"], head) == 0
    has, protos = np.asarray(outs["has"]), np.asarray(outs["protos"])
    for k in range(c):
        if has[:, k].any():
            np.testing.assert_allclose(new.protos[k], protos[has[:, k] > 0, k].mean(0),
                                       rtol=1e-5, atol=1e-6)
        else:
            assert float(new.present[k]) == 0 and np.all(np.asarray(new.protos[k]) == 0)
    hs, vs = np.asarray(outs["h"], np.float64), np.asarray(outs["v"], np.float64)
    heads = jax.tree_util.tree_map(np.asarray, outs["head"])
    for row, i in enumerate(ids):
        diff = (hs[row][None] - hs).reshape(m, -1)
        alpha = _slsqp(np.diag(vs) + diff @ diff.T)
        alpha = np.where(alpha > 1e-3, alpha, 0)
        want = jax.tree_util.tree_map(lambda x: np.tensordot(alpha, x, 1), heads)
        got = jax.tree_util.tree_map(lambda x: x[i], new.heads)
        assert max_rel_err(got, want) < 5e-3
    for k in (0, 3, 5):  # not in the round: the initial head
        assert max_rel_err(jax.tree_util.tree_map(lambda x: x[k], new.heads), head) == 0


@pytest.mark.slow
def test_a_round_trains_the_head_then_the_body_towards_prototypes():
    cd, model, variables, tx = pfl_setup()
    algo = fedpac(model, tx, 6, lam=2.0, head_fraction=0.5)
    server = algo.server_init(variables)
    protos = jnp.asarray(np.random.default_rng(3).normal(size=(10, 16)), jnp.float32)
    server = server._replace(protos=protos, present=jnp.ones(10))
    counts = jnp.asarray(np.bincount(np.asarray(cd.labels[:16]), minlength=10), jnp.float32)
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 2, 16, 0, 0, counts))
    assert int(local.head_steps) == 1
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    one, m1 = algo.client_step(local, batch, server)
    p0, p1 = local.train.params, one.train.params
    assert max_rel_err(p1["head"], p0["head"]) > 1e-4
    assert all(max_rel_err(p1[k], p0[k]) == 0 for k in ("fc1", "fc2"))
    assert float(m1["align_sum"]) == 0.0 and float(jnp.sum(one.count)) == 8
    two, m2 = algo.client_step(one, batch, server)
    p2 = two.train.params
    assert max_rel_err(p2["head"], p1["head"]) == 0
    assert all(max_rel_err(p2[k], p1[k]) > 1e-4 for k in ("fc1", "fc2"))
    assert float(m2["align_sum"]) > 0 and float(jnp.sum(two.p_count)) == 8
    out, state = algo.client_output(two, server)
    assert int(state["slot"]) == 0 and float(out["v"]) > 0


@pytest.mark.slow
def test_rounds_combine_heads_and_evaluate_them():
    cd, model, variables, tx = pfl_setup()
    algo = fedpac(model, tx, cd.num_clients, lam=1.0)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=2)
    assert np.isfinite(stats[-1]["train_loss"]) and "train_align" in stats[-1]
    last = states[-1]
    assert float(jnp.sum(last.server.present)) > 0
    mine = sim.personal_evaluation(last)
    slots = np.asarray(last.client_states["slot"])
    for k in range(cd.num_clients):
        want = (jax.tree_util.tree_map(lambda x: x[k], last.server.heads) if slots[k] >= 0
                else variables["params"]["head"])
        assert slots[k] in (-1, k)
        assert max_rel_err(jax.tree_util.tree_map(lambda x: x[k], mine["params"]["head"]),
                           want) == 0
        assert max_rel_err(jax.tree_util.tree_map(lambda x: x[k], mine["params"]["fc1"]),
                           last.server.params["fc1"]) == 0
    assert (slots >= 0).any() and (slots < 0).any()


def test_bad_options_raise():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match="-1"):
        fedpac(model, tx, 6, lam=-1.0)
    with pytest.raises(ValueError, match="1.5"):
        fedpac(model, tx, 6, head_fraction=1.5)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedpac(model, tx, cd.num_clients, lam=0.5)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
