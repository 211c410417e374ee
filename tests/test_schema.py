"""Config rules: every leaf of the default config rejects an invalid value of its type."""

import importlib.util
import glob
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from ml_collections.config_dict import FieldReference

from conftest import ROOT, random_variables
from fedjax_pan.config import defaults, schema
from fedjax_pan.run import main
from fedjax_pan import models
from fedjax_pan.algorithms import ClientContext, client_optimizer
from fedjax_pan.algorithms.personal.ditto import ditto
from fedjax_pan.algorithms.personal.ktpfl import soft_predictions
from fedjax_pan.algorithms.fedavg_family.moon import moon
from fedjax_pan.data.partition import partition
from fedjax_pan.errors import ConfigError
from fedjax_pan.pan.matching import bbp_map
from fedjax_pan.rules import Rule, between, boolean

SMOKE = "--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py") + ":smoke"


def typed_leaves(cfg, prefix=""):
    """(dotted key, declared type) for every leaf, placeholders (None) included."""
    for key in cfg.keys():
        field = cfg._fields[key]
        name = prefix + key
        if isinstance(field, FieldReference):
            yield name, field.get_type()
        elif isinstance(field, ml_collections.ConfigDict):
            if name in schema.OPAQUE:
                continue
            yield from typed_leaves(field, name + ".")
        else:
            yield name, type(field)


def invalid_values(kind):
    """Values of `kind` (or, for bool, of no valid spelling) that no setting accepts."""
    if kind is bool:
        return ["maybe"]
    if kind is int:
        return [-1]
    if kind is float:
        return [-1.0, float("nan"), float("inf")]
    if kind is str:
        return ["no-such-value"]
    if kind is tuple:
        return ["(-1,)"]
    raise AssertionError(f"no invalid value for {kind}")


LEAVES = list(typed_leaves(defaults.default_config()))
SIGNED = {"fedma.mu0_bias", "flchain.tamper_scale"}  # any finite number is valid


def test_every_default_leaf_has_a_rule_and_every_rule_a_leaf():
    assert sorted(k for k, _ in LEAVES) == sorted(schema.RULES)


@pytest.mark.parametrize("key,kind", LEAVES, ids=[k for k, _ in LEAVES])
def test_an_invalid_value_of_every_leaf_exits_2_with_one_line(tmp_path, capsys, key, kind):
    workdir = tmp_path / "w"
    for value in invalid_values(kind):
        if key in SIGNED and value == -1.0:  # a prior mean may be negative
            continue
        code = main.main(["prog", SMOKE, f"--workdir={workdir}", "--noprogress",
                          f"--config.{key}={value}"])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, (key, value, err)
        assert len(lines) == 1 and lines[0].startswith("error:"), (key, value, err)
        assert key.rsplit(".", 1)[-1] in lines[0], (key, value, err)
        assert "Unknown command line flag" not in lines[0], (key, value, err)
        assert not workdir.exists()


def test_the_issue_examples_are_refused_with_their_range():
    cases = {"pan.amplitude": -0.5, "dataset.train_limit": -5, "eval.batch_size": 0,
             "seed": -1, "execution.block_size": 0, "optimizer.momentum": 1.0,
             "optimizer.lr": math.inf, "partition.alpha": 0.0}
    for key, value in cases.items():
        cfg = defaults.default_config()
        node, last = cfg, key.split(".")
        for part in last[:-1]:
            node = node[part]
        with cfg.unlocked():
            node[last[-1]] = value
        with pytest.raises(ConfigError, match=rf"config\.{key} must be .*got {value!r}"):
            schema.validate(cfg)


def test_unknown_keys_name_the_nearest_valid_ones():
    assert "did you mean optimizer.momentum?" in schema.unknown_key("optimizer.momentun",
                                                                     schema.RULES)
    msg = schema.unknown_key("optimizer.foo", schema.RULES)
    assert "valid keys under optimizer: lr, momentum" in msg
    assert "did you mean seed?" in schema.unknown_key("seeds", schema.RULES)
    assert "did you mean optimizer.lr?" in schema.unknown_key("optimzer.lr", schema.RULES)
    cfg = defaults.default_config()
    with cfg.unlocked():
        cfg.local.epoch = 3.0
    with pytest.raises(ConfigError, match="unknown config key 'local.epoch'; did you mean "
                                          "local.epochs"):
        schema.validate(cfg)


def test_cross_checks_need_the_settings_a_scheme_uses():
    cfg = defaults.default_config()
    cfg.partition.scheme = "pathological"
    with pytest.raises(ConfigError, match="classes_per_client must be set"):
        schema.validate(cfg)
    cfg.partition.classes_per_client = 2
    schema.validate(cfg)
    cfg.local.mode = "steps"
    with pytest.raises(ConfigError, match="local_steps must be set"):
        schema.validate(cfg)
    cfg.local.mode = "epochs"
    cfg.partition.scheme = "natural"
    with pytest.raises(ConfigError, match="'natural' needs a dataset with natural clients "
                                          r"\(femnist\), got dataset.name='fashion_mnist'"):
        schema.validate(cfg)
    cfg.dataset.name = "femnist"
    schema.validate(cfg)


def test_every_shipped_config_and_preset_is_valid():
    for path in glob.glob(os.path.join(ROOT, "configs", "*.py")):
        spec = importlib.util.spec_from_file_location("cfg", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.PRESETS, path
        for preset in module.PRESETS:
            schema.validate(module.get_config(preset))


NUMERIC = [k for k, kind in LEAVES if kind in (int, float)]


def test_rules_carry_their_bounds_and_positional_rules_still_work():
    rule = between(0, 1e4, lo_open=True)
    assert (rule.lo, rule.hi, rule.lo_open, rule.hi_open) == (0, 1e4, True, False)
    assert math.isinf(between(0).hi) and math.isinf(between(hi=1).lo)
    plain = Rule(boolean, True)
    assert plain.optional and plain.lo is None and plain.hi is None
    assert between(1, 1e30).check(2e30) == "a number in [1, 1e+30]"
    with pytest.raises(ValueError, match="needs a lower or an upper bound"):
        between()


def test_every_numeric_option_has_a_finite_range_its_check_enforces():
    assert len(NUMERIC) > 40  # the leaves' types were read
    unbounded = [k for k in NUMERIC if schema.RULES[k].hi is None
                 or not (math.isfinite(schema.RULES[k].lo) and math.isfinite(schema.RULES[k].hi))]
    assert not unbounded, f"numeric options without a finite range: {unbounded}"
    for key, rule in schema.RULES.items():
        if rule.hi is None:  # not a numeric rule
            continue
        assert math.isfinite(rule.lo) and math.isfinite(rule.hi), key
        assert rule.lo < rule.hi, key
        assert (rule.check(rule.lo) is None) != rule.lo_open, key
        assert (rule.check(rule.hi) is None) != rule.hi_open, key
        assert rule.check(rule.hi + abs(rule.hi) + 1) is not None, key
        assert rule.check(rule.lo - abs(rule.lo) - 1) is not None, key


UNHONOURED = {  # values float32, or a day's run, cannot honour
    "pfedme.inner_steps": (100000000000, "an integer in [1, 100]"),
    "ditto.lam": (1e308, "a number in [0, 10000]"),
    "moon.tau": (1e-300, "a number in [0.01, 100]"),
}


@pytest.mark.parametrize("key", sorted(UNHONOURED))
def test_values_float32_or_a_day_cannot_honour_are_refused(tmp_path, capsys, key):
    value, want = UNHONOURED[key]
    cfg = defaults.set_keys(defaults.default_config(), {key: value})
    with pytest.raises(ConfigError, match=re.escape(f"config.{key} must be {want}, "
                                                    f"got {value!r}")):
        schema.validate(cfg)
    workdir = tmp_path / "w"
    code = main.main(["prog", SMOKE, f"--workdir={workdir}", "--noprogress",
                      f"--config.{key}={value!r}"])
    assert code == 2 and f"config.{key} must be {want}" in capsys.readouterr().err
    assert not workdir.exists()


def _client_steps(algo, variables, steps=3):
    """`steps` jitted local steps of one client on random batches: (local state, losses)."""
    server = algo.server_init(variables)
    ctx = ClientContext(jax.random.PRNGKey(0), steps, 8 * steps, 0, 0, jnp.zeros(10))
    local = algo.client_init(server, algo.client_state_init(server), ctx)
    step, rng, losses = jax.jit(algo.client_step), np.random.default_rng(0), []
    for _ in range(steps):
        batch = {"x": jnp.asarray(rng.normal(size=(8, 6, 6, 1)), jnp.float32),
                 "y": jnp.asarray(rng.integers(0, 10, 8), jnp.int32),
                 "mask": jnp.ones(8, jnp.float32)}
        local, metrics = step(local, batch, server)
        losses.append(float(metrics["loss_sum"]))
    return local, losses, batch


def _finite(tree):
    return all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(tree))


def test_float32_honours_ditto_and_moon_at_the_ends_of_their_ranges():
    model = models.build("mlp", 10, hidden=[24, 16])  # as tests/test_moon.py's
    variables = random_variables(model, (6, 6, 1), seed=0)
    tx = client_optimizer(0.05, 0.9, 1e-5, 100.0)  # the default config's
    local, losses, batch = _client_steps(
        ditto(model, tx, 0.05, lam=schema.RULES["ditto.lam"].hi), variables)
    logits = model.apply({"params": local.personal.params}, batch["x"])
    assert _finite(losses) and _finite(local.personal.params) and _finite(logits)

    algo = moon(model, tx, mu=schema.RULES["moon.mu"].hi, tau=schema.RULES["moon.tau"].lo)
    local, losses, _ = _client_steps(algo, variables)
    assert _finite(losses) and _finite(local.train.params)


def test_float32_honours_the_other_ends_that_divide():
    logits = jnp.asarray([[-30.0, 0.0, 30.0]])
    soft = soft_predictions(logits, schema.RULES["ktpfl.temperature"].lo)
    assert _finite(soft) and float(jnp.sum(soft)) == pytest.approx(1.0)
    labels = np.repeat(np.arange(10), 30)
    for alpha in (schema.RULES["partition.alpha"].lo, schema.RULES["partition.alpha"].hi):
        parts = partition(labels, 20, "dirichlet_by_client", 0, alpha=alpha, min_size=1)
        assert sum(map(len, parts)) == len(labels)
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=(4, 3)) for _ in range(3)]
    sigma, gamma = schema.RULES["fedma.sigma"], schema.RULES["fedma.gamma"]
    for s, s0, g in [(sigma.lo, sigma.hi, gamma.lo), (sigma.hi, sigma.lo, gamma.hi)]:
        match = bbp_map(weights, sigma=s, sigma0=s0, gamma=g, iterations=2)
        assert _finite(match.weights)


def _shipped_configs():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        spec = importlib.util.spec_from_file_location("cfg", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for preset in module.PRESETS:
            yield f"{os.path.basename(path)}:{preset}", module.get_config(preset)


def test_personalised_algorithms_need_a_test_part_of_each_client():
    from fedjax_pan.algorithms.registry import ALGORITHMS
    personal = sorted(name for name, entry in ALGORITHMS.items() if entry.personal)
    assert {"local", "ditto", "apfl", "fedrep", "ktpfl"} <= set(personal)
    for name in personal:
        cfg = defaults.default_config()
        cfg.algorithm = name
        with pytest.raises(ConfigError, match=rf"^config.partition.test_fraction must be > 0 "
                                              rf"for algorithm '{name}': .*got 0.0$"):
            schema.validate(cfg)
        cfg.partition.test_fraction = 0.25
        schema.validate(cfg)


def test_every_algorithm_runs_on_every_shipped_preset_with_its_defaults():
    """Options that must fit the rest of the config (a phase inside local.epochs) fit
    every preset; the personalised ones and Siren need only a test part per client."""
    from fedjax_pan.algorithms.registry import ALGORITHMS
    for where, cfg in _shipped_configs():
        for name, entry in ALGORITHMS.items():
            c = cfg.copy_and_resolve_references()
            c.algorithm = name
            if entry.personal or "client_evaluate" in entry.driver_needs:  # (Siren)
                c.partition.test_fraction = c.partition.test_fraction or 0.25
            try:
                schema.validate(c)
            except ConfigError as e:
                raise AssertionError(f"{where} with algorithm={name}: {e}") from None
    # Where a phase cannot fit, the check names the option before any data loads.
    cfg = defaults.default_config()
    cfg.algorithm, cfg.local.epochs, cfg.partition.test_fraction = "fedrep", 1.0, 0.25
    with pytest.raises(ConfigError, match=r"^config.fedrep.head_epochs must lie strictly "
                                          r"between 0 and local.epochs \(1\)"):
        schema.validate(cfg)
