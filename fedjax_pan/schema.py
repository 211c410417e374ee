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
from fedjax_pan.algorithms.fedavg import BN_MODES
from fedjax_pan.algorithms.local import WARMUPS
from fedjax_pan.algorithms.dp import counting_std
from fedjax_pan.algorithms.registry import (AGGREGATION_RULES, ALGORITHMS, SAMPLING_CHOICES,
                                            SERVER_OPTIMIZERS, cohort_sampling,
                                            expected_clients)
from fedjax_pan.data.partition import SCHEMES
from fedjax_pan.data.sources import DATASETS, GROUPED_DATASETS, NORMALIZATIONS
from fedjax_pan.engine.clients import AUGMENTS, STEP_MODES
from fedjax_pan.engine.execution import STRATEGIES
from fedjax_pan.engine.store import PLACES
from fedjax_pan.engine.robust import krum_kept
from fedjax_pan.engine.simulation import AGGREGATIONS, clients_per_round
from fedjax_pan.engine.staleness import FEDASYNC_KINDS
from fedjax_pan.engine.timing import DELAYS, POLICIES, forced_error
from fedjax_pan.algorithms.attacks import ATTACKS, DRAWS
from fedjax_pan.algorithms.compressed import MASK_SCORES
from fedjax_pan.compression import METHODS
from fedjax_pan.errors import ConfigError, require
from fedjax_pan.models.layers import parse_norm
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
    "aggregation.rule": one_of(AGGREGATION_RULES),
    "aggregation.trim": between(0, 0.5, hi_open=True),
    "aggregation.byzantine": between(0, 1e5, integer=True),
    "aggregation.krum_keep": between(1, 1e5, integer=True, optional=True),
    "aggregation.zeno.rho": between(0, 1e4),
    "aggregation.sageflow.entropy_threshold": between(1e-6, 100),
    "aggregation.sageflow.delta": between(0, 10),
    "aggregation.sageflow.lam": between(0, 10),
    "aggregation.sageflow.gamma_period": between(0, 1e6, integer=True),
    "aggregation.sageflow.min_weight": between(0, 1e6),
    "aggregation.fedasync.mixing": between(0, 1, lo_open=True),
    "aggregation.fedasync.staleness": one_of(FEDASYNC_KINDS),
    "aggregation.fedasync.a": between(0, 100),
    "aggregation.fedasync.b": between(0, 1e6),
    "straggler.max_delay": between(0, 100, integer=True),
    "straggler.delays": one_of(DELAYS),
    "straggler.slow_share": between(0, 1),
    "straggler.policy": one_of(POLICIES),
    "straggler.wait_share": between(0, 1, lo_open=True),
    "straggler.forced": Rule(forced_error),
    "attack.kind": one_of(ATTACKS),
    "attack.fraction": between(0, 1),
    "attack.start_round": between(0, 1e6, integer=True),
    "attack.scale": between(0, 1e4, optional=True),
    "attack.target": between(0, 1e5, integer=True),
    "attack.poisoned": between(0, 1),
    "attack.draw": one_of(DRAWS),
    **{f"compression.{side}.{key}": rule for side in ("upload", "download")
       for key, rule in {"method": one_of(METHODS), "ratio": between(0, 1, lo_open=True),
                         "levels": between(1, 2**16, integer=True),
                         "bits": between(1, 16, integer=True),
                         "quantize_bits": between(0, 16, integer=True),
                         "error_feedback": Rule(boolean)}.items()},
    "compression.vote": Rule(boolean),
    "compression.mask_before": one_of(("none",) + MASK_SCORES),
    "compression.mask_l1": between(0, 1e4),
    "privacy.clip": between(0, 1e6),
    "privacy.noise_multiplier": between(0, 1e4),
    "privacy.delta": between(0, 1, lo_open=True, hi_open=True),
    "privacy.adaptive": Rule(boolean),
    "privacy.quantile": between(0, 1),
    "privacy.clip_lr": between(0, 100),
    "privacy.count_std": between(0, 1e6, lo_open=True, optional=True),
    "sampling": one_of(SAMPLING_CHOICES),
    "execution.strategy": one_of(STRATEGIES),
    "execution.block_size": between(1, 1e5, integer=True, optional=True),
    "execution.client_states": one_of(PLACES),
    "eval.every": between(1, 1e6, integer=True),
    "eval.batch_size": between(1, 1e6, integer=True),
    "eval.local": Rule(boolean),
    "eval.finetune_epochs": between(0, 1000),
    "shuffle.n_sf": between(0, 1000),
    "shuffle.p_sf": between(0, 1),
    "shuffle.window": between(0, 1, lo_open=True, optional=True),
    "checkpoint_every": between(1, 1e6, integer=True),
    "max_train_loss": between(0, 1e30, lo_open=True),  # float32 losses reach 3.4e38
}
# Each algorithm's options, config.<algorithm>.<key>, with the rules it declares.
RULES.update({f"{name}.{key}": rule for name, entry in ALGORITHMS.items()
              for key, rule in entry.rules.items()})


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
        if value is None and rule.optional:
            continue
        want = "set" if value is None else rule.check(value)
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
    require(all(d <= cfg.straggler.max_delay for d in cfg.straggler.forced),
            f"config.straggler.forced delays must be at most straggler.max_delay = "
            f"{cfg.straggler.max_delay}, got {tuple(cfg.straggler.forced)}")
    for name, overrides in (cfg.get("variants") or {}).items():
        require(isinstance(overrides, (dict, ml_collections.ConfigDict)),
                f"config.variants.{name} must map config keys to values, got {overrides!r}")
    agg = cfg.aggregation
    if agg.rule == "multi_krum":
        m = clients_per_round(cfg.participation, p.num_clients)
        try:
            krum_kept(m, agg.byzantine, agg.krum_keep)
        except ValueError as e:
            raise ConfigError(f"config.aggregation.rule='multi_krum' with "
                              f"aggregation.byzantine = {agg.byzantine} and "
                              f"aggregation.krum_keep = {agg.krum_keep} ({m} clients a "
                              f"round): {e}") from None
    _communication_checks(cfg)
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
    if entry.check is not None:
        try:
            entry.check(cfg)
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None


def _communication_checks(cfg: ml_collections.ConfigDict) -> None:
    """Compression, privacy and sampling settings that exclude each other."""
    comp, dp = cfg.compression, cfg.privacy
    require(not comp.vote or comp.upload.method == "sign",
            f"config.compression.vote needs compression.upload.method='sign', got "
            f"{comp.upload.method!r}")
    require(comp.download.method not in ("magnitude_mask", "importance_mask"),
            f"config.compression.download.method={comp.download.method!r}: masks prune "
            f"a client's model before it is sent; the download sends the global update")
    require(comp.download.method == "none" or cfg.straggler.max_delay == 0,
            "config.compression.download needs straggler.max_delay=0 (a late client's "
            "download would be counted against a model it did not hold)")
    require(cohort_sampling(cfg) == "uniform" or cfg.straggler.max_delay == 0,
            "config.sampling='poisson' needs straggler.max_delay=0")
    if dp.clip > 0:
        require(cfg.aggregation.weights == "uniform",
                f"config.privacy.clip > 0 (DP-FedAvg) needs aggregation.weights='uniform' "
                f"(each client's sensitivity is the clip norm), got "
                f"{cfg.aggregation.weights!r}")
        require(cfg.aggregation.rule == "mean",
                f"config.privacy.clip > 0 (DP-FedAvg) adds its noise to the clients' sum: "
                f"aggregation.rule must be 'mean', got {cfg.aggregation.rule!r}")
        require(comp.download.method == "none" and not comp.vote,
                "config.privacy.clip > 0 (DP-FedAvg) clips updates against the model the "
                "server sends: set compression.download.method='none' and "
                "compression.vote=False")
        require(cfg.straggler.max_delay == 0,
                "config.privacy.clip > 0 (DP-FedAvg) needs straggler.max_delay=0")
        if dp.adaptive and dp.noise_multiplier > 0:
            std = counting_std(dp.count_std, expected_clients(cfg, cfg.partition.num_clients))
            require(dp.noise_multiplier < 2 * std,
                    f"config.privacy.noise_multiplier = {dp.noise_multiplier} must be below "
                    f"2 * privacy.count_std = {2 * std:g} with privacy.adaptive (the "
                    f"update's share of the noise, (z^-2 - (2 sigma_b)^-2)^(-1/2), must be "
                    f"real)")
    else:
        require(dp.noise_multiplier == 0 and not dp.adaptive,
                "config.privacy.noise_multiplier and privacy.adaptive need privacy.clip > 0")


def known_keys() -> List[str]:
    """Every dotted key a run config may hold."""
    return list(RULES) + list(OPAQUE)
