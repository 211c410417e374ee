"""The cross-cutting features describe themselves: the default config, the schema, the
cross-checks and the assembly's wrapping all derive from `features.FEATURES`, so a new
feature (or an option of one) is its entry, and nothing else names its settings."""

import os
import re

import ml_collections
import pytest

from conftest import ROOT
from fedjax_pan.config import schema
from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms import features
from fedjax_pan.algorithms.core import FeatureEntry
from fedjax_pan.config.defaults import default_config
from fedjax_pan.errors import ConfigError
from fedjax_pan.rules import between, one_of
from test_experiment import config


def test_the_order_is_the_wrapping_order():
    assert [f.section for f in features.FEATURES] == ["shuffle", "attack", "compression",
                                                      "privacy", "straggler", "recruitment"]


@pytest.mark.parametrize("feature", features.FEATURES, ids=lambda f: f.section)
def test_each_entry_is_the_whole_section(feature):
    cfg = default_config()
    assert cfg[feature.section].to_dict() == ml_collections.ConfigDict(
        feature.options).to_dict()
    section_keys = {k.partition(".")[2] for k in schema.RULES
                    if k.partition(".")[0] == feature.section}
    assert section_keys == set(feature.rules)
    # Every default passes its own rule, and the defaults leave the feature off.
    for key, rule in feature.rules.items():
        value = cfg[feature.section]
        for part in key.split("."):
            value = value[part]
        assert (value is None and rule.optional) or rule.check(value) is None, key
    assert feature.first_on(cfg) is None
    assert all(key in {k for k in feature.rules} for key, _ in feature.off)


def test_a_new_feature_is_one_entry():
    def refuse_big(cfg):
        if cfg.dropout.rate > 0.5:
            raise ValueError(f"dropout.rate must be at most 0.5, got {cfg.dropout.rate}")
    extra = FeatureEntry("dropout", {"rate": 0.0, "mode": "drop"},
                         {"rate": between(0, 1), "mode": one_of(("drop", "zero"))},
                         off=(("rate", 0),), check=refuse_big)
    table = features.FEATURES + (extra,)
    assert features.default_sections(table)["dropout"].to_dict() == {"rate": 0.0,
                                                                      "mode": "drop"}
    assert set(features.rules(table)) - set(features.rules()) == {"dropout.rate",
                                                                  "dropout.mode"}
    cfg = default_config()
    cfg.dropout = features.default_sections(table)["dropout"]
    assert [f.section for f, *_ in features.active(cfg, table)] == []
    cfg.dropout.rate = 0.7
    assert [(f.section, key, value, off) for f, key, value, off in
            features.active(cfg, table)] == [("dropout", "dropout.rate", 0.7, 0)]
    with pytest.raises(ValueError, match="at most 0.5"):
        features.check(cfg, table)


def test_first_on_names_the_first_setting_that_is_on():
    cfg = config(compression__download__method="top_k", compression__mask_before="magnitude")
    assert [(f.section, key, value) for f, key, value, _ in features.active(cfg)] == [
        ("compression", "compression.download.method", "top_k")]


def test_cross_checks_reach_the_schema_with_the_config_prefix():
    with pytest.raises(ConfigError, match=r"^config\.compression\.vote needs"):
        schema.validate(config(compression__vote=True))
    with pytest.raises(ConfigError, match=r"^config\.sampling='poisson' needs straggler"):
        schema.validate(config(sampling="poisson", straggler__max_delay=1))


def test_drivers_refuse_features_they_do_not_apply():
    from fedjax_pan.run import assembly
    with pytest.raises(ConfigError, match=r"config\.shuffle\.n_sf is not available with "
                                          r"algorithm 'fedma'.*set shuffle\.n_sf=0"):
        assembly.build(config(algorithm="fedma", pan__amplitude=0.0, shuffle__n_sf=1.0))


def test_no_other_module_names_a_features_settings():
    """Outside its own module (and the features table), a feature's section is read only
    through its entry: `cfg.attack.kind` appears in algorithms/robust/attacks.py alone."""
    own = {"shuffle": "shuffle.py", "attack": "attacks.py", "compression": "compressed.py",
           "privacy": "dp.py", "straggler": "stragglers.py"}
    # One read stays with its consumer: sampling's 'auto' is defined by DP's clip.
    allowed = {("sampling.py", "privacy")}
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "fedjax_pan")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.join(ROOT, "fedjax_pan"))
            text = open(path).read()
            for section, module in own.items():
                if rel.endswith(module) or any(rel.endswith(a) and s == section
                                               for a, s in allowed):
                    continue
                if re.search(rf"\bcfg\.{section}\b", text):
                    found.append(f"{rel} reads cfg.{section}")
    assert not found, found


def test_attack_options_are_declared_next_to_the_attack():
    assert set(attacks.FEATURE.rules) == set(attacks.FEATURE.options)
    assert attacks.FEATURE.rules["kind"].check("not_an_attack") is not None
