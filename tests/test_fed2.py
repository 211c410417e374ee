"""Fed2 / Psi-Net: feature paired averaging against a numpy computation with the groups
spelled out as slices, trimming against a softmax over the kept classes, upload bytes by
hand, and every strategy against the sequential reference."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err
from fedjax_pan import data, models
from fedjax_pan.algorithms import client_optimizer, fed2, fedavg
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.engine import ClientData, LocalWork, Simulation, make_executor
from fedjax_pan.engine.reference import reference_round

WORK = LocalWork(batch_size=8, epochs=2.0)
SHAPE = (4, 4, 1)
HIDDEN = [20, 20, 20]  # G = 5: fc2 is the first grouped layer (4 outputs per group), fc3
# block-diagonal, then 5 heads; class c belongs to group c // 2.
# The clients' classes: nobody holds classes 8 and 9, so group 4 is never averaged.
CLIENT_CLASSES = [(0, 1, 2, 3), (2, 3, 4, 5), (0, 4, 5), (6, 7, 0)]


def _model():
    return models.build("mlp", 10, hidden=HIDDEN, grouped={"groups": 5, "depth": 3})


@pytest.fixture(scope="module")
def setup():
    """(dataset, client data, parts, model, variables), shared by this module's tests."""
    ds, cd, parts = _clients()
    model = _model()
    return ds, cd, parts, model, models.init(model, jax.random.PRNGKey(0), SHAPE)


def _clients():
    ds = data.synthetic(600, 50, image_shape=SHAPE, seed=3)
    rng = np.random.default_rng(0)
    parts, used = [], set()
    for k, classes in enumerate(CLIENT_CLASSES):
        idx = [i for i in np.flatnonzero(np.isin(ds.train_labels, classes)) if i not in used]
        take = np.sort(rng.choice(idx, 14 + 5 * k, replace=False))
        used.update(take.tolist())
        parts.append(take)
    return ds, ClientData.create(ds.train_images, ds.train_labels, parts, 10), parts


def _tx(warmup="none", length=0):
    return client_optimizer(0.05, 0.9, 1e-5, 100.0, warmup, length)


def _sim(algo, cd, variables, strategy="loop", participation=1.0):
    ex = make_executor(strategy, algo, WORK, cd, variables, 4)
    return Simulation(algo, cd, WORK, ex, participation=participation, seed=5)


def _group_of_entries(params):
    """For each leaf, the group of every entry, written out from the architecture."""
    g = lambda shape, fn: np.fromfunction(fn, shape, dtype=int)  # noqa: E731
    return {
        "fc1": {"kernel": None, "bias": None},  # shared
        "fc2": {"kernel": g(params["fc2"]["kernel"].shape, lambda i, j: j // 4),
                "bias": g((20,), lambda j: j // 4)},
        "fc3": {"kernel": g((5, 4, 4), lambda a, b, c: a), "bias": g((5, 4), lambda a, b: a)},
        "head": {"kernel": g((5, 4, 10), lambda a, b, c: a), "bias": g((10,), lambda c: c // 2)},
    }


@pytest.mark.reference("algorithm", "fed2")
@pytest.mark.parametrize("group_weights", ["class_samples", "presence"])
def test_feature_paired_averaging_by_hand(setup, group_weights):
    ds, cd, parts, model, variables = setup
    # FedAvg's clients train exactly as Fed2's: their deltas are the raw local updates.
    base = fedavg(model, _tx())
    avg_sim = _sim(base, cd, variables)
    state = avg_sim.init(variables)
    deltas = [jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), o["delta"])
              for o in avg_sim.client_updates(state)]
    counts = np.stack([np.bincount(ds.train_labels[p] // 2, minlength=5) for p in parts])
    v = counts.astype(np.float64) if group_weights == "class_samples" else (counts > 0) * 1.0
    owners = _group_of_entries(variables["params"])
    expected = {}
    for layer, leaves in owners.items():
        expected[layer] = {}
        for name, group in leaves.items():
            old = np.asarray(variables["params"][layer][name], np.float64)
            d = np.stack([delta[layer][name] for delta in deltas])
            if group is None:
                mean = d.mean(axis=0)
            else:
                w = v[:, group]  # (clients, *leaf shape)
                den = w.sum(axis=0)
                mean = np.where(den > 0, (w * d).sum(axis=0) / np.where(den > 0, den, 1), 0)
            expected[layer][name] = old + mean

    algo = fed2(model, _tx(), group_weights=group_weights)
    sim = _sim(algo, cd, variables)
    new, _ = sim.round(sim.init(variables))
    assert max_rel_err(new.server.params, expected) < 1e-5
    # Group 4 (classes 8, 9) has no holder: its parameters are exactly unchanged.
    for layer, leaves in owners.items():
        for name, group in leaves.items():
            if group is not None:
                old = np.asarray(variables["params"][layer][name])
                np.testing.assert_array_equal(np.asarray(new.server.params[layer][name])[
                    group == 4], old[group == 4])


@pytest.mark.reference("algorithm", "fed2")
def test_trimmed_step_is_a_step_on_the_kept_classes_softmax(setup):
    ds, cd, parts, model, variables = setup
    algo = fed2(model, _tx(), trim=True)
    server = algo.server_init(variables)
    rows = parts[2][:8]  # client 2 holds classes 0, 4, 5: groups 0 and 2
    batch = {"x": jnp.asarray(ds.train_images[rows], jnp.float32),
             "y": jnp.asarray(ds.train_labels[rows]), "mask": jnp.ones(8)}
    counts = jnp.asarray(np.bincount(ds.train_labels[parts[2]], minlength=10), jnp.float32)
    ctx = ClientContext(jax.random.PRNGKey(0), 1, len(parts[2]), 2, 0, counts)
    got, _ = algo.client_step(algo.client_init(server, None, ctx), batch, server)

    kept = np.asarray([0, 1, 4, 5])  # the classes of groups 0 and 2
    position = np.full(10, -1)
    position[kept] = np.arange(4)

    def kept_softmax(logits, labels, mask):
        return local_lib.masked_cross_entropy(logits[:, kept], jnp.asarray(position)[labels],
                                              mask)
    want, _ = local_lib.sgd_step(model, _tx(), local_lib.init_local(_tx(), variables, 0),
                                 batch, loss=kept_softmax)
    assert max_rel_err(got.train.params, want.params) < 1e-6
    # Without trimming the absent classes' logits are pushed down: a different step.
    untrimmed, _ = fed2(model, _tx()).client_step(algo.client_init(server, None, ctx), batch,
                                                  server)
    assert max_rel_err(untrimmed.train.params, want.params) > 1e-4


def test_upload_bytes_by_hand(setup):
    _, cd, _, model, variables = setup
    n_params = models.count_params(variables)
    shared = 16 * 20 + 20
    per_group = (20 * 4 + 4) + (4 * 4 + 4) + 4 * 10  # fc2 block, fc3 block, head kernel
    held = [sorted({c // 2 for c in classes}) for classes in CLIENT_CLASSES]
    head_bias = [2 * len(h) for h in held]  # two classes per held group
    stats = {}
    for name, algo in (("fedavg", fedavg(model, _tx())), ("fed2", fed2(model, _tx())),
                       ("psi", fed2(model, _tx(), trim=True))):
        sim = _sim(algo, cd, variables)
        stats[name] = sim.round(sim.init(variables))[1]["upload_bytes"]
    assert stats["fedavg"] == 4 * 4 * n_params
    assert stats["fed2"] == 4 * 4 * (n_params + 5)  # and each client's 5 group weights
    trimmed = sum(4 * (shared + len(h) * per_group + b + 5) for h, b in zip(held, head_bias))
    assert stats["psi"] == trimmed < stats["fed2"]


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_strategies_match_the_sequential_reference(setup, strategy):
    _, cd, _, model, variables = setup
    algo = fed2(model, _tx("steps", 3), trim=True)
    sim = _sim(algo, cd, variables, strategy, participation=0.75)
    state = sim.init(variables)
    for _ in range(2):
        ref, _, _ = reference_round(algo, cd, WORK.batch_size, state.server,
                                    sim.cohort(state, state.round))
        state, _ = sim.round(state)
        assert max_rel_err(state.server.params, ref.params) < 1e-5


def test_fed2_runs_from_a_config_and_needs_a_grouped_model(tmp_path):
    from fedjax_pan.run import experiment
    from fedjax_pan.config.defaults import default_config
    from fedjax_pan.errors import ConfigError
    cfg = default_config()
    cfg.dataset.name, cfg.rounds, cfg.algorithm = "synthetic", 2, "fed2"
    cfg.partition.num_clients, cfg.participation, cfg.local.epochs = 8, 0.5, 1.0
    cfg.partition.scheme, cfg.partition.classes_per_client = "pathological", 2
    cfg.partition.alpha = None
    cfg.model.options.hidden = [20, 20]
    cfg.fed2.trim = True
    with pytest.raises(ConfigError, match="fed2 needs a grouped model"):
        experiment.train(cfg, str(tmp_path / "flat"), progress=False)
    cfg.model.options.grouped = {"groups": 5, "depth": 2}
    # Samples weighted twice (w_k = n_k, then n_kg per group): refused before any data.
    cfg.aggregation.weights = "num_examples"
    with pytest.raises(ConfigError, match=r"n_k x n_kg.*'uniform'.*'presence'"):
        experiment.train(cfg, str(tmp_path / "twice"), progress=False)
    cfg.fed2.group_weights = "presence"
    experiment.validate(cfg)
    cfg.aggregation.weights, cfg.fed2.group_weights = "uniform", "class_samples"
    experiment.train(cfg, str(tmp_path / "w"), progress=False)
    with open(tmp_path / "w" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    n = models.count_params(models.init(models.build("mlp", 10, hidden=[20, 20], grouped={
        "groups": 5, "depth": 2}), jax.random.PRNGKey(0), (28, 28, 1)))
    # 4 clients of 2 classes each: none sends all 5 groups.
    assert len(rows) == 2 and all(0 < r["upload_bytes"] < 4 * 4 * n for r in rows)


@pytest.mark.parametrize("name, classes, options, want", [
    ("mlp", 10, {"hidden": [1024] * 3}, {"groups": 10, "depth": 3}),  # one layer shared
    ("mlp", 10, {"hidden": [4, 6, 8]}, {"groups": 6, "depth": 3}),  # fc2's 6 units
    ("mlp", 3, {"hidden": [16]}, {"groups": 3, "depth": 2}),  # a group per class at most
    ("vgg9", 10, {}, {"groups": 10, "depth": 6}),  # the paper's
])
def test_the_suggested_grouping_fits_the_model_it_is_given(name, classes, options, want):
    from fedjax_pan.algorithms.fedavg_family.fed2 import suggested_grouping
    model = models.build(name, classes, **options)
    assert suggested_grouping(model) == want
    with pytest.raises(ValueError, match=r"--config.model.options.grouped=\"\{'groups': "
                                         rf"{want['groups']}, 'depth': {want['depth']}\}}\""):
        fed2(model, client_optimizer(0.1))
    # The grouping builds: its depth fits the model's weight layers, its groups the classes.
    grouped = models.build(name, classes, grouped=want, **options)
    jax.eval_shape(lambda: grouped.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)),
                                        train=False))


def test_models_that_cannot_be_grouped_are_refused_without_a_grouping():
    for model, why in [(models.build("resnet20", 10), "ResNet has no grouped form"),
                       (models.build("mlp", 10, hidden=[]), "this MLP has 1 weight layer")]:
        with pytest.raises(ValueError, match=f"fed2 needs a grouped model, and {why}"):
            fed2(model, client_optimizer(0.1))
