"""FedNTD: the not-true KL against numpy, a round against an independent loop that distils
the broadcast model, beta = 0 as FedAvg, executors against the reference, and its
refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.fedavg_family.fedntd import fedntd, not_true_kl
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine.reference import client_batches


def _softmax(v):
    e = np.exp(v - v.max())
    return e / e.sum()


@pytest.mark.reference("algorithm", "fedntd")
def test_the_not_true_kl_by_hand():
    rng = np.random.default_rng(3)
    local, glob = rng.normal(size=(2, 3, 5)) * 2
    labels, tau = np.array([0, 3, 4]), 2.5
    got = np.asarray(not_true_kl(jnp.asarray(local, jnp.float32),
                                 jnp.asarray(glob, jnp.float32), jnp.asarray(labels), tau))
    for i, y in enumerate(labels):
        q_l = _softmax(np.delete(local[i], y) / tau)
        q_g = _softmax(np.delete(glob[i], y) / tau)
        want = tau ** 2 * np.sum(q_g * np.log(q_g / q_l))
        assert abs(got[i] - want) < 1e-5
    # The true class's logit does not enter: moving it changes nothing.
    moved = local.copy()
    moved[np.arange(3), labels] += 10.0
    again = not_true_kl(jnp.asarray(moved, jnp.float32), jnp.asarray(glob, jnp.float32),
                        jnp.asarray(labels), tau)
    assert np.max(np.abs(np.asarray(again) - got)) < 1e-5
    # No gradient flows into the global logits.
    g = jax.grad(lambda gl: jnp.sum(not_true_kl(jnp.asarray(local, jnp.float32), gl,
                                                jnp.asarray(labels), tau)))(
        jnp.asarray(glob, jnp.float32))
    assert np.all(np.asarray(g) == 0)


@pytest.mark.slow
def test_a_round_distils_the_broadcast_model_on_the_not_true_classes():
    cd, model, variables, tx = pfl_setup()
    beta, tau = 0.8, 2.0
    sim, states, stats = pfl_rounds(fedntd(model, tx, beta=beta, tau=tau), cd, variables,
                                    rounds=1)
    cohort = sim.cohort(sim.init(variables), 0)
    glob = variables["params"]

    @jax.jit
    def grad(p, x, y):
        g = model.apply({"params": glob}, x)

        def loss(p):
            z = model.apply({"params": p}, x)
            ce = optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
            # Not-true softmaxes by removing the true column (PFLlib's refine_as_not_true:
            # rows of the C - 1 other classes).
            c = jnp.arange(z.shape[-1] - 1)[None]
            others = c + (c >= y[:, None])
            zl = jnp.take_along_axis(z, others, axis=-1) / tau
            zg = jnp.take_along_axis(g, others, axis=-1) / tau
            q_g = jax.nn.softmax(zg)
            kl = jnp.sum(q_g * (jax.nn.log_softmax(zg) - jax.nn.log_softmax(zl)), axis=-1)
            return ce + beta * tau ** 2 * kl.mean()
        return jax.grad(loss)(p)

    deltas, weights = [], []
    for m in range(len(cohort.ids)):
        params, opt = glob, tx.init(glob)
        for batch in client_batches(cd, 8, cohort, m):
            u, opt = tx.update(grad(params, batch["x"], batch["y"]), opt, params)
            params = optax.apply_updates(params, u)
        deltas.append(jax.tree_util.tree_map(lambda a, b: a - b, params, glob))
        weights.append(float(cohort.weights[m]))
    w = np.asarray(weights) / sum(weights)
    want = jax.tree_util.tree_map(lambda g, *d: g + sum(wi * di for wi, di in zip(w, d)),
                                  glob, *deltas)
    assert max_rel_err(states[1].server.params, want) < 1e-5
    assert stats[0]["train_ntd"] > 0  # the term is logged


@pytest.mark.slow
def test_beta_zero_is_fedavg_and_beta_changes_the_round():
    cd, model, variables, tx = pfl_setup()
    _, zero, _ = pfl_rounds(fedntd(model, tx, beta=0.0), cd, variables)
    _, avg, _ = pfl_rounds(fedavg(model, tx), cd, variables)
    assert max_rel_err(zero[-1].server.params, avg[-1].server.params) < 1e-6
    _, one, _ = pfl_rounds(fedntd(model, tx, beta=1.0), cd, variables)
    assert max_rel_err(one[-1].server.params, avg[-1].server.params) > 1e-4


def test_the_config_builds_it_and_bad_options_are_refused():
    _, model, _, tx = pfl_setup()
    cfg = default_config()
    cfg.algorithm = "fedntd"
    assert (cfg.fedntd.beta, cfg.fedntd.tau) == (1.0, 1.0)
    algo = registry.from_config(model, cfg)
    assert algo.personal_variables is None and not registry.ALGORITHMS["fedntd"].personal
    cfg.fedntd.tau = 0.0
    with pytest.raises(ValueError, match=r"tau .*got 0.0"):
        registry.from_config(model, cfg)
    with pytest.raises(ValueError, match=r"beta .*got -2"):
        fedntd(model, tx, beta=-2)


@pytest.mark.slow
def test_loop_vmap_and_the_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedntd(model, tx, beta=1.0, tau=2.0)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
