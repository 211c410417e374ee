"""FedCAC: the critical mask, the overlaps, the threshold and the customised models against
numpy; tau = 0 is FedAvg; the clients' models over rounds; loop / vmap / reference
agreement; options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import fedavg, registry
from fedjax_pan.algorithms.core import RoundInfo, tree_bytes
from fedjax_pan.algorithms.personal.fedcac import critical_mask, fedcac
from fedjax_pan.config.defaults import default_config


def _np_mask(w0, w, tau):
    """PFLlib's evaluate_critical_parameter for one tensor, in numpy."""
    c = np.abs((w - w0) * w)
    metric = c.reshape(-1)
    nz = int(tau * metric.size)
    thresh = np.sort(metric)[::-1][nz - 1] if nz > 0 else np.inf
    if thresh <= 1e-10:
        rest = metric[metric > 1e-20]
        if len(rest):
            thresh = np.sort(rest)[0]
    return c >= thresh


@pytest.mark.reference("algorithm", "fedcac")
def test_the_critical_mask_follows_pflibs_rule():
    rng = np.random.default_rng(0)
    w0 = {"a": rng.normal(size=(5, 4)), "b": rng.normal(size=3), "z": rng.normal(size=6),
          "t": rng.normal(size=2)}
    w = {k: v + 0.1 * rng.normal(size=v.shape) for k, v in w0.items()}
    w["z"] = w0["z"].copy()
    w["z"][[1, 4]] += 0.5  # only two scores above 0: the threshold drops to the smallest
    w["t"] = np.zeros(2)  # every score 0: all critical
    for tau in (0.3, 0.5, 1.0):
        got = critical_mask(jax.tree_util.tree_map(jnp.asarray, w0),
                            jax.tree_util.tree_map(jnp.asarray, w), tau)
        for k in w0:
            np.testing.assert_array_equal(np.asarray(got[k]), _np_mask(w0[k], w[k], tau),
                                          err_msg=f"{k} tau={tau}")
    got = critical_mask(w0, w, 0.3)
    assert int(np.sum(got["a"])) == 6 and int(np.sum(got["b"])) == 0  # int(0.9) = 0
    assert np.asarray(got["z"]).tolist() == [False, True] + [False] * 4  # the top one
    # tau = 0.5: the 3rd largest score is 0, so both scores above 0 are critical.
    got = critical_mask(w0, w, 0.5)
    assert np.asarray(got["z"]).tolist() == [False, True, False, False, True, False]
    assert np.all(np.asarray(got["t"]))


@pytest.mark.reference("algorithm", "fedcac")
def test_the_server_builds_customised_models_by_hand():
    """Four clients of K = 6 in round 2, beta = 4: the global mean, the overlaps, T and each
    client's customised mean, computed in numpy."""
    cd, model, variables, tx = pfl_setup()
    beta, rnd, m = 4, 2, 4
    algo = fedcac(model, tx, 6, tau=0.5, beta=beta)
    server = algo.server_init(variables)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(
        lambda v: jnp.asarray(v[None] + 0.1 * rng.normal(size=(m, *v.shape)), jnp.float32),
        variables["params"])
    base = {k: rng.random(size=v.shape) < 0.5 for k, v in
            jax.tree_util.tree_flatten_with_path(variables["params"])[0]}
    masks = {k: np.stack([np.where(rng.random(size=v.shape) < 0.2 * (i + 1), ~v, v)
                          for i in range(m)]) for k, v in base.items()}
    treedef = jax.tree_util.tree_structure(variables["params"])
    mask_tree = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(masks[k]) for k in base])
    ids = np.array([4, 0, 5, 2])
    weights = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    outs = {"params": params, "model_state": {}, "critical": mask_tree}
    new = jax.jit(algo.server_update)(server, outs, RoundInfo(jnp.int32(rnd), jnp.asarray(ids),
                                                     jnp.asarray(weights), 6))

    flat = np.concatenate([masks[k].reshape(m, -1) for k in base], axis=1).astype(np.float64)
    o = np.array([[1 - np.abs(flat[i] - flat[j]).sum() / (2 * flat[i].sum())
                   for j in range(m)] for i in range(m)])
    off = o[~np.eye(m, dtype=bool)]
    thresh = off.mean() + (rnd + 1) / beta * (off.max() - off.mean())
    leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(params)]
    groups = []
    for i in range(m):
        group = [i] + [j for j in range(m) if j != i and o[i, j] >= thresh]
        groups.append(group)
        want = [x[group].mean(axis=0) for x in leaves]
        got = [np.asarray(x)[ids[i]] for x in jax.tree_util.tree_leaves(new.customized)]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert any(len(g) == 1 for g in groups) and any(len(g) > 1 for g in groups)
    for a, x in zip(jax.tree_util.tree_leaves(new.params), leaves):
        np.testing.assert_allclose(np.asarray(a), np.tensordot(weights, x, 1), rtol=1e-5,
                                   atol=1e-6)
    # Clients not in the round keep their stored (initial) customised model.
    for a, v in zip(jax.tree_util.tree_leaves(new.customized),
                    jax.tree_util.tree_leaves(variables["params"])):
        np.testing.assert_array_equal(np.asarray(a)[[1, 3]], np.stack([v, v]))
    np.testing.assert_array_equal(np.asarray(new.built), [1, 0, 1, 0, 1, 1])




@pytest.mark.slow
def test_tau_zero_is_fedavg():
    cd, model, variables, tx = pfl_setup()
    _, cac, _ = pfl_rounds(fedcac(model, tx, 6, tau=0.0), cd, variables, rounds=2, on_host=True)
    _, avg, _ = pfl_rounds(fedavg(model, tx), cd, variables, rounds=2, on_host=True)
    assert max_rel_err(cac[-1].server.params, avg[-1].server.params) < 1e-6


@pytest.mark.slow
def test_clients_keep_critical_parameters_from_their_customised_models():
    cd, model, variables, tx = pfl_setup()
    algo = fedcac(model, tx, 6, tau=0.5, beta=2)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=3, on_host=True)
    last, cs = states[3].server, states[3].client_states
    mine = sim.personal_evaluation(states[3])
    sampled = {int(k) for r in range(3) for k in sim.sample(r)}
    mixed = 0
    for k in range(cd.num_clients):
        crit = jax.tree_util.tree_map(lambda v: np.asarray(v[k]), cs["critical"])
        got = jax.tree_util.tree_map(lambda v: np.asarray(v[k]), mine["params"])
        if k not in sampled:
            assert not bool(cs["trained"][k])
            assert max_rel_err(got, last.params) == 0
            continue
        assert int(cs["id"][k]) == k
        custom = jax.tree_util.tree_map(lambda v: np.asarray(v[k]), last.customized)
        want = jax.tree_util.tree_map(np.where, crit, custom, last.params)
        assert max_rel_err(got, want) == 0
        # About tau of each tensor is critical (ties only add).
        for c in jax.tree_util.tree_leaves(crit):
            assert np.sum(c) >= int(0.5 * c.size)
        mixed += 1
    assert mixed
    # Downloads: the global model, plus the customised model once the client has one.
    one, params = tree_bytes(variables), tree_bytes(variables["params"])
    built = set()
    for r, s in enumerate(stats):
        ids = [int(k) for k in sim.sample(r)]
        assert s["download_bytes"] == sum(one + (params if k in built else 0) for k in ids)
        built |= set(ids)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedcac(model, tx, 6, tau=0.5, beta=2)
    sim, loop, ref = strategies_agree(algo, cd, variables, rounds=3)[:3]


def test_options_are_checked():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match=r"fedcac.tau must be a number in \[0, 1\], got 1.5"):
        fedcac(model, tx, 6, tau=1.5)
    with pytest.raises(ValueError, match=r"fedcac.beta must be an integer in \[1, .*got 0"):
        fedcac(model, tx, 6, beta=0)
    cfg = default_config()
    cfg.algorithm = "fedcac"
    algo = registry.from_config(model, cfg)
    assert algo.personal_variables is not None
