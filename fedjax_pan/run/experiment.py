"""Config-driven runs: a config (or each of its variants) trained into a workdir.

A workdir receives `config.json`, `metrics.jsonl` (one object per evaluated round),
TensorBoard event files of the same rows (`tensorboard`), `summary.json`, `curve.png` and
orbax checkpoints under `checkpoints/`. A config with `variants` (name -> {dotted.key:
value}) runs each variant into `workdir/<name>/` and writes a comparison
(`comparison.json`, `comparison.csv`, `curves.png`). The pieces live by job: `assembly`
(config to runnable round), `training` (the loop), `resume` (workdir checks), `reporting`
(summaries, curves, paired statistics), `tensorboard` (event files); this module runs
variants and gathers their names.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Dict

import ml_collections

from fedjax_pan.engine import distributed
from fedjax_pan.run import reporting
from fedjax_pan import workdir as workdir_lib
from fedjax_pan.run.assembly import (Experiment, build, build_counted, load_dataset, make_round,
                                 public_split, validate)
from fedjax_pan.errors import (ConfigError, Interrupted, TrainingDiverged, WorkdirError,
                               require)
from fedjax_pan.run.reporting import (compare_groups, format_table, paired_stats, plot_curves,
                                  seed_groups, summarize)
from fedjax_pan.run.resume import RESUMABLE_CHANGES, check_workdir, config_changes, read_metrics
from fedjax_pan.run.training import (COUNTERS, Summary, check_run, claim, evaluate_clients,
                                 train, train_into, train_rounds)

__all__ = ["ConfigError", "TrainingDiverged", "WorkdirError", "Interrupted", "Experiment",
           "validate", "build", "build_counted", "make_round", "load_dataset", "public_split",
           "train", "train_into", "train_rounds", "Summary", "COUNTERS", "evaluate_clients",
           "run", "summarize", "plot_curves", "format_table", "seed_groups",
           "compare_groups", "paired_stats", "variant_configs", "apply_overrides",
           "RESUMABLE_CHANGES", "config_changes", "check_workdir", "read_metrics"]


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Dict[str, Any]
                    ) -> ml_collections.ConfigDict:
    """A copy of `cfg` with nested keys set, e.g. {'pan': {'amplitude': 0.0}}."""
    out = copy.deepcopy(cfg)
    with out.unlocked():
        out.variants = ml_collections.ConfigDict()

    def merge(target, values, prefix):
        for key, value in values.items():
            require(key in target, f"variant override {prefix + key!r} names no config key")
            if isinstance(value, dict) and isinstance(target[key], ml_collections.ConfigDict):
                merge(target[key], value, f"{prefix}{key}.")
            else:
                target[key] = value
    merge(out, overrides, "")
    return out


def variant_configs(cfg: ml_collections.ConfigDict) -> Dict[str, ml_collections.ConfigDict]:
    """{name: cfg with the variant's overrides} for each of cfg.variants (empty without)."""
    variants = cfg.variants.to_dict() if cfg.get("variants") else {}
    return {name: apply_overrides(cfg, ov) for name, ov in variants.items()}


def run(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False,
        overwrite: bool = False, progress: bool = True) -> Dict[str, Dict[str, Any]]:
    """Runs `cfg` (or each of its variants) and returns {name: summary}.

    Every variant is validated and built (its data loaded and partitioned) before the
    workdir is touched.
    """
    variants = cfg.variants.to_dict() if cfg.get("variants") else {}
    if not variants:
        return {"run": train(cfg, workdir, resume=resume, overwrite=overwrite,
                             progress=progress)}
    validate(cfg)
    configs = variant_configs(cfg)
    for name, c in configs.items():
        try:
            validate(c)
        except ConfigError as e:
            raise ConfigError(f"variant {name!r}: {e}") from None
    check_run(cfg, workdir, resume=resume, overwrite=overwrite)
    cache: Dict[Any, Any] = {}
    experiments = {name: build_counted(c, cache) for name, c in configs.items()}
    workdir_lib.raise_pending_signal()  # a Ctrl-C while the data loaded: nothing written
    top = os.path.join(workdir, "config.json")
    primary = distributed.is_primary()
    with claim(workdir, overwrite=overwrite, resume=resume):
        if primary:
            with workdir_lib.writing(top, lambda: "nothing of this run was saved yet"):
                workdir_lib.write_atomic(top, cfg.to_json(indent=2))
        summaries = {}
        for name, exp in experiments.items():
            workdir_lib.raise_pending_signal()
            sub = os.path.join(workdir, name)

            def prepare() -> bool:
                again = resume and os.path.isfile(os.path.join(sub, "config.json"))
                if not again:
                    os.makedirs(sub, exist_ok=True)
                return again
            again = distributed.on_primary(prepare, f"preparing {sub}")
            summaries[name] = train_into(exp, sub, resume=again, progress=progress, desc=name)
        if not primary:
            return summaries
        curves = {name: read_metrics(os.path.join(workdir, name, "metrics.jsonl"), cfg.rounds)
                  for name in configs}
        groups = seed_groups(configs)
        table = compare_groups(summaries, groups)
        csv = ["variant,final_accuracy,best_accuracy,final_loss,rounds,wall_seconds\n"]
        csv += [f"{name},{s['final_accuracy']:.6f},{s['best_accuracy']:.6f},"
                f"{s['final_loss']:.6f},{s['rounds']},{s['wall_seconds']:.1f}\n"
                for name, s in summaries.items()]
        with workdir_lib.deferred_interrupts(), \
                workdir_lib.writing(f"the comparison in {workdir}",
                                    lambda: f"each variant's results are complete in {workdir}"):
            reporting.plot_curves(curves, os.path.join(workdir, "curves.png"),
                        f"{cfg.model.name} on {cfg.dataset.name}", groups=groups)
            workdir_lib.write_atomic(os.path.join(workdir, "comparison.json"),
                                     reporting.json_text(summaries, indent=2))
            workdir_lib.write_atomic(os.path.join(workdir, "comparison.csv"), "".join(csv))
            if any(len(m) > 1 for m in groups.values()):
                workdir_lib.write_atomic(os.path.join(workdir, "comparison_seeds.json"),
                                         reporting.json_text(table, indent=2))
    return summaries
