"""FD: two steps' objective and per-class logit records by hand, the server's average of
the clients' class means, lam = 0 as Local, and clients of several widths."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.fd import fd
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

WORK = LocalWork(batch_size=8, epochs=1.5)
LAM = 0.6


def _setup(hidden=(24, 16), seed=0):
    _, cd = tiny_clients([27, 39, 19, 36, 62, 13])
    model = models.build("mlp", 10, hidden=list(hidden))
    variables = models.init(model, jax.random.PRNGKey(seed), (6, 6, 1))
    return cd, model, variables


@pytest.mark.reference("algorithm", "fd")
def test_steps_distil_towards_the_global_logits_and_record_their_own_by_class():
    cd, model, variables = _setup()
    tx = optax.sgd(0.2)
    algo = fd(model, tx, lam=LAM)
    server = algo.server_init(variables)
    teacher = jax.random.normal(jax.random.PRNGKey(1), (10, 10))
    present = jnp.ones(10).at[4].set(0)
    server = server._replace(logits=teacher, present=present)
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 2, 16, 0, 0, jnp.ones(10)))
    params = variables["params"]
    want_sums, want_counts = np.zeros((10, 10)), np.zeros(10)
    for start in (0, 8):
        batch = {"x": cd.images[start:start + 8], "y": cd.labels[start:start + 8],
                 "mask": jnp.ones(8).at[7].set(0.0)}
        y, m = np.asarray(batch["y"]), np.asarray(batch["mask"])

        def objective(p):
            logits = model.apply({"params": p}, batch["x"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            target = jax.nn.softmax(teacher[batch["y"]])
            kd = -jnp.sum(target * jax.nn.log_softmax(logits), -1) * np.asarray(present)[y]
            return (jnp.sum(ce * m) + LAM * jnp.sum(kd * m)) / 7
        logits = np.asarray(model.apply({"params": params}, batch["x"]), np.float64)
        for i in range(7):
            want_sums[y[i]] += logits[i]
            want_counts[y[i]] += 1
        params = jax.tree_util.tree_map(lambda w, g: w - 0.2 * g, params,
                                        jax.grad(objective)(params))
        local, metrics = algo.client_step(local, batch, server)
        assert set(metrics) == {"loss_sum", "num_examples", "distill_sum"}
    assert max_rel_err(local.train.params, params) < 1e-5
    np.testing.assert_allclose(np.asarray(local.sums), want_sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(local.counts), want_counts)
    out, _ = algo.client_output(local, server)
    seen = want_counts > 0
    np.testing.assert_allclose(np.asarray(out["logits"])[seen],
                               want_sums[seen] / want_counts[seen][:, None], rtol=1e-5)
    assert np.all(np.asarray(out["logits"])[~seen] == 0)


@pytest.mark.reference("algorithm", "fd")
def test_the_server_averages_each_class_over_the_clients_reporting_it():
    cd, model, variables = _setup()
    algo = fd(model, optax.sgd(0.1))
    server = algo.server_init(variables)
    a, b = np.zeros((10, 10)), np.zeros((10, 10))
    a[1], a[2], b[2], b[5] = 1.0, 2.0, 4.0, 3.0
    has_a, has_b = np.zeros(10), np.zeros(10)
    has_a[[1, 2]], has_b[[2, 5]] = 1, 1
    wa, wb = 3.0, 1.0  # num_examples weights
    sums = {"logits": jnp.asarray(wa * a + wb * b, jnp.float32),
            "has": jnp.asarray(wa * has_a + wb * has_b, jnp.float32)}
    new = algo.server_update(server, sums, None)
    np.testing.assert_allclose(np.asarray(new.logits)[[1, 2, 5]],
                               [a[1], (3 * a[2] + b[2]) / 4, b[5]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(new.present), (has_a + has_b > 0) * 1.0)


def _simulation(algo, cd, variables):
    return Simulation(algo, cd, WORK, make_executor("vmap", algo, WORK, cd, variables, 3),
                      participation=0.5, aggregation="num_examples", seed=7)


@pytest.mark.slow
def test_lam_zero_is_local_training_and_groups_of_several_widths_share_logits():
    cd, model, variables = _setup()
    tx = optax.sgd(0.1, momentum=0.9)
    states = {}
    for name, algo in (("fd", fd(model, tx, lam=0.0)),
                       ("local", partial_sharing(model, tx, PERSONAL["local"]))):
        sim = _simulation(algo, cd, variables)
        state = sim.init(variables)
        for _ in range(2):
            state, _ = sim.round(state)
        states[name] = state
    from flax import traverse_util
    mine = traverse_util.flatten_dict(jax.device_get(states["fd"].client_states["params"]),
                                      sep="/")
    for key, theirs in states["local"].client_states["params"].items():
        np.testing.assert_allclose(mine[key], theirs, rtol=1e-6, atol=1e-7)
    # One group is the simulation; networks of different widths share the (C, C) logits.
    algo = fd(model, tx, lam=LAM)
    sim = _simulation(algo, cd, variables)
    want, _ = sim.round(sim.init(variables))
    services = Services(cd, WORK, participation=0.5, seed=7, strategy="vmap")
    one = Groups([model], [variables], np.zeros(6, int), [algo], services, "num_examples")
    got, _ = one.round(one.init(None))
    assert max_rel_err(got.server[0].logits, want.server.logits) == 0
    wide = models.build("mlp", 10, hidden=[40])
    wvars = models.init(wide, jax.random.PRNGKey(3), (6, 6, 1))
    mixed = Groups([model, wide], [variables, wvars], np.arange(6) % 2,
                   [algo, fd(wide, tx, lam=LAM)], services, "num_examples")
    state, stats = mixed.round(mixed.init(None))
    assert max_rel_err(state.server[0].logits, state.server[1].logits) == 0
    assert stats["download_bytes"] == 3 * (10 * 10 * 4 + 10 * 4)


def test_bad_options_are_refused():
    _, model, _ = _setup()
    with pytest.raises(ValueError, match=r"fd.lam must be a number in \[0, 10000\], got -1"):
        fd(model, optax.sgd(0.1), lam=-1.0)
