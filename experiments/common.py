"""Shared plumbing of the paper-figure scripts: command line, output folder, data, training.

Every script runs as

    python -m experiments.<name> --out DIR [--preset default|paper|smoke]
                                 [--seed N | --seeds N ...] [--overwrite | --resume]
                                 [--no-progress]

and writes CSV/JSON/PNG files into DIR plus `run_info.json` (script, preset, seed, settings,
wall time). A non-empty DIR is refused unless --overwrite; any bad argument prints one
`error:` line and exits with status 2.

Training helpers: `train_centralised` (plain SGD with optax, one jitted step, numpy batches)
and `train_fl_run` / `global_variables` / `local_variables` (FedAvg through the library's
checkpointed workdir, and each sampled client's local model of the next round);
`train_run` / `train_runs` (library runs of a sweep, kept for --resume); `seed_result`
(multi-seed scripts; their paired statistics are `fedjax_pan.run.experiment.paired_stats`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import time
from types import MappingProxyType
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, NoReturn, Optional,
                    Sequence, Tuple)

import numpy as np

PRESETS = ("default", "paper", "smoke")
PyTree = Any


# ----------------------------------------------------------------------------------------
# Command line and output folder.
# ----------------------------------------------------------------------------------------

class UsageError(Exception):
    """A bad command line, preset or output folder; reported as one `error:` line, status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print the usage block too; the scripts promise one line.
        raise UsageError(message)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a script's `run` gets besides its settings."""

    out: str
    seed: int
    preset: str
    progress: bool
    resume: bool = False  # keep finished runs, continue interrupted ones (sweep scripts)

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)


def parse_args(argv: Optional[Sequence[str]], prog: str, description: str,
               presets: Iterable[str]) -> argparse.Namespace:
    """--out DIR (required), --preset, --seed / --seeds, --overwrite / --resume,
    --no-progress."""
    names = list(presets)
    p = _Parser(prog=prog, description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.add_argument("--preset", default="default", help=f"one of {', '.join(names)}")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of every random draw (scripts that run one seed; default 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="the seeds to run, in place of the preset's (multi-seed scripts; "
                        "runs of one preset split by seed can be gathered with --resume)")
    p.add_argument("--algorithms", nargs="+", default=None,
                   help="the algorithms to run, in place of the preset's (scripts comparing "
                        "algorithms; runs split by algorithm can be gathered with --resume)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--resume", action="store_true",
                   help="continue in a non-empty --out: finished runs are kept, interrupted "
                        "ones continue from their last checkpoint (sweep scripts)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide progress bars")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.preset not in names:
        raise UsageError(f"unknown preset {args.preset!r}; expected one of {', '.join(names)}")
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    return args


def check_out(path: str, overwrite: bool, resume: bool = False) -> None:
    """The library's workdir check: a non-empty `path` is refused unless `overwrite` (or
    `resume`: any folder, its runs are checked one by one)."""
    from fedjax_pan import workdir
    from fedjax_pan.errors import ConfigError
    if resume:
        return
    try:
        workdir.check(path, resume=False, overwrite=overwrite)
    except ConfigError as e:
        raise UsageError(str(e).replace("--resume to continue or ", "")) from None


def run_script(module: str, doc: Optional[str], presets: Mapping[str, Any],
               run: Callable[[Any, Context], List[str]],
               argv: Optional[Sequence[str]] = None) -> int:
    """Parses arguments, prepares --out, calls run(settings, ctx), prints its summary lines.

    Returns the exit status: 0, or after one `error:` line 2 for bad input, 3 when a run
    diverges where the script cannot go on, 4 for a workdir fault, 130 / 143 on SIGINT /
    SIGTERM (the run in progress saves its last round first; --resume continues).
    """
    from fedjax_pan import data as data_lib
    from fedjax_pan import workdir
    from fedjax_pan.errors import RunError

    description = (doc or "").strip()
    try:
        args = parse_args(argv, f"python -m experiments.{module}", description, presets)
        if args.resume and not supports_resume(run):
            raise UsageError(f"experiments.{module} has no --resume (its work is one piece)")
        settings = with_seeds(module, presets[args.preset], args.seed, args.seeds)
        settings = with_algorithms(module, settings, args.algorithms)
        check_out(args.out, args.overwrite, args.resume)
    except (UsageError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "status", 2)
    from fedjax_pan.engine.compiles import use_compilation_cache
    try:
        use_compilation_cache()  # a resumed or repeated run loads its programs
    except OSError as e:  # an unwritable home costs compile time, not the run
        print(f"warning: no compilation cache ({e})", file=sys.stderr)
    ctx = Context(args.out, args.seed or 0, args.preset, args.progress, args.resume)
    start = time.time()
    try:
        # SIGINT and SIGTERM (a scheduler's time limit) take effect at safe points (between
        # rounds, clients, runs, items of a progress bar): the run in progress saves its
        # last round, and `claim` says what is kept and how to continue. One after the
        # last safe point is raised as the block ends: the status is never 0 after one.
        with workdir.interrupts_at_safe_points():
            # The library's workdir semantics: --overwrite replaces the old results only
            # once this run has written its own.
            with workdir.claim(args.out, overwrite=args.overwrite, resume=args.resume):
                lines = run(settings, ctx)
                seconds = time.time() - start
                write_json(ctx.path("run_info.json"), {
                    "script": module, "preset": args.preset, "seed": ctx.seed,
                    "seconds": seconds,
                    "settings": dataclasses.asdict(settings)
                    if dataclasses.is_dataclass(settings) else settings})
            for line in lines:
                print(line)
            print(f"{module} ({args.preset}): {seconds:.1f} s, results in {args.out}")
    except data_lib.DataError as e:  # e.g. Fashion-MNIST not installed
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt as e:  # after the results were written: they are complete
        print(f"error: interrupted; the results in {args.out} are complete",
              file=sys.stderr)
        return 128 + workdir.signal_number(e)
    return 0


def with_seeds(module: str, settings: Any, seed: Optional[int],
               seeds: Optional[Sequence[int]]) -> Any:
    """`settings` with --seeds in place of its `seeds`; --seed and --seeds each refused
    where they would be ignored."""
    multi = dataclasses.is_dataclass(settings) and any(
        f.name == "seeds" for f in dataclasses.fields(settings))
    if multi and seed is not None:
        raise UsageError(f"experiments.{module} runs seeds {list(settings.seeds)}; choose "
                         f"them with --seeds, not --seed")
    if seeds is None:
        return settings
    if not multi:
        raise UsageError(f"experiments.{module} runs one seed; choose it with --seed")
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UsageError(f"--seeds must be distinct non-negative integers, got {list(seeds)}")
    return dataclasses.replace(settings, seeds=tuple(seeds))


def with_algorithms(module: str, settings: Any, algorithms: Optional[Sequence[str]]) -> Any:
    """`settings` with --algorithms in place of its `algorithms`: each one the preset
    runs, or one of the script's `ALGORITHMS` (refused where the script compares none)."""
    if algorithms is None:
        return settings
    fields = ({f.name: f for f in dataclasses.fields(settings)}
              if dataclasses.is_dataclass(settings) else {})
    if "algorithms" not in fields:
        raise UsageError(f"experiments.{module} compares no algorithms: --algorithms does "
                         f"not apply")
    known = set(settings.algorithms) | set(getattr(fields["algorithms"], "default", ()) or ())
    unknown = [a for a in algorithms if a not in known]
    if unknown or len(set(algorithms)) != len(algorithms):
        raise UsageError(f"--algorithms must be distinct names among "
                         f"{', '.join(sorted(known))}; got {' '.join(algorithms)}")
    return dataclasses.replace(settings, algorithms=tuple(algorithms))


def supports_resume(run: Callable[..., Any]) -> bool:
    """Whether a script's `run` trains its runs through `train_run` (marked by it)."""
    return bool(getattr(run, "resumable", False))


def resumable(run: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a script's `run` as one that accepts --resume."""
    run.resumable = True  # type: ignore[attr-defined]
    return run


def train_run(cfg: Any, run_dir: str, ctx: Context, desc: str) -> Tuple[Dict[str, Any], bool]:
    """(summary, diverged) of one library run into `run_dir`. With --resume a finished run
    (its summary.json written for this config) is read back, not trained again, and an
    interrupted one continues from its checkpoint. A run that diverges is an outcome to
    report, not a reason to stop the sweep: its summary holds NaNs, and `diverged.json`
    records it, so --resume keeps it as it is rather than training it again."""
    from fedjax_pan.run import experiment
    from fedjax_pan import workdir
    from fedjax_pan.errors import TrainingDiverged

    nan = {"final_accuracy": float("nan"), "best_accuracy": float("nan"),
           "wall_seconds": float("nan")}
    summary_path = os.path.join(run_dir, "summary.json")
    diverged_path = os.path.join(run_dir, "diverged.json")
    started = os.path.isfile(os.path.join(run_dir, "config.json"))
    if ctx.resume and started and workdir.read_config(run_dir) == json.loads(cfg.to_json()):
        if os.path.isfile(diverged_path):
            return nan, True
        # A run finished once its summary is written (after its curve; an older version
        # wrote the curve last: a run without one is finished again, which redraws it).
        if os.path.isfile(summary_path) and os.path.isfile(os.path.join(run_dir, "curve.png")):
            with open(summary_path) as f:
                summary = json.load(f)
            if summary.get("rounds") == cfg.rounds:
                return summary, False
    try:
        # A plain dict: a sweep must not keep each run's experiment (its data on the
        # device, 250-400 MB for Fashion-MNIST) alive; 67 runs of one sweep held 24 GB.
        return dict(experiment.train(cfg, run_dir, resume=ctx.resume and started,
                                     progress=ctx.progress, desc=desc)), False
    except TrainingDiverged as e:
        print(f"{desc}: {e}", file=sys.stderr)
        write_json(diverged_path, {"error": str(e)})
        return nan, True


def read_curve(run_dir: str) -> List[Dict[str, Any]]:
    """A library run's metrics.jsonl rows."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_runs(ctx: Context, jobs: Sequence[Tuple[str, Any]]
               ) -> List[Tuple[Dict[str, Any], bool, List[Dict[str, Any]]]]:
    """Each (name, config) trained in order into runs/<name>/ (`train_run`): its summary,
    whether it diverged, and its metrics rows."""
    from fedjax_pan import workdir
    out = []
    for n, (name, cfg) in enumerate(jobs, start=1):
        workdir.raise_pending_signal()
        run_dir = ctx.path(os.path.join("runs", name))
        summary, diverged = train_run(cfg, run_dir, ctx, f"[{n}/{len(jobs)}] {name}")
        out.append((summary, diverged, read_curve(run_dir)))
    return out


def accuracy_stats(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Mean and std (ddof 0) of `final_accuracy` over the rows that did not diverge, how
    many rows (`seeds`) and how many diverged."""
    acc = np.asarray([r["final_accuracy"] for r in rows if not r.get("diverged")])
    return {"mean": float(acc.mean()) if acc.size else float("nan"),
            "std": float(acc.std()) if acc.size else float("nan"),
            "seeds": len(rows), "diverged": len(rows) - len(acc)}


def seed_result(ctx: Context, seed: int, settings: Any,
                compute: Callable[[], Mapping[str, Any]]) -> Dict[str, Any]:
    """compute() for one seed of a multi-seed script, kept in `seeds/s<seed>.json` with the
    settings it ran under. With --resume a seed already there for the same settings (its
    `seeds` field aside, so seeds run apart can be gathered in one folder) is read back,
    not computed again."""
    from fedjax_pan import workdir
    path = ctx.path(os.path.join("seeds", f"s{seed}.json"))
    key = {k: v for k, v in settings_key(settings).items() if k != "seeds"}
    if ctx.resume and os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("settings") == key:
            return saved["result"]
    workdir.raise_pending_signal()
    result = jsonable(compute())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, {"seed": seed, "settings": key, "result": result})
    return result


def mean_curve(runs: Sequence[Sequence[Mapping[str, Any]]]) -> Tuple[List[int], np.ndarray]:
    """(rounds, mean test accuracy in %) over runs; a diverged run's curve stops early and
    the mean at later rounds is over the runs still going."""
    import warnings

    rounds = [r["round"] for r in max(runs, key=len)]
    acc = np.full((len(runs), len(rounds)), np.nan)
    for i, run in enumerate(runs):
        acc[i, :len(run)] = [r["test_accuracy"] for r in run]
    with warnings.catch_warnings():  # rounds no run reached: NaN, not plotted
        warnings.simplefilter("ignore", RuntimeWarning)
        return rounds, 100 * np.nanmean(acc, axis=0)


# ----------------------------------------------------------------------------------------
# Files.
# ----------------------------------------------------------------------------------------

# Field metadata: the field enters `settings_key` only when it differs from its default.
KEY_IF_SET = MappingProxyType({"key_if_set": True})


def settings_key(obj: Any) -> Any:
    """`jsonable(obj)`, less the dataclass fields marked KEY_IF_SET that hold their default."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: settings_key(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("key_if_set") and getattr(obj, f.name) == f.default)}
    if isinstance(obj, Mapping):
        return {str(k): settings_key(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [settings_key(v) for v in obj]
    return jsonable(obj)


def jsonable(obj: Any) -> Any:
    """numpy scalars/arrays, tuples and dataclasses as plain JSON values (NaN kept as null)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else None
    return obj


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(jsonable(obj), f, indent=2)
        f.write("\n")


def write_csv(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Rows of equal keys; floats written with full precision."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: repr(float(v)) if isinstance(v, (float, np.floating)) else v
                             for k, v in row.items()})


def read_csv(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def save_figure(fig: Any, path: str, dpi: int = 100) -> str:
    fig.savefig(path, format="png", dpi=dpi, bbox_inches="tight")
    return path


def progress(iterable: Iterable, enabled: bool, desc: str = "", total: Optional[int] = None
             ) -> Iterator:
    """`iterable` under a progress bar (silent when disabled); a SIGINT/SIGTERM takes
    effect between its items (`workdir.raise_pending_signal`)."""
    from fedjax_pan import workdir
    for item in _bar(iterable, enabled, desc, total):
        workdir.raise_pending_signal()
        yield item
    workdir.raise_pending_signal()


def _bar(iterable: Iterable, enabled: bool, desc: str, total: Optional[int] = None) -> Any:
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, disable=not enabled, dynamic_ncols=True,
                leave=False)


# ----------------------------------------------------------------------------------------
# PAN settings and data.
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pan:
    """One PAN setting; amplitude 0 means PANs off (the plain network)."""

    kind: str = "mul"
    period: float = 1.0
    amplitude: float = 0.0

    @property
    def on(self) -> bool:
        return self.amplitude != 0.0 and self.period != 0.0

    @property
    def label(self) -> str:
        if not self.on:
            return "PANs off"
        sign = "+" if self.kind == "add" else "x"
        return f"PAN{sign} T={self.period:g} A={self.amplitude:g}"

    def as_dict(self) -> Optional[Dict[str, Any]]:
        """The `pan=` argument of `fedjax_pan.models.build` (None when off)."""
        if not self.on:
            return None
        return {"kind": self.kind, "period": float(self.period),
                "amplitude": float(self.amplitude)}


PANS_OFF = Pan()
PANS_ON = Pan("mul", 1.0, 0.1)  # the paper's default "on" setting


@dataclasses.dataclass(frozen=True)
class ArrayData:
    """Normalised float32 NHWC images and int32 labels."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        return tuple(int(d) for d in self.train_x.shape[1:])  # type: ignore[return-value]


def load_data(name: str, seed: int = 0, train_limit: Optional[int] = None,
              test_limit: Optional[int] = None) -> ArrayData:
    """Dataset `name` (the library's loader, `assembly.load_dataset`) normalised, optionally
    subsampled (a seeded random subset, kept in original order)."""
    from fedjax_pan import data as data_lib
    from fedjax_pan.run.assembly import load_dataset

    ds = load_dataset(name, seed=seed, train_limit=train_limit, test_limit=test_limit)
    stats = data_lib.normalization(ds)

    def normalized(x: np.ndarray) -> np.ndarray:
        x = data_lib.normalize(x, stats) if stats is not None else x
        return np.asarray(x, np.float32)

    return ArrayData(name, normalized(ds.train_images), ds.train_labels,
                     normalized(ds.test_images), ds.test_labels, ds.num_classes)


# ----------------------------------------------------------------------------------------
# Centralised training.
# ----------------------------------------------------------------------------------------

def train_centralised(model: Any, variables: PyTree, x: np.ndarray, y: np.ndarray, *,
                      epochs: int, batch_size: int = 64, lr: float = 0.05,
                      momentum: float = 0.9, weight_decay: float = 0.0, seed: int = 0,
                      show_progress: bool = True, desc: str = "train",
                      optimizer: str = "sgd", warmup_steps: int = 0
                      ) -> Tuple[PyTree, List[float]]:
    """Mini-batch training on (x, y); returns (variables, mean loss per epoch).

    optimizer 'sgd' (optax, momentum) or 'adam' (lr, no momentum argument); the learning
    rate warms up linearly over the first `warmup_steps` steps (the paper: 100). Each epoch
    visits a seeded permutation of the data in full batches only, so the jitted step
    compiles once; BatchNorm statistics (if any) are updated in train mode.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from fedjax_pan import workdir
    from fedjax_pan.algorithms import client_optimizer, local

    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"unknown optimizer {optimizer!r}; expected 'sgd' or 'adam'")
    # The library's local step; full batches (mask all ones) make its loss the plain mean.
    warmup = "steps" if warmup_steps else "none"
    tx = (client_optimizer(lr, momentum, weight_decay, warmup=warmup,
                           warmup_length=warmup_steps) if optimizer == "sgd" else
          optax.chain(optax.add_decayed_weights(weight_decay), optax.adam(lr),
                      local.scale_by_warmup(warmup, warmup_steps)))
    state = local.init_local(tx, variables, 0)
    step = jax.jit(lambda s, b: local.sgd_step(model, tx, s, b))

    rng = np.random.default_rng(seed)
    n = len(y)
    batch_size = min(batch_size, n)
    steps = n // batch_size
    history = []
    bar = _bar(range(epochs * steps), show_progress, desc)
    for _ in range(epochs):
        order = rng.permutation(n)
        total = jnp.zeros((), jnp.float32)  # summed on the device: no sync per step
        for i in range(steps):
            workdir.raise_pending_signal()
            idx = order[i * batch_size:(i + 1) * batch_size]
            batch = {"x": x[idx], "y": y[idx], "mask": np.ones(batch_size, np.float32)}
            state, metrics = step(state, batch)
            total = total + metrics["loss_sum"] / batch_size
            bar.update(1)
        history.append(float(total) / steps)
        if not math.isfinite(history[-1]):
            raise RuntimeError(f"{desc}: training loss became {history[-1]}")
    bar.close()
    return {"params": state.params, **state.model_state}, history


def make_accuracy(model: Any, data: ArrayData, batch_size: int = 1000
                  ) -> Callable[[PyTree], float]:
    """variables -> test accuracy (one compiled evaluator, reused for shuffled copies)."""
    from fedjax_pan.engine import make_evaluator

    evaluate = make_evaluator(model, data.test_x, data.test_y, batch_size, data.num_classes)
    return lambda variables: float(evaluate(variables)["accuracy"])


# ----------------------------------------------------------------------------------------
# Federated training.
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FLSetup:
    """A FedAvg run of the MLP (paper App. E: K=10, R=1.0, E=5/20, H=20, B=64, SGD 0.05)."""

    dataset: str = "fashion_mnist"
    train_limit: Optional[int] = None  # a seeded subset of the training set (None: all)
    hidden: Optional[Tuple[int, ...]] = None  # MLP widths (None: the paper's 1024 x 3)
    # Another model of `fedjax_pan.models` and its options (e.g. ("width", 0.25)); left out
    # of cached results' keys at their defaults, so results cached before they existed stay.
    model: str = dataclasses.field(default="mlp", metadata=KEY_IF_SET)
    model_options: Tuple[Tuple[str, Any], ...] = dataclasses.field(default=(),
                                                                   metadata=KEY_IF_SET)
    num_clients: int = 10
    participation: float = 1.0
    alpha: float = 1.0
    epochs: float = 5.0
    batch_size: int = 64
    rounds: int = 20
    lr: float = 0.05
    warmup: str = "rounds"  # the released code's lr x min((r+1)/10, 1)
    strategy: str = "auto"  # execution strategy ('loop' compiles least: smoke runs)


def fl_config(setup: FLSetup, pan: Pan, seed: int):
    """The `fedjax_pan` ConfigDict of `setup` with PAN setting `pan`."""
    from fedjax_pan.config.defaults import default_config

    cfg = default_config()
    cfg.seed = seed
    cfg.dataset.name = setup.dataset
    cfg.dataset.train_limit = setup.train_limit
    cfg.model.name = setup.model
    if setup.hidden:
        cfg.model.options.hidden = list(setup.hidden)
    for key, value in setup.model_options:
        cfg.model.options[key] = list(value) if isinstance(value, tuple) else value
    cfg.pan.kind = pan.kind
    cfg.pan.period = float(pan.period)
    cfg.pan.amplitude = float(pan.amplitude) if pan.on else 0.0
    cfg.partition.num_clients = setup.num_clients
    cfg.partition.alpha = float(setup.alpha)
    cfg.participation = float(setup.participation)
    cfg.local.epochs = float(setup.epochs)
    cfg.local.batch_size = setup.batch_size
    cfg.optimizer.lr = float(setup.lr)
    cfg.optimizer.warmup = setup.warmup
    cfg.rounds = setup.rounds
    cfg.execution.strategy = setup.strategy
    return cfg


def train_fl_run(cfg: Any, run_dir: str, ctx: Context, desc: str = "FL"
                 ) -> Tuple[Any, Any, Dict[str, Any]]:
    """FedAvg `cfg` through the library's workdir (into `run_dir`, a checkpoint every
    round), so that with --resume an interrupted run continues and a finished one is read
    back; returns (experiment, state of the last round, info) with info
    {"train_loss": per round, "test_accuracy": final global model}.
    Raises TrainingDiverged if the run diverged."""
    from fedjax_pan.run import experiment
    from fedjax_pan.errors import TrainingDiverged

    cfg = cfg.copy_and_resolve_references()
    cfg.checkpoint_every = 1
    diverged = os.path.join(run_dir, "diverged.json")
    started = os.path.isfile(os.path.join(run_dir, "config.json"))
    if ctx.resume and started and os.path.isfile(diverged):
        raise TrainingDiverged(f"{desc}: training diverged (see {run_dir})")
    try:
        # A finished run resumes with no round to run: its final state comes back as it is.
        summary = experiment.train(cfg, run_dir, resume=ctx.resume and started,
                                   progress=ctx.progress, desc=desc)
    except TrainingDiverged as e:
        write_json(diverged, {"error": str(e)})
        raise TrainingDiverged(f"{desc}: training diverged (see {run_dir})") from None
    exp, state = summary.experiment, summary.state
    accuracy = float(exp.evaluate(global_variables(exp, state))["accuracy"])
    return exp, state, {"train_loss": [float(r["train_loss"]) for r in read_curve(run_dir)],
                        "test_accuracy": accuracy}


def global_variables(exp: Any, state: Any) -> PyTree:
    return exp.simulation.algorithm.eval_variables(state.server)


def local_variables(exp: Any, state: Any) -> List[PyTree]:
    """Each client sampled in round `state.round`, trained alone from the global model:
    its local variables (global params + delta, its own model state), in cohort order."""
    import jax

    g = global_variables(exp, state)
    out = []
    for o in exp.simulation.client_updates(state):
        params = jax.tree_util.tree_map(lambda a, d: a + d, g["params"], o["delta"])
        out.append({"params": params, **o["model_state"]})
    return out


def sample_test_inputs(exp: Any, n: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """A seeded random subset of n normalised test images (sorted indices) and labels."""
    from fedjax_pan import data as data_lib

    ds = exp.dataset
    rng = np.random.default_rng(seed)
    keep = np.sort(rng.permutation(ds.num_test)[:min(n, ds.num_test)])
    x = ds.test_images[keep]
    if ds.name in data_lib.NORMALIZATION:
        x = data_lib.normalize(x, ds.name)
    return np.asarray(x, np.float32), ds.test_labels[keep]
