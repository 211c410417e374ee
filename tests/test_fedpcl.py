"""FedPCL: the contrastive loss against NumPy, PFLlib's set of every client's latest
prototypes padded with the global ones, a first round that only collects prototypes,
later rounds training against the previous round's set, scoring by a client's own
prototypes padded with the global ones, and clients of several networks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.core import RoundInfo
from fedjax_pan.algorithms.personal.fedpcl import contrastive_loss, fedpcl
from fedjax_pan.algorithms.local import FEATURES
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

WORK = LocalWork(batch_size=8, epochs=2.0)  # one training epoch, one prototype pass
TAU = 0.5


def _np_ce(logits, y):
    logits = logits - logits.max(1, keepdims=True)
    return -(logits[np.arange(len(y)), y] - np.log(np.exp(logits).sum(1)))


@pytest.mark.reference("algorithm", "fedpcl")
def test_the_loss_is_the_global_term_plus_the_sum_of_every_clients_terms_over_k():
    rng = np.random.default_rng(0)
    k, c, d, b = 4, 5, 3, 6
    protos = rng.normal(size=(k, c, d))
    present = np.ones((k, c))
    present[0, 2] = present[2, 1] = present[3, [1, 4]] = 0
    present[:, 3] = 0  # no set holds class 3: rows of it have no term at all
    g = rng.normal(size=(c, d))
    g_present = np.array([1, 1, 0, 0, 1.0])
    r = rng.normal(size=(b, d))
    r /= np.linalg.norm(r, axis=1, keepdims=True)
    y = np.array([0, 1, 2, 3, 4, 1])
    mask = np.array([1, 1, 1, 1, 1, 0.0])
    want = np.zeros(b)
    for i in range(b):
        def ce(p, there):
            if not there[y[i]]:
                return 0.0
            logits = np.where(there > 0, r[i] @ p.T / TAU, -1e9)
            return _np_ce(logits[None], y[i:i + 1])[0]
        # PFLlib: L_g + sum over all K entries of S of their terms / K.
        want[i] = ce(g, g_present) + sum(ce(protos[s], present[s]) for s in range(k)) / k
    assert want[3] == 0 and want[1] > 0
    got = contrastive_loss(jnp.asarray(r, jnp.float32), jnp.asarray(y), jnp.asarray(mask),
                           jnp.asarray(g, jnp.float32), jnp.asarray(g_present, jnp.float32),
                           jnp.asarray(protos, jnp.float32), jnp.asarray(present, jnp.float32),
                           TAU)
    np.testing.assert_allclose(float(got), (want * mask).sum(), rtol=1e-5)


@pytest.mark.reference("algorithm", "fedpcl")
def test_the_set_keeps_stale_prototypes_and_pads_the_missing_with_the_global_ones():
    """PFLlib's receive_protos / proto_aggregation / prototype_padding over two rounds of
    4 clients, 3 classes: reporters' entries replaced, the others kept as they were (a
    never-reporting client's padded once with the first G), missing classes padded with
    that round's G, a class G lacks left missing; a slot of weight 0 reports nothing."""
    model = models.build("mlp", 3, hidden=[2])
    variables = models.init(model, jax.random.PRNGKey(0), (2, 2, 1))
    algo = fedpcl(model, optax.sgd(0.1), 4, 0.5, tau=TAU)
    server = algo.server_init(variables)
    rng = np.random.default_rng(1)
    p = rng.normal(size=(3, 3, 2)).astype(np.float32)  # round 1's reports of 0, 1, 3

    def update(server, ids, protos, has, weights):
        info = RoundInfo(0, jnp.asarray(ids), jnp.asarray(weights, jnp.float32), 4)
        out = {"protos": jnp.asarray(protos * np.asarray(has)[..., None]),
               "has": jnp.asarray(has, jnp.float32)}
        return algo.server_update(server, out, info)
    # Round 1: clients 0 {0, 1} and 1 {0, 2} report; client 3's slot has weight 0.
    s1 = update(server, [0, 1, 3], p, [[1, 1, 0], [1, 0, 1], [1, 1, 1]], [0.5, 0.5, 0])
    g1 = np.stack([(p[0, 0] + p[1, 0]) / 2, p[0, 1], p[1, 2]])
    np.testing.assert_allclose(np.asarray(s1.global_protos), g1, rtol=1e-6)
    want1 = np.stack([[p[0, 0], p[0, 1], g1[2]], [p[1, 0], g1[1], p[1, 2]], g1, g1])
    np.testing.assert_allclose(np.asarray(s1.protos), want1, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(s1.present), np.ones((4, 3)))
    # Round 2: clients 1 {0, 1} and 2 {0} report; nobody holds class 2.
    q = rng.normal(size=(2, 3, 2)).astype(np.float32)
    s2 = update(s1, [1, 2], q, [[1, 1, 0], [1, 0, 0]], [0.5, 0.5])
    g2 = np.stack([(q[0, 0] + q[1, 0]) / 2, q[0, 1], np.zeros(2)])
    np.testing.assert_allclose(np.asarray(s2.global_protos), g2, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(s2.global_present), [1, 1, 0])
    got, present = np.asarray(s2.protos), np.asarray(s2.present)
    np.testing.assert_allclose(got[0], want1[0], rtol=1e-6)  # stale, kept whole
    np.testing.assert_allclose(got[3], g1, rtol=1e-6)  # padded once, with round 1's G
    np.testing.assert_allclose(got[1, :2], q[0, :2], rtol=1e-6)
    np.testing.assert_allclose(got[2, :2], [q[1, 0], g2[1]], rtol=1e-6)
    np.testing.assert_array_equal(present, [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]])
    # Every client downloads G and all K padded entries, with their masks.
    assert algo.download_bytes(s2, None, 1) == (1 + 4) * (3 * 2 + 3) * 4


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
    # Clients that have not reported are padded with the global prototypes whole.
    g = np.asarray(first.server.global_protos)
    for k in set(range(6)) - set(ids):
        np.testing.assert_allclose(np.asarray(first.server.protos[k]), g, rtol=1e-6)
    download = sim.download_bytes(first.server, sim.sample(1), 1)
    assert download == len(sim.sample(1)) * (1 + 6) * (10 * 16 + 10) * 4
    second, stats = sim.round(first)
    assert stats["train_loss"] > 0
    again = [k for k in sim.sample(1) if k in ids]  # trained: had prototypes of its own
    assert again
    for k in again:
        st = jax.tree_util.tree_map(lambda v: v[k], second.client_states)
        assert max_rel_err(st["variables"]["params"]["fc1"], variables["params"]["fc1"]) > 1e-4
        # Scored by its own prototypes, the classes it lacks padded with the global
        # ones: the class of the largest r . p_j.
        personal = algo.personal_variables(second.server, st)
        x = cd.images[:20]
        r = _normalised_features(model, st["variables"], x)
        own = np.asarray(st["has"]) > 0
        g, g_present = (np.asarray(second.server.global_protos),
                        np.asarray(second.server.global_present) > 0)
        assert g_present.all()
        p = np.where(own[:, None], np.asarray(st["protos"]), g)
        score = r @ p.T
        np.testing.assert_array_equal(
            np.asarray(model.apply(personal, x)).argmax(1), score.argmax(1))
        # A class it lacks is scored by the global prototype (tiny clients hold all).
        lacking = {**st, "has": st["has"].at[3].set(0.0),
                   "protos": st["protos"].at[3].set(0.0)}
        head = algo.personal_variables(second.server, lacking)["params"]["head"]
        np.testing.assert_allclose(np.asarray(head["kernel"])[:, 3], g[3], rtol=1e-6)


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
