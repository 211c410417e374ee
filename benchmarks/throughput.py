"""The FedJAX comparison workload: local-training throughput and start-up.

Fashion-MNIST (synthetic in the quick suite) split over 20 clients by
`partition(labels, 20, 'dirichlet_by_class', seed, alpha=0.1)`, 10 clients per round (the
same cohorts for every configuration), MLP 784-1024x3-10, E=5, B=64, SGD lr 0.05 without
momentum, FedAvg weighted by client examples. Timed per configuration: the engine (`auto`
and `loop`), the naive per-batch loop (`naive.NaiveFedAvg`), FedJAX's way of running
FedAvg (`fedjax_style.FedJaxStyleFedAvg`: host-side batches, one dispatch per step) and,
where torch is installed, PFLlib's in PyTorch (`pytorch_style.PyTorchStyleFedAvg`).
Timed rounds are interleaved (round r of every configuration, then round r + 1, each round
starting with the next row), so a drift in the machine's speed hits all of them alike; throughput is real training examples
(sample-epochs) per second of training.

Start-up: a fresh process per row (`python -m benchmarks.throughput --startup WHICH`)
reports the time from its start to the end of its first trained round, split into
imports, data (load, normalise, partition), build (device data, model, executor) and the
first round (compilation included). The engine runs twice against one empty persistent
compilation cache: cold, then warm as a second run of the same job finds it.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before the heavy imports: the start-up rows count them

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import pytorch_style, roofline  # noqa: E402
from benchmarks.fedjax_style import FedJaxStyleFedAvg  # noqa: E402
from benchmarks.pytorch_style import PyTorchStyleFedAvg  # noqa: E402
from benchmarks.naive import NaiveFedAvg, engine_orders, max_rel_diff  # noqa: E402
from fedjax_pan import data as data_lib  # noqa: E402
from fedjax_pan import models  # noqa: E402
from fedjax_pan.algorithms import client_optimizer, fedavg  # noqa: E402
from fedjax_pan.engine import (ClientData, LocalWork, Simulation, count_compiles,  # noqa: E402
                               make_executor, resolve_strategy)
from fedjax_pan.engine.clients import real_examples  # noqa: E402

PyTree = Any
Log = Callable[[str], None]
MLP_PARAMS = 2_913_290
STARTUP_ROWS = ("engine (cold cache)", "engine (warm cache)", "fedjax-style")
PYTORCH = "pytorch (PFLlib-style)"


@dataclasses.dataclass(frozen=True)
class ThroughputSettings:
    """The workload; `quick` shrinks it to seconds (synthetic data, small MLP)."""

    dataset: str = "fashion_mnist"
    num_clients: int = 20
    per_round: int = 10
    alpha: float = 0.1
    epochs: int = 5
    batch_size: int = 64
    learning_rate: float = 0.05
    momentum: float = 0.0
    hidden: Tuple[int, ...] = (1024, 1024, 1024)
    synthetic_examples: int = 2000  # used when the dataset is synthetic
    reps: int = 3
    seed: int = 0
    startup: bool = True


def quick_settings() -> ThroughputSettings:
    return ThroughputSettings(dataset="synthetic", per_round=4, num_clients=6, epochs=1,
                              hidden=(32, 32, 32), synthetic_examples=600, reps=1)


@dataclasses.dataclass
class Setup:
    """Everything every configuration shares."""

    model: Any
    variables: PyTree
    algorithm: Any
    work: LocalWork
    data: ClientData
    images: np.ndarray  # host copies for the host-side loops
    labels: np.ndarray
    parts: List[np.ndarray]
    dataset: str
    params: int


def load_data(s: ThroughputSettings) -> Tuple[np.ndarray, np.ndarray, str]:
    """Normalised training images and labels (synthetic when Fashion-MNIST is missing)."""
    if s.dataset == "fashion_mnist":
        try:
            ds = data_lib.load("fashion_mnist")
            return (data_lib.normalize(ds.train_images, "fashion_mnist").astype(np.float32),
                    np.asarray(ds.train_labels, np.int32), ds.name)
        except (data_lib.DataError, ImportError, OSError) as e:
            print(f"[throughput] Fashion-MNIST unavailable ({e}); using synthetic data",
                  file=sys.stderr)
    ds = data_lib.synthetic(s.synthetic_examples, 10, image_shape=(28, 28, 1), seed=s.seed)
    return (np.asarray(ds.train_images, np.float32), np.asarray(ds.train_labels, np.int32),
            "synthetic")


def partition(s: ThroughputSettings, labels: np.ndarray) -> List[np.ndarray]:
    return data_lib.partition(labels, s.num_clients, "dirichlet_by_class", s.seed,
                              alpha=s.alpha)


def build(s: ThroughputSettings, images: np.ndarray, labels: np.ndarray,
          parts: List[np.ndarray], dataset: str) -> Setup:
    model = models.build("mlp", 10, hidden=tuple(s.hidden))
    variables = models.init(model, jax.random.PRNGKey(s.seed), (28, 28, 1))
    algorithm = fedavg(model, client_optimizer(s.learning_rate, s.momentum, 0.0, None))
    return Setup(model, variables, algorithm, LocalWork(s.batch_size, float(s.epochs)),
                 ClientData.create(images, labels, parts), images, labels, parts, dataset,
                 models.count_params(variables))


def simulation(s: ThroughputSettings, setup: Setup, strategy: str,
               workers: Optional[int] = None) -> Simulation:
    executor = make_executor(strategy, setup.algorithm, setup.work, setup.data,
                             setup.variables, s.per_round, workers=workers)
    return Simulation(setup.algorithm, setup.data, setup.work, executor,
                      s.per_round / s.num_clients, aggregation="num_examples", seed=s.seed)


class _Config:
    """One timed configuration: `run(r)` trains round r (blocking) and returns its real
    examples; `params()` the current global parameters; `cost(r)` XLA's cost of round r
    (`benchmarks.roofline`; None where not modelled), asked for before the timed rounds."""

    def __init__(self, run: Callable[[int], int], params: Callable[[], PyTree],
                 cost: Callable[[int], Optional[roofline.Cost]] = lambda r: None):
        self.run, self.params, self.cost = run, params, cost
        self.costs: List[Optional[roofline.Cost]] = []
        self.seconds: List[float] = []
        self.examples: List[int] = []
        self.compiles_warmup = self.compiles_timed = 0
        self.compile_seconds_warmup = 0.0


def _engine_config(sim: Simulation, variables: PyTree) -> _Config:
    box = [sim.init(variables)]

    def run(r: int) -> int:
        assert box[0].round == r, (box[0].round, r)
        box[0], stats = sim.round(box[0])
        jax.block_until_ready(box[0].server)
        return int(stats["real_examples"])
    coster = roofline.round_costs(sim)
    return _Config(run, lambda: sim.evaluation(box[0].server)[1]["params"],
                   lambda r: coster(box[0]._replace(round=r)))


def _host_config(s: ThroughputSettings, setup: Setup, sim: Simulation,
                 loop: Any) -> _Config:
    """The naive or the FedJAX-style loop on the engine's cohorts; round 0 in the engine's
    batch order (for the agreement check), later rounds shuffled with numpy."""
    box = [setup.variables["params"]]
    rng = np.random.default_rng(s.seed)
    first = sim.cohort(sim.init(setup.variables), 0)

    def run(r: int) -> int:
        ids = sim.sample(r)
        order = engine_orders(first.data_keys, setup.data.max_size) if r == 0 else None
        parts = [setup.parts[i] for i in ids]
        if isinstance(loop, PyTorchStyleFedAvg):
            loop.round(setup.images, setup.labels, parts, order)
            return real_examples(setup.work, setup.data.sizes[ids])
        if isinstance(loop, FedJaxStyleFedAvg):
            box[0], _ = loop.round(box[0], setup.images, setup.labels, parts, rng,
                                   jax.random.PRNGKey(r), order)
        else:
            box[0], _ = loop.round(box[0], setup.images, setup.labels, parts, rng, order,
                                   weights=setup.data.sizes[ids])
        jax.block_until_ready(box[0])
        return real_examples(setup.work, setup.data.sizes[ids])
    # The PyTorch loop runs no XLA program: its rounds are costed as the FedJAX-style
    # loop's programs for the same maths.
    model = FedJaxStyleFedAvg(setup.model, s.learning_rate, s.momentum, s.batch_size,
                              s.epochs) if isinstance(loop, PyTorchStyleFedAvg) else loop
    steps = model.cost(setup.variables["params"], setup.images, setup.labels)

    def cost(r: int) -> roofline.Cost:
        return steps.round(setup.data.sizes[sim.sample(r)], s.epochs)
    if isinstance(loop, PyTorchStyleFedAvg):
        return _Config(run, loop.params, cost)
    return _Config(run, lambda: box[0], cost)


def throughput_section(s: ThroughputSettings, roof: roofline.Roof, log: Log
                       ) -> Dict[str, Any]:
    """Throughput per configuration, ratios to both baselines, agreement, start-up."""
    images, labels, dataset = load_data(s)
    setup = build(s, images, labels, partition(s, labels), dataset)
    auto = resolve_strategy("auto", setup.variables)
    sims = {f"{k} (auto)" if k == auto else k: simulation(s, setup, k)
            for k in dict.fromkeys([auto, "loop"])}
    if getattr(sims[f"{auto} (auto)"].executor, "workers", 1) > 1:
        # The same executor with its lone clients one at a time: what running two side by
        # side gains.
        sims[f"{auto}, one client at a time"] = simulation(s, setup, auto, workers=1)
    configs = {k: _engine_config(sim, setup.variables) for k, sim in sims.items()}
    sim = next(iter(sims.values()))
    configs["fedjax-style loop"] = _host_config(s, setup, sim, FedJaxStyleFedAvg(
        setup.model, s.learning_rate, s.momentum, s.batch_size, s.epochs))
    configs["naive loop"] = _host_config(s, setup, sim, NaiveFedAvg(
        setup.model, s.learning_rate, s.momentum, s.batch_size, s.epochs))
    if pytorch_style.available():
        configs[PYTORCH] = _host_config(s, setup, sim, PyTorchStyleFedAvg(
            setup.variables["params"], s.learning_rate, s.momentum, s.batch_size, s.epochs,
            s.seed))
    else:
        log("[throughput] torch is not installed: no PyTorch row (pip install torch==2.13.0)")
    firsts = {}
    for k, c in configs.items():  # warm-up: round 0, whose models are compared
        with count_compiles() as warm:
            c.run(0)
        c.compiles_warmup, c.compile_seconds_warmup = warm.count, warm.seconds
        firsts[k] = c.params()
        log(f"[throughput] {k}: warm-up round done")
    names = list(configs)
    for c in configs.values():  # untimed, before the timed rounds
        c.costs = [c.cost(r) for r in range(1, s.reps + 1)]
    for r in range(1, s.reps + 1):
        # Each round starts with another row, so no row always runs first after a switch.
        for k in names[(r - 1) % len(names):] + names[:(r - 1) % len(names)]:
            c = configs[k]
            with count_compiles() as timed:
                t0 = time.perf_counter()
                c.examples.append(c.run(r))
                c.seconds.append(time.perf_counter() - t0)
            c.compiles_timed += timed.count
            log(f"[throughput] {k} round {r}: {c.seconds[-1]:.2f} s")
    flops = 6.0 * setup.params
    records = {}
    for k, c in configs.items():
        rate = sum(c.examples) / sum(c.seconds)
        records[k] = {"seconds_per_round": float(statistics.median(c.seconds)),
                      "round_seconds": c.seconds, "reps": len(c.seconds),
                      "examples_per_second": rate, "gflops": rate * flops / 1e9,
                      "fraction_of_ceiling": rate * flops / 1e9 / roof.peak_gflops,
                      **roofline.row_record(c.costs, c.seconds, roof),
                      "compiles_warmup": c.compiles_warmup,
                      "compile_seconds_warmup": c.compile_seconds_warmup,
                      "compiles_timed": c.compiles_timed}
    for rec in records.values():
        for base, key in (("fedjax-style loop", "vs_fedjax_style"), ("naive loop", "vs_naive"),
                          (PYTORCH, "vs_pytorch")):
            if base in records:
                rec[key] = rec["examples_per_second"] / records[base]["examples_per_second"]
    reference = firsts[next(iter(sims))]
    agreement = {k: max_rel_diff(p, reference) for k, p in firsts.items()}
    sizes = setup.data.sizes
    out = {"workload": {
        "name": f"mlp_{dataset}_dirichlet_by_class", "num_clients": int(len(sizes)),
        "clients_per_round": s.per_round, "client_size_min": int(sizes.min()),
        "client_size_max": int(sizes.max()), "client_size_mean": float(sizes.mean()),
        "batch_size": s.batch_size, "epochs": s.epochs, "params": setup.params,
        "flops_per_example": flops, "alpha": s.alpha, "momentum": s.momentum,
        "learning_rate": s.learning_rate},
        "auto": auto, "configs": records, "agreement_max_rel_diff": agreement}
    if PYTORCH in configs:
        import torch
        out["torch_version"], out["torch_threads"] = torch.__version__, torch.get_num_threads()
    if s.startup:
        out["startup"] = startup_rows(s, log)
    return out


# ----------------------------------------------------------------------------------------
# Start-up: one fresh process per row
# ----------------------------------------------------------------------------------------

def first_round(s: ThroughputSettings, which: str) -> Dict[str, Any]:
    """In this (fresh) process: phases up to the end of the first trained round."""
    t_import = time.perf_counter()
    images, labels, dataset = load_data(s)
    parts = partition(s, labels)
    t_data = time.perf_counter()
    setup = build(s, images, labels, parts, dataset)
    with count_compiles() as compiles:
        if which == "engine":
            sim = simulation(s, setup, "auto")
            state = sim.init(setup.variables)
            t_build = time.perf_counter()
            state, _ = sim.round(state)
            jax.block_until_ready(state.server)
        else:
            loop = FedJaxStyleFedAvg(setup.model, s.learning_rate, s.momentum, s.batch_size,
                                     s.epochs)
            ids = simulation(s, setup, "loop").sample(0)
            t_build = time.perf_counter()
            params, _ = loop.round(setup.variables["params"], images, labels,
                                   [parts[i] for i in ids], np.random.default_rng(s.seed),
                                   jax.random.PRNGKey(0))
            jax.block_until_ready(params)
    t_round = time.perf_counter()
    return {"imports_s": t_import - _T0, "data_s": t_data - t_import,
            "build_s": t_build - t_data, "first_round_s": t_round - t_build,
            "to_first_round_s": t_round - _T0, "compiles": compiles.count,
            "compile_s": compiles.seconds}


def _run_startup(s: ThroughputSettings, which: str, env: Dict[str, str]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.throughput", "--startup", which,
         "--settings", json.dumps(dataclasses.asdict(s))],
        capture_output=True, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode:
        raise RuntimeError(f"start-up run {which!r} failed:\n{done.stderr[-2000:]}")
    rec = json.loads(done.stdout.strip().splitlines()[-1])
    rec["process_s"] = time.perf_counter() - t0
    return rec


def startup_rows(s: ThroughputSettings, log: Log) -> Dict[str, Dict[str, Any]]:
    """Engine cold and warm against one fresh compilation cache; FedJAX-style (no cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        cached = {**env, "JAX_COMPILATION_CACHE_DIR": cache,
                  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        for label in STARTUP_ROWS[:2]:
            rows[label] = _run_startup(s, "engine", cached)
            log(f"[throughput] start-up {label}: {rows[label]['to_first_round_s']:.1f} s")
    rows[STARTUP_ROWS[2]] = _run_startup(s, "fedjax_style", env)
    log(f"[throughput] start-up fedjax-style: {rows[STARTUP_ROWS[2]]['to_first_round_s']:.1f} s")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput",
                                description="one start-up measurement (used by the suite)")
    p.add_argument("--startup", choices=("engine", "fedjax_style"), required=True)
    p.add_argument("--settings", required=True, help="ThroughputSettings as JSON")
    args = p.parse_args(argv)
    raw = json.loads(args.settings)
    s = ThroughputSettings(**{**raw, "hidden": tuple(raw["hidden"])})
    print(json.dumps(first_round(s, args.startup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
