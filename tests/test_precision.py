"""Mixed precision (models/precision.py): bfloat16 compute on float32 weights, float32
unchanged, matmul precision for a run's duration, and every algorithm under bfloat16."""

import contextlib
import io
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, needs_fmnist
from fedjax_pan import models
from fedjax_pan.algorithms import local, registry
from fedjax_pan.config import defaults, schema
from fedjax_pan.engine.simulation import Simulation
from fedjax_pan.errors import ConfigError
from fedjax_pan.models import precision
from fedjax_pan.run import experiment

SHAPE = (6, 6, 2)


def _net():
    # BatchNorm and a PAN: the parts that could pull a bfloat16 pass back to float32.
    net = models.build("cnn", 10, channels=(4, 8), fc_hidden=(8,), norm="batch",
                       pan={"kind": "mul", "period": 1.0, "amplitude": 0.1})
    return net, models.init(net, jax.random.PRNGKey(0), SHAPE)


def _batch(n=4):
    x = jax.random.normal(jax.random.PRNGKey(1), (n, *SHAPE))
    return {"x": x, "y": jnp.arange(n) % 10, "mask": jnp.ones(n)}


def _products(fn, *args):
    """The dtypes of the operands of every matrix product and convolution `fn` traces."""
    eqns, todo = [], [jax.make_jaxpr(fn)(*args).jaxpr]
    while todo:  # into pjit / custom_vjp sub-jaxprs
        jaxpr = todo.pop()
        for e in jaxpr.eqns:
            eqns.append(e)
            todo += [v.jaxpr if hasattr(v, "jaxpr") else v for v in e.params.values()
                     if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")]
    return [tuple(str(v.aval.dtype) for v in e.invars) for e in eqns
            if e.primitive.name in ("dot_general", "conv_general_dilated")]


def test_bfloat16_forward_computes_in_bfloat16_and_returns_float32():
    net, variables = _net()
    mixed = precision.policy(net, "bfloat16")
    b = _batch()

    def train_pass(v):
        return mixed.apply(v, b["x"], train=True, mask=b["mask"],
                           mutable=["batch_stats", "intermediates"])
    products = _products(train_pass, variables)
    assert len(products) == 4  # two convs, the hidden FC and the head
    assert all(dtypes == ("bfloat16", "bfloat16") for dtypes in products), products
    assert all(d == ("float32", "float32") for d in _products(
        lambda v: net.apply(v, b["x"], train=False), variables))
    logits, state = train_pass(variables)
    leaves = jax.tree_util.tree_leaves((logits, state))
    assert {str(x.dtype) for x in leaves} == {"float32"}
    # Statistics updated from a bfloat16 pass, kept in float32; close to float32's.
    ref_logits, ref_state = net.apply(variables, b["x"], train=True, mask=b["mask"],
                                      mutable=["batch_stats"])
    for a, r in zip(jax.tree_util.tree_leaves(state["batch_stats"]),
                    jax.tree_util.tree_leaves(ref_state["batch_stats"])):
        np.testing.assert_allclose(a, r, rtol=0.05, atol=0.02)
    scale = float(jnp.max(jnp.abs(ref_logits)))
    assert float(jnp.max(jnp.abs(logits - ref_logits))) < 0.05 * scale
    assert not np.array_equal(logits, ref_logits)  # bfloat16 did change something


def test_weights_gradients_and_optimiser_state_stay_float32():
    net, variables = _net()
    mixed = precision.policy(net, "bfloat16")
    tx = local.client_optimizer(0.1, 0.9, 1e-4, 10.0)
    state = local.init_local(tx, variables, 0)
    loss = lambda p: local.mean_loss(mixed, p, state.model_state, _batch())[0]  # noqa: E731
    # The backward pass's products in bfloat16 too (forward 4, two per layer backward).
    products = _products(jax.grad(loss), state.params)
    assert len(products) > 4 and set(products) == {("bfloat16", "bfloat16")}, products
    grads = jax.grad(loss)(state.params)
    ref = jax.grad(lambda p: local.mean_loss(net, p, state.model_state, _batch())[0])(
        state.params)
    assert {str(g.dtype) for g in jax.tree_util.tree_leaves(grads)} == {"float32"}
    flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)])  # noqa: E731
    error = float(jnp.linalg.norm(flat(grads) - flat(ref)))
    assert error < 0.05 * float(jnp.linalg.norm(flat(ref)))
    new, metrics = jax.jit(lambda s, b: local.sgd_step(mixed, tx, s, b))(state, _batch())
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(
        (new.params, new.model_state, new.opt_state, metrics["loss_sum"]))} == {"float32"}


def test_float32_is_the_model_itself_and_the_wrapper_reads_as_the_model():
    net, variables = _net()
    assert precision.policy(net, "float32") is net
    assert precision.policy(net) is net
    mixed = precision.policy(net, "bfloat16")
    # What permutation specs, layer orders and evaluation read of a model.
    assert mixed.weight_layers() == net.weight_layers() and mixed.num_classes == 10
    assert models.layer_order(mixed, variables["params"]) == \
        models.layer_order(net, variables["params"])
    assert hash(mixed) == hash(precision.policy(net, "bfloat16"))  # a static jit argument
    with pytest.raises(ValueError, match="float16"):
        precision.policy(net, "float16")


def test_matmul_precision_is_set_inside_and_restored_after():
    x = jnp.ones((2, 2))
    before = jax.config.jax_default_matmul_precision

    def traced():
        return [e.params.get("precision") for e in jax.make_jaxpr(jnp.matmul)(x, x).eqns]
    with precision.matmul_precision("highest"):
        assert traced() == [(jax.lax.Precision.HIGHEST,) * 2]
    with precision.matmul_precision("default"):
        assert jax.config.jax_default_matmul_precision == before
    assert jax.config.jax_default_matmul_precision == before and traced() == [None]
    with pytest.raises(ValueError, match="fastest"):
        precision.matmul_precision("fastest")


def _config(**changes):
    cfg = defaults.default_config()
    cfg.dataset.name = "synthetic"
    cfg.dataset.train_limit = 400
    cfg.partition.num_clients, cfg.participation, cfg.rounds = 4, 0.5, 1
    cfg.local.epochs, cfg.local.batch_size = 1.0, 50
    cfg.model.options = {"hidden": [16]}
    return defaults.set_keys(cfg, changes)


def test_each_variant_runs_at_its_own_matmul_precision(tmp_path, monkeypatch):
    seen = []
    round_ = Simulation.round

    def watched(self, state):
        seen.append(jax.config.jax_default_matmul_precision)
        return round_(self, state)
    monkeypatch.setattr(Simulation, "round", watched)
    cfg = _config()
    cfg.variants = {"high": {"execution": {"matmul_precision": "high"}},
                    "plain": {}}
    before = jax.config.jax_default_matmul_precision
    experiment.run(cfg, str(tmp_path / "w"), progress=False)
    assert seen == ["high", before]
    assert jax.config.jax_default_matmul_precision == before


def test_a_bfloat16_run_trains_float32_weights(tmp_path):
    summary = experiment.train(_config(**{"execution.precision": "bfloat16"}),
                               str(tmp_path / "w"), progress=False)
    assert isinstance(summary.experiment.model, precision.MixedPrecision)
    server = summary.state.server
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(server)
            if jnp.issubdtype(x.dtype, jnp.floating)} == {"float32"}
    assert np.isfinite(summary["final_loss"]) and summary["final_accuracy"] > 0


@pytest.mark.parametrize("key,value", [("precision", "float16"),
                                       ("matmul_precision", "tf32")])
def test_unknown_precisions_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"config.execution.{key} must be one of"):
        schema.validate(_config(**{f"execution.{key}": value}))


@pytest.mark.parametrize("algorithm,changes", [
    ("fedma", {}), ("fedkd", {}), ("fml", {}),
    ("ktpfl", {"ktpfl.architectures": "mlp(hidden=(8,));mlp(hidden=(16,))",
               "ktpfl.distill_epochs": 0.5})])
def test_algorithms_building_their_own_networks_refuse_bfloat16(algorithm, changes):
    changes = {"algorithm": algorithm, "partition.test_fraction": 0.25, **changes}
    schema.validate(_config(**changes))  # float32: accepted
    with pytest.raises(ConfigError, match=r"^config\.execution\.precision='bfloat16' is "
                       r"not available with algorithm .*set execution\.precision='float32'$"):
        schema.validate(_config(**changes, **{"execution.precision": "bfloat16"}))


# --- slow: every algorithm on the smoke preset, and the accuracy script's smoke preset ---

SMOKE = "--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py") + ":smoke"


def _needs(name):
    """What an algorithm needs on the smoke preset whatever the precision."""
    out = ["--config.partition.test_fraction=0.25"]  # personalised ones and Siren score on it
    if name == "fed2":
        out.append("--config.model.options.grouped={'groups': 2, 'depth': 2}")
    if name == "fedma":
        out.append("--config.pan.amplitude=0.0")
    return out


@needs_fmnist
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(registry.ALGORITHMS))
def test_every_algorithm_runs_or_refuses_under_bfloat16(name, tmp_path):
    from fedjax_pan.run import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main.main(["prog", SMOKE, f"--workdir={tmp_path / 'w'}", "--noprogress",
                          "--config.rounds=1", f"--config.algorithm={name}",
                          "--config.execution.precision=bfloat16", *_needs(name)])
    lines = err.getvalue().strip().splitlines()
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("error: config.execution.precision"), \
            lines
        assert not (tmp_path / "w").exists()
    else:
        assert code == 0, lines
        row = experiment.read_metrics(str(tmp_path / "w" / "metrics.jsonl"), 1)[-1]
        assert np.isfinite(row["train_loss"]) and np.isfinite(row["test_loss"])


def test_the_accuracy_script_runs_the_main_jobs_fedavg_in_each_precision():
    from experiments import precision as script
    s = script.PRESETS["cpu"]
    assert script.PRESETS["default"] == s and s.seeds == (0, 1, 2) and s.tolerance == 0.5
    main_job = script._main_job("compare")
    for p in s.precisions:
        cfg = script.run_config(s, 0.0, p, 2)
        experiment.validate(cfg)
        assert cfg.execution.precision == p and cfg.seed == 2 and not cfg.variants
        # The compare preset's baseline (its pans_off variant of seed 2) but for precision.
        same = experiment.apply_overrides(main_job, main_job.variants.pans_off_s2.to_dict())
        same.execution.precision = p
        assert experiment.config_changes(same.to_dict(), cfg.to_dict()) == \
            ["checkpoint_every"]
    for a, p, seed in [(a, p, seed) for a in script.PRESETS["paper"].amplitudes
                       for p in s.precisions for seed in s.seeds]:
        experiment.validate(script.run_config(script.PRESETS["paper"], a, p, seed))


@pytest.mark.slow
def test_the_accuracy_script_runs_its_smoke_preset(tmp_path):
    from experiments import common
    from experiments import precision as script
    out = str(tmp_path / "p")
    assert script.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    runs = common.read_csv(os.path.join(out, "precision_runs.csv"))
    assert [(r["precision"], r["seed"]) for r in runs] == [("float32", "0"), ("bfloat16", "0")]
    table = {r["precision"]: r for r in common.read_csv(os.path.join(out, "precision.csv"))}
    diff = float(table["bfloat16"]["mean"]) - float(table["float32"]["mean"])
    assert float(table["bfloat16"]["diff_mean"]) == pytest.approx(diff)
    assert float(table["float32"]["mean"]) > 0.5  # the smoke runs learn
    assert table["bfloat16"]["within"] == str(abs(100 * diff) <= 0.5)
    # The bfloat16 run computed in bfloat16: its losses are close to float32's, not equal.
    curves = [common.read_curve(os.path.join(out, "runs", f"off_{p}_s0"))
              for p in ("float32", "bfloat16")]
    losses = np.asarray([[r["train_loss"] for r in c] for c in curves])
    assert not np.array_equal(losses[0], losses[1])
    np.testing.assert_allclose(losses[1], losses[0], rtol=0.02)
    assert os.path.getsize(os.path.join(out, "precision.png")) > 10_000


@needs_fmnist
@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    ["--config.shuffle.n_sf=1.0"],
    ["--config.privacy.clip=1.0", "--config.privacy.noise_multiplier=0.5"],
    ["--config.compression.upload.method=top_k"],
    ["--config.eval.finetune_epochs=1.0", "--config.partition.test_fraction=0.25"],
    ["--config.algorithm=fedproto", "--config.partition.test_fraction=0.25",
     "--config.model.architectures=mlp(hidden=(32,));mlp(hidden=(64, 32))"],
], ids=["shuffle", "privacy", "compression", "finetune", "architectures"])
def test_features_run_under_bfloat16(changes, tmp_path):
    from fedjax_pan.run import main
    w = tmp_path / "w"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main.main(["prog", SMOKE, f"--workdir={w}", "--noprogress", "--config.rounds=1",
                          "--config.execution.precision=bfloat16", *changes]) == 0
    row = experiment.read_metrics(str(w / "metrics.jsonl"), 1)[-1]
    assert np.isfinite(row["train_loss"]) and np.isfinite(row["test_loss"])
