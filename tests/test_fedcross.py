"""FedCross: similarities, the collaborative model's choice and the cross-aggregation
against PFLlib's loops in numpy; alpha = 1 is Local training and a first stage covering
every round is FedAvg; loop / vmap / reference agreement; options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import fedavg, registry
from fedjax_pan.algorithms.core import RoundInfo
from fedjax_pan.algorithms.personal.fedcross import STRATEGIES, collaborators, fedcross
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from fedjax_pan.config.defaults import default_config

ALPHA = 0.9


def _cos(a, b):
    return float(a @ b / (max(np.linalg.norm(a), 1e-8) * max(np.linalg.norm(b), 1e-8)))


def _np_pick(sim, j, rnd, strategy):
    """PFLlib's cross_aggregation loop choosing j's collaborative model."""
    n = len(sim)
    maxtag, submax, mintag = 0, 1, (j + 1) % n
    for p in range(n):
        if sim[j][p] > sim[j][maxtag]:
            submax, maxtag = maxtag, p
        elif sim[j][p] > sim[j][submax]:
            submax = p
        if sim[j][p] < sim[j][mintag] and p != j:
            mintag = p
    return {"cyclic": (j + rnd % (n - 1) + 1) % n, "least_similar": mintag,
            "most_similar": maxtag}[strategy]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.reference("algorithm", "fedcross")
def test_cross_aggregation_follows_pflibs_loops(strategy):
    cd, model, variables, tx = pfl_setup()
    rnd, m, k = 3, 4, 6
    algo = fedcross(model, tx, k, alpha=ALPHA, strategy=strategy)
    server = algo.server_init(variables)
    rng = np.random.default_rng(2)
    trained = jax.tree_util.tree_map(
        lambda v: jnp.asarray(v[None] + 0.3 * rng.normal(size=(m, *v.shape)), jnp.float32),
        variables["params"])
    ids, weights = np.array([5, 1, 0, 3]), np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    new = jax.jit(algo.server_update)(server, {"params": trained},
                             RoundInfo(jnp.int32(rnd), jnp.asarray(ids), jnp.asarray(weights),
                                       k))
    # Similarity: per layer in call order (fc1, fc2, head), the last twice.
    layer = {n: np.stack([np.concatenate([np.asarray(trained[n][p][i]).ravel()
                                          for p in ("bias", "kernel")]) for i in range(m)])
             for n in ("fc1", "fc2", "head")}
    sim = np.zeros((m, m))
    for a in range(m):
        for b in range(m):
            if a != b:
                sim[a, b] = sum(_cos(layer[n][a], layer[n][b])
                                for n in ("fc1", "fc2", "head", "head"))
    picks = [_np_pick(sim, j, rnd, strategy) for j in range(m)]
    for j in range(m):
        for n in layer:
            for p in ("bias", "kernel"):
                want = ALPHA * np.asarray(trained[n][p][j]) + (1 - ALPHA) * np.asarray(
                    trained[n][p][picks[j]])
                np.testing.assert_allclose(np.asarray(new.middleware["params"][n][p][ids[j]]),
                                           want, rtol=1e-5, atol=1e-6)
    # The global model: the weighted mean; clients 2 and 4 keep the initial model.
    for n in layer:
        for p in ("bias", "kernel"):
            np.testing.assert_allclose(np.asarray(new.params[n][p]),
                                       np.tensordot(weights, np.asarray(trained[n][p]), 1),
                                       rtol=1e-5, atol=1e-6)
            for c in (2, 4):
                np.testing.assert_array_equal(np.asarray(new.middleware["params"][n][p][c]),
                                              np.asarray(variables["params"][n][p]))


@pytest.mark.reference("algorithm", "fedcross")
def test_ties_go_where_pflibs_loop_sends_them():
    sim = jnp.asarray([[0.0, 1.0, 1.0, 2.0], [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, -1.0],
                       [-1.0, -1.0, -1.0, 0.0]])
    for strategy in ("least_similar", "most_similar"):
        got = np.asarray(collaborators(sim, jnp.int32(0), strategy)).tolist()
        assert got == [_np_pick(np.asarray(sim), j, 0, strategy) for j in range(4)]
    assert np.asarray(collaborators(sim, jnp.int32(0), "least_similar")).tolist() == [
        1, 2, 3, 0]
    assert np.asarray(collaborators(sim, jnp.int32(0), "most_similar")).tolist() == [
        3, 0, 0, 3]


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


@pytest.mark.slow
def test_alpha_one_is_local_training_and_a_whole_first_stage_is_fedavg():
    cd, model, variables, tx = pfl_setup()
    _, cross, _ = pfl_rounds(fedcross(model, tx, 6, alpha=1.0), cd, variables)
    _, loc, _ = pfl_rounds(partial_sharing(model, tx, PERSONAL["local"]), cd, variables)
    mine, theirs = _flat(cross[-1].client_states["params"]), loc[-1].client_states["params"]
    assert set(mine) == set(theirs)
    for key in mine:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-6, atol=1e-7)
    _, cross, _ = pfl_rounds(fedcross(model, tx, 6, first_stage_bound=5), cd, variables)
    _, avg, _ = pfl_rounds(fedavg(model, tx), cd, variables)
    assert max_rel_err(cross[-1].server.params, avg[-1].server.params) < 1e-6


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedcross(model, tx, 6, alpha=0.8)
    sim, loop, ref = strategies_agree(algo, cd, variables, rounds=3)[:3]


def test_options_are_checked():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match=r"fedcross.alpha must be a number in \[0, 1\], got 1.5"):
        fedcross(model, tx, 6, alpha=1.5)
    with pytest.raises(ValueError, match=r"fedcross.strategy must be one of cyclic, .*got 'best'"):
        fedcross(model, tx, 6, strategy="best")
    with pytest.raises(ValueError, match=r"first_stage_bound must be an integer in \[0, .*got -1"):
        fedcross(model, tx, 6, first_stage_bound=-1)
    cfg = default_config()
    cfg.algorithm = "fedcross"
    assert registry.from_config(model, cfg).personal_variables is not None
