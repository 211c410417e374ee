"""FedMA: layer patching against the network function it must preserve, the class-weighted
head by hand, one client against FedAvg's local model and the exact posterior shrinkage,
widths within their bounds, bytes by hand, strategies and resume agreeing, bad configs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_variables
from fedjax_pan import data, models
from fedjax_pan.config import defaults
from fedjax_pan.run import experiment
from fedjax_pan.pan import permutation as perm_lib
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.algorithms.fedavg_family import fedma
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.engine import ClientData, LocalWork, Simulation, make_executor
from fedjax_pan.engine.services import Services
from fedjax_pan.errors import ConfigError

SHAPE = (4, 4, 1)
WORK = LocalWork(batch_size=8, epochs=2.0)


def _tx():
    return client_optimizer(0.05, 0.9, 1e-5, 100.0)


@pytest.fixture(scope="module")
def clients():
    ds = data.synthetic(400, 50, image_shape=SHAPE, seed=3)
    parts = data.partition(ds.train_labels, 4, "dirichlet_by_client", 0, alpha=0.5,
                           num_classes=10)
    return ClientData.create(ds.train_images, ds.train_labels, parts, 10)


def test_neuron_matrix_round_trip():
    rng = np.random.default_rng(0)
    for shape in [(5, 7), (3, 3, 4, 6)]:
        layer = {"kernel": rng.normal(size=shape).astype(np.float32),
                 "bias": rng.normal(size=shape[-1]).astype(np.float32)}
        rows = fedma.neuron_matrix(layer)
        assert rows.shape == (shape[-1], int(np.prod(shape[:-1])) + 1)
        # Row j holds neuron j's incoming weights, then its bias.
        np.testing.assert_array_equal(rows[2, :-1], layer["kernel"][..., 2].reshape(-1))
        assert rows[2, -1] == layer["bias"][2]
        back = fedma.from_neuron_matrix(rows, shape)
        for k in layer:
            np.testing.assert_array_equal(back[k], layer[k])


@pytest.mark.parametrize("name,options,layer", [
    ("mlp", {"hidden": [6, 5]}, "fc1"),
    ("vgg9", {"channels": [3, 4, 4, 5, 5, 3], "fc_hidden": [7, 6]}, "conv6"),  # flatten
    ("vgg9", {"channels": [3, 4, 4, 5, 5, 3], "fc_hidden": [7, 6]}, "conv2"),
])
def test_widening_a_layer_by_an_assignment_keeps_the_function(name, options, layer):
    """Client neurons moved to global positions (an injective assignment into a wider
    layer), new neurons with arbitrary weights: their patched outgoing weights are zero,
    so the network computes the same logits."""
    model = models.build(name, 10, **options)
    shape = (8, 8, 1)
    variables = jax.tree_util.tree_map(np.asarray, random_variables(model, shape, 0))
    width = models.widths(model)[layer]
    rng = np.random.default_rng(1)
    assign = rng.permutation(width + 3)[:width]
    wide_rows = rng.normal(size=(width + 3, fedma.neuron_matrix(
        variables["params"][layer]).shape[1]))
    wide_rows[assign] = fedma.neuron_matrix(variables["params"][layer])
    spec = perm_lib.spec_for(model, variables)
    wide = fedma.patch_inputs(spec, variables, layer, assign, width + 3)
    wide["params"][layer] = fedma.from_neuron_matrix(
        wide_rows, variables["params"][layer]["kernel"].shape)
    wide_model = models.resized(model, {layer: width + 3})
    x = jnp.asarray(rng.normal(size=(5, *shape)), jnp.float32)
    np.testing.assert_allclose(wide_model.apply(wide, x), model.apply(variables, x),
                               rtol=1e-4, atol=1e-5)
    # The patch itself, by hand: the next layer's input rows moved, the rest zero.
    nxt = [k for k in spec.axes if k[1] != layer and any(
        (e.name if isinstance(e, perm_lib.Flat) else e) == layer for e in spec.axes[k])]
    assert len(nxt) == 1
    old, new = variables["params"][nxt[0][1]]["kernel"], wide["params"][nxt[0][1]]["kernel"]
    if name == "mlp":
        np.testing.assert_array_equal(new[assign], old)
        assert not np.any(np.delete(new, assign, axis=0))


@pytest.mark.reference("algorithm", "fedma")
def test_class_weighted_head_by_hand():
    heads = [{"kernel": np.full((2, 3), 1.0), "bias": np.array([1.0, 1.0, 1.0])},
             {"kernel": np.full((2, 3), 4.0), "bias": np.array([4.0, 4.0, 4.0])}]
    counts = np.array([[3, 0, 0], [1, 5, 0]])
    head = fedma.class_weighted_head(heads, counts)
    # class 0: (3*1 + 1*4)/4; class 1: only client 2; class 2: nobody, plain mean.
    np.testing.assert_allclose(head["bias"], [7 / 4, 4.0, 2.5])
    np.testing.assert_allclose(head["kernel"], np.tile([7 / 4, 4.0, 2.5], (2, 1)))


def _driver(model, clients, participation=1.0, seed=0, strategy="auto", **kw):
    return fedma.FedMA(model, _tx(), Services(clients, WORK, participation, seed, strategy),
                       **kw)


@pytest.mark.reference("algorithm", "fedma")
def test_one_client_returns_its_model_up_to_the_posterior_shrinkage(clients):
    """M = 1 without retraining: the flat-prior limit (sigma0 -> inf) returns the client's
    locally trained model (as FedAvg with that one client computes it); sigma = sigma0 = 1
    returns each hidden layer's posterior mean (w / sigma^2 + mu0 / sigma0^2) /
    (1 / sigma^2 + 1 / sigma0^2) = (w + mu0) / 2, mu0 = 0.1 on biases, and the head as
    trained (after its inputs were matched, by the identity)."""
    model = models.build("mlp", 10, hidden=[12, 9])
    variables = models.init(model, jax.random.PRNGKey(0), SHAPE)
    algo = fedavg(model, _tx())
    sim = Simulation(algo, clients, WORK, make_executor("loop", algo, WORK, clients, variables, 1),
                     participation=0.25, seed=4)
    state, _ = sim.round(sim.init(variables))
    local = jax.tree_util.tree_map(np.asarray, state.server.params)

    flat = _driver(model, clients, participation=0.25, seed=4, sigma0=1e8)
    assert list(flat.sample(0)) == list(sim.sample(0))
    got, stats = flat.round(flat.init(variables))
    for name in ("fc1", "fc2", "head"):
        for leaf in ("kernel", "bias"):
            np.testing.assert_allclose(got.server["params"][name][leaf], local[name][leaf],
                                       rtol=1e-5, atol=1e-6)
    assert stats["train_width_fc1"] == 12 and stats["train_width_fc2"] == 9

    shrunk, _ = _driver(model, clients, participation=0.25, seed=4).round(
        flat.init(variables))
    for name in ("fc1", "fc2"):
        np.testing.assert_allclose(shrunk.server["params"][name]["kernel"],
                                   local[name]["kernel"] / 2, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(shrunk.server["params"][name]["bias"],
                                   (local[name]["bias"] + 0.1) / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shrunk.server["params"]["head"]["kernel"],
                               local["head"]["kernel"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # FedMA rounds on VGG / several strategies
def test_vgg_round_matches_convs_through_the_flatten():
    """A VGG9 round of two clients: every conv and FC layer matched (the conv-to-FC
    flatten patched), widths within bounds, and the grown network evaluates."""
    shape = (16, 16, 1)
    ds = data.synthetic(96, 10, image_shape=shape, seed=1)
    cd = ClientData.create(ds.train_images, ds.train_labels,
                           [np.arange(0, 48), np.arange(48, 96)], 10)
    model = models.build("vgg9", 10, channels=[3, 4, 4, 4, 5, 5], fc_hidden=[6, 6])
    variables = models.init(model, jax.random.PRNGKey(0), shape)
    driver = fedma.FedMA(model, _tx(), Services(cd, LocalWork(batch_size=16, epochs=1.0),
                                                strategy="loop"),
                         LocalWork(batch_size=16, epochs=1.0))
    state, stats = driver.round(driver.init(variables))
    before = models.widths(model)
    after = models.widths(fedma.network_for(model, state.server))
    assert list(after) == list(before) == list(driver.hidden)
    for k in before:
        assert before[k] <= after[k] <= 2 * before[k] and stats[f"train_width_{k}"] == after[k]
    net, params = driver.evaluation(state.server)
    assert params["params"]["fc1"]["kernel"].shape == (2 * 2 * after["conv6"], after["fc1"])
    logits = net.apply(params, jnp.asarray(ds.test_images))
    assert logits.shape == (10, 10) and np.all(np.isfinite(logits))


@pytest.mark.slow  # FedMA rounds on VGG / several strategies
def test_widths_bytes_and_strategies(clients):
    """Two rounds of 4 clients with retraining: each global width lies between the
    clients' width and their sum; bytes as counted by hand; loop and vmap agree."""
    model = models.build("mlp", 10, hidden=[8, 6])
    variables = models.init(model, jax.random.PRNGKey(1), SHAPE)
    retrain = LocalWork(batch_size=8, epochs=1.0)
    runs = {}
    for strategy in ("loop", "vmap"):
        driver = _driver(model, clients, retrain=retrain, strategy=strategy, seed=2)
        state = driver.init(variables)
        history = []
        for _ in range(2):
            before = models.widths(fedma.network_for(model, state.server))
            state, stats = driver.round(state)
            history.append((before, stats))
        runs[strategy] = (state, history)
    for before, stats in runs["loop"][1]:
        widths = {k: int(stats[f"train_width_{k}"]) for k in before}
        for k in before:
            assert before[k] <= widths[k] <= 4 * before[k]
        d_in = {"fc1": 16, "fc2": widths["fc1"]}  # inputs already in the global order
        m = 4  # clients, each sending float32 matched layers and its patched head
        up = sum(m * 4 * before[k] * (d_in[k] + 1) for k in before) + m * 4 * (
            widths["fc2"] * 10 + 10)
        assert stats["upload_bytes"] == up
        model_bytes = 4 * (16 * before["fc1"] + before["fc1"] + before["fc1"] * before["fc2"]
                           + before["fc2"] + before["fc2"] * 10 + 10)
        # The global model, then each global layer and the client's int32 assignment.
        down = m * model_bytes + sum(4 * (m * widths[k] * (d_in[k] + 1) + m * before[k])
                                     for k in before)
        assert stats["download_bytes"] == down
    grown = runs["loop"][1][1][1]
    assert grown["train_width_fc1"] >= 8
    a, b = runs["loop"][0].server, runs["vmap"][0].server
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)


def _config(**overrides):
    c = defaults.default_config()
    c.algorithm = "fedma"
    c.pan.amplitude = 0.0
    c.dataset.name = "synthetic"
    c.partition.num_clients = 4
    c.partition.alpha = 0.5
    c.participation = 1.0
    c.model.options = {"hidden": (10, 8)}
    c.local.epochs = 1.0
    c.local.batch_size = 32
    c.rounds = 2
    c.fedma.retrain_epochs = 1.0
    return defaults.set_keys(c, overrides)


@pytest.mark.slow  # FedMA rounds on VGG / several strategies
def test_config_run_resumes_with_grown_widths(tmp_path):
    straight = tmp_path / "straight"
    experiment.train(_config(), str(straight), progress=False)
    split = tmp_path / "split"
    experiment.train(_config(rounds=1), str(split), progress=False)
    summary = experiment.train(_config(), str(split), resume=True, progress=False)
    assert summary["rounds"] == 2 and summary["processes"] == 2
    rows = [[json.loads(line) for line in open(d / "metrics.jsonl")] for d in (straight, split)]
    for a, b in zip(*rows):
        assert a["train_width_fc1"] == b["train_width_fc1"]
        assert a["upload_bytes"] == b["upload_bytes"] and "download_bytes" in a
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-6)


@pytest.mark.parametrize("overrides,words", [
    ({"pan.amplitude": 0.1}, "pan.amplitude=0"),
    ({"model.norm": "batch"}, "model.norm='none'"),
    ({"model.name": "resnet20", "model.options": {}}, "ResNet"),
    ({"shuffle.n_sf": 1.0}, "shuffle.n_sf=0"),
    ({"fedma.sigma": 0.0}, "config.fedma.sigma"),
])
def test_bad_configs_are_refused(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        experiment.train(_config(**overrides), str(tmp_path / "w"), progress=False)
    assert not (tmp_path / "w").exists()


def test_own_initialisations_in_round_0_as_ibm(clients):
    """own_init: in round 0 each client starts from its own random network. With one
    client, the flat prior and no retraining FedMA returns that client's model, so the
    round equals FedAvg's local training from init(fold_in(fold_in(seed, 0xFED), id))."""
    model = models.build("mlp", 10, hidden=[12, 9])
    variables = models.init(model, jax.random.PRNGKey(0), SHAPE)
    driver = _driver(model, clients, participation=0.25, seed=4, sigma0=1e8, own_init=True)
    (client,) = driver.sample(0)
    own = models.init(model, jax.random.fold_in(jax.random.fold_in(
        jax.random.PRNGKey(4), fedma.OWN_INIT_STREAM), int(client)), SHAPE)
    algo = fedavg(model, _tx())
    sim = Simulation(algo, clients, WORK, make_executor("loop", algo, WORK, clients, own, 1),
                     participation=0.25, seed=4)
    expected, _ = sim.round(sim.init(own))
    got, stats = driver.round(driver.init(variables))
    for name in ("fc1", "fc2", "head"):
        np.testing.assert_allclose(got.server["params"][name]["kernel"],
                                   expected.server.params[name]["kernel"], rtol=1e-5, atol=1e-6)
    assert stats["download_bytes"] == 4 * (12 * 17 + 9 * 13) + 4 * 21  # layers, assignments
    # Later rounds start from the global model as before.
    again, _ = _driver(model, clients, participation=0.25, seed=4, sigma0=1e8,
                       own_init=True).round(got._replace(round=1))
    plain, _ = _driver(model, clients, participation=0.25, seed=4, sigma0=1e8).round(
        got._replace(round=1))
    for a, b in zip(jax.tree_util.tree_leaves(again.server),
                    jax.tree_util.tree_leaves(plain.server)):
        np.testing.assert_array_equal(a, b)


def test_the_config_follows_ibm_for_the_cap_and_the_head_retraining():
    cd = ClientData.create(np.zeros((8, 4, 4, 1), np.float32), np.arange(8) % 10,
                           [np.arange(4), np.arange(4, 8)], 10)
    model = models.build("mlp", 10, hidden=[4])
    cfg = defaults.set_keys(_config(), {"fedma.retrain_epochs": 2.0, "optimizer.lr": 0.05,
                                        "optimizer.momentum": 0.9})
    driver = fedma.from_config(model, cfg, _tx(), Services(cd, WORK))
    assert driver.cap == 700 and not driver.own_init
    assert driver.retrain.epochs == 2.0 and driver.head_retrain.epochs == 6.0
    # The head's optimiser: lr / 10 with weight decay 1e-4 (one SGD step from rest), and
    # the config's warm-up (lr x min((r + 1) / 10, 1)): x 0.1 in round 0, x 1 from round 9.
    params = {"w": jnp.asarray([1.0, -2.0])}
    grads = {"w": jnp.asarray([0.5, 0.25])}
    for r, warm in ((0, 0.1), (9, 1.0)):
        state = local_lib.start_round(driver.head_tx.init(params), r)
        updates, _ = driver.head_tx.update(grads, state, params)
        np.testing.assert_allclose(updates["w"],
                                   -0.005 * warm * (grads["w"] + 1e-4 * params["w"]),
                                   rtol=1e-6)
    same = fedma.from_config(model, defaults.set_keys(cfg, {"fedma.head_retrain": "same",
                                                            "fedma.width_cap": 0}),
                             _tx(), Services(cd, WORK))
    assert same.head_tx is None and same.head_retrain is None and same.cap is None
