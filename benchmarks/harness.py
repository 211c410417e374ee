"""What every benchmark section shares: the settings, the machine's description, the
workloads, how a round is timed and summarised, and the machine's roof (matmul ceiling
and memory bandwidth; see `benchmarks.suites` for how the measurements are made and
`benchmarks.roofline` for the cost model)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import roofline, throughput
from benchmarks.fedjax_style import FedJaxStyleFedAvg
from benchmarks.naive import NaiveFedAvg, engine_orders, max_rel_diff
from fedjax_pan import data as data_lib
from fedjax_pan import models
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.engine import (ClientData, LocalWork, Simulation, count_compiles,
                               make_evaluator, make_executor, resolve_strategy)
from fedjax_pan.engine.clients import real_examples
from fedjax_pan.models import grouped as grouped_lib


PyTree = Any


Log = Callable[[str], None]


CONCRETE_IMPLS = tuple(i for i in grouped_lib.CONV_IMPLS if i != "auto")


MLP_PARAMS = 2_913_290  # 784-1024-1024-1024-10


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
    stream_mib: int = 256  # each array of the bandwidth measurement
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
    # Population: stateless FedAvg over K clients of `population_examples` examples each,
    # drawn from one shared pool (the data is held once, whatever K), at each
    # clients-per-round; one local step per client (B = its size, E = 1).
    population_sizes: Tuple[int, ...] = (1000, 10000, 100000)
    population_per_round: Tuple[int, ...] = (10, 100, 1000)
    population_examples: int = 20
    population_pool: int = 60000
    # MOON with a previous model per client (the MLP bench network) over this many
    # clients on Fashion-MNIST, its states placed by size ('auto': disk past half of
    # memory); 0 rounds: not run. Run in a process of its own, for its peak memory.
    moon_clients: int = 3000
    moon_per_round: int = 60
    moon_rounds: int = 70
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
            suite=suite, quick=True, reps=r, matmul_size=1024, matmul_reps=3, stream_mib=16,
            mlp_clients=10, mlp_examples=64, mlp_per_round=10, mlp_epochs=1,
            test_examples=500, eval_batch_size=250, naive_reps=r,
            padding_dataset="synthetic", padding_clients=10, padding_per_round=5,
            padding_epochs=1, padding_block_sizes=(2,), padding_reps=1, padding_cohorts=20,
            conv=conv, slow_round_s=5.0, scaling_per_round=(2, 5, 10), scaling_reps=1,
            population_sizes=(100, 1000), population_per_round=(2, 5),
            population_pool=2000, moon_rounds=0,
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


def peak_rss_mib(usage: Optional[Any] = None) -> float:
    """Peak resident memory of this process so far, or of the process `usage`
    (`resource.struct_rusage`) describes (ru_maxrss: KiB on Linux, B on macOS)."""
    rss = (usage or resource.getrusage(resource.RUSAGE_SELF)).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def rss_mib() -> Optional[float]:
    """Resident memory of this process now (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        return None


def _device_mib(key: str) -> Optional[float]:
    """The first device's memory statistic `key` in MiB (None where not reported)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if not stats or key not in stats:
        return None
    return stats[key] / 2 ** 20


def device_in_use_mib() -> Optional[float]:
    """Memory in use on the first device now (accelerators; None where not reported)."""
    return _device_mib("bytes_in_use")


def device_peak_mib() -> Optional[float]:
    """Peak memory in use on the first device (accelerators; None where not reported)."""
    return _device_mib("peak_bytes_in_use")


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


def mlp_workload(settings: Settings, num_clients: int, precision: str = "float32"
                 ) -> Workload:
    """The MLP bench: `num_clients` synthetic clients of `mlp_examples` 28x28x1 images;
    `precision` 'bfloat16' computes it in bfloat16 on float32 weights
    (`fedjax_pan.models.precision.policy`, ImportError where that is missing)."""
    n = num_clients * settings.mlp_examples
    ds = data_lib.synthetic(n, settings.test_examples, image_shape=(28, 28, 1),
                            seed=settings.seed)
    model = models.build("mlp", 10)
    if precision != "float32":
        from fedjax_pan.models.precision import policy
        model = policy(model, precision)
    return make_workload("mlp_synthetic", model, (28, 28, 1), ds.train_images,
                         ds.train_labels, equal_parts(num_clients, settings.mlp_examples,
                                                      settings.seed),
                         ds.test_images, ds.test_labels, settings.batch_size,
                         settings.mlp_epochs, settings, flops_per_example=6.0 * MLP_PARAMS)


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
    # XLA's cost of each timed round (`benchmarks.roofline`); None where not modelled.
    costs: Optional[List[Optional[roofline.Cost]]] = None


def evaluate_round(evaluate: Callable[..., Dict[str, Any]], sim: Any, server: PyTree
              ) -> Dict[str, Any]:
    net, variables = sim.evaluation(server)
    return evaluate(variables, net)


def time_engine(sim: Simulation, variables: PyTree,
                evaluate: Optional[Callable[[PyTree], Dict[str, Any]]], warmup: int,
                reps: int, slow_round_s: float, cost: bool = True) -> Measured:
    """`warmup` untimed rounds, then `reps` timed rounds (1 if a round is slow); with
    `cost`, XLA's cost of each timed round too (computed before it, untimed)."""
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
                evaluate_round(evaluate, sim, state.server)
        warmup_s = time.perf_counter() - start
    slow = (warmup_s - warm.seconds) / warmup > slow_round_s
    train_s, eval_s, real, computed, accuracy = [], [], [], [], None
    n = 1 if slow else reps
    costs = None
    if cost:
        # Before the timed rounds (whose cohorts are known from their index): what this
        # compiles is neither timed nor counted with the rounds.
        coster = roofline.round_costs(sim)
        costs = [coster(state._replace(round=state.round + i)) for i in range(n)]
    with count_compiles() as timed:
        for _ in range(n):
            t0 = time.perf_counter()
            state, stats = sim.round(state)
            jax.block_until_ready(state.server)
            t1 = time.perf_counter()
            if evaluate is not None:
                accuracy = float(evaluate_round(evaluate, sim, state.server)["accuracy"])
            eval_s.append(time.perf_counter() - t1)
            train_s.append(t1 - t0)
            real.append(stats["real_examples"])
            computed.append(stats["computed_examples"])
    return Measured(train_s, eval_s, real, computed, all_real + sum(real),
                    all_computed + sum(computed), warmup_s, warm.count, warm.seconds,
                    timed.count, timed.seconds, first, stats["train_loss"], accuracy, stats,
                    costs)


class FedJaxStyleLoop:
    """The FedJAX-style loop with the naive loop's round, evaluate, cost and epochs, so
    `time_naive` times it on the same cohorts (its evaluation is the naive loop's; with
    equal clients its example-weighted mean is the uniform one)."""

    def __init__(self, loop: FedJaxStyleFedAvg, naive: NaiveFedAvg):
        self.loop, self.naive, self.epochs = loop, naive, loop.epochs

    def round(self, params, images, labels, clients, rng, order=None):
        return self.loop.round(params, images, labels, clients, rng, jax.random.PRNGKey(0),
                               order)

    def evaluate(self, params, images, labels):
        return self.naive.evaluate(params, images, labels)

    def cost(self, params, images, labels) -> roofline.LoopCost:
        return self.loop.cost(params, images, labels)


def time_naive(naive: Any, w: Workload, sim: Simulation, warmup: int, reps: int,
               seed: int) -> Measured:
    """The naive loop (or `FedJaxStyleLoop`) on the engine's cohorts (`sim.sample`); round 0
    uses the engine's batch order so its model can be compared with the engine's, later
    rounds shuffle with numpy as a naive loop would."""
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
    loop_cost = naive.cost(params, w.train_images, w.train_labels)
    costs = [loop_cost.round(sizes[sim.sample(r)], naive.epochs)
             for r in range(warmup, warmup + reps)]
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
                    accuracy, costs=costs)


def summarize(m: Measured, flops_per_example: float, roof: roofline.Roof,
              dtype: str = "float32") -> Dict[str, Any]:
    """The JSON record of one configuration: times, rates, its matmul-ceiling fraction
    and (where its rounds' cost is known) its roofline (`roofline.row_record`)."""
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
        "fraction_of_ceiling": gflops / roof.peak(dtype),
        **roofline.row_record(m.costs or [], m.train_s, roof, dtype),
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


def measure_matmul(size: int, reps: int, dtype: Any = jnp.float32) -> Dict[str, Any]:
    """Jitted (size x size) @ (size x size) in `dtype` (float32: the dense-compute
    ceiling)."""
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (size, size), dtype)
    b = jax.random.normal(kb, (size, size), dtype)
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


def naive_baseline(w: Workload, sim: Simulation, settings: Settings, reps: int,
                    configs: Dict[str, Dict[str, Any]], roof: roofline.Roof, label: str,
                    log: Log) -> Tuple[Measured, Dict[str, Any]]:
    """Times the naive loop on the same cohorts and adds 'vs naive' ratios to `configs`."""
    nm = time_naive(w.naive(settings), w, sim, settings.warmup, reps, settings.seed)
    naive = summarize(nm, w.flops_per_example, roof)
    log(f"[{label}] naive: {naive['seconds_per_round']:.3f} s/round")
    add_naive_ratios(configs, naive)
    return nm, naive


def time_strategies(w: Workload, per_round: int, settings: Settings, roof: roofline.Roof,
                     log: Log, label: str) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Any],
                                                    Simulation]:
    """Every concrete strategy, then the naive loop; records and agreement with naive."""
    evaluate = w.evaluator(settings.eval_batch_size)
    configs, firsts, sim = {}, {}, None
    for strategy in strategies():
        sim = w.simulation(w.executor(strategy, per_round, settings), per_round, settings.seed)
        m = time_engine(sim, w.variables, evaluate, settings.warmup, settings.reps,
                        settings.slow_round_s)
        configs[strategy] = summarize(m, w.flops_per_example, roof)
        firsts[strategy] = m.first_params
        log(f"[{label}] {strategy}: {configs[strategy]['seconds_per_round']:.3f} s/round, "
            f"{configs[strategy]['gflops']:.1f} GFLOP/s, "
            f"{_percent(configs[strategy]['fraction_of_roofline'])} of the roofline")
    nm, naive = naive_baseline(w, sim, settings, settings.naive_reps, configs, roof,
                                label, log)
    agreement = {k: max_rel_diff(p, nm.first_params) for k, p in firsts.items()}
    return configs, {"naive": naive, "agreement_max_rel_diff": agreement}, sim


def _percent(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def measure_roof(settings: Settings) -> Tuple[roofline.Roof, Dict[str, Any]]:
    """The machine's roof now: float32 matmul rate and memory bandwidth."""
    return roofline.measure_roof(measure_matmul, settings.matmul_size, settings.matmul_reps,
                                 settings.stream_mib)
