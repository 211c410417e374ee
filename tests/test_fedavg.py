"""FedAvg against centralised SGD, hand-computed server optimisers, and BN-N state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.clients import epoch_order


@pytest.mark.reference("algorithm", "fedavg")
def test_one_client_full_participation_equals_centralised_sgd():
    """K=1, R=1, server SGD(1): the global model after a round is the local SGD result."""
    _, cd = tiny_clients([45])
    model = models.build("mlp", 10, hidden=[16], pan={"kind": "mul", "amplitude": 0.2})
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    tx = client_optimizer(0.1, momentum=0.9, weight_decay=1e-4, grad_clip=1.0)
    algo = fedavg(model, client_optimizer(0.1, momentum=0.9, weight_decay=1e-4, grad_clip=1.0,
                                          warmup="steps", warmup_length=4))
    work = LocalWork(batch_size=10, epochs=2)  # 5 batches/epoch, last one of 5 examples
    ex = make_executor("vmap", algo, work, cd, variables, 1)
    sim = Simulation(algo, cd, work, ex, participation=1.0, seed=0)
    state = sim.init(variables)
    cohort = sim.cohort(state, 0)
    state, _ = sim.round(state)

    # Centralised SGD written out by hand over the same batches.
    images, labels = np.asarray(cd.images), np.asarray(cd.labels)
    params, opt = variables["params"], tx.init(variables["params"])

    def loss(p, x, y):
        ce = optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y)
        return jnp.mean(ce)

    t = 0
    for epoch in range(2):
        order = np.asarray(epoch_order(cohort.data_keys[0], epoch, 45, cd.max_size))[:45]
        for b in range(5):
            rows = np.asarray(cd.index_table[0])[order[b * 10:(b + 1) * 10]]
            g = jax.grad(loss)(params, jnp.asarray(images[rows]), jnp.asarray(labels[rows]))
            upd, opt = tx.update(g, opt, params)
            warm = min((t + 1) / 4, 1.0)
            params = optax.apply_updates(params, jax.tree_util.tree_map(lambda u: u * warm, upd))
            t += 1
    assert max_rel_err(state.server.params, params) < 1e-5


@pytest.mark.reference("algorithm", "fedavg")
def test_server_optimizers_follow_the_pseudo_gradient():
    model = models.build("mlp", 10, hidden=[4])
    variables = models.init(model, jax.random.PRNGKey(0), (2, 2, 1))
    p0 = variables["params"]
    delta1 = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 0.2), p0)
    delta2 = jax.tree_util.tree_map(lambda x: jnp.full_like(x, -0.1), p0)
    algo = fedavg(model, optax.sgd(0.1), server_tx=optax.sgd(0.5, momentum=0.9))  # FedAvgM
    s = algo.server_init(variables)
    s = algo.server_update(s, {"delta": delta1, "model_state": {}}, None)
    s = algo.server_update(s, {"delta": delta2, "model_state": {}}, None)
    # momentum buffer: m1 = -0.2, m2 = 0.9 * m1 + 0.1 = -0.08; p = p0 + 0.5*0.2 + 0.5*0.08
    want = jax.tree_util.tree_map(lambda x: x + 0.5 * 0.2 + 0.5 * 0.08, p0)
    assert max_rel_err(s.params, want, floor=1.0) < 1e-6
    assert int(s.round) == 2
    plain = fedavg(model, optax.sgd(0.1))  # server SGD(1): p + mean delta
    s = plain.server_update(plain.server_init(variables),
                            {"delta": delta1, "model_state": {}}, None)
    assert max_rel_err(s.params, jax.tree_util.tree_map(lambda x: x + 0.2, p0), floor=1.0) < 1e-6


def test_bn_local_keeps_statistics_per_client():
    _, cd = tiny_clients([30, 30, 30, 30])
    model = models.build("mlp", 10, hidden=[8], norm="batch")
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    algo = fedavg(model, client_optimizer(0.05), bn="local")
    work = LocalWork(batch_size=10, epochs=1)
    sim = Simulation(algo, cd, work, make_executor("loop", algo, work, cd, variables, 2),
                     participation=0.5, seed=0)
    state = sim.init(variables)
    init_mean = np.asarray(variables["batch_stats"]["fc1_norm"]["mean"])
    sampled = sim.sample(0)
    state, _ = sim.round(state)
    stored = np.asarray(state.client_states["batch_stats"]["fc1_norm"]["mean"])
    for k in range(4):
        changed = not np.allclose(stored[k], init_mean)
        assert changed == (k in sampled), k
    # A client resumes from its own statistics, not the global ones.
    k = int(sampled[0])
    local = algo.client_init(state.server, jax.tree_util.tree_map(lambda x: x[k],
                                                                  state.client_states), None)
    np.testing.assert_array_equal(local.model_state["batch_stats"]["fc1_norm"]["mean"], stored[k])
