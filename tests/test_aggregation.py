"""The aggregation rules' table (`algorithms.aggregation.RULES`): every entry builds from
the default config, the config's defaults and schema are derived from it, and a new entry
joins both; and the coordinate-wise rules against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan.config import schema
from fedjax_pan.algorithms import aggregation, core
from fedjax_pan.algorithms.aggregation import (RULES, RuleEntry, config_options, config_rules,
                                               median, trimmed_mean)
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine.protocol import Aggregator
from fedjax_pan.errors import ConfigError
from fedjax_pan.rules import between


def _flat(options, prefix=""):
    for key, value in options.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _public():
    """A linear model and a tiny labelled public set, for the rules that score on one."""
    import flax.linen as nn

    class Linear(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3)(x.reshape(x.shape[0], -1))
    rng = np.random.default_rng(0)
    return (Linear(), rng.normal(size=(5, 2, 2, 1)).astype(np.float32),
            rng.integers(0, 3, size=5))


def test_the_table_lists_every_rule_in_order():
    assert tuple(RULES) == ("mean", "median", "trimmed_mean", "multi_krum", "geometric_median",
                            "zeno", "sageflow", "fedasync", "auto_weights")
    assert aggregation.public_rules() == ("zeno", "sageflow", "auto_weights")
    for name, entry in RULES.items():
        assert entry.summary and entry.reference is not None, name


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_builds_from_the_default_config(name, late):
    cfg = default_config()
    cfg.aggregation.rule = name
    cfg.straggler.max_delay = 2 if late else 0
    schema.validate(cfg)
    rule = aggregation.from_config(cfg, *_public())
    assert isinstance(rule, Aggregator)
    assert (rule.score is not None) == (name == "zeno" or name == "sageflow")
    if name == "mean":
        assert rule is core.weighted_mean


def test_an_unknown_rule_is_named():
    cfg = default_config()
    cfg.aggregation.rule = "krum"
    with pytest.raises(ValueError, match="unknown aggregation rule 'krum'; expected one of"):
        aggregation.from_config(cfg)


def test_the_default_config_and_the_schema_follow_the_table():
    section = default_config().aggregation.to_dict()
    flat = dict(_flat(section))
    declared = {"weights", "bn", "rule"}
    for name, entry in RULES.items():
        for key, value in _flat(entry.options):
            assert key in flat, (name, key)
            want = value.get() if hasattr(value, "get_type") else value
            assert flat[key] == want, (name, key)
            assert schema.RULES[f"aggregation.{key}"] is entry.rules[key], (name, key)
        declared |= set(entry.rules)
    assert set(flat) == declared
    keys = {k.removeprefix("aggregation.") for k in schema.RULES if k.startswith("aggregation.")}
    assert keys == declared
    rule = schema.RULES["aggregation.rule"]
    assert all(rule.check(name) is None for name in RULES) and rule.check("krum") is not None


def test_a_new_entry_joins_the_defaults_and_the_schema():
    table = dict(RULES)
    table["clipped_mean"] = RuleEntry(
        lambda options, context: core.weighted_mean,
        {"byzantine": 0, "clipped": {"norm": 10.0}},
        {"byzantine": aggregation.BYZANTINE, "clipped.norm": between(0, 1e6, lo_open=True)},
        summary="a throwaway entry")
    options, rules = config_options(table), config_rules(table)
    assert options["clipped"] == {"norm": 10.0} and options["byzantine"] == 0
    assert {k: v for k, v in options.items() if k != "clipped"} == config_options()
    assert rules["clipped.norm"].check(0.0) is not None and rules["clipped.norm"].check(1.0) is None
    assert rules["rule"].check("clipped_mean") is None
    assert config_rules()["rule"].check("clipped_mean") is not None
    assert set(rules) == set(config_rules()) | {"clipped.norm"}


def test_entries_that_disagree_on_a_key_are_refused():
    def table(**entry):
        return {**RULES, "other": RuleEntry(lambda o, c: core.weighted_mean, **entry)}
    with pytest.raises(ValueError, match="declares aggregation.byzantine"):  # its default
        config_options(table(options={"byzantine": 1}, rules={"byzantine": aggregation.BYZANTINE}))
    with pytest.raises(ValueError, match="declares aggregation.byzantine"):  # its rule
        config_rules(table(options={"byzantine": 0},
                           rules={"byzantine": between(0, 1e5, integer=True)}))
    with pytest.raises(ValueError, match="declares aggregation.krum_keep"):  # its type
        from ml_collections.config_dict import placeholder
        config_options(table(options={"krum_keep": placeholder(float)},
                             rules={"krum_keep": RULES["multi_krum"].rules["krum_keep"]}))
    with pytest.raises(ValueError, match="name different keys"):
        config_options(table(options={"extra": 1.0}, rules={}))


def test_multi_krums_check_names_the_clients_a_round():
    cfg = default_config()
    cfg.aggregation.rule, cfg.aggregation.byzantine = "multi_krum", 8  # 10 clients a round
    with pytest.raises(ValueError, match=r"^aggregation.rule='multi_krum' with aggregation"
                                         r".byzantine = 8 and aggregation.krum_keep = None "
                                         r"\(10 clients a round\): Krum needs"):
        RULES["multi_krum"].check(cfg)
    with pytest.raises(ConfigError, match=r"^config.aggregation.rule='multi_krum' with .*"
                                          r"\(aggregation.byzantine in \[0, 7\], "
                                          r"aggregation.krum_keep in \[1, 10\] or unset\)$"):
        schema.validate(cfg)
    cfg.aggregation.byzantine = 7
    schema.validate(cfg)


@pytest.mark.parametrize("b", [10, 11, 100])
def test_zenos_check_names_the_clients_a_round(b):
    cfg = default_config()  # 10 clients a round
    cfg.aggregation.rule, cfg.aggregation.byzantine = "zeno", b
    with pytest.raises(ConfigError, match=rf"^config.aggregation.byzantine={b} with "
                                          r"aggregation.rule='zeno' \(10 clients a round\): "
                                          r"Zeno averages the n - b best .* needs 0 <= b < n: "
                                          rf"10 clients, b = {b}; set aggregation.byzantine "
                                          r"in \[0, 9\]$"):
        schema.validate(cfg)
    cfg.aggregation.byzantine = 9  # the paper's m > b: one client kept
    schema.validate(cfg)
    assert aggregation.zeno_kept(10, 9) == 1 and aggregation.zeno_kept(10, 0) == 10


@pytest.mark.parametrize("name", [n for n, e in RULES.items() if "byzantine" not in e.options])
def test_a_rule_that_does_not_read_byzantine_refuses_it(name):
    cfg = default_config()
    cfg.aggregation.rule, cfg.aggregation.byzantine = name, 3
    trim = ": its tolerance is aggregation.trim.*" if name == "trimmed_mean" else ""
    with pytest.raises(ConfigError, match=rf"^config.aggregation.byzantine=3 is not used by "
                                          rf"aggregation.rule='{name}'{trim}; set aggregation"
                                          r".byzantine=0, or a rule that reads it "
                                          r"\(multi_krum, zeno\)$"):
        schema.validate(cfg)
    cfg.aggregation.byzantine = 0
    schema.validate(cfg)


def test_the_byzantine_key_says_what_each_rule_allows():
    cfg = default_config()
    cfg.aggregation.byzantine = -1
    with pytest.raises(ConfigError, match=r"must be an integer in \[0, 100000\]: under "
                                          r"multi_krum at most the clients a round - 3, under "
                                          r"zeno at most the clients a round - 1, under the "
                                          r"other rules 0, got -1"):
        schema.validate(cfg)
    # The rules the text names are the table's readers of the key.
    assert [n for n, e in RULES.items() if "byzantine" in e.options] == ["multi_krum", "zeno"]


@pytest.mark.reference("aggregation", "median", "trimmed_mean")
def test_median_and_trimmed_mean_match_numpy():
    rng = np.random.default_rng(0)
    outs = {"a": rng.normal(size=(7, 3, 4)).astype(np.float32),
            "b": rng.normal(size=(7,)).astype(np.float32)}
    weights = jnp.full((7,), 1 / 7)
    med = median().finalize(jax.tree_util.tree_map(jnp.asarray, outs), weights)
    for k in outs:
        np.testing.assert_allclose(med[k], np.median(outs[k], axis=0), rtol=1e-6)
    trimmed = trimmed_mean(0.2).finalize(jax.tree_util.tree_map(jnp.asarray, outs), weights)
    for k in outs:  # floor(0.2 * 7) = 1 value cut at each end
        want = np.sort(outs[k], axis=0)[1:6].mean(axis=0)
        np.testing.assert_allclose(trimmed[k], want, rtol=1e-5, atol=1e-7)
    full = trimmed_mean(0.0).finalize({"b": jnp.asarray(outs["b"])}, weights)
    np.testing.assert_allclose(full["b"], outs["b"].mean(), rtol=1e-6)
    with pytest.raises(ValueError, match="trim in"):
        trimmed_mean(0.5)


def test_robust_rules_ignore_one_client_sending_huge_values():
    honest = np.random.default_rng(1).normal(size=(9, 5)).astype(np.float32)
    attacked = honest.copy()
    attacked[3] = 1e30
    w = jnp.full((9,), 1 / 9)
    for rule in (median(), trimmed_mean(0.2)):
        out = np.asarray(rule.finalize({"x": jnp.asarray(attacked)}, w)["x"])
        assert np.all(np.abs(out) < 3.0), out  # bounded by the honest clients' values
    mean = core.weighted_mean.finalize({"x": jnp.asarray(attacked.sum(0) / 9)}, jnp.float32(1))
    assert np.all(np.asarray(mean["x"]) > 1e28)  # the mean is not robust
