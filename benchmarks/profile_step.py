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
The gaps between rows say what stands between the step and the 2048^2 ceiling.
`benchmarks.run` includes this as its `profile` section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan import models
from fedjax_pan.algorithms import local

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


def profile(batch: int = 64, reps: int = 20,
            ceiling: Optional[float] = None) -> Dict[str, Dict[str, float]]:
    """The rows above, in order; fractions are of `ceiling` GFLOP/s (measured if None)."""
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
    floor = out["shapes"]["seconds"] + 5 * nbytes / stream_rate
    out["floor"] = {"seconds": floor, "gflops": flops / floor / 1e9}
    for row in out.values():
        if "gflops" in row:
            row["fraction_of_ceiling"] = row["gflops"] / ceiling
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20,
                        help="timed repetitions of each part (default: %(default)s)")
    parser.add_argument("--json", default="", help="also write the numbers here")
    args = parser.parse_args(argv)
    out = profile(reps=args.reps)
    for name, row in out.items():
        rate = (f"{row['gflops']:7.1f} GFLOP/s ({100 * row['fraction_of_ceiling']:5.1f}% of "
                f"ceiling)" if "gflops" in row else f"{row['gb_per_s']:7.1f} GB/s moved")
        print(f"{name:8s} {1e3 * row['seconds']:8.2f} ms  {rate}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
