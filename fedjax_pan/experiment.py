"""Config-driven runs: assemble data, model, algorithm and engine; train; write a workdir.

A workdir receives `config.json`, `metrics.jsonl` (one object per evaluated round),
`summary.json`, `curve.png` and orbax checkpoints under `checkpoints/`. A config with
`variants` (name -> {dotted.key: value}) runs each variant into `workdir/<name>/` and
writes a comparison (`comparison.json`, `comparison.csv`, `curves.png`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any, Dict, List

import jax
import ml_collections
import numpy as np

from fedjax_pan import algorithms, models, permutation
from fedjax_pan import data as data_lib
from fedjax_pan.engine import (ClientData, LocalWork, Simulation, count_compiles,
                               make_evaluator, make_executor, resolve_strategy)
from fedjax_pan.algorithms.fedavg import BN_MODES
from fedjax_pan.algorithms.local import WARMUPS
from fedjax_pan.algorithms.registry import SERVER_OPTIMIZERS
from fedjax_pan.algorithms.shuffle import with_shuffling
from fedjax_pan.data.partition import SCHEMES
from fedjax_pan.engine.clients import STEP_MODES
from fedjax_pan.engine.execution import STRATEGIES
from fedjax_pan.engine.simulation import AGGREGATIONS, SimState
from fedjax_pan.pan import as_config

# Keys that may change when resuming (to extend a run or change its reporting cadence).
RESUMABLE_CHANGES = ("rounds", "eval", "checkpoint_every")


class ConfigError(ValueError):
    """An invalid configuration or workdir request; the message is one line."""


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite."""


@dataclasses.dataclass
class Experiment:
    config: ml_collections.ConfigDict
    dataset: data_lib.Dataset
    client_indices: List[np.ndarray]
    model: Any
    variables: Any
    simulation: Simulation
    evaluate: Any
    strategy: str


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first invalid value; touches no file."""
    _check(cfg.dataset.name in data_lib.DATASETS + ("synthetic",),
           f"unknown dataset {cfg.dataset.name!r}; available: "
           f"{', '.join(data_lib.DATASETS + ('synthetic',))}")
    _check(cfg.model.name in models.NAMES,
           f"unknown model {cfg.model.name!r}; available: {', '.join(models.NAMES)}")
    _check(cfg.algorithm in algorithms.ALGORITHMS,
           f"unknown algorithm {cfg.algorithm!r}; available: {', '.join(algorithms.ALGORITHMS)}")
    _check(0.0 < cfg.participation <= 1.0,
           f"participation R must lie in (0, 1], got {cfg.participation}")
    _check(cfg.rounds >= 1, f"rounds must be >= 1, got {cfg.rounds}")
    p = cfg.partition
    _check(p.scheme in SCHEMES,
           f"unknown partition scheme {p.scheme!r}; available: {', '.join(SCHEMES)}")
    _check(p.num_clients >= 1, f"num_clients must be >= 1, got {p.num_clients}")
    if p.scheme.startswith("dirichlet"):
        _check(p.alpha is not None and p.alpha > 0, f"Dirichlet alpha must be > 0, got {p.alpha}")
    _check(cfg.local.batch_size >= 1, f"batch_size must be >= 1, got {cfg.local.batch_size}")
    _check(cfg.local.mode in STEP_MODES,
           f"unknown local mode {cfg.local.mode!r}; expected one of {', '.join(STEP_MODES)}")
    _check(cfg.local.mode == "steps" or cfg.local.epochs > 0,
           f"local epochs must be > 0, got {cfg.local.epochs}")
    _check(cfg.local.mode != "steps" or (cfg.local.local_steps or 0) >= 1,
           f"local mode 'steps' needs local_steps >= 1, got {cfg.local.local_steps}")
    _check(cfg.optimizer.lr > 0, f"learning rate must be > 0, got {cfg.optimizer.lr}")
    _check(cfg.optimizer.warmup in WARMUPS,
           f"unknown warmup {cfg.optimizer.warmup!r}; expected one of {', '.join(WARMUPS)}")
    _check(cfg.server.optimizer in SERVER_OPTIMIZERS,
           f"unknown server optimizer {cfg.server.optimizer!r}; expected one of "
           f"{', '.join(SERVER_OPTIMIZERS)}")
    _check(cfg.aggregation.weights in AGGREGATIONS,
           f"unknown aggregation weights {cfg.aggregation.weights!r}; expected one of "
           f"{', '.join(AGGREGATIONS)}")
    _check(cfg.aggregation.bn in BN_MODES,
           f"unknown bn mode {cfg.aggregation.bn!r}; expected one of {', '.join(BN_MODES)}")
    _check(cfg.execution.strategy in STRATEGIES,
           f"unknown execution strategy {cfg.execution.strategy!r}; expected one of "
           f"{', '.join(STRATEGIES)}")
    _check(cfg.eval.every >= 1, f"eval.every must be >= 1, got {cfg.eval.every}")
    _check(cfg.shuffle.n_sf >= 0, f"shuffle.n_sf must be >= 0, got {cfg.shuffle.n_sf}")
    _check(0.0 <= cfg.shuffle.p_sf <= 1.0, f"shuffle.p_sf must lie in [0, 1], got {cfg.shuffle.p_sf}")
    _check(cfg.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {cfg.checkpoint_every}")
    try:
        as_config(cfg.pan)
        models.layers.parse_norm(cfg.model.norm or "none")
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _load_dataset(cfg: ml_collections.ConfigDict) -> data_lib.Dataset:
    d = cfg.dataset
    if d.name == "synthetic":
        ds = data_lib.synthetic(seed=cfg.seed)
    else:
        try:
            ds = data_lib.load(d.name, data_dir=d.data_dir)
        except data_lib.DataError as e:
            raise ConfigError(str(e)) from None
    if d.train_limit:
        keep = np.sort(np.random.default_rng(cfg.seed).permutation(ds.num_train)[:d.train_limit])
        ds = dataclasses.replace(ds, train_images=ds.train_images[keep],
                                 train_labels=ds.train_labels[keep])
    return ds


def build(cfg: ml_collections.ConfigDict) -> Experiment:
    """Everything a run needs, from a validated config."""
    validate(cfg)
    ds = _load_dataset(cfg)
    p = cfg.partition
    _check(p.num_clients <= ds.num_train,
           f"num_clients {p.num_clients} exceeds the {ds.num_train} training examples")
    try:
        parts = data_lib.partition(ds.train_labels, p.num_clients, p.scheme, cfg.seed,
                                   alpha=p.alpha, classes_per_client=p.classes_per_client,
                                   min_size=p.min_size, balance=p.balance,
                                   num_classes=ds.num_classes)
    except ValueError as e:
        raise ConfigError(f"partition: {e}") from None
    pan = None if not cfg.pan.amplitude else cfg.pan.to_dict()
    try:
        model = models.build(cfg.model.name, ds.num_classes, pan=pan, norm=cfg.model.norm,
                             **cfg.model.options.to_dict())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    variables = models.init(model, jax.random.PRNGKey(cfg.seed), ds.input_shape)
    stats = data_lib.NORMALIZATION.get(ds.name)
    train_x = ds.train_images if stats is None else data_lib.normalize(ds.train_images, stats)
    test_x = ds.test_images if stats is None else data_lib.normalize(ds.test_images, stats)
    client_data = ClientData.create(train_x, ds.train_labels, parts)
    work = LocalWork(cfg.local.batch_size, cfg.local.epochs, cfg.local.mode,
                     cfg.local.local_steps)
    algorithm = algorithms.from_config(model, cfg)
    if cfg.shuffle.n_sf > 0:
        spec = permutation.spec_for(model, variables)
        algorithm = with_shuffling(algorithm, spec, cfg.shuffle.p_sf, cfg.shuffle.n_sf,
                                   cfg.shuffle.window)
    sim_m = max(1, int(round(cfg.participation * len(parts))))
    strategy = resolve_strategy(cfg.execution.strategy, variables)
    executor = make_executor(strategy, algorithm, work, client_data, variables, sim_m,
                             cfg.execution.group_size)
    simulation = Simulation(algorithm, client_data, work, executor, cfg.participation,
                            cfg.aggregation.weights, cfg.seed)
    evaluate = make_evaluator(model, test_x, ds.test_labels, cfg.eval.batch_size,
                              ds.num_classes)
    return Experiment(cfg, ds, parts, model, variables, simulation, evaluate, strategy)


# ----------------------------------------------------------------------------------------
# Workdir: checkpoints and metrics.
# ----------------------------------------------------------------------------------------

def _checkpointer(workdir: str):
    import orbax.checkpoint as ocp  # slow import, needed only when running
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp, ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                                      options=options)


def _save(manager, ocp, state: SimState) -> None:
    leaves = jax.tree_util.tree_leaves((state.server, state.client_states))
    manager.save(state.round, args=ocp.args.StandardSave({f"{i:05d}": x for i, x in
                                                          enumerate(leaves)}), force=True)
    manager.wait_until_finished()


def _restore(manager, ocp, template: SimState) -> SimState:
    step = manager.latest_step()
    leaves, treedef = jax.tree_util.tree_flatten((template.server, template.client_states))
    target = {f"{i:05d}": x for i, x in enumerate(leaves)}
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    server, clients = jax.tree_util.tree_unflatten(
        treedef, [restored[f"{i:05d}"] for i in range(len(leaves))])
    return SimState(server, clients, int(step))


def _prepare_workdir(cfg: ml_collections.ConfigDict, workdir: str, resume: bool,
                     overwrite: bool) -> None:
    """Refuses to clobber: a non-empty workdir needs resume or overwrite."""
    _check(not (resume and overwrite), "--resume and --overwrite exclude each other")
    exists = os.path.isdir(workdir) and bool(os.listdir(workdir))
    _check(not os.path.exists(workdir) or os.path.isdir(workdir),
           f"workdir {workdir!r} exists and is not a directory")
    if resume:
        _check(exists and os.path.isfile(os.path.join(workdir, "config.json")),
               f"nothing to resume in {workdir!r} (no config.json)")
        with open(os.path.join(workdir, "config.json")) as f:
            saved = json.load(f)
        now = json.loads(cfg.to_json())
        changed = sorted(k for k in set(saved) | set(now)
                         if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
        _check(not changed, f"cannot resume {workdir!r} with a different config "
               f"(changed: {', '.join(changed)})")
        return
    if exists:
        _check(overwrite, f"workdir {workdir!r} is not empty; pass --resume to continue "
               "or --overwrite to replace it")
        shutil.rmtree(workdir)
    os.makedirs(workdir, exist_ok=True)


def _read_metrics(path: str, up_to_round: int) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["round"] <= up_to_round]


def summarize(rows: List[Dict[str, Any]], last: int = 5) -> Dict[str, float]:
    """Final accuracy = mean test accuracy of the last `last` evaluations (paper Fig. 10)."""
    acc = [r["test_accuracy"] for r in rows]
    return {"final_accuracy": float(np.mean(acc[-last:])) if acc else float("nan"),
            "best_accuracy": float(np.max(acc)) if acc else float("nan"),
            "final_loss": float(np.mean([r["test_loss"] for r in rows[-last:]])) if rows else
            float("nan")}


def plot_curves(runs: Dict[str, List[Dict[str, Any]]], path: str, title: str = "") -> None:
    """Test accuracy and training loss per round, one line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_acc, ax_loss = fig.subplots(1, 2)
    for name, rows in runs.items():
        rounds = [r["round"] for r in rows]
        ax_acc.plot(rounds, [100 * r["test_accuracy"] for r in rows], label=name)
        ax_loss.plot(rounds, [r["train_loss"] for r in rows], label=name)
    ax_acc.set(xlabel="round", ylabel="test accuracy (%)", title=title)
    ax_loss.set(xlabel="round", ylabel="training loss", yscale="log")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------------------

def train(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False,
          overwrite: bool = False, progress: bool = True, desc: str = "") -> Dict[str, Any]:
    """Runs `cfg` into `workdir`; returns the summary (also written to summary.json)."""
    from tqdm.auto import tqdm

    with count_compiles() as compiles:
        exp = build(cfg)  # validates before the workdir is touched
        _prepare_workdir(cfg, workdir, resume, overwrite)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(cfg.to_json(indent=2))
        ocp, manager = _checkpointer(workdir)
        state = exp.simulation.init(exp.variables)
        if resume and manager.latest_step() is not None:
            state = _restore(manager, ocp, state)
        metrics_path = os.path.join(workdir, "metrics.jsonl")
        rows = _read_metrics(metrics_path, state.round)
        with open(metrics_path, "w") as f:  # drops rows past the restored checkpoint
            f.writelines(json.dumps(r) + "\n" for r in rows)

        # Client k's expected accuracy on a test set with its own label mix (eval.local).
        counts = data_lib.client_label_counts(exp.dataset.train_labels, exp.client_indices,
                                              exp.dataset.num_classes)
        label_mix = counts / counts.sum(axis=1, keepdims=True)
        start, real, computed, first_round_compiles = time.time(), 0, 0, None
        bar = tqdm(total=cfg.rounds, initial=state.round, desc=desc or "rounds",
                   disable=not progress, unit="round", dynamic_ncols=True)
        last_saved = state.round
        while state.round < cfg.rounds:
            t0 = time.time()
            new_state, stats = exp.simulation.round(state)
            if not math.isfinite(stats["train_loss"]):
                if last_saved != state.round:
                    _save(manager, ocp, state)
                bar.close()
                raise TrainingDiverged(
                    f"training loss is {stats['train_loss']} in round {new_state.round}; "
                    f"stopped, last good checkpoint (round {state.round}) kept in "
                    f"{os.path.join(workdir, 'checkpoints')}")
            state = new_state
            real += stats["real_examples"]
            computed += stats["computed_examples"]
            r = state.round
            if r % cfg.eval.every == 0 or r == cfg.rounds:
                ev = exp.evaluate(exp.simulation.algorithm.eval_variables(state.server))
                row = {"round": r, "test_accuracy": ev["accuracy"], "test_loss": ev["loss"],
                       "train_loss": stats["train_loss"], "seconds": time.time() - t0}
                if cfg.eval.local:
                    local_acc = label_mix @ ev["class_accuracy"]
                    row.update(local_test_accuracy_mean=float(local_acc.mean()),
                               local_test_accuracy_min=float(local_acc.min()),
                               local_test_accuracy_std=float(local_acc.std()))
                rows.append(row)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                bar.set_postfix(acc=f"{100 * ev['accuracy']:.2f}%",
                                loss=f"{stats['train_loss']:.3f}")
            if r % cfg.checkpoint_every == 0 or r == cfg.rounds:
                _save(manager, ocp, state)
                last_saved = r
            if first_round_compiles is None:
                first_round_compiles = compiles.count
            bar.update(1)
        bar.close()
        manager.close()

    summary = {**summarize(rows), "rounds": state.round, "wall_seconds": time.time() - start,
               "strategy": exp.strategy, "num_clients": len(exp.client_indices),
               "clients_per_round": exp.simulation.num_sampled,
               "padding_efficiency": real / computed if computed else None,
               "compiles": compiles.count,
               "compiles_after_first_round": (compiles.count - first_round_compiles
                                              if first_round_compiles is not None else 0)}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_curves({desc or "run": rows}, os.path.join(workdir, "curve.png"),
                f"{cfg.model.name} on {cfg.dataset.name}")
    return summary


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Dict[str, Any]
                    ) -> ml_collections.ConfigDict:
    """A copy of `cfg` with nested keys set, e.g. {'pan': {'amplitude': 0.0}}."""
    out = copy.deepcopy(cfg)
    with out.unlocked():
        out.variants = ml_collections.ConfigDict()

    def merge(target, values, prefix):
        for key, value in values.items():
            _check(key in target, f"variant override {prefix + key!r} names no config key")
            if isinstance(value, dict) and isinstance(target[key], ml_collections.ConfigDict):
                merge(target[key], value, f"{prefix}{key}.")
            else:
                target[key] = value
    merge(out, overrides, "")
    return out


def run(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False,
        overwrite: bool = False, progress: bool = True) -> Dict[str, Dict[str, Any]]:
    """Runs `cfg` (or each of its variants) and returns {name: summary}."""
    variants = cfg.variants.to_dict() if cfg.get("variants") else {}
    if not variants:
        return {"run": train(cfg, workdir, resume=resume, overwrite=overwrite,
                             progress=progress)}
    configs = {name: apply_overrides(cfg, ov) for name, ov in variants.items()}
    for c in configs.values():
        validate(c)
    if not resume:
        _prepare_workdir(cfg, workdir, resume=False, overwrite=overwrite)
    summaries = {name: train(c, os.path.join(workdir, name), resume=resume, overwrite=False,
                             progress=progress, desc=name) for name, c in configs.items()}
    curves = {name: _read_metrics(os.path.join(workdir, name, "metrics.jsonl"), cfg.rounds)
              for name in configs}
    plot_curves(curves, os.path.join(workdir, "curves.png"),
                f"{cfg.model.name} on {cfg.dataset.name}")
    with open(os.path.join(workdir, "comparison.json"), "w") as f:
        json.dump(summaries, f, indent=2)
    with open(os.path.join(workdir, "comparison.csv"), "w") as f:
        f.write("variant,final_accuracy,best_accuracy,final_loss,rounds,wall_seconds\n")
        for name, s in summaries.items():
            f.write(f"{name},{s['final_accuracy']:.6f},{s['best_accuracy']:.6f},"
                    f"{s['final_loss']:.6f},{s['rounds']},{s['wall_seconds']:.1f}\n")
    return summaries


def format_table(summaries: Dict[str, Dict[str, Any]]) -> str:
    """A small plain-text comparison table."""
    head = f"{'variant':<12} {'final acc (last 5)':>18} {'best acc':>9} {'rounds':>6} {'time':>8}"
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        lines.append(f"{name:<12} {100 * s['final_accuracy']:>17.2f}% "
                     f"{100 * s['best_accuracy']:>8.2f}% {s['rounds']:>6} "
                     f"{s['wall_seconds']:>7.0f}s")
    return "\n".join(lines)
