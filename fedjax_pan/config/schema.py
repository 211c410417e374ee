"""What every config value may be: one rule per dotted key, checked before anything runs.

`validate(cfg)` walks every leaf of a run config. A leaf without a rule is an unknown key,
reported with the valid keys nearest to it; a value its rule rejects is reported with its
key, the value and the valid range. Rules are data: a new option adds one entry to `RULES`.
Checks that need the loaded data (e.g. `partition.num_clients` against the number of
examples) live where the data is, in `experiment.build`.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import ml_collections

from fedjax_pan import models
from fedjax_pan.algorithms.fedavg_family.fedavg import BN_MODES
from fedjax_pan.algorithms import aggregation, features
from fedjax_pan.algorithms.local import WARMUPS
from fedjax_pan.algorithms.sampling import CHOICES as SAMPLING_CHOICES
from fedjax_pan.algorithms.registry import ALGORITHMS, SERVER_OPTIMIZERS
from fedjax_pan.data.partition import SCHEMES
from fedjax_pan.data.sources import DATASETS, GROUPED_DATASETS, NORMALIZATIONS
from fedjax_pan.engine.clients import AUGMENTS, STEP_MODES
from fedjax_pan.engine.execution import STRATEGIES
from fedjax_pan.engine.store import PLACES
from fedjax_pan.engine.simulation import AGGREGATIONS
from fedjax_pan.errors import ConfigError, require
from fedjax_pan.models.layers import parse_norm
from fedjax_pan.models.precision import MATMUL_PRECISIONS, PRECISIONS
from fedjax_pan.pan import KINDS
from fedjax_pan.rules import Rule, between, boolean, directory, one_of

# Keys holding free-form mappings, checked by their consumer (model constructors, variants).
OPAQUE = ("model.options", "variants")
SEED_MAX = 2**32 - 1  # numpy's SeedSequence and jax.random.PRNGKey both take uint32 seeds


def _norm(value: Any) -> Optional[str]:
    try:
        parse_norm(value)
    except ValueError:
        return "'none', 'batch', 'group' or 'group(G)' with G >= 1"
    return None


# Every numeric rule has finite bounds (tests/test_schema.py checks): wide enough for every
# value the papers and PFLlib use, narrow enough for float32 and for a run that ends within
# a day on a CPU. Counts of examples are capped at 1e9 (no dataset here nears it), other
# counts at 1e6 or less; a positive lower bound stands where a tiny value breaks the
# arithmetic (float32 divisions by it: temperatures, FedDyn's alpha; Dirichlet draws).
RULES: Dict[str, Rule] = {
    "seed": between(0, SEED_MAX, integer=True),
    "rounds": between(1, 1e6, integer=True),
    "participation": between(0, 1, lo_open=True),
    "algorithm": one_of(tuple(ALGORITHMS)),
    "dataset.name": one_of(DATASETS + ("synthetic",)),
    "dataset.data_dir": Rule(directory, optional=True),
    "dataset.train_limit": between(1, 1e9, integer=True, optional=True),
    "dataset.public_size": between(0, 1e9, integer=True),
    "dataset.augment": one_of(AUGMENTS),
    "dataset.normalization": one_of(NORMALIZATIONS),
    "model.name": one_of(models.NAMES),
    "model.norm": Rule(_norm, optional=True),
    "model.architectures": Rule(models.specs_error),
    "pan.kind": one_of(KINDS),
    "pan.period": between(0, 1e4),
    "pan.amplitude": between(0, 10),
    "pan.ratio": between(0, 1),
    "partition.scheme": one_of(SCHEMES),
    "partition.num_clients": between(1, 1e6, integer=True),
    # numpy's Dirichlet proportions are finite at 1e-3 (a class whose column underflows is
    # split evenly); smaller values change nothing, each client already holds ~one class.
    "partition.alpha": between(1e-3, 1e4, optional=True),
    "partition.classes_per_client": between(1, 1e4, integer=True, optional=True),
    "partition.min_size": between(1, 1e9, integer=True, optional=True),
    "partition.balance": Rule(boolean),
    "partition.test_fraction": between(0, 1, hi_open=True),
    "partition.noisy_share": between(0, 1),
    "partition.noise_rate": between(0, 1),
    "local.epochs": between(0, 1000, lo_open=True),
    "local.batch_size": between(1, 1e6, integer=True),
    "local.mode": one_of(STEP_MODES),
    "local.local_steps": between(1, 1e6, integer=True, optional=True),
    "optimizer.lr": between(0, 100, lo_open=True),
    "optimizer.momentum": between(0, 1, hi_open=True),
    "optimizer.weight_decay": between(0, 10),
    "optimizer.grad_clip": between(0, 1e6),
    "optimizer.warmup": one_of(WARMUPS),
    "optimizer.warmup_length": between(0, 1e6, integer=True),
    "server.optimizer": one_of(SERVER_OPTIMIZERS),
    "server.lr": between(0, 100, lo_open=True),
    "server.momentum": between(0, 1, hi_open=True),
    "aggregation.weights": one_of(AGGREGATIONS),
    "aggregation.bn": one_of(BN_MODES),
    # rule, and the keys the rules read, as their entries declare them
    **{f"aggregation.{key}": rule for key, rule in aggregation.config_rules().items()},
    **features.rules(),
    "sampling": one_of(SAMPLING_CHOICES),
    "execution.strategy": one_of(STRATEGIES),
    "execution.block_size": between(1, 1e5, integer=True, optional=True),
    "execution.client_states": one_of(PLACES),
    "execution.precision": one_of(PRECISIONS),
    "execution.matmul_precision": one_of(MATMUL_PRECISIONS),
    "eval.every": between(1, 1e6, integer=True),
    "eval.batch_size": between(1, 1e6, integer=True),
    "eval.local": Rule(boolean),
    "eval.finetune_epochs": between(0, 1000),
    "checkpoint_every": between(1, 1e6, integer=True),
    "max_train_loss": between(0, 1e30, lo_open=True),  # float32 losses reach 3.4e38
}
# Each algorithm's options, config.<algorithm>.<key>, with the rules it declares.
RULES.update({f"{name}.{key}": rule for name, entry in ALGORITHMS.items()
              for key, rule in entry.rules.items()})

# Where execution.precision other than 'float32' cannot reach, and why: the policy wraps
# the networks a run builds from config.model, and these configurations compute on
# networks their algorithm builds itself. algorithm -> (applies(cfg), why).
UNMIXED: Dict[str, Tuple[Any, str]] = {
    "fedma": (lambda cfg: True,
              "FedMA grows the network's matched layers and rebuilds the grown network "
              "itself (models.resized)"),
    "ktpfl": (lambda cfg: bool(cfg.ktpfl.architectures),
              "KT-pFL builds the networks ktpfl.architectures lists itself"),
    "fedkd": (lambda cfg: True, "FedKD trains the student network fedkd.student names, "
              "which it builds itself"),
    "fml": (lambda cfg: True, "FML trains the meme network fml.meme names, which it "
            "builds itself"),
}


def leaves(cfg: ml_collections.ConfigDict, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) for every leaf; opaque mappings count as one leaf."""
    for key, value in cfg.items():
        name = prefix + key
        if isinstance(value, ml_collections.ConfigDict) and name not in OPAQUE:
            yield from leaves(value, name + ".")
        else:
            yield name, value


def unknown_key(key: str, valid: Sequence[str]) -> str:
    """'unknown config key ...' naming the valid keys nearest to `key`."""
    key = key.removeprefix("config.")
    parent = key.rpartition(".")[0]
    siblings = [k.rpartition(".")[2] for k in valid if k.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(key.rpartition(".")[2], siblings, n=2, cutoff=0.7)
    near = [f"{parent}.{k}" if parent else k for k in near]
    if not siblings:  # a misspelt section: compare whole keys
        near = difflib.get_close_matches(key, list(valid), n=2, cutoff=0.8)
    if near:
        return f"unknown config key {key!r}; did you mean {' or '.join(near)}?"
    if not parent:
        siblings += sorted({k.split(".")[0] for k in valid if "." in k})
    if siblings:
        where = f"under {parent}" if parent else "at the top level"
        return f"unknown config key {key!r}; valid keys {where}: {', '.join(siblings)}"
    sections = sorted({k.split(".")[0] for k in valid})
    return f"unknown config key {key!r}; valid sections: {', '.join(sections)}"


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first invalid or unknown key; touches no file."""
    for key, value in leaves(cfg):
        if key in OPAQUE:
            continue
        rule = RULES.get(key)
        if rule is None:
            raise ConfigError(unknown_key(key, list(RULES)))
        want = rule.want(value)
        if want is not None:
            raise ConfigError(f"config.{key} must be {want}, got {value!r}")
    _cross_checks(cfg)


def _cross_checks(cfg: ml_collections.ConfigDict) -> None:
    p = cfg.partition
    require(not p.scheme.startswith("dirichlet") or p.alpha is not None,
            f"config.partition.alpha must be set for partition.scheme={p.scheme!r}")
    require(p.scheme != "pathological" or p.classes_per_client is not None,
            "config.partition.classes_per_client must be set for partition.scheme='pathological'")
    # 'natural' needs the data's own groups; num_clients is checked against them in build.
    require(p.scheme != "natural" or cfg.dataset.name in GROUPED_DATASETS,
            f"config.partition.scheme='natural' needs a dataset with natural clients "
            f"({', '.join(GROUPED_DATASETS)}), got dataset.name={cfg.dataset.name!r}")
    require(cfg.local.mode != "steps" or cfg.local.local_steps is not None,
            "config.local.local_steps must be set for local.mode='steps'")
    for name, overrides in (cfg.get("variants") or {}).items():
        require(isinstance(overrides, (dict, ml_collections.ConfigDict)),
                f"config.variants.{name} must map config keys to values, got {overrides!r}")
    rule = aggregation.RULES[cfg.aggregation.rule]
    if rule.check is not None:
        try:
            rule.check(cfg)
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None
    try:
        features.check(cfg)
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    entry = ALGORITHMS[cfg.algorithm]
    # Without a test part per client, a personalised algorithm's models are never scored:
    # its run would report an untrained or a FedAvg model under its name.
    require(not entry.personal or p.test_fraction > 0,
            f"config.partition.test_fraction must be > 0 for algorithm {cfg.algorithm!r}: it "
            f"trains a model per client, scored on each client's own test part (PFLlib: "
            f"--config.partition.test_fraction=0.25), got {p.test_fraction!r}")
    require(not cfg.eval.finetune_epochs or p.test_fraction > 0,
            f"config.partition.test_fraction must be > 0 with eval.finetune_epochs = "
            f"{cfg.eval.finetune_epochs!r}: the fine-tuned models are scored on each "
            f"client's own test part, got {p.test_fraction!r}")
    several = sorted(name for name, e in ALGORITHMS.items() if e.heterogeneous)
    require(not cfg.model.architectures or entry.heterogeneous,
            f"config.model.architectures runs clients of several networks, which algorithm "
            f"{cfg.algorithm!r} cannot (its clients send what depends on their network; "
            f"those that can: {', '.join(several)}); got {cfg.model.architectures!r}")
    applies, why = UNMIXED.get(cfg.algorithm, (lambda cfg: False, ""))
    require(cfg.execution.precision == "float32" or not applies(cfg),
            f"config.execution.precision={cfg.execution.precision!r} is not available with "
            f"algorithm {cfg.algorithm!r} as configured: {why}, outside the precision "
            f"policy; set execution.precision='float32'")
    if entry.check is not None:
        try:
            entry.check(cfg)
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None


def known_keys() -> List[str]:
    """Every dotted key a run config may hold."""
    return list(RULES) + list(OPAQUE)
