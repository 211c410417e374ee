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
import re
import time
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_pan import algorithms, models, permutation, schema
from fedjax_pan import data as data_lib
from fedjax_pan import workdir as workdir_lib
from fedjax_pan.algorithms.shuffle import with_shuffling
from fedjax_pan.engine import (Augment, ClientData, LocalWork, Simulation, clients_per_round,
                               count_compiles, make_evaluator, make_executor, resolve_strategy)
from fedjax_pan.engine.evaluation import client_metrics, make_client_evaluator
from fedjax_pan.engine.simulation import SimState
from fedjax_pan.errors import ConfigError, Interrupted, TrainingDiverged, WorkdirError

__all__ = ["ConfigError", "TrainingDiverged", "WorkdirError", "Interrupted", "Experiment",
           "validate", "build", "train", "train_rounds", "run", "summarize", "format_table",
           "seed_groups", "compare_groups", "paired_stats", "variant_configs"]

# Keys that may change when resuming (to extend a run or change its reporting cadence).
RESUMABLE_CHANGES = ("rounds", "eval", "checkpoint_every", "max_train_loss")
# What a run's summary adds up over all the processes that ran it (kept in checkpoints).
COUNTERS = ("wall_seconds", "real_examples", "computed_examples", "compiles",
            "compiles_after_first_round", "processes")


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
    setup_compiles: int = 0
    # Each client scored on its own test part (partition.test_fraction > 0), else None.
    client_evaluate: Any = None
    test_indices: Optional[List[np.ndarray]] = None


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first invalid or unknown value; touches no file."""
    schema.validate(cfg)


def _data_key(cfg: ml_collections.ConfigDict) -> tuple:
    """What determines a run's training data (variants sharing it share one copy)."""
    d = cfg.dataset
    return (d.name, d.data_dir, d.train_limit, cfg.seed)


def _load_dataset(cfg: ml_collections.ConfigDict,
                  cache: Optional[Dict[Any, Any]] = None) -> data_lib.Dataset:
    d = cfg.dataset
    key = _data_key(cfg)
    if cache is not None and key in cache:
        return cache[key]
    if d.name == "synthetic":
        ds = data_lib.synthetic(seed=cfg.seed)
    else:
        try:
            ds = data_lib.load(d.name, data_dir=d.data_dir)
        except data_lib.DataError as e:
            raise ConfigError(str(e)) from None
    # A cap: a limit above the dataset's size keeps it whole.
    ds = data_lib.subset(ds, d.train_limit, None, cfg.seed)
    if cache is not None:
        cache[key] = ds
    return ds


def _normalized(cfg: ml_collections.ConfigDict, ds: data_lib.Dataset,
                cache: Optional[Dict[Any, Any]]) -> Any:
    """Normalised float32 train and test images on the device, shared through `cache` by
    every variant on the same data (a sweep holds one copy, not one per run)."""
    key = ("normalized", cfg.dataset.normalization, *_data_key(cfg))
    if cache is not None and key in cache:
        return cache[key]
    stats = _stats(cfg, ds)
    train_x = ds.train_images if stats is None else data_lib.normalize(ds.train_images, stats)
    test_x = ds.test_images if stats is None else data_lib.normalize(ds.test_images, stats)
    arrays = (jnp.asarray(train_x, jnp.float32), jnp.asarray(test_x, jnp.float32))
    if cache is not None:
        cache[key] = arrays
    return arrays


def _stats(cfg: ml_collections.ConfigDict, ds: data_lib.Dataset) -> Optional[Any]:
    """The (mean, std) normalising `ds` under `config.dataset.normalization`."""
    if cfg.dataset.normalization == "authors":
        _check(ds.name in data_lib.AUTHORS_NORMALIZATION,
               f"config.dataset.normalization='authors' has constants for "
               f"{', '.join(data_lib.AUTHORS_NORMALIZATION)}, not {ds.name!r}")
        return data_lib.AUTHORS_NORMALIZATION[ds.name]
    return data_lib.normalization(ds)


def _augment(cfg: ml_collections.ConfigDict, ds: data_lib.Dataset) -> Optional[Augment]:
    """`config.dataset.augment` as the engine's `Augment` (padding is black, normalised)."""
    if cfg.dataset.augment == "none":
        return None
    stats = _stats(cfg, ds)
    fill = (0.0,) if stats is None else tuple(-m / s for m, s in zip(*stats))
    return Augment(pad=4, flip=True, fill=fill)


def _check_shuffleable(algorithm: Any, variables: Any, num_classes: int, name: str) -> None:
    # Alg. 2 permutes a local model in place: the local state must be one (params and
    # model_state); per-client extras (control variates, previous models) would also need
    # permuting, which no algorithm declares yet.
    ctx = algorithms.ClientContext(jax.random.PRNGKey(0), jnp.int32(1), jnp.int32(1),
                                   jnp.int32(0), jnp.int32(0), jnp.zeros(num_classes))
    server = jax.eval_shape(algorithm.server_init, variables)
    local = jax.eval_shape(lambda s: algorithm.client_init(
        s, algorithm.client_state_init(s), ctx), server)
    _check(hasattr(local, "params") and hasattr(local, "model_state"),
           f"config.shuffle.n_sf > 0 (Alg. 2) needs a local state that is a model; "
           f"algorithm {name!r} keeps {type(local).__name__}: set shuffle.n_sf=0")


def public_split(num_train: int, public_size: int, seed: int
                 ) -> Tuple[np.ndarray, np.ndarray]:
    """(public rows, rows kept for the clients) of the training set: `public_size` rows
    drawn by the seed, held out of every client's data (both sorted)."""
    if public_size <= 0:
        return np.zeros(0, np.int64), np.arange(num_train)
    if public_size >= num_train:
        raise ConfigError(f"{public_size} public examples (config.dataset.public_size, or "
                          f"the algorithm's default where it is 0) must be fewer than the "
                          f"{num_train} training examples: set dataset.public_size")
    perm = np.random.default_rng([seed, 0x9B]).permutation(num_train)
    return np.sort(perm[:public_size]), np.sort(perm[public_size:])


def build(cfg: ml_collections.ConfigDict,
          cache: Optional[Dict[Any, Any]] = None) -> Experiment:
    """Everything a run needs, from a config (validated here); `cache` shares loaded data."""
    validate(cfg)
    ds = _load_dataset(cfg, cache)
    _check(ds.num_test > 0, f"the {ds.name} test set is empty: nothing to evaluate on")
    p = cfg.partition
    if p.scheme == "natural":
        # The data decide the clients (FEMNIST: its sampled writers); say how many there are.
        # (The schema has refused datasets without writer groups.)
        groups = len(np.unique(ds.train_groups))
        _check(p.num_clients == groups,
               f"config.partition.num_clients={p.num_clients}, but partition.scheme='natural' "
               f"makes one client per writer (natural group) and this {ds.name} training "
               f"data has {groups}: set --config.partition.num_clients={groups}")
    _check(p.num_clients <= ds.num_train,
           f"config.partition.num_clients={p.num_clients} exceeds the {ds.num_train} "
           "training examples")
    public_rows, kept = public_split(
        ds.num_train, algorithms.registry.public_size(cfg, ds.num_train), cfg.seed)
    _check(len(kept) >= p.num_clients,
           f"{len(public_rows)} public examples (config.dataset.public_size) leave {len(kept)} "
           f"training "
           f"examples for {p.num_clients} clients")
    try:
        groups = None if ds.train_groups is None else np.asarray(ds.train_groups)[kept]
        parts = data_lib.partition(np.asarray(ds.train_labels)[kept], p.num_clients, p.scheme,
                                   cfg.seed, alpha=p.alpha,
                                   classes_per_client=p.classes_per_client,
                                   min_size=p.min_size, balance=p.balance,
                                   num_classes=ds.num_classes, groups=groups)
        parts = [kept[q] for q in parts]  # indices into the whole training set
    except ValueError as e:
        raise ConfigError(f"partition: {e}") from None
    test_parts = None
    if p.test_fraction > 0:
        parts, test_parts = data_lib.split_clients(parts, p.test_fraction, cfg.seed)
    pan = None if not cfg.pan.amplitude else cfg.pan.to_dict()
    try:
        model = models.build(cfg.model.name, ds.num_classes, pan=pan, norm=cfg.model.norm,
                             **cfg.model.options.to_dict())
        variables = models.init(model, jax.random.PRNGKey(cfg.seed), ds.input_shape)
    except (TypeError, ValueError) as e:
        # The first line: JAX appends a paragraph on its filtered traceback frames.
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config.model.options {cfg.model.options.to_dict()} "
                          f"({cfg.model.name} on {ds.name}): {why}") from None
    train_x, test_x = _normalized(cfg, ds, cache)
    client_data = ClientData.create(train_x, ds.train_labels, parts, ds.num_classes)
    work = LocalWork(cfg.local.batch_size, cfg.local.epochs, cfg.local.mode,
                     cfg.local.local_steps, _augment(cfg, ds))
    evaluate = make_evaluator(model, test_x, ds.test_labels, cfg.eval.batch_size,
                              ds.num_classes)
    local = {}
    if test_parts is not None:
        local = {"client_evaluate": make_client_evaluator(model, train_x, ds.train_labels,
                                                          test_parts, cfg.eval.batch_size),
                 "test_indices": test_parts}
    strategy = resolve_strategy(cfg.execution.strategy, variables)
    entry = algorithms.ALGORITHMS[cfg.algorithm]
    public = train_x[public_rows] if len(public_rows) else None
    try:
        # Rounds run by the algorithm's own driver (FedMA; KT-pFL over several
        # architectures), where it gives one for this config.
        simulation = None if entry.driver is None else entry.driver(
            model, cfg, algorithms.registry.client_tx(cfg), client_data, work,
            **({"public": public} if entry.public else {}))
        algorithm = None if simulation is not None else algorithms.from_config(
            model, cfg, public=public)
        if algorithm is not None:
            # Options checked against the model's layers fail here, not in round 1.
            jax.eval_shape(lambda v: algorithm.client_state_init(algorithm.server_init(v)),
                           variables)
    except ValueError as e:
        why = str(e).strip().splitlines()[0]
        raise ConfigError(f"config.{cfg.algorithm}: {why}") from None
    if simulation is not None:
        _check(cfg.shuffle.n_sf == 0, f"config.shuffle.n_sf > 0 (Alg. 2) is not available "
               f"with algorithm {cfg.algorithm!r} as configured: set shuffle.n_sf=0")
        return Experiment(cfg, ds, parts, model, variables, simulation, evaluate, strategy,
                          **local)
    if cfg.shuffle.n_sf > 0:
        _check_shuffleable(algorithm, variables, ds.num_classes, cfg.algorithm)
        spec = permutation.spec_for(model, variables)
        algorithm = with_shuffling(algorithm, spec, cfg.shuffle.p_sf, cfg.shuffle.n_sf,
                                   cfg.shuffle.window)
    try:
        executor = make_executor(strategy, algorithm, work, client_data, variables,
                                 clients_per_round(cfg.participation, len(parts)),
                                 cfg.execution.block_size)
    except ValueError as e:
        raise ConfigError(f"config.execution: {e}") from None
    simulation = Simulation(algorithm, client_data, work, executor, cfg.participation,
                            cfg.aggregation.weights, cfg.seed)
    return Experiment(cfg, ds, parts, model, variables, simulation, evaluate, strategy, **local)


# ----------------------------------------------------------------------------------------
# Workdir: resumability and metrics.
# ----------------------------------------------------------------------------------------

def config_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """Dotted keys whose values differ between a run's saved config and `now` (JSON
    dicts). A key the saved config lacks counts only if `now` holds it at other than its
    default: options added to the library since (a new algorithm's namespace, say) leave
    older runs resumable."""
    from fedjax_pan.defaults import default_config

    def walk(saved, now, default, prefix):
        out = []
        for k in sorted(set(saved) | set(now)):
            if k not in saved and k in default and now[k] == default[k]:
                continue
            if isinstance(saved.get(k), dict) and isinstance(now.get(k), dict):
                sub = default.get(k)
                out += walk(saved[k], now[k], sub if isinstance(sub, dict) else {},
                            f"{prefix}{k}.")
            elif saved.get(k) != now.get(k):
                out.append(prefix + k)
        return out
    return walk(saved, now, json.loads(default_config().to_json()), "")


def check_workdir(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool,
                  overwrite: bool) -> None:
    """Everything about `workdir` that can refuse the run, checked before any data loads."""
    workdir_lib.check(workdir, resume=resume, overwrite=overwrite)
    if not resume:
        return
    saved = workdir_lib.read_config(workdir)
    now = json.loads(cfg.to_json())
    changed = sorted(k for k in config_changes(saved, now)
                     if k.split(".")[0] not in RESUMABLE_CHANGES)
    _check(not changed, f"cannot resume {workdir!r} with a different config "
           f"(changed: {', '.join(changed)}); only {', '.join(RESUMABLE_CHANGES)} may change")
    subdirs = [os.path.join(workdir, name) for name in (cfg.get("variants") or {})]
    for d in [workdir] + [d for d in subdirs if os.path.isdir(d)]:
        done = max(workdir_lib.saved_rounds(d), default=0)
        _check(cfg.rounds >= done, f"cannot resume {d!r} with rounds={cfg.rounds}: it has run "
               f"{done} rounds already; pass --config.rounds={done} or more")


def _read_metrics(path: str, up_to_round: int) -> List[Dict[str, Any]]:
    """The rows of `path` up to `up_to_round`; ConfigError naming the line when one is cut
    short (a crash or a full disk) and nothing else holds the rows."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ConfigError(
                    f"line {n} of {path} is cut short and the checkpoint to resume from "
                    f"(written by an older version) holds no copy of the metrics: delete that "
                    f"line and the ones after it to resume without their rounds, or start "
                    f"again with --overwrite") from None
    return [r for r in rows if r["round"] <= up_to_round]


def summarize(rows: List[Dict[str, Any]], last: int = 5) -> Dict[str, float]:
    """Final accuracy = mean test accuracy of the last `last` evaluations (paper Fig. 10)."""
    acc = [r["test_accuracy"] for r in rows]
    out = {"final_accuracy": float(np.mean(acc[-last:])) if acc else float("nan"),
           "best_accuracy": float(np.max(acc)) if acc else float("nan"),
           "final_loss": float(np.mean([r["test_loss"] for r in rows[-last:]])) if rows else
           float("nan")}
    own = [r["pfl_accuracy"] for r in rows if "pfl_accuracy" in r]
    if own:  # each client on its own test part (a personalised algorithm's own result)
        out["final_pfl_accuracy"] = float(np.mean(own[-last:]))
    return out


def plot_curves(runs: Dict[str, List[Dict[str, Any]]], path: str, title: str = "",
                groups: Optional[Dict[str, Dict[int, str]]] = None) -> None:
    """Test accuracy and training loss per round: one line per run, or with `groups`
    ({group: {seed: run}}) the mean over a group's runs with a band from min to max."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_acc, ax_loss = fig.subplots(1, 2)
    groups = groups or {name: {0: name} for name in runs}
    for group, members in groups.items():
        rows = [runs[name] for name in members.values()]
        n = min(len(r) for r in rows)
        if n == 0:
            continue
        rounds = [r["round"] for r in rows[0][:n]]
        label = group if len(rows) == 1 else f"{group} (mean of {len(rows)} seeds)"
        for ax, key, scale in ((ax_acc, "test_accuracy", 100.0), (ax_loss, "train_loss", 1.0)):
            v = scale * np.asarray([[r[key] for r in run[:n]] for run in rows], np.float64)
            line, = ax.plot(rounds, v.mean(axis=0), label=label)
            if len(rows) > 1:
                ax.fill_between(rounds, v.min(axis=0), v.max(axis=0), alpha=0.2,
                                color=line.get_color())
    ax_acc.set(xlabel="round", ylabel="test accuracy (%)", title=title)
    ax_loss.set(xlabel="round", ylabel="training loss", yscale="log")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def seed_groups(configs: Dict[str, ml_collections.ConfigDict]) -> Dict[str, Dict[int, str]]:
    """Variants named `<group>_s<seed>` (the seed their config runs with) gathered as
    {group: {seed: variant}}, in order of first appearance; any other variant is a group
    of its own."""
    out: Dict[str, Dict[int, str]] = {}
    for name, c in configs.items():
        m = re.fullmatch(r"(.+)_s(\d+)", name)
        group = m.group(1) if m and int(m.group(2)) == c.seed else name
        out.setdefault(group, {})[int(c.seed)] = name
    return out


def paired_stats(off: List[float], on: List[float]) -> Dict[str, float]:
    """Mean and std (ddof 0) of `off` and `on` and of the paired difference on - off (element
    i of each from the same seed); NaN entries (diverged runs) drop their pair."""
    a, b = np.asarray(off, np.float64), np.asarray(on, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal lengths, got {a.size} and {b.size}")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    stat = (lambda v: (float(v.mean()), float(v.std()))) if ok.any() else (
        lambda v: (float("nan"), float("nan")))
    (om, osd), (nm, nsd), (dm, dsd) = stat(a), stat(b), stat(b - a)
    return {"off_mean": om, "off_std": osd, "on_mean": nm, "on_std": nsd,
            "diff_mean": dm, "diff_std": dsd, "pairs": int(ok.sum())}


def compare_groups(summaries: Dict[str, Dict[str, Any]],
                   groups: Dict[str, Dict[int, str]]) -> List[Dict[str, Any]]:
    """Per group: mean and std (ddof 0) of the final accuracy over its seeds, and the
    difference to the first group (the reference) paired by seed, with its std."""
    ref = next(iter(groups.values()))
    out = []
    for group, members in groups.items():
        acc = np.asarray([summaries[v]["final_accuracy"] for v in members.values()])
        common = [seed for seed in members if seed in ref]
        paired = paired_stats([summaries[ref[seed]]["final_accuracy"] for seed in common],
                              [summaries[members[seed]]["final_accuracy"] for seed in common])
        out.append({"group": group, "seeds": sorted(members), "mean": float(acc.mean()),
                    "std": float(acc.std()), "diff_mean": paired["diff_mean"],
                    "diff_std": paired["diff_std"], "pairs": paired["pairs"]})
    return out


# ----------------------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------------------

def train(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False,
          overwrite: bool = False, progress: bool = True, desc: str = "") -> Dict[str, Any]:
    """Runs `cfg` into `workdir`; returns the summary (also written to summary.json).

    The config, the workdir request and the data are all checked before anything is
    written; see `workdir.claim` for how `overwrite` keeps the old results until this
    run succeeds.
    """
    validate(cfg)
    check_workdir(cfg, workdir, resume=resume, overwrite=overwrite)
    exp = _build_counted(cfg)
    with workdir_lib.claim(workdir, overwrite=overwrite, resume=resume):
        return _train(exp, workdir, resume=resume, progress=progress, desc=desc)


def _build_counted(cfg: ml_collections.ConfigDict,
                   cache: Optional[Dict[Any, Any]] = None) -> Experiment:
    """`build`, with the compilations it took (a run's summary counts them)."""
    with count_compiles() as c:
        exp = build(cfg, cache)
    exp.setup_compiles = c.count
    return exp


def _divergence(loss: float, cfg: ml_collections.ConfigDict) -> Optional[str]:
    """What is wrong with a round's training loss (None: nothing)."""
    if math.isfinite(loss) and loss <= cfg.max_train_loss:
        return None
    why = ("is not finite" if not math.isfinite(loss) else
           f"exceeds config.max_train_loss={cfg.max_train_loss:g}")
    return f"training loss {loss:.4g} {why}"


def _alive(state: SimState) -> bool:
    """Whether none of `state`'s arrays was donated to (and deleted by) a later call."""
    return not any(isinstance(x, jax.Array) and x.is_deleted()
                   for x in jax.tree_util.tree_leaves((state.server, state.client_states)))


def _divergence_advice(cfg: ml_collections.ConfigDict) -> str:
    """What to change after a diverged run: the learning rate, or the algorithm's options
    that were set away from their defaults (the likelier cause when there are any)."""
    defaults = algorithms.ALGORITHMS[cfg.algorithm].options
    own = cfg.get(cfg.algorithm) or {}
    changed = [f"{cfg.algorithm}.{k}={own[k]!r}" for k in defaults
               if k in own and own[k] != defaults[k]]
    advice = "lower optimizer.lr or optimizer.grad_clip"
    if changed:
        advice = f"check {', '.join(changed)} (changed from the default), or {advice}"
    return advice


def evaluate_clients(exp: Experiment, state: SimState, net: Any, global_variables: Any
                     ) -> Dict[str, float]:
    """Each client's own model (or the global one) on its own test part: the PFLlib
    aggregate and the spread over clients (`engine.evaluation.client_metrics`)."""
    groups = getattr(exp.simulation, "personal_groups", None)
    if groups is not None:  # clients of several networks: each group on its own network
        correct = count = 0.0
        for group_net, ids, stacked in groups(state):
            # Vmapped like training, except where training loops (CPU convnets).
            one = jax.tree_util.tree_map(lambda x: x[0], stacked)
            looped = resolve_strategy(exp.config.execution.strategy, one) == "loop"
            part = exp.client_evaluate(stacked, personal=True, vmapped=not looped,
                                       net=group_net, clients=ids)
            correct, count = correct + part["correct"], count + part["count"]
        return client_metrics(correct, count)
    personal = getattr(exp.simulation, "personal_evaluation", lambda s: None)(state)
    if personal is None:
        counts = exp.client_evaluate(global_variables, net=net)
    else:
        counts = exp.client_evaluate(personal, personal=True, vmapped=exp.strategy != "loop")
    return client_metrics(counts["correct"], counts["count"])


def train_rounds(exp: Experiment, state: SimState, rounds: int, *, progress: bool = True,
                 desc: str = "rounds") -> tuple:
    """`rounds` more rounds of `exp` without a workdir (analyses, notebooks): the new state
    and each round's statistics. Stops with TrainingDiverged as `train` does."""
    from tqdm.auto import tqdm

    history = []
    for _ in tqdm(range(rounds), desc=desc, disable=not progress, leave=False,
                  dynamic_ncols=True):
        new_state, stats = exp.simulation.round(state)
        why = _divergence(stats["train_loss"], exp.config)
        if why:
            raise TrainingDiverged(f"training diverged in round {new_state.round}: {why}")
        state = new_state
        history.append(stats)
    return state, history


class _Run:
    """One process's share of a run: counters on top of those restored from a checkpoint."""

    def __init__(self, base: Dict[str, Any], setup_compiles: int):
        self.base = {k: base.get(k, 0) for k in COUNTERS}
        self.start = time.time()
        self.real = self.computed = self.rounds = 0
        self.compiles = setup_compiles
        self.first_round_compiles: Optional[int] = None

    def totals(self) -> Dict[str, Any]:
        if not self.rounds:  # e.g. resuming a finished run: its record stands
            return dict(self.base)
        own = {"wall_seconds": time.time() - self.start, "real_examples": self.real,
               "computed_examples": self.computed, "compiles": self.compiles,
               "compiles_after_first_round": self.compiles - self.first_round_compiles,
               "processes": 1}
        return {k: self.base[k] + own[k] for k in COUNTERS}


def _train(exp: Experiment, workdir: str, *, resume: bool, progress: bool,
           desc: str) -> Dict[str, Any]:
    from tqdm.auto import tqdm

    cfg = exp.config
    ckpt: Optional[workdir_lib.Checkpoints] = None
    last_saved = 0

    def safe() -> str:
        if last_saved:
            return (f"{workdir} holds {workdir_lib.rounds_text(last_saved)} (checkpoint of "
                    f"round {last_saved}); free space")
        return "no round of it was saved; free space"

    with count_compiles() as compiles:
        state = exp.simulation.init(exp.variables)
        with workdir_lib.writing(f"checkpoints in {workdir}", safe):
            ckpt = workdir_lib.Checkpoints(workdir)
        counters: Dict[str, Any] = {}
        metrics_path = os.path.join(workdir, "metrics.jsonl")
        rows: Optional[List[Dict[str, Any]]] = None
        if resume and ckpt.latest() is not None:
            tree, counters = ckpt.restore(ckpt.latest(), (state.server, state.client_states),
                                          saved_shapes=exp.simulation.shapes_change)
            state = SimState(*tree, ckpt.latest())
            last_saved = state.round
            # The checkpoint's own record: metrics.jsonl may end in a line a crash cut.
            rows = ckpt.metrics(state.round)
        run = _Run(counters, exp.setup_compiles)
        if rows is None:
            rows = _read_metrics(metrics_path, state.round)
        with workdir_lib.writing(f"{workdir}/config.json", safe):
            workdir_lib.write_atomic(os.path.join(workdir, "config.json"), cfg.to_json(indent=2))
            # drops rows past the restored checkpoint
            workdir_lib.write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

        saved_totals = run.totals()

        def save(s: SimState) -> None:
            nonlocal last_saved, saved_totals
            totals = run.totals()
            with workdir_lib.writing(f"the checkpoint of round {s.round}", safe):
                ckpt.save(s.round, (s.server, s.client_states), totals,
                          [r for r in rows if r["round"] <= s.round])
            last_saved, saved_totals = s.round, totals

        # Client k's expected accuracy on a test set with its own label mix (eval.local).
        counts = data_lib.client_label_counts(exp.dataset.train_labels, exp.client_indices,
                                              exp.dataset.num_classes)
        label_mix = counts / counts.sum(axis=1, keepdims=True)
        bar = tqdm(total=cfg.rounds, initial=state.round, desc=desc or "rounds",
                   disable=not progress, unit="round", dynamic_ncols=True)
        try:
            while state.round < cfg.rounds:
                t0 = time.time()
                new_state, stats = exp.simulation.round(state)
                # Once a round has run, its evaluation, files and checkpoint complete before a
                # signal is acted on: the state it started from may be gone (donated buffers).
                with workdir_lib.deferred_interrupts():
                    loss, r = stats["train_loss"], new_state.round
                    why = _divergence(loss, cfg)
                    if why:
                        if state.round > last_saved and _alive(state):
                            save(state)
                        kept = (f"the last good checkpoint (round {last_saved}) is kept in "
                                f"{ckpt.directory}" if last_saved else
                                "no round completed, so nothing was kept")
                        raise TrainingDiverged(f"training diverged in round {r}: {why}; {kept}; "
                                               f"{_divergence_advice(cfg)}")
                    row = None
                    if r % cfg.eval.every == 0 or r == cfg.rounds:
                        net, evaluated = exp.simulation.evaluation(new_state.server)
                        ev = exp.evaluate(evaluated, net)
                        # The algorithm's own metrics (train_*) follow the engine's.
                        row = {"round": r, "test_accuracy": ev["accuracy"],
                               "test_loss": ev["loss"],
                               **{k: v for k, v in stats.items() if k.startswith("train_")},
                               "upload_bytes": stats["upload_bytes"],
                               **({"download_bytes": stats["download_bytes"]}
                                  if "download_bytes" in stats else {}),
                               "seconds": time.time() - t0}
                        if exp.client_evaluate is not None:
                            row.update(evaluate_clients(exp, new_state, net, evaluated))
                        if cfg.eval.local:
                            local_acc = label_mix @ ev["class_accuracy"]
                            row.update(local_test_accuracy_mean=float(local_acc.mean()),
                                       local_test_accuracy_min=float(local_acc.min()),
                                       local_test_accuracy_std=float(local_acc.std()))
                    state = new_state
                    run.rounds += 1
                    run.real += stats["real_examples"]
                    run.computed += stats["computed_examples"]
                    run.compiles = exp.setup_compiles + compiles.count
                    if run.first_round_compiles is None:
                        run.first_round_compiles = run.compiles
                    if row is not None:
                        rows.append(row)
                        with workdir_lib.writing(metrics_path, safe):
                            with open(metrics_path, "a") as f:
                                f.write(json.dumps(row) + "\n")
                        bar.set_postfix(acc=f"{100 * row['test_accuracy']:.2f}%",
                                        loss=f"{loss:.3f}")
                    if r % cfg.checkpoint_every == 0 or r == cfg.rounds:
                        save(state)
                    bar.update(1)
        except KeyboardInterrupt as e:
            with workdir_lib.deferred_interrupts():  # a second Ctrl-C must not cut the save
                # A round cut short may have consumed its starting state's buffers; then the
                # last checkpoint stands (its record of the rows goes with it).
                if state.round > last_saved and _alive(state):
                    save(state)
            done = (f"{workdir_lib.rounds_text(last_saved)} "
                    f"{'is' if last_saved == 1 else 'are'} saved in {workdir}"
                    if last_saved else "no round of it was saved")
            raise workdir_lib.interrupted(e, f"interrupted in round {state.round + 1}; "
                                          f"{done}") from None
        finally:
            bar.close()
            ckpt.close()

    totals = saved_totals  # the final round is always saved: its record is the run's
    summary = {**summarize(rows), "rounds": state.round, "wall_seconds": totals["wall_seconds"],
               "strategy": exp.strategy, "num_clients": len(exp.client_indices),
               "clients_per_round": exp.simulation.num_sampled,
               "padding_efficiency": (totals["real_examples"] / totals["computed_examples"]
                                      if totals["computed_examples"] else None),
               "compiles": totals["compiles"],
               "compiles_after_first_round": totals["compiles_after_first_round"],
               "processes": totals["processes"]}
    # summary.json marks a finished run (scripts read it back on --resume), so it comes
    # after the curve, and a signal waits until both are written.
    with workdir_lib.deferred_interrupts(), \
            workdir_lib.writing(f"the summary of {workdir}", safe):
        plot_curves({desc or "run": rows}, os.path.join(workdir, "curve.png"),
                    f"{cfg.model.name} on {cfg.dataset.name}")
        workdir_lib.write_atomic(os.path.join(workdir, "summary.json"),
                                 json.dumps(summary, indent=2))
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
    check_workdir(cfg, workdir, resume=resume, overwrite=overwrite)
    cache: Dict[Any, Any] = {}
    experiments = {name: _build_counted(c, cache) for name, c in configs.items()}
    top = os.path.join(workdir, "config.json")
    with workdir_lib.claim(workdir, overwrite=overwrite, resume=resume):
        with workdir_lib.writing(top, lambda: "nothing of this run was saved yet"):
            workdir_lib.write_atomic(top, cfg.to_json(indent=2))
        summaries = {}
        for name, exp in experiments.items():
            sub = os.path.join(workdir, name)
            again = resume and os.path.isfile(os.path.join(sub, "config.json"))
            if not again:
                os.makedirs(sub, exist_ok=True)
            summaries[name] = _train(exp, sub, resume=again, progress=progress, desc=name)
        curves = {name: _read_metrics(os.path.join(workdir, name, "metrics.jsonl"), cfg.rounds)
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
            plot_curves(curves, os.path.join(workdir, "curves.png"),
                        f"{cfg.model.name} on {cfg.dataset.name}", groups=groups)
            workdir_lib.write_atomic(os.path.join(workdir, "comparison.json"),
                                     json.dumps(summaries, indent=2))
            workdir_lib.write_atomic(os.path.join(workdir, "comparison.csv"), "".join(csv))
            if any(len(m) > 1 for m in groups.values()):
                workdir_lib.write_atomic(os.path.join(workdir, "comparison_seeds.json"),
                                         json.dumps(table, indent=2))
    return summaries


def format_table(summaries: Dict[str, Dict[str, Any]],
                 groups: Optional[Dict[str, Dict[int, str]]] = None) -> str:
    """A small plain-text comparison table; with `groups` (`seed_groups`) of several seeds,
    also each group's mean +- std over seeds and its difference to the first group paired
    by seed."""
    width = max([12, *(len(n) for n in summaries)])
    # Clients scored on their own test parts: a personalised algorithm's result, beside
    # the global model's (KT-pFL's is its initial one).
    own = any("final_pfl_accuracy" in s for s in summaries.values())
    head = (f"{'variant':<{width}} {'final acc (last 5)':>18} {'best acc':>9} "
            + (f"{'own test (last 5)':>18} " if own else "") + f"{'rounds':>6} {'time':>8}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        mine = (f"{100 * s['final_pfl_accuracy']:>17.2f}% " if "final_pfl_accuracy" in s
                else f"{'-':>18} ") if own else ""
        lines.append(f"{name:<{width}} {100 * s['final_accuracy']:>17.2f}% "
                     f"{100 * s['best_accuracy']:>8.2f}% {mine}{s['rounds']:>6} "
                     f"{s['wall_seconds']:>7.0f}s")
    if groups and any(len(m) > 1 for m in groups.values()):
        table = compare_groups(summaries, groups)
        ref = table[0]["group"]
        lines.append("")
        lines.append(f"mean +- std over seeds; difference to {ref} paired by seed:")
        for r in table:
            diff = ("" if r["group"] == ref else
                    f"   {r['group']} - {ref}: {100 * r['diff_mean']:+.2f} +- "
                    f"{100 * r['diff_std']:.2f} points ({r['pairs']} pairs)")
            lines.append(f"{r['group']:<{width}} {100 * r['mean']:>6.2f}% +- "
                         f"{100 * r['std']:.2f}{diff}")
    return "\n".join(lines)
