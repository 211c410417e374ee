"""FedRoD: the balanced softmax by hand, a round against an independent loop (generic
model on the balanced loss, personal head on the detached generic logits), and the
personal model's summed head equal to generic + personal outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan import models
from fedjax_pan.algorithms.personal.fedrod import balanced_softmax_sum, fedrod
from fedjax_pan.engine.reference import client_batches


@pytest.mark.reference("algorithm", "fedrod")
def test_balanced_softmax_by_hand():
    logits = np.asarray([[1.0, 0.5, -1.0], [0.2, 0.1, 0.3]])
    counts = np.asarray([3.0, 1.0, 0.0])  # class 2 absent
    labels, mask = np.asarray([0, 1]), np.asarray([1.0, 1.0])
    z = logits + np.log([3.0, 1.0, 1e-300])
    want = sum(-(z[i, labels[i]] - np.log(np.exp(z[i]).sum())) for i in range(2))
    got = balanced_softmax_sum(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask),
                               jnp.asarray(counts))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    masked = balanced_softmax_sum(jnp.asarray(logits), jnp.asarray(labels),
                                  jnp.asarray([1.0, 0.0]), jnp.asarray(counts))
    np.testing.assert_allclose(float(masked), -(z[0, 0] - np.log(np.exp(z[0]).sum())),
                               rtol=1e-6)


def _logits_and_features(model, params, x):
    logits, state = model.apply({"params": params}, x, mutable=["intermediates"])
    return logits, state["intermediates"]["features_out"]


@pytest.mark.reference("algorithm", "fedrod")
def test_a_round_against_an_independent_loop():
    cd, model, variables, tx = pfl_setup()
    sim, states, _ = pfl_rounds(fedrod(model, tx), cd, variables, rounds=1)
    cohort = sim.cohort(sim.init(variables), 0)
    glob = variables["params"]
    deltas = []
    for m, k in enumerate(cohort.ids):
        params, head = glob, glob["head"]
        opt_g, opt_p = tx.init(params), tx.init(head)
        counts = np.asarray(cd.label_counts)[k]
        for batch in client_batches(cd, 8, cohort, m):
            def generic(p):
                z = model.apply({"params": p}, batch["x"]) + jnp.log(
                    jnp.where(counts > 0, counts, 1e-30))
                return optax.softmax_cross_entropy_with_integer_labels(z, batch["y"]).mean()

            logits, feats = _logits_and_features(model, params, batch["x"])

            def personal(h):
                z = logits + feats @ h["kernel"] + h["bias"]
                return optax.softmax_cross_entropy_with_integer_labels(z, batch["y"]).mean()
            u, opt_g = tx.update(jax.grad(generic)(params), opt_g, params)
            v, opt_p = tx.update(jax.grad(personal)(head), opt_p, head)
            params, head = optax.apply_updates(params, u), optax.apply_updates(head, v)
        mine = jax.tree_util.tree_map(lambda v: v[k], states[1].client_states["head"])
        assert max_rel_err(mine, head) < 1e-4
        assert max_rel_err(mine, glob["head"]) > 1e-3  # it trained
        deltas.append(jax.tree_util.tree_map(lambda a, b: a - b, params, glob))
    w = np.asarray(cohort.weights) / np.sum(cohort.weights)
    want = jax.tree_util.tree_map(lambda g, *d: g + sum(wi * di for wi, di in zip(w, d)),
                                  glob, *deltas)
    assert max_rel_err(states[1].server.params, want) < 1e-4


def test_personal_model_is_generic_plus_personal_head():
    cd, model, variables, tx = pfl_setup()
    sim, states, _ = pfl_rounds(fedrod(model, tx), cd, variables, rounds=2)
    personal = sim.personal_evaluation(states[-1])
    x = cd.images[:5]
    logits, feats = _logits_and_features(model, states[-1].server.params, x)
    for k in range(cd.num_clients):
        h = jax.tree_util.tree_map(lambda v: v[k], states[-1].client_states["head"])
        mine = model.apply(jax.tree_util.tree_map(lambda v: v[k], personal), x)
        np.testing.assert_allclose(mine, logits + feats @ h["kernel"] + h["bias"],
                                   rtol=1e-4, atol=1e-5)


def test_a_model_without_a_linear_head_is_refused():
    model = models.build("mlp", 10, hidden=[20, 20], grouped={"groups": 2, "depth": 2})
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    algo = fedrod(model, optax.sgd(0.1))
    with pytest.raises(ValueError, match="one linear layer named 'head'"):
        algo.client_state_init(algo.server_init(variables))
