"""FedLC: the calibrated cross-entropy against numpy, a round against an independent loop
on each client's own label counts, tau = 0 as FedAvg, executors against the reference,
and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.fedavg_family.fedlc import calibrated_cross_entropy, calibration, fedlc
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine.reference import client_batches


@pytest.mark.reference("algorithm", "fedlc")
def test_the_calibrated_loss_by_hand():
    logits = np.array([[1.0, -0.5, 2.0, 0.3], [0.2, 0.1, -1.0, 1.5],
                       [3.0, 0.0, 0.5, -2.0]], np.float32)
    labels = np.array([2, 3, 1])  # the last row is padding, of a class the client lacks
    mask = np.array([1.0, 1.0, 0.0], np.float32)
    counts, tau = np.array([5.0, 0.0, 2.0, 1.0]), 0.7
    margin, present = calibration(jnp.asarray(counts), tau)
    got = calibrated_cross_entropy(jnp.asarray(logits), jnp.asarray(labels),
                                   jnp.asarray(mask), margin, present)
    # By hand: classes 0, 2, 3 only, each shifted down by tau n^(-1/4).
    want = 0.0
    for i in range(2):
        z = {c: logits[i, c] - tau * counts[c] ** -0.25 for c in (0, 2, 3)}
        want += np.log(sum(np.exp(v) for v in z.values())) - z[labels[i]]
    assert abs(float(got) - want) < 1e-5
    # No class held: plain cross-entropy, as at tau = 0.
    for counts0, tau0 in ((np.zeros(4), 0.7), (counts, 0.0)):
        m0, p0 = calibration(jnp.asarray(counts0), tau0)
        plain = calibrated_cross_entropy(jnp.asarray(logits), jnp.asarray(labels),
                                         jnp.asarray(mask), m0, p0)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        assert abs(float(plain) - float(np.sum(ce * mask))) < 1e-5
    # A padded row of an absent class stays finite, and so do the gradients.
    g = jax.grad(lambda z: calibrated_cross_entropy(z, jnp.asarray(labels),
                                                    jnp.asarray(mask), margin, present)
                 )(jnp.asarray(logits))
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[:, 1] == 0)
    assert np.all(np.asarray(g)[2] == 0)


@pytest.mark.slow
def test_a_round_calibrates_by_each_clients_own_counts():
    cd, model, variables, tx = pfl_setup()
    tau = 1.0
    sim, states, _ = pfl_rounds(fedlc(model, tx, tau=tau), cd, variables, rounds=1)
    cohort = sim.cohort(sim.init(variables), 0)
    glob = variables["params"]
    deltas, weights, lacking = [], [], 0
    for m, k in enumerate(np.asarray(cohort.ids)):
        counts = np.asarray(cd.label_counts[k])
        held = np.flatnonzero(counts > 0)
        lacking += len(held) < len(counts)
        shift = jnp.asarray(tau * counts[held] ** -0.25, jnp.float32)
        remap = np.full(len(counts), -1)
        remap[held] = np.arange(len(held))

        @jax.jit
        def grad(p, x, y):
            def loss(p):  # the softmax over the held classes alone
                z = model.apply({"params": p}, x)[:, held] - shift
                return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
            return jax.grad(loss)(p)

        params, opt = glob, tx.init(glob)
        for batch in client_batches(cd, 8, cohort, m):
            y = jnp.asarray(remap[np.asarray(batch["y"])])
            u, opt = tx.update(grad(params, batch["x"], y), opt, params)
            params = optax.apply_updates(params, u)
        deltas.append(jax.tree_util.tree_map(lambda a, b: a - b, params, glob))
        weights.append(float(cohort.weights[m]))
    assert lacking > 0  # the case of absent classes is exercised
    w = np.asarray(weights) / sum(weights)
    want = jax.tree_util.tree_map(lambda g, *d: g + sum(wi * di for wi, di in zip(w, d)),
                                  glob, *deltas)
    assert max_rel_err(states[1].server.params, want) < 1e-5


@pytest.mark.slow
def test_tau_zero_is_fedavg():
    cd, model, variables, tx = pfl_setup()
    _, mine, _ = pfl_rounds(fedlc(model, tx, tau=0.0), cd, variables)
    _, avg, _ = pfl_rounds(fedavg(model, tx), cd, variables)
    assert max_rel_err(mine[-1].server.params, avg[-1].server.params) < 1e-6


def test_the_config_builds_it_and_bad_options_are_refused():
    _, model, _, tx = pfl_setup()
    cfg = default_config()
    cfg.algorithm = "fedlc"
    assert cfg.fedlc.tau == 1.0
    algo = registry.from_config(model, cfg)
    assert algo.personal_variables is None and not registry.ALGORITHMS["fedlc"].personal
    cfg.fedlc.tau = -0.5
    with pytest.raises(ValueError, match="-0.5"):
        registry.from_config(model, cfg)
    with pytest.raises(ValueError, match="nope"):
        fedlc(model, tx, bn="nope")


@pytest.mark.slow
def test_loop_vmap_and_the_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedlc(model, tx, tau=0.5)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
