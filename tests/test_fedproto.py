"""FedProto: prototype averaging against NumPy, the class means collected from the
training steps (PFLlib's clientproto.py), one step's objective by hand, nearest-prototype
scoring, lam = 0 as Local; clients of several networks (engine.groups) against the
one-network simulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.fedproto import fedproto, nearest_prototype_head, proto_loss
from fedjax_pan.algorithms.local import FEATURES
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

SIZES = [27, 39, 19, 36, 62, 13]
WORK = LocalWork(batch_size=8, epochs=2.0)
LAM = 0.7


def _setup(hidden=(24, 16), seed=0):
    _, cd = tiny_clients(SIZES)
    model = models.build("mlp", 10, hidden=list(hidden))
    variables = models.init(model, jax.random.PRNGKey(seed), (6, 6, 1))
    return cd, model, variables, optax.sgd(0.1, momentum=0.9)


def _simulation(algo, cd, variables, work=WORK, strategy="vmap", participation=0.5):
    return Simulation(algo, cd, work, make_executor(strategy, algo, work, cd, variables, 3),
                      participation=participation, aggregation="num_examples", seed=7)


def _features(model, variables, x):
    _, state = model.apply(variables, x, mutable=["intermediates"])
    return np.asarray(state["intermediates"][FEATURES], np.float64)


@pytest.mark.reference("algorithm", "fedproto")
@pytest.mark.slow
def test_global_prototypes_average_the_clients_class_means():
    """At learning rate 0 every step sees the initial model, so a client's class means
    are those of the initial model over its data (each example counted in both epochs)."""
    cd, model, variables, _ = _setup()
    sim = _simulation(fedproto(model, optax.sgd(0.0), lam=LAM), cd, variables)
    state, stats = sim.round(sim.init(variables))
    ids = sim.sample(0)
    sums, has = np.zeros((10, 16)), np.zeros(10)
    for k in ids:
        rows = np.asarray(cd.index_table[k][:cd.sizes[k]])
        z, y = _features(model, variables, cd.images[rows]), np.asarray(cd.labels[rows])
        for j in np.unique(y):
            sums[j] += cd.sizes[k] * z[y == j].mean(0)
            has[j] += cd.sizes[k]
    present = has > 0
    np.testing.assert_array_equal(np.asarray(state.server.present), present.astype(float))
    np.testing.assert_allclose(np.asarray(state.server.protos)[present],
                               sums[present] / has[present][:, None], rtol=2e-5, atol=1e-6)
    # Each client trains on its data twice (two epochs) and makes no other pass.
    assert stats["real_examples"] == sum(2 * cd.sizes[k] for k in ids)


@pytest.mark.reference("algorithm", "fedproto")
def test_class_means_come_from_every_training_step_in_train_mode():
    """PFLlib's clientproto.py records rep = model.base(x) of each training batch (train
    mode, the parameters before that batch's step) over every epoch: with BatchNorm, the
    batch's own statistics, not the running ones."""
    _, cd = tiny_clients(SIZES)
    model = models.build("mlp", 10, hidden=[24, 16], norm="batch")
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    algo = fedproto(model, optax.sgd(0.2), lam=LAM)
    server = algo.server_init(variables)
    server = server._replace(protos=jax.random.normal(jax.random.PRNGKey(1),
                                                      server.protos.shape),
                             present=jnp.ones(10))
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 3, 20, 0, 1, jnp.ones(10)))
    sums, counts = np.zeros((10, 16)), np.zeros(10)
    state = {k: v for k, v in variables.items() if k != "params"}
    params = variables["params"]
    for i in range(3):
        rows = slice(8 * i, 8 * i + 8)
        batch = {"x": cd.images[rows], "y": cd.labels[rows],
                 "mask": jnp.ones(8).at[7].set(0.0 if i == 1 else 1.0)}
        _, st = model.apply({"params": params, **state}, batch["x"], train=True,
                            mask=batch["mask"], mutable=["intermediates", *state])
        z, y, m = (np.asarray(st["intermediates"][FEATURES], np.float64),
                   np.asarray(batch["y"]), np.asarray(batch["mask"]))
        for j in range(8):
            sums[y[j]] += m[j] * z[j]
            counts[y[j]] += m[j]
        local, _ = algo.client_step(local, batch, server)
        params, state = local.train.params, local.train.model_state
    out, _ = algo.client_output(local, server)
    has = counts > 0
    np.testing.assert_array_equal(np.asarray(out["has"]), has.astype(float))
    np.testing.assert_allclose(np.asarray(out["protos"])[has],
                               sums[has] / counts[has][:, None], rtol=1e-5, atol=1e-6)
    # Not the eval-mode features (running statistics) of the same model.
    eval_z = _features(model, {"params": variables["params"], **{
        k: v for k, v in variables.items() if k != "params"}}, cd.images[:8])
    _, st = model.apply(variables, cd.images[:8], train=True, mask=jnp.ones(8),
                        mutable=["intermediates", "batch_stats"])
    assert np.abs(eval_z - np.asarray(st["intermediates"][FEATURES])).max() > 1e-3


@pytest.mark.reference("algorithm", "fedproto")
def test_a_step_minimises_ce_plus_lam_times_the_distance_to_the_prototypes():
    cd, model, variables, _ = _setup()
    tx = optax.sgd(0.2)
    algo = fedproto(model, tx, lam=LAM)
    server = algo.server_init(variables)
    protos = jax.random.normal(jax.random.PRNGKey(1), server.protos.shape)
    present = jnp.asarray([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], jnp.float32)
    server = server._replace(protos=protos, present=present)
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 6, 20, 0, 1, jnp.ones(10)))
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8).at[7].set(0)}
    y, m = np.asarray(batch["y"]), np.asarray(batch["mask"])

    def objective(p):
        logits, state = model.apply({"params": p}, batch["x"], mutable=["intermediates"])
        z = state["intermediates"][FEATURES]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        use = jnp.asarray(m * np.asarray(present)[y])
        mse = jnp.sum(use[:, None] * (z - protos[batch["y"]]) ** 2) / (7 * z.shape[1])
        return jnp.sum(ce * batch["mask"]) / 7 + LAM * mse
    want = jax.tree_util.tree_map(lambda w, g: w - 0.2 * g, variables["params"],
                                  jax.grad(objective)(variables["params"]))
    new, metrics = algo.client_step(local, batch, server)
    assert max_rel_err(new.train.params, want) < 1e-5
    assert float(metrics["proto_sum"]) > 0
    assert float(proto_loss(jnp.ones((2, 3)), jnp.array([2, 6]), jnp.ones(2), protos[:, :3],
                            present)) == 0  # classes without prototypes add nothing


def test_clients_are_scored_by_their_nearest_prototype():
    rng = np.random.default_rng(0)
    protos = rng.normal(size=(10, 5))
    present = np.ones(10)
    present[[3, 8]] = 0
    head = nearest_prototype_head(jnp.asarray(protos, jnp.float32),
                                  jnp.asarray(present, jnp.float32))
    z = rng.normal(size=(40, 5))
    logits = z @ np.asarray(head["kernel"]) + np.asarray(head["bias"])
    d = ((z[:, None] - protos[None]) ** 2).sum(-1)
    d[:, present == 0] = np.inf
    np.testing.assert_array_equal(logits.argmax(1), d.argmin(1))


@pytest.mark.slow
def test_lam_zero_trains_each_clients_model_as_local_training_does():
    cd, model, variables, tx = _setup()
    sim = _simulation(fedproto(model, tx, lam=0.0), cd, variables)
    local = partial_sharing(model, tx, PERSONAL["local"])
    ref = _simulation(local, cd, variables)
    a, b = sim.init(variables), ref.init(variables)
    for _ in range(2):
        a, _ = sim.round(a)
        b, _ = ref.round(b)
    from flax import traverse_util
    mine = traverse_util.flatten_dict(jax.device_get(a.client_states["params"]), sep="/")
    for key, theirs in b.client_states["params"].items():
        np.testing.assert_allclose(mine[key], theirs, rtol=1e-6, atol=1e-7)
    # Before any prototype a client scores its own head; after, its prototype head.
    first = jax.tree_util.tree_map(lambda v: v[0], sim.init(variables).client_states)
    assert max_rel_err(fedproto(model, tx).personal_variables(
        sim.init(variables).server, first), first) == 0


def _groups(algorithms, nets, initial, cd, arch):
    services = Services(cd, WORK, participation=0.5, seed=7, strategy="vmap")
    return Groups(nets, initial, arch, algorithms, services, "num_examples")


@pytest.mark.slow
def test_groups_of_one_network_give_the_simulations_numbers():
    """One group over every client is the Simulation exactly; the same network split
    into two groups, to float32 rounding of the sums' order."""
    cd, model, variables, tx = _setup()
    algo = fedproto(model, tx, lam=LAM)
    sim = _simulation(algo, cd, variables)
    want = sim.init(variables)
    for _ in range(2):
        want, _ = sim.round(want)
    for arch, exact in ((np.zeros(6, int), True), (np.arange(6) % 2, False)):
        k = int(arch.max()) + 1
        g = _groups([algo] * k, [model] * k, [variables] * k, cd, arch)
        state = g.init(None)
        for _ in range(2):
            state, stats = g.round(state)
        for server in state.server:
            err = max_rel_err(server.protos, want.server.protos)
            assert (err == 0) if exact else err < 1e-5
        for a, ids in enumerate(g.ids):
            assert max_rel_err(state.client_states[a],
                               jax.tree_util.tree_map(lambda v: v[ids],
                                                      want.client_states)) < 1e-5
        nets = g.personal_groups(state)
        assert [list(ids) for _, ids, _ in nets] == [list(ids) for ids in g.ids]


@pytest.mark.slow
def test_networks_of_several_architectures_share_prototypes():
    cd, model, variables, tx = _setup()
    deep, dvars = _setup(hidden=(32, 24, 16), seed=1)[1:3]
    algos = [fedproto(m, tx, lam=LAM) for m in (model, deep)]
    g = _groups(algos, [model, deep], [variables, dvars], cd, np.arange(6) % 2)
    state = g.init(None)
    state, stats = g.round(state)
    a, b = state.server
    assert max_rel_err(a.protos, b.protos) == 0 and float(jnp.sum(a.present)) > 0
    assert stats["download_bytes"] == 3 * (10 * 16 * 4 + 10 * 4)
    # Different feature widths cannot share prototypes: refused before training.
    wide = models.build("mlp", 10, hidden=[20])
    wvars = models.init(wide, jax.random.PRNGKey(2), (6, 6, 1))
    with pytest.raises(ValueError, match=r"architecture 1 \(MLP\) sends outputs shaped"):
        _groups([algos[0], fedproto(wide, tx)], [model, wide], [variables, wvars], cd,
                np.arange(6) % 2)


@pytest.mark.slow
def test_config_runs_several_networks_and_refuses_them_elsewhere(tmp_path):
    from fedjax_pan.run import experiment
    from test_experiment import config, metrics
    archs = "mlp(hidden=(32, 16)); mlp(hidden=(16,))"
    with pytest.raises(experiment.ConfigError,
                       match=r"^config.model.architectures runs clients of several networks, "
                             r"which algorithm 'fedavg' cannot .*fedproto"):
        experiment.build(config(model__architectures=archs))
    with pytest.raises(experiment.ConfigError, match=r"model.architectures"):
        experiment.build(config(model__architectures="mlp(hidden=-3)"))
    cfg = dict(algorithm="fedproto", model__architectures=archs, rounds=2,
               partition__test_fraction=0.25, local__epochs=2.0)
    experiment.train(config(**cfg), str(tmp_path / "a"), progress=False)
    rows = metrics(tmp_path / "a")
    assert len(rows) == 2 and 0 <= rows[-1]["pfl_accuracy"] <= 1
    assert rows[-1]["download_bytes_per_client"] == 10 * 16 * 4 + 10 * 4
