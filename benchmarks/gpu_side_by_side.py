"""The MLP on Fashion-MNIST side by side on one accelerator: `python -m
benchmarks.gpu_side_by_side --out DIR` (`--quick`: tiny sizes on any device, seconds).

At 10, 100 and 1,000 clients a round (K = 1,000 clients, `partition.scheme` 'iid', about
60 examples each, MLP 784-1024x3-10, E = 5, B = 64, SGD lr 0.05 without momentum, FedAvg
weighted by examples, no PANs), each row trains the same cohorts (the engine's sampling):

  fedjax_pan float32    the run's own assembly (`run.assembly.build` of the config), its
                        `auto` strategy;
  fedjax_pan bfloat16   the same with `execution.precision = 'bfloat16'` (skipped, with a
                        note, where the config has no such key);
  FedJAX 0.0.17         `fedjax.algorithms.fed_avg.federated_averaging` with FedJAX's
                        default `jit` for_each_client backend, the same MLP in Haiku with
                        the same initial weights (skipped, with a note, where `fedjax`
                        does not import: benchmarks/README.md says how to carry it);
  PyTorch-style         PFLlib's client loop (`pytorch_style.py`) on CUDA where torch sees
                        a GPU (else its CPU; skipped where torch is missing).

Each row: one warm-up round, then `--rounds` timed rounds (blocked on), examples/s = real
training examples (sample-epochs) of the timed rounds per second; % of roofline
(`benchmarks.roofline`): XLA's cost of the row's round against the matmul rate (float32,
or bfloat16 for the bfloat16 row) and the memory bandwidth measured in this run. FedJAX and
PyTorch rows are costed as the FedJAX-style loop's programs for the same maths
(`fedjax_style.py`). Writes DIR/side_by_side.json and DIR/side_by_side.md (a block for
benchmarks/RESULTS_gpu.md) and prints the latter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import pytorch_style, roofline
from benchmarks.fedjax_style import FedJaxStyleFedAvg
from benchmarks.harness import machine_info, measure_matmul
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine.clients import real_examples

PyTree = Any
ENGINE, FEDJAX, TORCH = "fedjax_pan", "FedJAX 0.0.17 fed_avg (jit)", "PyTorch-style"


@dataclasses.dataclass(frozen=True)
class SideBySide:
    """The workload and its sizes (`quick_settings`: seconds on a CPU)."""

    dataset: str = "fashion_mnist"
    num_clients: int = 1000
    per_round: Tuple[int, ...] = (10, 100, 1000)
    hidden: Tuple[int, ...] = (1024, 1024, 1024)
    epochs: int = 5
    batch_size: int = 64
    learning_rate: float = 0.05
    rounds: int = 3  # timed, after one warm-up round
    seed: int = 0
    matmul_size: int = 8192
    matmul_reps: int = 10
    stream_mib: int = 1024


def quick_settings() -> SideBySide:
    # 50 examples a client in batches of 10: no short batch, one step shape to compile.
    return SideBySide(dataset="synthetic", num_clients=20, per_round=(4,), hidden=(16, 16),
                      epochs=1, batch_size=10, rounds=1, matmul_size=256, matmul_reps=2,
                      stream_mib=4)


def config(s: SideBySide, per_round: int, precision: str = "float32") -> Any:
    """The run's config of this workload; None where `execution.precision` is not a key
    (a library without mixed precision) and `precision` is not float32."""
    cfg = default_config()
    cfg.seed = s.seed
    cfg.dataset.name = s.dataset
    cfg.model.name, cfg.model.options = "mlp", {"hidden": tuple(s.hidden)}
    cfg.pan.amplitude = 0.0
    cfg.partition.scheme, cfg.partition.num_clients = "iid", s.num_clients
    cfg.participation = per_round / s.num_clients
    cfg.local.epochs, cfg.local.batch_size = float(s.epochs), s.batch_size
    opt = cfg.optimizer
    opt.lr, opt.momentum, opt.weight_decay, opt.grad_clip, opt.warmup = (
        s.learning_rate, 0.0, 0.0, 0.0, "none")
    cfg.aggregation.weights = "num_examples"
    if "precision" in cfg.execution:
        cfg.execution.precision = precision
    elif precision != "float32":
        return None
    return cfg


@dataclasses.dataclass
class Row:
    """One timed configuration: `run(r)` trains round r to completion and returns its
    real examples; `cost(r)` XLA's cost of round r (untimed)."""

    run: Callable[[int], int]
    cost: Callable[[int], Optional[roofline.Cost]]
    dtype: str = "float32"
    seconds: List[float] = dataclasses.field(default_factory=list)
    examples: List[int] = dataclasses.field(default_factory=list)
    costs: List[Optional[roofline.Cost]] = dataclasses.field(default_factory=list)

    def time(self, rounds: int) -> None:
        self.run(0)  # warm-up: compilation
        self.costs = [self.cost(r) for r in range(1, rounds + 1)]  # untimed
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            self.examples.append(self.run(r))
            self.seconds.append(time.perf_counter() - t0)

    def record(self, roof: roofline.Roof) -> Dict[str, Any]:
        return {"seconds_per_round": float(statistics.median(self.seconds)),
                "round_seconds": self.seconds, "examples_per_round": self.examples[-1],
                "examples_per_second": sum(self.examples) / sum(self.seconds),
                "dtype": self.dtype, **roofline.row_record(self.costs, self.seconds, roof,
                                                           self.dtype)}


def engine_row(exp: Any, dtype: str) -> Row:
    sim = exp.simulation
    box = [sim.init(exp.variables)]

    def run(r: int) -> int:
        box[0], stats = sim.round(box[0])
        jax.block_until_ready(box[0].server)
        return int(stats["real_examples"])
    coster = roofline.round_costs(sim)
    return Row(run, lambda r: coster(box[0]._replace(round=r)), dtype)


def _host_data(exp: Any) -> Tuple[np.ndarray, np.ndarray, List[np.ndarray]]:
    data = exp.simulation.data
    return (np.asarray(data.images, np.float32), np.asarray(data.labels, np.int32),
            [np.asarray(p) for p in exp.client_indices])


def import_fedjax() -> Any:
    """`fedjax`, after restoring `jax.tree_map`, which FedJAX 0.0.17 calls and JAX has
    since removed, as `jax.tree_util.tree_map` (ImportError where fedjax is missing)."""
    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree_util.tree_map
    import fedjax
    return fedjax


def fedjax_row(exp: Any, s: SideBySide, steps: Any) -> Row:
    """FedJAX's own FedAvg on the same clients and initial weights (ImportError where
    fedjax is not installed)."""
    fedjax = import_fedjax()
    import haiku as hk

    params = exp.variables["params"]
    names = [n for n in params if n != "head"] + ["head"]

    def forward(batch):
        x = hk.Flatten()(batch["x"])
        for name in names[:-1]:
            x = jax.nn.relu(hk.Linear(params[name]["kernel"].shape[1], name=name)(x))
        return hk.Linear(params["head"]["kernel"].shape[1], name="head")(x)
    images, labels, parts = _host_data(exp)
    sample = {"x": images[:1], "y": labels[:1]}
    model = fedjax.create_model_from_haiku(
        hk.transform(forward), sample,
        lambda b, p: fedjax.metrics.unreduced_cross_entropy_loss(b["y"], p))
    algorithm = fedjax.algorithms.fed_avg.federated_averaging(
        fedjax.model_grad(model), fedjax.optimizers.sgd(s.learning_rate),
        fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=s.batch_size, num_epochs=s.epochs,
                                         seed=s.seed))
    fd = fedjax.InMemoryFederatedData({str(k).encode(): {"x": images[p], "y": labels[p]}
                                       for k, p in enumerate(parts)})
    init = {name: {"w": jnp.asarray(params[name]["kernel"]),
                   "b": jnp.asarray(params[name]["bias"])} for name in names}
    box = [algorithm.init(init)]
    sim, work = exp.simulation, exp.simulation.work

    def run(r: int) -> int:
        ids = sim.sample(r)
        clients = [(str(k).encode(), fd.get_client(str(k).encode()),
                    jax.random.PRNGKey(r * s.num_clients + int(k))) for k in ids]
        box[0], _ = algorithm.apply(box[0], clients)
        jax.block_until_ready(box[0].params)
        return real_examples(work, sim.data.sizes[ids])
    return Row(run, lambda r: steps.round(sim.data.sizes[sim.sample(r)], s.epochs))


def torch_row(exp: Any, s: SideBySide, steps: Any) -> Tuple[Row, str]:
    """PFLlib's loop on CUDA where torch sees a GPU, else on its CPU (ImportError where
    torch is missing); (row, device)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    loop = pytorch_style.PyTorchStyleFedAvg(exp.variables["params"], s.learning_rate, 0.0,
                                            s.batch_size, s.epochs, s.seed, device=device)
    images, labels, parts = _host_data(exp)
    sim = exp.simulation

    def run(r: int) -> int:
        ids = sim.sample(r)
        loop.round(images, labels, [parts[k] for k in ids])
        return real_examples(sim.work, sim.data.sizes[ids])
    return Row(run, lambda r: steps.round(sim.data.sizes[sim.sample(r)], s.epochs)), device


def side_by_side(s: SideBySide, log: Callable[[str], None]) -> Dict[str, Any]:
    """Every row at every clients-per-round, the roof measured in this run, the ratios."""
    from fedjax_pan.run import assembly

    bf16 = measure_matmul(s.matmul_size, s.matmul_reps, jnp.bfloat16)["gflops"]
    roof, roof_record = roofline.measure_roof(measure_matmul, s.matmul_size, s.matmul_reps,
                                              s.stream_mib)
    roof = dataclasses.replace(roof, peak_gflops_bf16=bf16)
    roof_record["matmul_gflops_bf16"] = bf16
    log(f"[side-by-side] matmul {roof.peak_gflops:.0f} GFLOP/s (bfloat16 {bf16:.0f}), "
        f"bandwidth {roof.bandwidth_gbs:.0f} GB/s")
    notes, points, cache = [], [], {}
    for m in s.per_round:
        rows: Dict[str, Row] = {}
        exp = assembly.build(config(s, m), cache)
        rows[f"{ENGINE} float32"] = engine_row(exp, "float32")
        cfg16 = config(s, m, "bfloat16")
        if cfg16 is None:
            _note(notes, "fedjax_pan bfloat16: skipped, the config has no "
                         "execution.precision key")
        else:
            rows[f"{ENGINE} bfloat16"] = engine_row(assembly.build(cfg16, cache), "bfloat16")
        images, labels, _ = _host_data(exp)
        fj = FedJaxStyleFedAvg(exp.model, s.learning_rate, 0.0, s.batch_size, s.epochs)
        steps = _Lazy(lambda: fj.cost(exp.variables["params"], images, labels))
        try:
            rows[FEDJAX] = fedjax_row(exp, s, steps)
        except ImportError as e:
            _note(notes, f"{FEDJAX}: skipped, fedjax does not import ({e}); "
                         "benchmarks/README.md, 'GPU side by side', carries it")
        try:
            row, device = torch_row(exp, s, steps)
            rows[f"{TORCH} ({device})"] = row
        except ImportError:
            _note(notes, f"{TORCH}: skipped, torch is not installed")
        records = {}
        for name, row in rows.items():
            row.time(s.rounds)
            records[name] = row.record(roof)
            log(f"[side-by-side] {m} clients/round, {name}: "
                f"{records[name]['examples_per_second']:.0f} examples/s")
        _ratios(records)
        points.append({"clients_per_round": m, "rows": records})
    return {"meta": machine_info(), "settings": dataclasses.asdict(s), "roof": roof_record,
            "points": points, "notes": notes}


class _Lazy:
    """A LoopCost built when first asked for (no host-loop row: nothing compiled)."""

    def __init__(self, make: Callable[[], roofline.LoopCost]):
        self.make, self.made = make, None

    def round(self, sizes: Sequence[int], epochs: int) -> roofline.Cost:
        if self.made is None:
            self.made = self.make()
        return self.made.round(sizes, epochs)


def _note(notes: List[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _ratios(records: Dict[str, Dict[str, Any]]) -> None:
    """Each row's examples/s over FedJAX's and over PyTorch's (where they ran)."""
    bases = {"vs_fedjax": FEDJAX, "vs_pytorch": next(
        (k for k in records if k.startswith(TORCH)), None)}
    for rec in records.values():
        for key, base in bases.items():
            if base in records:
                rec[key] = rec["examples_per_second"] / records[base]["examples_per_second"]


# (name, clients a round, what is measured, its threshold): the GPU's targets.
TARGETS = (("fedjax_pan float32 >= 60% of its roofline at 1,000 clients a round", 1000,
            "roofline_f32", 0.6),
           ("fedjax_pan bfloat16 >= 1.6x float32's examples/s at 1,000 clients a round",
            1000, "bf16_speedup", 1.6),
           ("fedjax_pan float32 >= 3x FedJAX's examples/s at 100 clients a round", 100,
            "vs_fedjax", 3.0))


def targets(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each target with its measured value and PASS / MISS (n/a where its rows or its
    clients-a-round did not run)."""
    out = []
    for name, m, what, threshold in TARGETS:
        rows = next((p["rows"] for p in results["points"] if p["clients_per_round"] == m), {})
        f32, bf16 = rows.get(f"{ENGINE} float32"), rows.get(f"{ENGINE} bfloat16")
        value = None
        if what == "roofline_f32" and f32 is not None:
            value = f32.get("fraction_of_roofline")
        elif what == "bf16_speedup" and f32 is not None and bf16 is not None:
            value = bf16["examples_per_second"] / f32["examples_per_second"]
        elif what == "vs_fedjax" and f32 is not None:
            value = f32.get("vs_fedjax")
        status = "n/a" if value is None else ("PASS" if value >= threshold else "MISS")
        out.append({"name": name, "value": value, "threshold": threshold, "status": status})
    return out


def markdown(results: Dict[str, Any], command: str) -> str:
    """The block for benchmarks/RESULTS_gpu.md."""
    meta, roof, s = results["meta"], results["roof"], results["settings"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    out = ["## Side by side: MLP on Fashion-MNIST", "",
           f"- generated by `{command}` on {meta['date']}, {meta['device_kind']} "
           f"({meta['backend']}), jax {meta['jax']}",
           f"- {s['num_clients']} clients ({s['dataset']}, iid), MLP 784-"
           f"{'-'.join(map(str, s['hidden']))}-10, E={s['epochs']}, B={s['batch_size']}, "
           f"SGD lr {s['learning_rate']:g}, FedAvg weighted by examples; one warm-up round, "
           f"median of {s['rounds']} timed rounds; the same cohorts in every row",
           f"- roof measured in this run: matmul {roof['matmul_gflops']:.0f} GFLOP/s "
           f"float32, {roof['matmul_gflops_bf16']:.0f} bfloat16; bandwidth "
           f"{roof['bandwidth_gbs']:.0f} GB/s (copy {roof['copy_gbs']:.0f}, triad "
           f"{roof['triad_gbs']:.0f}); % roofline as in `benchmarks/roofline.py` (FedJAX and "
           "PyTorch rows costed as the FedJAX-style loop's XLA programs)"]
    out += [f"- {n}" for n in results["notes"]] + [""]
    out += ["| clients/round | row | s/round | examples/s | % roofline | bound | vs FedJAX | "
            "vs PyTorch |", "|" + " --- |" * 8]
    for p in results["points"]:
        for name, r in p["rows"].items():
            out.append(f"| {p['clients_per_round']} | {name} | {r['seconds_per_round']:.3f} | "
                       f"{r['examples_per_second']:.0f} | {pct(r.get('fraction_of_roofline'))} "
                       f"| {r.get('roofline_bound') or '-'} | {ratio(r.get('vs_fedjax'))} | "
                       f"{ratio(r.get('vs_pytorch'))} |")
    out += ["", "| status | target | measured |", "| --- | --- | --- |"]
    out += [f"| {t['status']} | {t['name']} | "
            f"{'-' if t['value'] is None else format(t['value'], '.3f')} |"
            for t in targets(results)]
    return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_side_by_side",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for side_by_side.json and .md")
    p.add_argument("--quick", "--dry-run", action="store_true",
                   help="tiny sizes, any device, seconds (the tests run this)")
    p.add_argument("--per-round", default="",
                   help="comma-separated clients per round (default: 10,100,1000)")
    p.add_argument("--rounds", type=int, default=0, help="timed rounds per row (default 3)")
    args = p.parse_args(argv)
    s = quick_settings() if args.quick else SideBySide()
    if args.per_round:
        s = dataclasses.replace(s, per_round=tuple(int(x) for x in args.per_round.split(",")))
    if args.rounds:
        s = dataclasses.replace(s, rounds=args.rounds)
    results = side_by_side(s, lambda line: print(line, file=sys.stderr, flush=True))
    command = "python -m benchmarks.gpu_side_by_side " + " ".join(
        sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "side_by_side.json"), "w") as f:
        json.dump(results, f, indent=2)
    text = markdown(results, command)
    with open(os.path.join(args.out, "side_by_side.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
