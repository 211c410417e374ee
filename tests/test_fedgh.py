"""FedGH: the server's head training against full-batch and sequential SGD by hand, the
clients' rounds (global head in, prototypes out), and clients of several networks through
the stacked path of engine.groups."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.personal.fedgh import fedgh, train_head
from fedjax_pan.algorithms.local import FEATURES
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

WORK = LocalWork(batch_size=8, epochs=2.0)  # one training epoch, one prototype pass


def _head_ce(h, x, y):
    logits = x @ h["kernel"] + h["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.reference("algorithm", "fedgh")
def test_one_batch_is_a_full_gradient_step_and_small_batches_are_sgd_in_some_order():
    rng = np.random.default_rng(0)
    protos = jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32)  # 3 clients, 4 classes
    has = jnp.asarray([[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]], jnp.float32)
    head = {"kernel": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),
            "bias": jnp.zeros(4, jnp.float32)}
    pairs = [(0, 0), (0, 2), (1, 3)]
    x = jnp.stack([protos[m, j] for m, j in pairs])
    y = jnp.asarray([j for _, j in pairs])
    g = jax.grad(_head_ce)(head, x, y)
    want = jax.tree_util.tree_map(lambda p, gp: p - 0.5 * gp, head, g)
    got = train_head(head, protos, has, 0.5, 64, jax.random.PRNGKey(1))
    assert max_rel_err(got, want) < 1e-6
    # Batches of one: SGD over the three pairs in one of their 6 orders, nothing else.
    got = train_head(head, protos, has, 0.5, 1, jax.random.PRNGKey(2))
    errs = []
    for order in itertools.permutations(range(3)):
        h = head
        for i in order:
            gi = jax.grad(_head_ce)(h, x[i:i + 1], y[i:i + 1])
            h = jax.tree_util.tree_map(lambda p, gp: p - 0.5 * gp, h, gi)
        errs.append(max_rel_err(got, h))
    assert min(errs) < 1e-6 and max(errs) > 1e-3


def _setup(hidden=(24, 16), seed=0):
    _, cd = tiny_clients([27, 39, 19, 36, 62, 13])
    model = models.build("mlp", 10, hidden=list(hidden))
    variables = models.init(model, jax.random.PRNGKey(seed), (6, 6, 1))
    return cd, model, variables, optax.sgd(0.1, momentum=0.9)


@pytest.mark.slow
def test_a_round_trains_from_the_global_head_and_reports_the_trained_models_prototypes():
    cd, model, variables, tx = _setup()
    algo = fedgh(model, tx, 0.5, server_lr=0.5, batch_size=8, seed=3)
    sim = Simulation(algo, cd, WORK, make_executor("loop", algo, WORK, cd, variables, 3),
                     participation=0.5, aggregation="num_examples", seed=7)
    state = sim.init(variables)
    first, _ = sim.round(state)
    assert max_rel_err(first.server.head, state.server.head) > 1e-3  # trained
    out = sim.client_updates(first)  # round 1's clients, from round 1's global head
    second, _ = sim.round(first)
    for m, k in enumerate(sim.sample(1)):
        rows = np.asarray(cd.index_table[k][:cd.sizes[k]])
        mine = jax.tree_util.tree_map(lambda v: v[k], second.client_states)
        _, st = model.apply(mine, cd.images[rows], mutable=["intermediates"])
        z, y = np.asarray(st["intermediates"][FEATURES]), np.asarray(cd.labels[rows])
        for j in range(10):
            if (y == j).any():
                np.testing.assert_allclose(out[m]["protos"][j], z[y == j].mean(0),
                                           rtol=2e-5, atol=1e-6)
            else:
                assert float(out[m]["has"][j]) == 0
        # Scored with its own body and the current global head.
        personal = algo.personal_variables(second.server, mine)
        assert max_rel_err(personal["params"]["head"], second.server.head) == 0
        assert max_rel_err(personal["params"]["fc1"], mine["params"]["fc1"]) == 0


@pytest.mark.slow
def test_groups_run_the_stacked_server_and_one_group_is_the_simulation():
    cd, model, variables, tx = _setup()
    algo = fedgh(model, tx, 0.5, batch_size=8, seed=3)
    sim = Simulation(algo, cd, WORK, make_executor("vmap", algo, WORK, cd, variables, 3),
                     participation=0.5, aggregation="num_examples", seed=7)
    want = sim.init(variables)
    for _ in range(2):
        want, _ = sim.round(want)
    services = Services(cd, WORK, participation=0.5, seed=7, strategy="vmap")
    for arch in (np.zeros(6, int), np.arange(6) % 2):
        k = int(arch.max()) + 1
        g = Groups([model] * k, [variables] * k, arch, [algo] * k, services, "num_examples")
        state = g.init(None)
        for _ in range(2):
            state, stats = g.round(state)
        for server in state.server:
            assert max_rel_err(server.head, want.server.head) < 1e-5
    deep = models.build("mlp", 10, hidden=[32, 16])
    dvars = models.init(deep, jax.random.PRNGKey(1), (6, 6, 1))
    g = Groups([model, deep], [variables, dvars], np.arange(6) % 2,
               [algo, fedgh(deep, tx, 0.5, batch_size=8, seed=3)], services, "num_examples")
    state, stats = g.round(g.init(None))
    assert max_rel_err(state.server[0].head, state.server[1].head) == 0
    assert stats["download_bytes"] == 3 * (16 * 10 + 10) * 4


def test_bad_options_are_refused():
    _, model, _, tx = _setup()
    with pytest.raises(ValueError, match=r"fedgh.server_lr must be a number in \(0, .*got 0.0"):
        fedgh(model, tx, 0.5, server_lr=0.0)
