"""The measurements: matmul ceiling, MLP bench, padding, conv nets, scaling, grouped convs.

Every figure is measured in this one process after warm-up: each configuration runs
`warmup` untimed rounds (which absorb compilation; their compile count and seconds are
reported), then timed rounds whose median is reported. A round is timed with
`time.perf_counter()` around `Simulation.round` plus `jax.block_until_ready` on the new
server state; "end-to-end" adds evaluating the global model on the test set. Rounds
whose warm-up already exceeds `slow_round_s` (convnets under `vmap` on CPU, scaling at
50+ clients) are timed once instead of `reps` times, so the suite stays inside its time
budget. The matmul ceiling is re-measured right before each section, which divides by its
own measurement.

FLOPs: the MLP bench counts 6 x parameters per real (unmasked) training example, as the
issue defines it; convnets count 3 x the forward FLOPs of XLA's cost analysis; grouped
convs count a grouped conv's real FLOPs (never a block-diagonal expansion's zeros). Padded
examples are never counted as useful work.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import profile_step, throughput
from benchmarks.naive import NaiveFedAvg, engine_orders, max_rel_diff
from fedjax_pan import data as data_lib
from fedjax_pan import models
from fedjax_pan.models.grouped import GroupedConfig
from fedjax_pan.algorithms import client_optimizer, fedavg, local, tree_bytes
from fedjax_pan.defaults import set_keys
from fedjax_pan.engine import (ClientData, LocalWork, Simulation, count_compiles,
                               make_evaluator, make_executor, resolve_strategy)
from fedjax_pan.engine.clients import real_examples
from fedjax_pan.engine.execution import VmapExecutor
from fedjax_pan.models import grouped as grouped_lib

PyTree = Any
Log = Callable[[str], None]
SECTIONS = ("mlp", "padding", "vgg", "scaling", "profile", "algorithms", "grouped_conv",
            "throughput")
CONCRETE_IMPLS = tuple(i for i in grouped_lib.CONV_IMPLS if i != "auto")
MLP_PARAMS = 2_913_290  # 784-1024-1024-1024-10


# ----------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ConvBench:
    """One convnet workload of the `vgg` section (equal-sized synthetic clients, E=1)."""

    key: str
    model: str
    width: float
    input_shape: Tuple[int, int, int]
    clients_per_round: int
    examples: int  # per client
    batch_size: int
    test_examples: int
    gates_auto: bool  # counts for the "auto within 10% of best" target


@dataclasses.dataclass(frozen=True)
class GroupedLayer:
    """One grouped conv layer shape of the `grouped_conv` section (square, 'same' padded)."""

    batch: int
    size: int  # height = width
    channels: int  # in = out
    groups: int
    kernel: int = 3

    @property
    def key(self) -> str:
        return (f"B{self.batch} {self.size}x{self.size} C{self.channels} G{self.groups} "
                f"k{self.kernel}")


@dataclasses.dataclass(frozen=True)
class GroupedRound:
    """A grouped model whose round the `grouped_conv` section times per strategy."""

    key: str
    model: str  # 'vgg9' or 'mlp'
    options: Tuple[Tuple[str, Any], ...]  # models.build options besides `grouped`
    groups: int
    depth: int
    input_shape: Tuple[int, int, int]
    clients_per_round: int
    examples: int  # per client
    batch_size: int
    epochs: int


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes and repetitions of one suite run (see `make_settings`)."""

    suite: str
    quick: bool
    reps: int
    warmup: int = 1
    seed: int = 0
    learning_rate: float = 0.05
    momentum: float = 0.9
    batch_size: int = 64
    matmul_size: int = 2048
    matmul_reps: int = 10
    # MLP bench: synthetic 28x28x1, equal clients.
    mlp_clients: int = 100
    mlp_examples: int = 600
    mlp_per_round: int = 10
    mlp_epochs: int = 5
    test_examples: int = 10000
    eval_batch_size: int = 1000
    naive_reps: int = 2
    # Padding: Fashion-MNIST (synthetic if absent), Dirichlet by client.
    padding_dataset: str = "fashion_mnist"
    padding_clients: int = 100
    padding_per_round: int = 10
    padding_epochs: int = 5
    padding_alpha: float = 0.1
    padding_block_sizes: Tuple[int, ...] = (5,)
    padding_reps: int = 2
    padding_cohorts: int = 100  # cohorts sampled for the expected efficiency
    # Convnets.
    conv: Tuple[ConvBench, ...] = ()
    slow_round_s: float = 15.0
    # Scaling: MLP bench at several clients per round.
    scaling_per_round: Tuple[int, ...] = (10, 20, 50, 100)
    scaling_reps: int = 2
    # Grouped convs: layers, a grouped VGG9's local step per implementation, strategies.
    grouped_layers: Tuple[GroupedLayer, ...] = (
        GroupedLayer(64, 8, 260, 10), GroupedLayer(64, 4, 260, 10),
        GroupedLayer(64, 8, 260, 2), GroupedLayer(64, 4, 260, 2),
        GroupedLayer(64, 8, 64, 32))  # 2 channels per group: auto's other branch
    grouped_reps: int = 10  # per layer / step timing, within `grouped_budget_s`
    grouped_budget_s: float = 4.0  # timed seconds per configuration (at least one call)
    grouped_step: Tuple[float, Tuple[int, int, int], int] = (1.0, (28, 28, 1), 64)
    grouped_groups: int = 10
    grouped_rounds: Tuple[GroupedRound, ...] = ()
    # Algorithms with their own driver (FedMA): the MLP bench network at these widths.
    driver_hidden: Tuple[int, ...] = (1024, 1024, 1024)
    # The FedJAX comparison workload (`benchmarks.throughput`).
    throughput: throughput.ThroughputSettings = throughput.ThroughputSettings()


def make_settings(suite: str = "cpu", quick: bool = False,
                  reps: Optional[int] = None) -> Settings:
    """The suite's sizes; `quick` shrinks everything to seconds (for tests)."""
    if suite not in ("cpu", "gpu"):
        raise ValueError(f"unknown suite {suite!r}; expected 'cpu' or 'gpu'")
    if reps is not None and reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    scaling = (10, 20, 50, 100) + ((1000,) if suite == "gpu" else ())
    if quick:
        r = reps or 2
        # One narrow VGG9: each convnet costs ~20 s of compilation alone.
        conv = (ConvBench("vgg9_32x32x3", "vgg9", 0.25, (32, 32, 3), 4, 16, 16, 64, True),)
        return Settings(
            suite=suite, quick=True, reps=r, matmul_size=1024, matmul_reps=3,
            mlp_clients=10, mlp_examples=64, mlp_per_round=10, mlp_epochs=1,
            test_examples=500, eval_batch_size=250, naive_reps=r,
            padding_dataset="synthetic", padding_clients=10, padding_per_round=5,
            padding_epochs=1, padding_block_sizes=(2,), padding_reps=1, padding_cohorts=20,
            conv=conv, slow_round_s=5.0, scaling_per_round=(2, 5, 10), scaling_reps=1,
            grouped_layers=(GroupedLayer(8, 4, 24, 4),), grouped_reps=r,
            grouped_budget_s=0.5, grouped_step=(0.125, (8, 8, 1), 8), grouped_groups=2,
            driver_hidden=(16, 16, 16), throughput=throughput.quick_settings(),
            grouped_rounds=(
                GroupedRound("vgg9_grouped", "vgg9", (("width", 0.125),), 2, 6, (8, 8, 1),
                             2, 16, 8, 1),
                GroupedRound("mlp_grouped", "mlp", (("hidden", (32, 32, 32)),), 2, 3,
                             (8, 8, 1), 2, 16, 8, 1)))
    r = reps or 3
    conv = (
        # Full-width VGG9 at a small workload: vmapped convs in compiled loops run ~20x slower
        # on CPU, and that strategy must still finish one timed round.
        ConvBench("vgg9_32x32x3", "vgg9", 1.0, (32, 32, 3), 10, 16, 16, 500, True),
        ConvBench("cnn_28x28x1", "vgg9", 0.25, (28, 28, 1), 10, 64, 64, 1000, False),
    )
    grouped_rounds = (
        # Fed2's grouped VGG9 (G=10 over the last 6 weight layers; a small workload, as in
        # the vgg section: its vmap round ran 36x slower than loop, 93 s at 2 x 128, B=64)
        # and a grouped MLP bench.
        GroupedRound("vgg9_grouped_28x28x1", "vgg9", (("width", 1.0),), 10, 6, (28, 28, 1),
                     2, 16, 16, 1),
        GroupedRound("mlp_grouped_28x28x1", "mlp", (), 10, 3, (28, 28, 1), 10, 256, 64, 2),
    )
    return Settings(suite=suite, quick=False, reps=r, naive_reps=min(r, 2),
                    padding_reps=min(r, 2), scaling_reps=min(r, 2), conv=conv,
                    scaling_per_round=scaling, grouped_rounds=grouped_rounds)


# ----------------------------------------------------------------------------------------
# Machine facts
# ----------------------------------------------------------------------------------------

def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (ru_maxrss: KiB on Linux, B on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def device_peak_mib() -> Optional[float]:
    """Peak memory in use on the first device (accelerators; None where not reported)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2 ** 20


def git_commit() -> Optional[Dict[str, Any]]:
    """{'commit': short hash, 'dirty': bool} of the checkout, or None outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


def machine_info() -> Dict[str, Any]:
    """Where and when: platform, CPU, cores, library versions, devices, load, commit."""
    devices = jax.devices()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "optax": _version("optax"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        # A busy machine inflates every time; the load average says whether it was.
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git": git_commit(),
    }


def strategies() -> List[str]:
    """The concrete strategies worth timing here (sharded only with several devices)."""
    return ["loop", "vmap"] + (["sharded"] if jax.device_count() > 1 else [])


# ----------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Workload:
    """Data, model and algorithm shared by every configuration timed on it."""

    name: str
    model: Any
    variables: PyTree
    algorithm: Any
    work: LocalWork
    data: ClientData
    train_images: np.ndarray  # host copies, for the naive loop
    train_labels: np.ndarray
    client_indices: List[np.ndarray]
    test_images: np.ndarray
    test_labels: np.ndarray
    flops_per_example: float  # training FLOPs per real example

    def simulation(self, executor: Any, per_round: int, seed: int) -> Simulation:
        sim = Simulation(self.algorithm, self.data, self.work, executor,
                         per_round / self.data.num_clients, seed=seed)
        if sim.num_sampled != per_round:
            raise AssertionError(f"sampled {sim.num_sampled} clients, wanted {per_round}")
        return sim

    def executor(self, strategy: str, per_round: int, settings: Settings,
                 block_size: Optional[int] = None) -> Any:
        return make_executor(strategy, self.algorithm, self.work, self.data, self.variables,
                             per_round, block_size=block_size)

    def evaluator(self, batch_size: int) -> Callable[[PyTree], Dict[str, Any]]:
        return make_evaluator(self.model, self.test_images, self.test_labels,
                              min(batch_size, len(self.test_labels)), num_classes=10)

    def naive(self, settings: Settings) -> NaiveFedAvg:
        return NaiveFedAvg(self.model, settings.learning_rate, settings.momentum,
                           self.work.batch_size, int(self.work.epochs),
                           min(settings.eval_batch_size, len(self.test_labels)))

    def describe(self, per_round: int) -> Dict[str, Any]:
        sizes = self.data.sizes
        return {"name": self.name, "num_clients": int(self.data.num_clients),
                "clients_per_round": per_round, "client_size_min": int(sizes.min()),
                "client_size_max": int(sizes.max()), "client_size_mean": float(sizes.mean()),
                "batch_size": self.work.batch_size, "epochs": self.work.epochs,
                "params": models.count_params(self.variables),
                "flops_per_example": self.flops_per_example,
                "test_examples": int(len(self.test_labels))}


def make_workload(name: str, model: Any, input_shape: Tuple[int, ...],
                  train_images: np.ndarray, train_labels: np.ndarray,
                  parts: List[np.ndarray], test_images: np.ndarray, test_labels: np.ndarray,
                  batch_size: int, epochs: int, settings: Settings,
                  flops_per_example: Optional[float] = None) -> Workload:
    """A workload with FedAvg and the engine's PyTorch-style SGD (no decay, no clip)."""
    variables = models.init(model, jax.random.PRNGKey(settings.seed), input_shape)
    # The naive loop has no BatchNorm path; both sides must do the same maths.
    if set(variables) != {"params"}:
        raise ValueError(f"{name}: benchmarks need models without non-trainable state")
    algorithm = fedavg(model, client_optimizer(settings.learning_rate, settings.momentum,
                                               0.0, None))
    if flops_per_example is None:
        flops_per_example = 3.0 * forward_flops(model, variables, input_shape)
    return Workload(name, model, variables, algorithm, LocalWork(batch_size, float(epochs)),
                    ClientData.create(train_images, train_labels, parts),
                    np.asarray(train_images, np.float32), np.asarray(train_labels, np.int32),
                    [np.asarray(p) for p in parts], np.asarray(test_images, np.float32),
                    np.asarray(test_labels, np.int32), float(flops_per_example))


def forward_flops(model: Any, variables: PyTree, input_shape: Tuple[int, ...]) -> float:
    """XLA's FLOP count of one example's forward pass."""
    fn = jax.jit(lambda v, x: model.apply(v, x, train=False))
    cost = fn.lower(variables, jnp.zeros((1, *input_shape), jnp.float32)).compile()
    analysis = cost.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
        analysis = analysis[0]
    return float(analysis["flops"])


def equal_parts(num_clients: int, size: int, seed: int) -> List[np.ndarray]:
    perm = np.random.default_rng(seed).permutation(num_clients * size)
    return [np.sort(p) for p in np.split(perm, num_clients)]


def mlp_workload(settings: Settings, num_clients: int) -> Workload:
    """The MLP bench: `num_clients` synthetic clients of `mlp_examples` 28x28x1 images."""
    n = num_clients * settings.mlp_examples
    ds = data_lib.synthetic(n, settings.test_examples, image_shape=(28, 28, 1),
                            seed=settings.seed)
    model = models.build("mlp", 10)
    return make_workload("mlp_synthetic", model, (28, 28, 1), ds.train_images,
                         ds.train_labels, equal_parts(num_clients, settings.mlp_examples,
                                                      settings.seed),
                         ds.test_images, ds.test_labels, settings.batch_size,
                         settings.mlp_epochs, settings, flops_per_example=6.0 * MLP_PARAMS)


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Measured:
    """Raw timings of one configuration."""

    train_s: List[float]
    eval_s: List[float]
    real: List[int]  # real examples per timed round
    computed: List[int]  # computed (padded) examples per timed round
    all_real: int  # over warm-up and timed rounds
    all_computed: int
    warmup_s: float
    compiles_warmup: int
    compile_s_warmup: float
    compiles_timed: int
    compile_s_timed: float
    first_params: PyTree  # global params after round 0 (agreement check)
    train_loss: float
    accuracy: Optional[float]
    last_stats: Optional[Dict[str, Any]] = None  # the last timed round's statistics


def _evaluate(evaluate: Callable[..., Dict[str, Any]], sim: Any, server: PyTree
              ) -> Dict[str, Any]:
    net, variables = sim.evaluation(server)
    return evaluate(variables, net)


def time_engine(sim: Simulation, variables: PyTree,
                evaluate: Optional[Callable[[PyTree], Dict[str, Any]]], warmup: int,
                reps: int, slow_round_s: float) -> Measured:
    """`warmup` untimed rounds, then `reps` timed rounds (1 if a round is slow)."""
    if warmup < 1:
        raise ValueError("at least one warm-up round is needed to absorb compilation")
    state = sim.init(variables)
    all_real = all_computed = 0
    first = None
    with count_compiles() as warm:
        start = time.perf_counter()
        for _ in range(warmup):
            state, stats = sim.round(state)
            jax.block_until_ready(state.server)
            if first is None:
                first = sim.evaluation(state.server)[1]["params"]
            all_real += stats["real_examples"]
            all_computed += stats["computed_examples"]
            if evaluate is not None:
                _evaluate(evaluate, sim, state.server)
        warmup_s = time.perf_counter() - start
    slow = (warmup_s - warm.seconds) / warmup > slow_round_s
    train_s, eval_s, real, computed, accuracy = [], [], [], [], None
    with count_compiles() as timed:
        for _ in range(1 if slow else reps):
            t0 = time.perf_counter()
            state, stats = sim.round(state)
            jax.block_until_ready(state.server)
            t1 = time.perf_counter()
            if evaluate is not None:
                accuracy = float(_evaluate(evaluate, sim, state.server)["accuracy"])
            eval_s.append(time.perf_counter() - t1)
            train_s.append(t1 - t0)
            real.append(stats["real_examples"])
            computed.append(stats["computed_examples"])
    return Measured(train_s, eval_s, real, computed, all_real + sum(real),
                    all_computed + sum(computed), warmup_s, warm.count, warm.seconds,
                    timed.count, timed.seconds, first, stats["train_loss"], accuracy, stats)


def time_naive(naive: NaiveFedAvg, w: Workload, sim: Simulation, warmup: int, reps: int,
               seed: int) -> Measured:
    """The naive loop on the engine's cohorts (`sim.sample`); round 0 uses the engine's
    batch order so its model can be compared with the engine's, later rounds shuffle with
    numpy as a naive loop would."""
    state0 = sim.init(w.variables)
    params = w.variables["params"]
    rng = np.random.default_rng(seed)
    sizes = w.data.sizes
    first, all_real = None, 0

    def one_round(r: int, params: PyTree, order) -> Tuple[PyTree, float, int]:
        ids = sim.sample(r)
        params, loss = naive.round(params, w.train_images, w.train_labels,
                                   [w.client_indices[i] for i in ids], rng, order)
        return params, loss, real_examples(w.work, sizes[ids])

    with count_compiles() as warm:
        start = time.perf_counter()
        for r in range(warmup):
            order = None
            if r == 0:
                order = engine_orders(sim.cohort(state0, 0).data_keys, w.data.max_size)
            params, loss, n = one_round(r, params, order)
            jax.block_until_ready(params)
            first = params if first is None else first
            all_real += n
            naive.evaluate(params, w.test_images, w.test_labels)
        warmup_s = time.perf_counter() - start
    train_s, eval_s, real, accuracy = [], [], [], None
    with count_compiles() as timed:
        for r in range(warmup, warmup + reps):
            t0 = time.perf_counter()
            params, loss, n = one_round(r, params, None)
            jax.block_until_ready(params)
            t1 = time.perf_counter()
            accuracy = naive.evaluate(params, w.test_images, w.test_labels)["accuracy"]
            eval_s.append(time.perf_counter() - t1)
            train_s.append(t1 - t0)
            real.append(n)
    all_real += sum(real)
    # The naive loop computes short last batches at their true size: no padding.
    return Measured(train_s, eval_s, real, list(real), all_real, all_real, warmup_s,
                    warm.count, warm.seconds, timed.count, timed.seconds, first, loss,
                    accuracy)


def summarize(m: Measured, flops_per_example: float, ceiling_gflops: float) -> Dict[str, Any]:
    """The JSON record of one configuration."""
    train = float(statistics.median(m.train_s))
    end_to_end = float(statistics.median([a + b for a, b in zip(m.train_s, m.eval_s)]))
    rate = sum(m.real) / sum(m.train_s)
    gflops = rate * flops_per_example / 1e9
    return {
        "seconds_per_round": train,
        "eval_seconds": float(statistics.median(m.eval_s)),
        "end_to_end_seconds": end_to_end,
        "round_seconds": [float(t) for t in m.train_s],
        "reps": len(m.train_s),
        "examples_per_second": rate,
        "real_examples_per_round": float(np.mean(m.real)),
        "gflops": gflops,
        "fraction_of_ceiling": gflops / ceiling_gflops,
        "padding_efficiency": m.all_real / m.all_computed,
        "warmup_seconds": m.warmup_s,
        "compiles_warmup": m.compiles_warmup,
        "compile_seconds_warmup": m.compile_s_warmup,
        "compiles_timed": m.compiles_timed,
        "train_loss": float(m.train_loss),
        "test_accuracy": m.accuracy,
    }


def add_naive_ratios(configs: Dict[str, Dict[str, Any]], naive: Dict[str, Any]) -> None:
    """speedup = naive time / config time, end-to-end and training only (in place)."""
    for rec in configs.values():
        rec["speedup_vs_naive"] = naive["end_to_end_seconds"] / rec["end_to_end_seconds"]
        rec["training_speedup_vs_naive"] = (naive["seconds_per_round"] /
                                            rec["seconds_per_round"])


def auto_summary(configs: Dict[str, Dict[str, Any]], variables: PyTree) -> Dict[str, Any]:
    """What `auto` resolves to and its training time over the best strategy's.

    `make_executor('auto', ...)` builds exactly the executor of the strategy it resolves
    to, so that strategy's measurement is auto's.
    """
    picks = resolve_strategy("auto", variables)
    timed = {k: v["seconds_per_round"] for k, v in configs.items() if k in strategies()}
    best = min(timed, key=timed.get)
    return {"picks": picks, "best": best, "ratio_to_best": timed[picks] / timed[best],
            "within_10_percent": timed[picks] <= 1.10 * timed[best]}


# ----------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------

def measure_matmul(size: int, reps: int) -> Dict[str, Any]:
    """Jitted float32 (size x size) @ (size x size): the dense-compute ceiling."""
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (size, size), jnp.float32)
    b = jax.random.normal(kb, (size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        times.append(time.perf_counter() - t0)
    median = float(statistics.median(times))
    flops = 2.0 * size ** 3
    return {"size": size, "reps": reps, "seconds": median, "gflops": flops / median / 1e9,
            "best_gflops": flops / min(times) / 1e9}


def _naive_baseline(w: Workload, sim: Simulation, settings: Settings, reps: int,
                    configs: Dict[str, Dict[str, Any]], ceiling: float, label: str,
                    log: Log) -> Tuple[Measured, Dict[str, Any]]:
    """Times the naive loop on the same cohorts and adds 'vs naive' ratios to `configs`."""
    nm = time_naive(w.naive(settings), w, sim, settings.warmup, reps, settings.seed)
    naive = summarize(nm, w.flops_per_example, ceiling)
    log(f"[{label}] naive: {naive['seconds_per_round']:.3f} s/round")
    add_naive_ratios(configs, naive)
    return nm, naive


def _time_strategies(w: Workload, per_round: int, settings: Settings, ceiling: float,
                     log: Log, label: str) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Any],
                                                    Simulation]:
    """Every concrete strategy, then the naive loop; records and agreement with naive."""
    evaluate = w.evaluator(settings.eval_batch_size)
    configs, firsts, sim = {}, {}, None
    for strategy in strategies():
        sim = w.simulation(w.executor(strategy, per_round, settings), per_round, settings.seed)
        m = time_engine(sim, w.variables, evaluate, settings.warmup, settings.reps,
                        settings.slow_round_s)
        configs[strategy] = summarize(m, w.flops_per_example, ceiling)
        firsts[strategy] = m.first_params
        log(f"[{label}] {strategy}: {configs[strategy]['seconds_per_round']:.3f} s/round, "
            f"{configs[strategy]['gflops']:.1f} GFLOP/s")
    nm, naive = _naive_baseline(w, sim, settings, settings.naive_reps, configs, ceiling,
                                label, log)
    agreement = {k: max_rel_diff(p, nm.first_params) for k, p in firsts.items()}
    return configs, {"naive": naive, "agreement_max_rel_diff": agreement}, sim


def mlp_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """The MLP bench per strategy, the naive loop, and their agreement after round 0."""
    w = mlp_workload(settings, settings.mlp_clients)
    configs, extra, _ = _time_strategies(w, settings.mlp_per_round, settings, ceiling, log,
                                         "mlp")
    return {"workload": w.describe(settings.mlp_per_round), "strategies": configs, **extra,
            "auto": auto_summary(configs, w.variables)}


class CohortOrderVmapExecutor(VmapExecutor):
    """VmapExecutor without step-count bucketing: blocks follow the cohort's order."""

    def blocks(self, steps: np.ndarray) -> list:
        n = len(steps)
        padded = np.full(math.ceil(n / self.block_size) * self.block_size, -1)
        padded[:n] = np.arange(n)
        return list(padded.reshape(-1, self.block_size))


def _unbucketed(executor: VmapExecutor) -> CohortOrderVmapExecutor:
    # Same fields as the library-built executor, only the blocks differ.
    return CohortOrderVmapExecutor(**{f.name: getattr(executor, f.name)
                                      for f in dataclasses.fields(executor)})


def _padding_data(settings: Settings, log: Log) -> Tuple[data_lib.Dataset, str]:
    if settings.padding_dataset == "fashion_mnist":
        try:
            ds = data_lib.load("fashion_mnist")
            return dataclasses.replace(
                ds, train_images=data_lib.normalize(ds.train_images, "fashion_mnist"),
                test_images=data_lib.normalize(ds.test_images, "fashion_mnist")), ds.name
        except (data_lib.DataError, ImportError, OSError) as e:
            log(f"[padding] Fashion-MNIST unavailable ({e}); using synthetic data")
    n = settings.padding_clients * settings.mlp_examples
    return data_lib.synthetic(n, settings.test_examples, seed=settings.seed), "synthetic"


def padding_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """Unequal clients (Dirichlet by client): padding efficiency and time per configuration.

    'vmap' is the library's default blocks; 'vmap G=g' fixes the block size, bucketed
    (sorted by step count, the library) or unbucketed (cohort order, this module's
    subclass). With g = clients per round there is one block, so sorting cannot help.
    """
    ds, name = _padding_data(settings, log)
    parts = data_lib.partition(ds.train_labels, settings.padding_clients,
                               "dirichlet_by_client", settings.seed,
                               alpha=settings.padding_alpha)
    model = models.build("mlp", 10)
    w = make_workload(f"mlp_{name}_dirichlet", model, (28, 28, 1), ds.train_images,
                      ds.train_labels, parts, ds.test_images, ds.test_labels,
                      settings.batch_size, settings.padding_epochs, settings,
                      flops_per_example=6.0 * MLP_PARAMS)
    m_per = settings.padding_per_round
    executors = {s: w.executor(s, m_per, settings) for s in strategies()}
    for g in sorted(set(settings.padding_block_sizes) | {m_per}):
        bucketed = w.executor("vmap", m_per, settings, block_size=g)
        if g < m_per:
            executors[f"vmap G={g} bucketed"] = bucketed
        executors[f"vmap G={g} unbucketed"] = _unbucketed(bucketed)

    evaluate = w.evaluator(settings.eval_batch_size)
    configs, sim = {}, None
    for label, ex in executors.items():
        sim = w.simulation(ex, m_per, settings.seed)
        m = time_engine(sim, w.variables, evaluate, settings.warmup, settings.padding_reps,
                        settings.slow_round_s)
        rec = summarize(m, w.flops_per_example, ceiling)
        rec["block_size"] = getattr(ex, "block_size", 1)
        rec["expected_padding_efficiency"] = _expected_efficiency(
            w, sim, ex, settings.padding_cohorts)
        configs[label] = rec
        log(f"[padding] {label}: efficiency {rec['padding_efficiency']:.3f}, "
            f"{rec['seconds_per_round']:.3f} s/round")
    _, naive = _naive_baseline(w, sim, settings, settings.padding_reps, configs, ceiling,
                               "padding", log)
    return {"dataset": name, "alpha": settings.padding_alpha,
            "workload": w.describe(m_per), "configs": configs, "naive": naive,
            "auto": auto_summary(configs, w.variables)}


def _expected_efficiency(w: Workload, sim: Simulation, executor: Any, cohorts: int) -> float:
    """real / computed examples over `cohorts` sampled rounds, without training."""
    real = computed = 0
    for r in range(cohorts):
        ids = sim.sample(r)
        steps = w.work.num_steps(w.data.sizes[ids])
        real += real_examples(w.work, w.data.sizes[ids])
        computed += executor.computed_examples(w.data.sizes[ids], steps)
    return real / computed


def conv_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """Convnets per strategy with the naive loop; what `auto` picks and how it fares."""
    out = {}
    for b in settings.conv:
        n = b.clients_per_round * b.examples
        ds = data_lib.synthetic(n, b.test_examples, image_shape=b.input_shape,
                                seed=settings.seed)
        model = models.build(b.model, 10, width=b.width)
        w = make_workload(b.key, model, b.input_shape, ds.train_images, ds.train_labels,
                          equal_parts(b.clients_per_round, b.examples, settings.seed),
                          ds.test_images, ds.test_labels, b.batch_size, 1, settings)
        configs, extra, _ = _time_strategies(w, b.clients_per_round, settings, ceiling, log,
                                             b.key)
        out[b.key] = {"model": b.model, "width": b.width, "input_shape": list(b.input_shape),
                      "gates_auto_target": b.gates_auto,
                      "workload": w.describe(b.clients_per_round), "strategies": configs,
                      **extra, "auto": auto_summary(configs, w.variables)}
    return out


def scaling_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """MLP-bench round time against clients per round, with `auto`'s strategy.

    Each setting gets its own executor and warm-up; `compiles_timed` must be 0.
    `per_client_vs_first` is (t/M) / (t_first/M_first): 1.0 means linear cost.
    """
    per_round = [m for m in settings.scaling_per_round]
    w = mlp_workload(settings, max(settings.mlp_clients, max(per_round)))
    strategy = resolve_strategy("auto", w.variables)
    points = []
    for m_per in per_round:
        sim = w.simulation(w.executor(strategy, m_per, settings), m_per, settings.seed)
        m = time_engine(sim, w.variables, None, settings.warmup, settings.scaling_reps,
                        settings.slow_round_s)
        rec = summarize(m, w.flops_per_example, ceiling)
        rec = {"clients_per_round": m_per, **{k: rec[k] for k in (
            "seconds_per_round", "round_seconds", "reps", "examples_per_second", "gflops",
            "fraction_of_ceiling", "compiles_warmup", "compile_seconds_warmup",
            "compiles_timed")}}
        rec["seconds_per_client"] = rec["seconds_per_round"] / m_per
        points.append(rec)
        log(f"[scaling] {m_per} clients/round: {rec['seconds_per_round']:.3f} s/round, "
            f"{rec['compiles_timed']} compiles after warm-up")
    for p in points:
        p["per_client_vs_first"] = p["seconds_per_client"] / points[0]["seconds_per_client"]
    return {"strategy": strategy, "workload": w.describe(per_round[0]), "points": points,
            "compiles_after_warmup": sum(p["compiles_timed"] for p in points)}


def profile_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """One MLP-bench local step taken apart (`benchmarks.profile_step`)."""
    rows = profile_step.profile(settings.batch_size, 5 if settings.quick else 20, ceiling)
    log(f"[profile] step {1e3 * rows['step']['seconds']:.2f} ms, floor "
        f"{1e3 * rows['floor']['seconds']:.2f} ms ({rows['floor']['fraction_of_ceiling']:.3f} "
        "of the ceiling)")
    return {"batch_size": settings.batch_size, "rows": rows}


def _bench_round(cfg: Any, model: Any, variables: Any, w: "Workload") -> Any:
    """The round `cfg.algorithm` runs on the bench's clients, assembled as every run is
    (`assembly.make_round`); an algorithm distilling on public data gets the first 500
    training images."""
    from fedjax_pan.algorithms import registry
    from fedjax_pan.assembly import make_round
    public = w.data.images[:500] if registry.ALGORITHMS[cfg.algorithm].public else None
    return make_round(cfg, model, variables, w.data, w.work, public)


def _bench_config(settings: Settings, w: "Workload", per_round: int) -> Any:
    """The default config with the bench's optimiser (plain momentum SGD at the bench's
    rate, no weight decay, no clipping, no warm-up), participation and seed."""
    from fedjax_pan.defaults import default_config
    cfg = default_config()
    cfg.seed = settings.seed
    cfg.participation = per_round / w.data.num_clients
    cfg.partition.num_clients = w.data.num_clients
    opt = cfg.optimizer
    opt.lr, opt.momentum, opt.weight_decay, opt.grad_clip, opt.warmup = (
        settings.learning_rate, settings.momentum, 0.0, 0.0, "none")
    return cfg


def algorithms_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """The MLP bench round (training and aggregation, no evaluation) per registered
    algorithm with its default options, relative to FedAvg; the memory each keeps per
    client (all K) and a stacked aggregation rule's buffer (M outputs)."""
    from fedjax_pan.algorithms import registry

    w = mlp_workload(settings, settings.mlp_clients)
    m_per = settings.mlp_per_round
    cfg = _bench_config(settings, w, m_per)
    strategy = resolve_strategy("auto", w.variables)
    reps = 1 if settings.quick else settings.reps
    out: Dict[str, Any] = {}
    for name in registry.ALGORITHMS:
        cfg.algorithm = name
        model, variables = w.model, w.variables
        if name == "fed2":  # needs a grouped network: the bench MLP, last 3 layers in 10 groups
            model = w.model.clone(grouped=GroupedConfig(groups=10, depth=3))
            variables = models.init(model, jax.random.PRNGKey(settings.seed),
                                    tuple(w.data.images.shape[1:]))
        sim = _bench_round(cfg, model, variables, w)
        if not isinstance(sim, Simulation):
            continue  # its own driver for this config: `driver_rows` below
        m = time_engine(sim, variables, None, settings.warmup, reps, settings.slow_round_s)
        rec = summarize(m, w.flops_per_example, ceiling)
        state = sim.init(variables)
        rec = {"seconds_per_round": rec["seconds_per_round"], "reps": rec["reps"],
               "compiles_timed": rec["compiles_timed"],
               "client_state_mib": tree_bytes(state.client_states) / 2**20,
               "server_state_mib": tree_bytes(state.server) / 2**20}
        out[name] = rec
        log(f"[algorithms] {name}: {rec['seconds_per_round']:.3f} s/round, client state "
            f"{rec['client_state_mib']:.1f} MiB")
    for rec in out.values():
        rec["vs_fedavg"] = rec["seconds_per_round"] / out["fedavg"]["seconds_per_round"]

    def fedavg_variant(changes):
        variant = set_keys(cfg.copy_and_resolve_references(), {"algorithm": "fedavg", **changes})
        sim = _bench_round(variant, w.model, w.variables, w)
        m = time_engine(sim, w.variables, None, settings.warmup, reps, settings.slow_round_s)
        seconds = summarize(m, w.flops_per_example, ceiling)["seconds_per_round"]
        return {"seconds_per_round": seconds,
                "vs_fedavg": seconds / out["fedavg"]["seconds_per_round"]}

    # A stacked rule (median) keeps every sampled client's output: M FedAvg deltas.
    median = {**fedavg_variant({"aggregation.rule": "median"}),
              "stacked_outputs_mib": m_per * tree_bytes(w.variables) / 2**20}
    log(f"[algorithms] fedavg + median: {median['seconds_per_round']:.3f} s/round, "
        f"{median['stacked_outputs_mib']:.1f} MiB of stacked outputs")
    # The PAN paper's shuffling during local training (Alg. 2, Fig. 5: P_sf = 0.1).
    shuffled = {}
    for n_sf in (1.0, 5.0):
        shuffled[f"{n_sf:g}"] = fedavg_variant({"shuffle.n_sf": n_sf, "shuffle.p_sf": 0.1})
        log(f"[algorithms] fedavg + Alg. 2 shuffling, N_sf {n_sf:g}: "
            f"{shuffled[f'{n_sf:g}']['seconds_per_round']:.3f} s/round")
    return {"strategy": strategy, "workload": w.describe(m_per), "algorithms": out,
            "median_aggregation": median, "shuffled": shuffled,
            "drivers": driver_rows(settings, w, cfg, strategy, log)}


def driver_rows(settings: Settings, w: Workload, cfg: Any, strategy: str,
                log: Log) -> Dict[str, Any]:
    """Each algorithm with its own driver (FedMA) against FedAvg, both on the MLP bench at
    `driver_hidden` widths without PANs: seconds per round (its layers grow, so each of
    its rounds compiles anew: included), bytes sent up and down per round."""
    from fedjax_pan.algorithms import registry

    model = models.resized(w.model, {f"fc{i}": h for i, h in
                                     enumerate(settings.driver_hidden, start=1)})
    variables = models.init(model, jax.random.PRNGKey(settings.seed),
                            tuple(w.data.images.shape[1:]))
    m_per = settings.mlp_per_round
    sim = _bench_round(set_keys(cfg.copy_and_resolve_references(),
                                {"algorithm": "fedavg", "execution.strategy": strategy}),
                       model, variables, w)
    reps = 1 if settings.quick else settings.reps
    base = time_engine(sim, variables, None, settings.warmup, reps, settings.slow_round_s)
    model_bytes = float(tree_bytes(variables))
    fedavg_rec = {"seconds_per_round": float(np.median(base.train_s)),
                  "upload_mib": m_per * model_bytes / 2**20,
                  "download_mib": m_per * model_bytes / 2**20}
    out = {}
    for name, entry in registry.ALGORITHMS.items():
        if entry.driver is None:
            continue
        cfg.algorithm, cfg.execution.strategy = name, strategy
        driver = _bench_round(cfg, model, variables, w)
        if isinstance(driver, Simulation):
            continue  # one compiled round for this config (KT-pFL with one architecture)
        m = time_engine(driver, variables, None, settings.warmup, reps, settings.slow_round_s)
        stats = m.last_stats
        rec = {"seconds_per_round": float(np.median(m.train_s)), "reps": len(m.train_s),
               "compiles_timed": m.compiles_timed, "compile_s_timed": m.compile_s_timed,
               "upload_mib": stats["upload_bytes"] / 2**20,
               "download_mib": stats["download_bytes"] / 2**20,
               "widths": [int(stats[f"train_width_fc{i}"])
                          for i in range(1, len(settings.driver_hidden) + 1)]}
        rec["vs_fedavg"] = rec["seconds_per_round"] / fedavg_rec["seconds_per_round"]
        out[name] = rec
        log(f"[algorithms] {name}: {rec['seconds_per_round']:.2f} s/round "
            f"({rec['vs_fedavg']:.1f}x FedAvg's on hidden {settings.driver_hidden}), "
            f"{rec['upload_mib']:.1f} / {rec['download_mib']:.1f} MiB up / down")
    return {"hidden": list(settings.driver_hidden), "fedavg": fedavg_rec, "algorithms": out}


def _time_interleaved(calls: Dict[str, Tuple[Callable, tuple]], reps: int,
                      budget_s: float) -> Dict[str, Tuple[float, int]]:
    """name -> (median seconds, calls timed) of `fn(*args)` for every `calls[name]`, each
    called once untimed first (compilation), then timed round-robin (so a drift in the
    machine's speed hits all alike) until it has `reps` calls or has spent `budget_s`."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: Dict[str, List[float]] = {name: [] for name in calls}
    while True:
        todo = [n for n, t in times.items() if len(t) < reps and (not t or sum(t) < budget_s)]
        if not todo:
            break
        for name in todo:
            fn, args = calls[name]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {n: (float(statistics.median(t)), len(t)) for n, t in times.items()}


def _impl_summary(records: Dict[str, Dict[str, Any]], picks: str) -> Dict[str, Any]:
    """What 'auto' resolves to, the fastest and slowest implementation, and the ratios."""
    t = {k: v["seconds"] for k, v in records.items()}
    best, slowest = min(t, key=t.get), max(t, key=t.get)
    return {"picks": picks, "best": best, "slowest": slowest,
            "ratio_to_best": t[picks] / t[best], "slowest_over_auto": t[slowest] / t[picks]}


def _rate(seconds: float, reps: int, flops: float, ceiling: float) -> Dict[str, Any]:
    gflops = flops / seconds / 1e9
    return {"seconds": seconds, "gflops": gflops, "fraction_of_ceiling": gflops / ceiling,
            "reps": reps}


def grouped_layer_rows(layer: GroupedLayer, reps: int, budget_s: float, ceiling: float,
                       seed: int = 0) -> Dict[str, Any]:
    """Forward + backward (input and kernel gradients) of one grouped conv per
    implementation, and of the dense (G=1) conv of the same width."""
    rng = np.random.default_rng(seed)
    b, n, c, g, k = layer.batch, layer.size, layer.channels, layer.groups, layer.kernel
    x = jnp.asarray(rng.normal(size=(b, n, n, c)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(b, n, n, c)), jnp.float32)
    # 2 FLOPs per multiply-add; backward = input grads + kernel grads, each the forward's.
    flops = lambda groups: 3 * 2 * b * n * n * k * k * (c // groups) * c  # noqa: E731

    def fwd_bwd(groups: int, impl: str) -> Callable:
        def loss(w, x):  # a random cotangent: the backward pass does real work
            return jnp.vdot(cot, grouped_lib.grouped_conv(x, w, groups, 1, impl))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    grouped_w = jnp.asarray(rng.normal(scale=0.05, size=(k, k, c // g, c)), jnp.float32)
    dense_w = jnp.asarray(rng.normal(scale=0.05, size=(k, k, c, c)), jnp.float32)
    calls = {impl: (fwd_bwd(g, impl), (grouped_w, x)) for impl in CONCRETE_IMPLS}
    calls["dense"] = (fwd_bwd(1, "feature_group_count"), (dense_w, x))
    timed = _time_interleaved(calls, reps, budget_s)
    impls = {impl: _rate(*timed[impl], flops=flops(g), ceiling=ceiling)
             for impl in CONCRETE_IMPLS}
    return {"key": layer.key, **dataclasses.asdict(layer), "flops": flops(g),
            "impls": impls, "dense": _rate(*timed["dense"], flops=flops(1), ceiling=ceiling),
            "auto": _impl_summary(impls, grouped_lib.pick_conv_impl(g, c))}


def grouped_step_rows(settings: Settings, ceiling: float) -> Dict[str, Any]:
    """One local SGD step (`local.sgd_step`, momentum SGD) of Fed2's grouped VGG9 per conv
    implementation, all from the same variables and batch."""
    width, shape, batch = settings.grouped_step
    g = settings.grouped_groups
    build = lambda impl: models.build("vgg9", 10, width=width, grouped={  # noqa: E731
        "groups": g, "depth": 6, "conv_impl": impl})
    variables = numpy_variables(build("feature_group_count"), shape, settings.seed)
    # XLA counts a feature_group_count conv's real FLOPs (split's agree; block_diagonal's
    # would count its zeros).
    flops = 3.0 * batch * forward_flops(build("feature_group_count"), variables, shape)
    rng = np.random.default_rng(settings.seed)
    data = {"x": jnp.asarray(rng.normal(size=(batch, *shape)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, 10, batch), jnp.int32),
            "mask": jnp.ones(batch, jnp.float32)}
    tx = client_optimizer(settings.learning_rate, settings.momentum, 0.0, None)
    state = jax.jit(lambda v: local.init_local(tx, v, 1.0))(variables)
    calls = {impl: (jax.jit(lambda s, b, m=build(impl): local.sgd_step(m, tx, s, b)[0]),
                    (state, data)) for impl in CONCRETE_IMPLS}
    timed = _time_interleaved(calls, settings.grouped_reps, settings.grouped_budget_s)
    impls = {impl: _rate(*timed[impl], flops=flops, ceiling=ceiling)
             for impl in CONCRETE_IMPLS}
    # The convs 'auto' would run in this model: its grouped (G-group) convs' choice.
    picks = {grouped_lib.pick_conv_impl(g, c)
             for c in grouped_conv_inputs(build("auto"), variables)}
    if len(picks) != 1:
        raise AssertionError(f"auto mixes implementations in this model: {picks}")
    return {"model": "vgg9", "width": width, "input_shape": list(shape), "batch_size": batch,
            "groups": g, "depth": 6, "params": models.count_params(variables),
            "flops": flops, "impls": impls, "auto": _impl_summary(impls, picks.pop())}


def numpy_variables(model: Any, input_shape: Tuple[int, ...], seed: int) -> PyTree:
    """He-normal weights (fan-in: all but the last axis), unit norm scales, zero biases,
    drawn with numpy: the model's own init compiles a PRNG program per leaf (~20 s for a
    VGG9 on a busy 2-core machine), and a timing needs sane values, not those."""
    shapes = jax.eval_shape(lambda: models.init(model, jax.random.PRNGKey(0), input_shape))
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = path[-1].key
        if name == "scale":
            return np.ones(s.shape, s.dtype)
        if len(s.shape) < 2:
            return np.zeros(s.shape, s.dtype)
        std = math.sqrt(2.0 / math.prod(s.shape[:-1]))
        return rng.normal(scale=std, size=s.shape).astype(s.dtype)
    # Host arrays, one transfer: eager jnp constructors would compile once per shape.
    return jax.device_put(jax.tree_util.tree_map_with_path(leaf, shapes))


def grouped_conv_inputs(model: Any, variables: PyTree) -> List[int]:
    """Input channels of every G-group conv of a grouped model (the grouped convs after
    the first grouped layer, which reads shared features and is dense)."""
    layout = model.group_layout()
    first = next(iter(layout), None)
    g = int(model.grouped.groups)
    return [g * variables["params"][name]["kernel"].shape[2] for name in layout
            if name.startswith("conv") and name != first]


def grouped_round_rows(bench: GroupedRound, settings: Settings, ceiling: float,
                       log: Log) -> Dict[str, Any]:
    """A grouped model's FedAvg round (training only) per concrete strategy, with the
    default `conv_impl`; what `resolve_strategy('auto', ...)` picks and how it fares."""
    n = bench.clients_per_round * bench.examples
    ds = data_lib.synthetic(n, 64, image_shape=bench.input_shape, seed=settings.seed)
    model = models.build(bench.model, 10, grouped={"groups": bench.groups,
                                                   "depth": bench.depth},
                         **dict(bench.options))
    w = make_workload(bench.key, model, bench.input_shape, ds.train_images, ds.train_labels,
                      equal_parts(bench.clients_per_round, bench.examples, settings.seed),
                      ds.test_images, ds.test_labels, bench.batch_size, bench.epochs,
                      settings)
    configs = {}
    for strategy in strategies():
        sim = w.simulation(w.executor(strategy, bench.clients_per_round, settings),
                           bench.clients_per_round, settings.seed)
        m = time_engine(sim, w.variables, None, settings.warmup, settings.reps,
                        settings.slow_round_s)
        configs[strategy] = summarize(m, w.flops_per_example, ceiling)
        log(f"[grouped_conv] {bench.key} {strategy}: "
            f"{configs[strategy]['seconds_per_round']:.3f} s/round")
    convs = grouped_conv_inputs(model, w.variables) if bench.model != "mlp" else []
    return {"model": bench.model, "groups": bench.groups, "depth": bench.depth,
            "conv_impls": sorted({grouped_lib.pick_conv_impl(bench.groups, c)
                                  for c in convs}),
            "workload": w.describe(bench.clients_per_round), "strategies": configs,
            "auto": auto_summary(configs, w.variables)}


def grouped_conv_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """Grouped convs per implementation (`grouped_lib.CONV_IMPLS`): layer shapes (forward +
    backward, with the dense conv of the same width), one local step of Fed2's grouped
    VGG9, and grouped models' rounds per execution strategy."""
    layers = []
    for layer in settings.grouped_layers:
        rec = grouped_layer_rows(layer, settings.grouped_reps, settings.grouped_budget_s,
                                 ceiling, settings.seed)
        layers.append(rec)
        log(f"[grouped_conv] {layer.key}: " + ", ".join(
            f"{k} {1e3 * v['seconds']:.1f} ms" for k, v in rec["impls"].items())
            + f"; dense {1e3 * rec['dense']['seconds']:.1f} ms; auto {rec['auto']['picks']}")
    step = grouped_step_rows(settings, ceiling)
    log("[grouped_conv] grouped VGG9 step: " + ", ".join(
        f"{k} {1e3 * v['seconds']:.1f} ms" for k, v in step["impls"].items())
        + f"; auto {step['auto']['picks']}")
    rounds = {b.key: grouped_round_rows(b, settings, ceiling, log)
              for b in settings.grouped_rounds}
    return {"backend": jax.default_backend(), "layers": layers, "vgg_step": step,
            "rounds": rounds}


SECTION_FUNCTIONS = {"mlp": mlp_section, "padding": padding_section, "vgg": conv_section,
                     "scaling": scaling_section, "profile": profile_section,
                     "algorithms": algorithms_section, "grouped_conv": grouped_conv_section,
                     "throughput": lambda settings, ceiling, log: throughput.throughput_section(
                         settings.throughput, ceiling, log)}


def run_suite(settings: Settings, only: Sequence[str] = SECTIONS,
              log: Log = lambda s: print(s, file=sys.stderr, flush=True)) -> Dict[str, Any]:
    """Runs the matmul ceiling and the sections in `only`; returns the results tree."""
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown section(s) {sorted(unknown)}; expected some of {SECTIONS}")
    start = time.perf_counter()
    results: Dict[str, Any] = {"meta": machine_info(), "settings": dataclasses.asdict(settings)}
    with count_compiles() as compiles:
        results["matmul"] = measure_matmul(settings.matmul_size, settings.matmul_reps)
        log(f"[matmul] {results['matmul']['gflops']:.1f} GFLOP/s")
        memory = {"after_matmul_mib": peak_rss_mib()}
        seconds = {"matmul": time.perf_counter() - start}
        ceilings = {}
        for section in SECTIONS:
            if section in only:
                t0 = time.perf_counter()
                # Re-measured next to each section: on a shared machine the rate drifts,
                # and a fraction is only meaningful against the same conditions.
                ceiling = measure_matmul(settings.matmul_size, settings.matmul_reps)["gflops"]
                ceilings[section] = ceiling
                log(f"[{section}] matmul ceiling {ceiling:.1f} GFLOP/s")
                results[section] = SECTION_FUNCTIONS[section](settings, ceiling, log)
                seconds[section] = time.perf_counter() - t0
                memory[f"after_{section}_mib"] = peak_rss_mib()
    results["matmul"]["per_section_gflops"] = ceilings
    results["compiles"] = {"count": compiles.count, "seconds": compiles.seconds}
    results["section_seconds"] = seconds
    results["memory"] = {"peak_rss_mib": peak_rss_mib(), "device_peak_mib": device_peak_mib(),
                         **memory}
    results["meta"]["load_average_end"] = (list(os.getloadavg()) if hasattr(os, "getloadavg")
                                           else None)
    results["total_seconds"] = time.perf_counter() - start
    return results
