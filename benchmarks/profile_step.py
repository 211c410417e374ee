"""Where the time of one MLP-bench local step goes: `python -m benchmarks.profile_step`.

Times, in one process, after warm-up (median of `--reps`):
  ceiling     jitted float32 2048x2048 @ 2048x2048 (the suite's reference rate);
  shapes      the step's own matmuls (B=64: forward, input-grad and weight-grad products of
              784-1024-1024-1024-10), i.e. the best this step's arithmetic can run here;
  grad        forward + backward of the MLP (no optimiser);
  update      the optimiser update alone (momentum SGD on 2.9M parameters: memory-bound);
  stream      a plain memory stream over parameter-sized arrays (read two, write one);
  step        the engine's full local step (`fedjax_pan.algorithms.local.sgd_step`);
  floor       shapes + the update's 5 passes over the parameters at stream bandwidth: the
              best a step can do here, whatever the engine.
The gaps between rows say what stands between the step and the 2048^2 ceiling. Given the
machine's roof (`benchmarks.roofline.Roof`), each compiled part also gets XLA's FLOPs and
bytes and its fraction of the roofline.

`--trace-round DIR` instead runs one MLP-bench round of the engine under `jax.profiler`
(after a warm-up round), writes the trace to DIR (TensorBoard's profile plugin or
Perfetto read it) and prints where the round's time went (`round_profile`): the round's
wall time, the time inside the executor (local training), the rest (sampling, cohort,
aggregation, statistics), compilations, and from the trace the time some XLA program was
running against the time none was (host work, dispatch, syncs), with the busiest XLA ops
and engine functions. `benchmarks.run` includes this as its `profile` section.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import roofline
from fedjax_pan import models
from fedjax_pan.algorithms import local
from fedjax_pan.engine import count_compiles

SIZES = (784, 1024, 1024, 1024, 10)


def _time(fn: Callable, *args, reps: int = 20) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile(batch: int = 64, reps: int = 20, ceiling: Optional[float] = None,
            roof: Optional[roofline.Roof] = None) -> Dict[str, Dict[str, float]]:
    """The rows above, in order; fractions are of `ceiling` GFLOP/s (measured if None)
    and, given `roof`, of each compiled part's roofline."""
    costs: Dict[str, roofline.Cost] = {}
    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    out: Dict[str, Dict[str, float]] = {}

    if ceiling is None:
        a, b = f32(2048, 2048), f32(2048, 2048)
        t = _time(jax.jit(jnp.dot), a, b, reps=reps)
        ceiling = 2 * 2048 ** 3 / t / 1e9
    out["ceiling"] = {"seconds": 2 * 2048 ** 3 / ceiling / 1e9, "gflops": ceiling}

    # The step's matmuls at their own shapes: x W (fwd), g W^T (input grads), x^T g (W grads).
    ws = [f32(i, o) for i, o in zip(SIZES[:-1], SIZES[1:])]
    xs = [f32(batch, i) for i in SIZES[:-1]]
    gs = [f32(batch, o) for o in SIZES[1:]]

    @jax.jit
    def shapes(ws, xs, gs):
        return [(x @ w, g @ w.T, x.T @ g) for w, x, g in zip(ws, xs, gs)]
    flops = 6 * batch * sum(i * o for i, o in zip(SIZES[:-1], SIZES[1:]))
    t = _time(shapes, ws, xs, gs, reps=reps)
    out["shapes"] = {"seconds": t, "gflops": flops / t / 1e9}
    costs["shapes"] = roofline.program_cost(shapes, ws, xs, gs)

    model = models.build("mlp", 10)
    variables = models.init(model, jax.random.PRNGKey(0), (28, 28, 1))
    params = variables["params"]
    x, y = f32(batch, 28, 28, 1), jnp.asarray(rng.integers(0, 10, batch), jnp.int32)

    @jax.jit
    def grad(params, x, y):
        def loss(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return jax.grad(loss)(params)
    t = _time(grad, params, x, y, reps=reps)
    out["grad"] = {"seconds": t, "gflops": flops / t / 1e9}
    costs["grad"] = roofline.program_cost(grad, params, x, y)

    tx = local.client_optimizer(0.05, momentum=0.9)
    opt_state = tx.init(params)
    grads = grad(params, x, y)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    t = _time(update, params, opt_state, grads, reps=reps)
    nbytes = 4 * models.count_params(variables)
    # momentum SGD reads grads, params, momentum and writes params, momentum: 5 passes.
    out["update"] = {"seconds": t, "gb_per_s": 5 * nbytes / t / 1e9}
    costs["update"] = roofline.program_cost(update, params, opt_state, grads)

    # Bandwidth: out = a + 0.5 b over parameter-sized buffers, 3 passes, in place.
    n = models.count_params(variables)
    sa, sb = f32(n), f32(n)
    stream = jax.jit(lambda a, b: a + 0.5 * b, donate_argnums=(0,))
    box = [stream(sa, sb)]

    def run_stream():
        box[0] = stream(box[0], sb)
        return box[0]
    t = _time(run_stream, reps=reps)
    stream_rate = 3 * nbytes / t
    out["stream"] = {"seconds": t, "gb_per_s": stream_rate / 1e9}

    state = local.init_local(tx, variables, 0)
    batch_d = {"x": x, "y": y, "mask": jnp.ones(batch, jnp.float32)}
    step = jax.jit(lambda s, b: local.sgd_step(model, tx, s, b)[0])
    t = _time(step, state, batch_d, reps=reps)
    out["step"] = {"seconds": t, "gflops": flops / t / 1e9}
    costs["step"] = roofline.program_cost(step, state, batch_d)
    floor = out["shapes"]["seconds"] + 5 * nbytes / stream_rate
    out["floor"] = {"seconds": floor, "gflops": flops / floor / 1e9}
    for row in out.values():
        if "gflops" in row:
            row["fraction_of_ceiling"] = row["gflops"] / ceiling
    for name, cost in costs.items():
        out[name].update(xla_flops=cost.flops, xla_bytes=cost.bytes)
        if roof is not None:
            out[name].update(roofline_seconds=roof.seconds(cost),
                             roofline_bound=roof.bound(cost),
                             fraction_of_roofline=roof.seconds(cost) / out[name]["seconds"])
    return out


# ----------------------------------------------------------------------------------------
# One round under the profiler
# ----------------------------------------------------------------------------------------

class _TimedExecutor:
    """An executor whose `run` is timed to completion (its result blocked on)."""

    def __init__(self, executor: Any):
        self.executor, self.seconds = executor, 0.0

    def run(self, server, cohort):
        t0 = time.perf_counter()
        result = jax.block_until_ready(self.executor.run(server, cohort))
        self.seconds += time.perf_counter() - t0
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)


def _union_ns(spans: List[Tuple[float, float]]) -> float:
    """Total length of the union of (start, end) spans."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# XLA:CPU runs a program's thunks under this event; accelerators have device planes.
_XLA_EVENT = "ThunkExecutor::Execute"


def trace_summary(trace_dir: str, top: int = 10) -> Dict[str, Any]:
    """From the newest `*.xplane.pb` under `trace_dir`: the time some XLA program ran
    (union over threads or device streams) and the sum over them, the busiest XLA ops,
    and the engine's Python functions by inclusive time (per name, all threads)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(files[-1])
    busy: List[Tuple[float, float]] = []
    ops: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    python: collections.Counter = collections.Counter()
    python_calls: collections.Counter = collections.Counter()
    device = [p for p in data.planes if p.name.startswith("/device:")]
    for plane in data.planes:
        on_device = plane in device
        if not (on_device or plane.name.startswith("/host:CPU")):
            continue
        for line in plane.lines:
            for ev in line.events:
                name, span = ev.name, (ev.start_ns, ev.start_ns + ev.duration_ns)
                if on_device:
                    if "Ops" in line.name or "Stream" in line.name:
                        busy.append(span)
                        ops[name] += ev.duration_ns
                        calls[name] += 1
                elif name.startswith("$"):
                    if any(f in name for f in ("simulation.py", "execution.py", "clients.py",
                                               "store.py", "protocol.py")):
                        python[name[1:]] += ev.duration_ns
                        python_calls[name[1:]] += 1
                elif name == _XLA_EVENT and not device:
                    busy.append(span)
                elif not device and not name.startswith(("ThunkExecutor", "Pjit",
                                                         "CommonPjRt", "TfrtCpu")):
                    ops[name] += ev.duration_ns
                    calls[name] += 1
    return {"file": files[-1], "xla_busy_s": _union_ns(busy) / 1e9,
            "xla_thread_s": sum(b - a for a, b in busy) / 1e9,
            "xla_ops": [{"name": k, "seconds": v / 1e9, "calls": calls[k]}
                        for k, v in ops.most_common(top)],
            "engine_functions": [{"name": k, "seconds": v / 1e9, "calls": python_calls[k]}
                                 for k, v in python.most_common(top)]}


def round_profile(strategy: str = "auto", quick: bool = False,
                  trace_dir: Optional[str] = None, per_round: Optional[int] = None
                  ) -> Dict[str, Any]:
    """One MLP-bench round after a warm-up round, timed (round, executor, the rest,
    compilations, padding), then again under `jax.profiler` into `trace_dir` (a
    temporary folder if None), summarised by `trace_summary`."""
    from benchmarks import harness

    settings = harness.make_settings("cpu", quick)
    m = per_round or settings.mlp_per_round
    w = harness.mlp_workload(settings, max(m, settings.mlp_clients))
    sim = w.simulation(w.executor(strategy, m, settings), m, settings.seed)
    timed = _TimedExecutor(sim.executor)
    sim.executor = timed
    state = sim.init(w.variables)
    with count_compiles() as warm:
        state, _ = sim.round(state)
        jax.block_until_ready(state.server)
    timed.seconds = 0.0
    with count_compiles() as compiles:
        t0 = time.perf_counter()
        state, stats = sim.round(state)
        jax.block_until_ready(state.server)
        wall = time.perf_counter() - t0
    out = {"strategy": strategy, "clients_per_round": m, "round_s": wall,
           "executor_s": timed.seconds, "outside_executor_s": wall - timed.seconds,
           "compiles_warmup": warm.count, "compiles": compiles.count,
           "compile_s": compiles.seconds,
           "padding_efficiency": stats["real_examples"] / stats["computed_examples"]}
    kept = trace_dir
    with contextlib.ExitStack() as stack:
        if trace_dir is None:
            trace_dir = stack.enter_context(tempfile.TemporaryDirectory())
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            state, _ = sim.round(state)
            jax.block_until_ready(state.server)
            traced = time.perf_counter() - t0
        summary = trace_summary(trace_dir)
    out.update(traced_round_s=traced, **summary,
               host_only_s=max(0.0, traced - summary["xla_busy_s"]))
    out["trace_dir"] = kept
    return out


def format_round_profile(r: Dict[str, Any]) -> str:
    """The text summary `--trace-round` prints."""
    lines = [
        f"one MLP-bench round, strategy {r['strategy']}, {r['clients_per_round']} clients:",
        f"  untraced: {r['round_s']:.3f} s; in the executor (local training, blocked on) "
        f"{r['executor_s']:.3f} s; outside it (sampling, cohort, aggregation, statistics) "
        f"{r['outside_executor_s']:.3f} s; {r['compiles']} compilations "
        f"({r['compile_s']:.2f} s); padding efficiency {100 * r['padding_efficiency']:.1f}%",
        f"  traced: {r['traced_round_s']:.3f} s; some XLA program running "
        f"{r['xla_busy_s']:.3f} s (summed over threads {r['xla_thread_s']:.3f} s); none "
        f"running (host work, dispatch, syncs) {r['host_only_s']:.3f} s",
        "  busiest XLA ops (s, calls): " + ", ".join(
            f"{o['name']} {o['seconds']:.3f} ({o['calls']})" for o in r["xla_ops"][:8]),
        "  engine functions by inclusive time (s, calls; threads overlap): " + ", ".join(
            f"{o['name']} {o['seconds']:.3f} ({o['calls']})"
            for o in r["engine_functions"][:8])]
    if r.get("trace_dir"):
        lines.append(f"  trace: {r['trace_dir']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20,
                        help="timed repetitions of each part (default: %(default)s)")
    parser.add_argument("--json", default="", help="also write the numbers here")
    parser.add_argument("--trace-round", default="", metavar="DIR",
                        help="profile one engine round into DIR instead (see above)")
    parser.add_argument("--strategy", default="auto",
                        help="the traced round's strategy (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="the traced round at the quick suite's sizes")
    args = parser.parse_args(argv)
    if args.trace_round:
        r = round_profile(args.strategy, args.quick, args.trace_round)
        print(format_round_profile(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)
        return 0
    from benchmarks.harness import measure_matmul
    roof, measured = roofline.measure_roof(measure_matmul, 2048, 10, 256)
    print(f"roof: matmul {roof.peak_gflops:.1f} GFLOP/s, bandwidth {roof.bandwidth_gbs:.1f} "
          f"GB/s (jitted copy {measured['copy_gbs']:.1f}, triad {measured['triad_gbs']:.1f}, "
          f"NumPy triad {measured['numpy_triad_gbs']:.1f})")
    out = profile(reps=args.reps, ceiling=roof.peak_gflops, roof=roof)
    for name, row in out.items():
        rate = (f"{row['gflops']:7.1f} GFLOP/s ({100 * row['fraction_of_ceiling']:5.1f}% of "
                f"ceiling)" if "gflops" in row else f"{row['gb_per_s']:7.1f} GB/s moved")
        roof_part = ("" if "xla_bytes" not in row else
                     f"  XLA {row['xla_flops'] / 1e6:.0f} MFLOP {row['xla_bytes'] / 2**20:.1f} "
                     f"MiB: {100 * row['fraction_of_roofline']:.1f}% of its roofline "
                     f"({row['roofline_bound']})")
        print(f"{name:8s} {1e3 * row['seconds']:8.2f} ms  {rate}{roof_part}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
