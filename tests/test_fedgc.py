"""FedGC: the server's regulariser and its gradient against PFLlib's loops in numpy, a
round against an independent loop (held-class softmax, body averaged, heads stored and
corrected), personal models over each client's own classes, executors against the
reference, and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import PFL_LR, max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan import models
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.personal.fedgc import UNHELD_BIAS, fedgc, regulariser
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine.reference import client_batches


def _pfllib_reg(heads, held):
    """servergc.py's reg_train in numpy: (Reg, its gradient in the heads), e_c fixed.
    heads (K, F, C): client k's embedding of class j is heads[k, :, j] (a row of its
    bias-free head, which has rows for its held classes only)."""
    k_all, _, c_all = heads.shape
    embs = {c: np.mean([heads[k, :, c] for k in range(k_all) if held[k, c]], axis=0)
            for c in range(c_all) if held[:, c].any()}
    reg, grad = 0.0, np.zeros_like(heads)
    for k in range(k_all):
        for c in np.flatnonzero(held[k]):
            e = embs[c]
            d1 = np.exp(e @ e)
            negatives = [(k2, j) for k2 in range(k_all) if not held[k2, c]
                         for j in np.flatnonzero(held[k2])]
            d2 = sum(np.exp(heads[k2, :, j] @ e) for k2, j in negatives)
            reg += -np.log(d1 / (d1 + d2))
            for k2, j in negatives:  # d/dW of log(d1 + d2)
                grad[k2, :, j] += np.exp(heads[k2, :, j] @ e) / (d1 + d2) * e
    return reg, grad


@pytest.mark.reference("algorithm", "fedgc")
def test_the_regulariser_and_its_gradient_by_hand():
    rng = np.random.default_rng(5)
    heads = rng.normal(size=(4, 3, 5)) * 0.7
    held = np.array([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 1, 1],
                     [0, 0, 0, 0, 0]], bool)  # the last client has not reported
    want, want_grad = _pfllib_reg(heads, held)
    h = jnp.asarray(heads, jnp.float32)
    got = regulariser(h, jnp.asarray(held))
    assert abs(float(got) - want) < 1e-5 * max(1.0, abs(want))
    got_grad = np.asarray(jax.grad(regulariser)(h, jnp.asarray(held)))
    assert np.max(np.abs(got_grad - want_grad)) < 1e-5
    assert np.all(got_grad[3] == 0)  # an unreported client's head stays out
    for k in range(3):  # a client's unheld columns are nobody's embeddings: untouched
        assert np.all(got_grad[k][:, ~held[k]] == 0)


@pytest.mark.slow
def test_a_round_trains_held_class_heads_and_corrects_them_on_the_server():
    cd, model, variables, tx = pfl_setup()
    server_lr = 0.3
    sim, states, stats = pfl_rounds(fedgc(model, tx, cd.num_clients, server_lr), cd,
                                    variables, rounds=1)
    cohort = sim.cohort(sim.init(variables), 0)
    glob = variables["params"]
    bias = glob["head"]["bias"]
    body = {n: p for n, p in glob.items() if n != "head"}
    heads = np.repeat(np.asarray(glob["head"]["kernel"])[None], cd.num_clients, axis=0)
    held_all = np.zeros((cd.num_clients, 10), bool)
    deltas, weights = [], []
    for m, k in enumerate(np.asarray(cohort.ids)):
        held = np.flatnonzero(np.asarray(cd.label_counts[k]) > 0)
        remap = np.full(10, -1)
        remap[held] = np.arange(len(held))

        @jax.jit
        def grad(p, x, y):
            def loss(p):  # the head's rows of the held classes alone, no bias training
                params = {**p["body"], "head": {"kernel": p["kernel"], "bias": bias}}
                z = model.apply({"params": params}, x)[:, held]
                return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
            return jax.grad(loss)(p)

        p = {"body": body, "kernel": glob["head"]["kernel"]}
        opt = tx.init(p)
        for batch in client_batches(cd, 8, cohort, m):
            y = jnp.asarray(remap[np.asarray(batch["y"])])
            u, opt = tx.update(grad(p, batch["x"], y), opt, p)
            p = optax.apply_updates(p, u)
        deltas.append(jax.tree_util.tree_map(lambda a, b: a - b, p["body"], body))
        weights.append(float(cohort.weights[m]))
        heads[k] = np.asarray(p["kernel"])
        held_all[k, held] = True
    w = np.asarray(weights) / sum(weights)
    want_body = jax.tree_util.tree_map(lambda g, *d: g + sum(wi * di for wi, di in zip(w, d)),
                                       body, *deltas)
    _, g = _pfllib_reg(heads.astype(np.float64), held_all)
    want_heads = heads - server_lr * g
    server = states[1].server
    assert max_rel_err({n: p for n, p in server.base.params.items() if n != "head"},
                       want_body) < 1e-5
    assert max_rel_err(server.heads, want_heads) < 1e-5
    assert np.array_equal(np.asarray(server.held), held_all)
    assert max_rel_err(server.base.params["head"], glob["head"]) == 0  # the initial head
    assert np.max(np.abs(g)) > 1e-4  # the correction acted
    # Each sampled client sends its body and its held classes' embeddings.
    f = heads.shape[1]
    body_bytes = sum(4 * np.size(x) for x in jax.tree_util.tree_leaves(body))
    assert stats[0]["upload_bytes"] == len(cohort.ids) * body_bytes + 4 * f * int(
        held_all.sum())


@pytest.mark.slow
def test_personal_models_score_each_client_over_its_own_classes():
    cd, model, variables, tx = pfl_setup()
    sim, states, _ = pfl_rounds(fedgc(model, tx, cd.num_clients, PFL_LR), cd, variables)
    state = states[-1]
    ids = np.asarray(state.client_states["id"])
    mine = sim.personal_evaluation(state)
    glob = variables["params"]["head"]
    trained = [k for k in range(cd.num_clients) if ids[k] >= 0]
    assert trained and len(trained) < cd.num_clients and all(ids[k] == k for k in trained)
    for k in range(cd.num_clients):
        head = jax.tree_util.tree_map(lambda v: v[k], mine["params"]["head"])
        held = np.asarray(cd.label_counts[k]) > 0
        if ids[k] < 0:  # never trained: the initial head over every class
            assert max_rel_err(head, glob) == 0
            continue
        assert max_rel_err(head["kernel"], state.server.heads[k]) == 0
        want_bias = np.where(held, 0.0, UNHELD_BIAS) if not held.all() else np.zeros(10)
        assert np.array_equal(np.asarray(head["bias"]), want_bias)
    # The global model: the averaged body and each reported class's mean embedding.
    glob_model = sim.evaluation(state.server)[1]["params"]
    h = np.asarray(state.server.held)
    e = np.einsum("kfc,kc->fc", np.asarray(state.server.heads), h) / np.maximum(h.sum(0), 1)
    want = np.where(h.any(0), e, np.asarray(glob["kernel"]))
    assert np.max(np.abs(np.asarray(glob_model["head"]["kernel"]) - want)) < 1e-6


@pytest.mark.slow
def test_lam_zero_stores_the_trained_heads_unchanged():
    cd, model, variables, tx = pfl_setup()
    sim, zero, _ = pfl_rounds(fedgc(model, tx, cd.num_clients, 0.0), cd, variables, rounds=1)
    _, some, _ = pfl_rounds(fedgc(model, tx, cd.num_clients, 1.0), cd, variables, rounds=1)
    # Local training does not see the server's step: the bodies agree, the heads do not.
    assert max_rel_err(zero[1].server.base.params, some[1].server.base.params) == 0
    assert max_rel_err(zero[1].server.heads, some[1].server.heads) > 1e-4


def test_the_config_builds_it_and_bad_options_are_refused():
    _, model, variables, tx = pfl_setup()
    cfg = default_config()
    cfg.algorithm = "fedgc"
    cfg.optimizer.lr = 0.02
    assert cfg.fedgc.lam == 1.0
    algo = registry.from_config(model, cfg)
    assert algo.personal_variables is not None and registry.ALGORITHMS["fedgc"].personal
    cfg.fedgc.lam = -3.0
    with pytest.raises(ValueError, match=r"fedgc.lam .*got -3.0"):
        registry.from_config(model, cfg)
    cfg.fedgc.lam, cfg.aggregation.bn = 1.0, "local"
    with pytest.raises(ValueError, match="'local'"):
        registry.from_config(model, cfg)
    grouped = models.build("mlp", 10, hidden=[20, 20], grouped={"groups": 2, "depth": 2})
    with pytest.raises(ValueError, match="dense layer"):
        fedgc(grouped, tx, 6, 0.1).server_init(
            models.init(grouped, jax.random.PRNGKey(0), (6, 6, 1)))


@pytest.mark.slow
def test_loop_vmap_and_the_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedgc(model, tx, cd.num_clients, 0.5)
    sim, loop, ref = strategies_agree(algo, cd, variables, states_tol=0)[:3]
