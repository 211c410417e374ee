"""Grouped convolutions (Fed2): each implementation per layer, in a VGG step, in rounds."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (CONCRETE_IMPLS, GroupedLayer, GroupedRound, Log, PyTree,
                                Settings, auto_summary, equal_parts, forward_flops,
                                make_workload, strategies, summarize, time_engine)
from benchmarks.roofline import Roof
from fedjax_pan import data as data_lib
from fedjax_pan import models
from fedjax_pan.algorithms import client_optimizer, local
from fedjax_pan.models import grouped as grouped_lib


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
    state = jax.jit(lambda v: local.init_local(tx, v, 0))(variables)
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


def grouped_round_rows(bench: GroupedRound, settings: Settings, roof: Roof,
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
        configs[strategy] = summarize(m, w.flops_per_example, roof)
        log(f"[grouped_conv] {bench.key} {strategy}: "
            f"{configs[strategy]['seconds_per_round']:.3f} s/round")
    convs = grouped_conv_inputs(model, w.variables) if bench.model != "mlp" else []
    return {"model": bench.model, "groups": bench.groups, "depth": bench.depth,
            "conv_impls": sorted({grouped_lib.pick_conv_impl(bench.groups, c)
                                  for c in convs}),
            "workload": w.describe(bench.clients_per_round), "strategies": configs,
            "auto": auto_summary(configs, w.variables)}


def grouped_conv_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """Grouped convs per implementation (`grouped_lib.CONV_IMPLS`): layer shapes (forward +
    backward, with the dense conv of the same width), one local step of Fed2's grouped
    VGG9, and grouped models' rounds per execution strategy."""
    layers = []
    for layer in settings.grouped_layers:
        rec = grouped_layer_rows(layer, settings.grouped_reps, settings.grouped_budget_s,
                                 roof.peak_gflops, settings.seed)
        layers.append(rec)
        log(f"[grouped_conv] {layer.key}: " + ", ".join(
            f"{k} {1e3 * v['seconds']:.1f} ms" for k, v in rec["impls"].items())
            + f"; dense {1e3 * rec['dense']['seconds']:.1f} ms; auto {rec['auto']['picks']}")
    step = grouped_step_rows(settings, roof.peak_gflops)
    log("[grouped_conv] grouped VGG9 step: " + ", ".join(
        f"{k} {1e3 * v['seconds']:.1f} ms" for k, v in step["impls"].items())
        + f"; auto {step['auto']['picks']}")
    rounds = {b.key: grouped_round_rows(b, settings, roof, log)
              for b in settings.grouped_rounds}
    return {"backend": jax.default_backend(), "layers": layers, "vgg_step": step,
            "rounds": rounds}
