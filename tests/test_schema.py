"""Config rules: every leaf of the default config rejects an invalid value of its type."""

import importlib.util
import glob
import math
import os

import ml_collections
import pytest
from ml_collections.config_dict import FieldReference

from conftest import ROOT
from fedjax_pan import defaults, main, schema
from fedjax_pan.errors import ConfigError

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
    raise AssertionError(f"no invalid value for {kind}")


LEAVES = list(typed_leaves(defaults.default_config()))
SIGNED = {"fedma.mu0_bias"}  # settings where any finite number is valid


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
