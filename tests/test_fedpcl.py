"""FedPCL: the contrastive loss against NumPy, a first round that only collects
prototypes, later rounds training against the previous round's set, scoring by a
client's own prototypes, and clients of several networks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.fedpcl import contrastive_loss, fedpcl
from fedjax_pan.algorithms.moon import FEATURES
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

WORK = LocalWork(batch_size=8, epochs=2.0)  # one training epoch, one prototype pass
TAU = 0.5


def _np_ce(logits, y):
    logits = logits - logits.max(1, keepdims=True)
    return -(logits[np.arange(len(y)), y] - np.log(np.exp(logits).sum(1)))


def test_the_loss_is_the_global_term_plus_the_mean_of_the_reporting_clients_terms():
    rng = np.random.default_rng(0)
    k, c, d, b = 4, 5, 3, 6
    protos = rng.normal(size=(k, c, d))
    has = np.ones((k, c))
    has[0, 2] = has[2, 1] = has[3, [1, 4]] = 0
    has[:, 3] = 0  # nobody holds class 3: rows of it have no term at all
    reported = np.array([1.0, 0.0, 1.0, 1.0])
    r = rng.normal(size=(b, d))
    r /= np.linalg.norm(r, axis=1, keepdims=True)
    y = np.array([0, 1, 2, 3, 4, 1])
    mask = np.array([1, 1, 1, 1, 1, 0.0])
    w = has * reported[:, None]
    g = (w[:, :, None] * protos).sum(0) / np.maximum(w.sum(0), 1)[:, None]
    gp = w.sum(0) > 0
    want = np.zeros(b)
    for i in range(b):
        def ce(p, present):
            if not present[y[i]]:
                return 0.0
            logits = np.where(present, r[i] @ p.T / TAU, -1e9)
            return _np_ce(logits[None], y[i:i + 1])[0]
        holders = [s for s in range(k) if reported[s] and has[s, y[i]]]
        want[i] = ce(g, gp) + (sum(ce(protos[s], has[s] > 0) for s in holders) /
                               max(len(holders), 1))
    assert want[3] == 0 and want[1] > 0
    got = contrastive_loss(jnp.asarray(r, jnp.float32), jnp.asarray(y), jnp.asarray(mask),
                           jnp.asarray(protos, jnp.float32), jnp.asarray(has, jnp.float32),
                           jnp.asarray(reported, jnp.float32), TAU)
    np.testing.assert_allclose(float(got), (want * mask).sum(), rtol=1e-5)


def _setup(hidden=(24, 16), seed=0):
    _, cd = tiny_clients([27, 39, 19, 36, 62, 13])
    model = models.build("mlp", 10, hidden=list(hidden))
    variables = models.init(model, jax.random.PRNGKey(seed), (6, 6, 1))
    return cd, model, variables, optax.sgd(0.1, momentum=0.9)


def _simulation(algo, cd, variables, strategy="vmap"):
    return Simulation(algo, cd, WORK, make_executor(strategy, algo, WORK, cd, variables, 3),
                      participation=0.5, aggregation="num_examples", seed=7)


def _normalised_features(model, variables, x):
    _, st = model.apply(variables, x, mutable=["intermediates"])
    z = np.asarray(st["intermediates"][FEATURES], np.float64)
    return z / np.linalg.norm(z, axis=1, keepdims=True)


@pytest.mark.slow
def test_first_rounds_collect_then_clients_train_and_score_by_their_prototypes():
    cd, model, variables, tx = _setup()
    algo = fedpcl(model, tx, cd.num_clients, 0.5, tau=TAU)
    sim = _simulation(algo, cd, variables)
    first, stats = sim.round(sim.init(variables))
    ids = sim.sample(0)
    assert stats["train_loss"] == 0  # nobody had prototypes: nobody trained
    for k in range(cd.num_clients):
        st = jax.tree_util.tree_map(lambda v: v[k], first.client_states)
        assert max_rel_err(st["variables"], variables) == 0
        rows = np.asarray(cd.index_table[k][:cd.sizes[k]])
        r, y = _normalised_features(model, variables, cd.images[rows]), cd.labels[rows]
        for j in range(10):
            want = r[np.asarray(y) == j].mean(0) if k in ids and (y == j).any() else 0.0
            np.testing.assert_allclose(np.asarray(st["protos"][j]), want, rtol=1e-5,
                                       atol=1e-6)
    np.testing.assert_array_equal(np.asarray(first.server.reported),
                                  np.isin(np.arange(6), ids).astype(float))
    download = sim.download_bytes(first.server, sim.sample(1), 1)
    assert download == len(sim.sample(1)) * (1 + len(ids)) * (10 * 16 + 10) * 4
    second, stats = sim.round(first)
    assert stats["train_loss"] > 0
    again = [k for k in sim.sample(1) if k in ids]  # trained: had prototypes of its own
    assert again
    for k in again:
        st = jax.tree_util.tree_map(lambda v: v[k], second.client_states)
        assert max_rel_err(st["variables"]["params"]["fc1"], variables["params"]["fc1"]) > 1e-4
        # Scored by its own prototypes: the class of the largest r . p_j.
        personal = algo.personal_variables(second.server, st)
        x = cd.images[:20]
        r = _normalised_features(model, st["variables"], x)
        p = np.asarray(st["protos"])
        score = np.where(np.asarray(st["has"]) > 0, r @ p.T, -np.inf)
        np.testing.assert_array_equal(
            np.asarray(model.apply(personal, x)).argmax(1), score.argmax(1))


@pytest.mark.slow
def test_one_group_is_the_simulation_and_several_networks_share_the_prototypes():
    cd, model, variables, tx = _setup()
    algo = fedpcl(model, tx, cd.num_clients, 0.5, tau=TAU)
    sim = _simulation(algo, cd, variables)
    want = sim.init(variables)
    for _ in range(2):
        want, _ = sim.round(want)
    services = Services(cd, WORK, participation=0.5, seed=7, strategy="vmap")
    one = Groups([model], [variables], np.zeros(6, int), [algo], services, "num_examples")
    state = one.init(None)
    for _ in range(2):
        state, _ = one.round(state)
    assert max_rel_err(state.server[0].protos, want.server.protos) == 0
    deep = models.build("mlp", 10, hidden=[32, 16])
    dvars = models.init(deep, jax.random.PRNGKey(1), (6, 6, 1))
    mixed = Groups([model, deep], [variables, dvars], np.arange(6) % 2,
                   [algo, fedpcl(deep, tx, 6, 0.5, tau=TAU)], services, "num_examples")
    state = mixed.init(None)
    for _ in range(2):
        state, stats = mixed.round(state)
    assert max_rel_err(state.server[0].protos, state.server[1].protos) == 0
    assert stats["train_loss"] > 0
