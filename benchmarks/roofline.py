"""The roofline of a benchmark row: what its compiled programs cost (XLA's own cost
analysis), what this machine can do (measured matmul rate and memory bandwidth), and the
least time the row's work could take here.

Cost model. `Cost` holds XLA's 'flops' and 'bytes accessed' of a compiled program
(`Compiled.cost_analysis()`, summed over the programs a round runs). XLA counts the
operands and outputs of every HLO instruction after fusion, so 'bytes accessed' is an
upper bound on memory traffic: a fused or small operand that stays in cache is counted as
if it went to memory. XLA counts a loop's body once whatever its trip count, so a round's
cost is built from one local step at a time: steps x the cost of one step at its batch
rows, plus each client's init and final output, each epoch's batch order, and the server's
aggregation and update (`EngineCost`). The host loops (naive, FedJAX-style) count their own
jitted step likewise (`LoopCost`); a loop whose short last batches take shapes of their own
gets their cost interpolated linearly in the rows between two compiled shapes (exact where
FLOPs and activation bytes scale with the rows and the weights' bytes do not).

Machine. The matmul rate is `harness.measure_matmul`'s (the dense-compute ceiling);
the bandwidth is a STREAM-like copy (b = -a) and triad (a = b + s c) over large jitted
arrays, median of reps, bytes moved (read + written) per second, and the triad in NumPy;
the best triad is used (`measure_bandwidth`).

Bound. A row's roofline time is max(FLOPs / peak, bytes / bandwidth) summed over its
rounds; `fraction_of_roofline` = roofline time / measured time (1.0: as fast as the
machine allows under this model).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.engine.clients import step_rows
from fedjax_pan.engine.protocol import ClientContext, RoundInfo

PyTree = Any
tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and bytes accessed of some compiled work (XLA's counts)."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.bytes * k)

    __rmul__ = __mul__

    @property
    def intensity(self) -> float:
        """FLOPs per byte accessed."""
        return self.flops / self.bytes if self.bytes else math.inf


def total(costs: Iterable[Cost]) -> Cost:
    out = Cost()
    for c in costs:
        out = out + c
    return out


def xla_cost(compiled: Any) -> Cost:
    """The Cost of a compiled program (`jax.jit(f).lower(...).compile()`): JAX 0.4.3x
    returns a list with one dict per program, later versions the dict itself."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return Cost(float(analysis.get("flops", 0.0)),
                float(analysis.get("bytes accessed", 0.0)))


def abstract(tree: PyTree) -> PyTree:
    """Shapes and dtypes of `tree`'s arrays (what lowering needs; nothing is copied);
    Python scalars and None stay as they are."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "dtype"):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return tree_map(one, tree)


def program_cost(fn: Callable, *args: Any) -> Cost:
    """XLA's cost of `jax.jit(fn)` compiled for `args`' shapes."""
    return xla_cost(jax.jit(fn).lower(*abstract(args)).compile())


# ----------------------------------------------------------------------------------------
# The machine: matmul rate and memory bandwidth
# ----------------------------------------------------------------------------------------

def _median_seconds(fn: Callable[[], Any], reps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def measure_bandwidth(mib: int = 256, reps: int = 10) -> Dict[str, float]:
    """STREAM-like copy (b = -a: 2 arrays moved) and triad (a = b + s c: 3 arrays), jitted,
    over float32 arrays of `mib` MiB each (far above the caches), GB/s of bytes read and
    written, median of `reps`; and the same triad in NumPy, the host's own rate (XLA:CPU's
    elementwise loops have run at a fifth of it: 2.3 against 12 GB/s on a 2-core EPYC).
    'bandwidth_gbs' is the best triad: the memory's rate, whoever reaches it."""
    n = mib * 2 ** 20 // 4
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    b = jax.random.normal(ka, (n,), jnp.float32)
    c = jax.random.normal(kb, (n,), jnp.float32)
    # The output overwrites a donated buffer: a fresh one per call would time the
    # allocator's page faults instead of the memory.
    copy = jax.jit(lambda out, a: -a, donate_argnums=(0,))
    triad = jax.jit(lambda out, b, c: b + 3.0 * c, donate_argnums=(0,))
    box = [jnp.zeros(n, jnp.float32)]

    def run(fn, *args):
        box[0] = fn(box[0], *args)
        return box[0]
    nbytes = 4.0 * n
    t_copy = _median_seconds(lambda: run(copy, b), reps)
    t_triad = _median_seconds(lambda: run(triad, b, c), reps)
    hb, hc = np.asarray(b), np.asarray(c)
    ha, tmp = np.empty_like(hb), np.empty_like(hb)

    def host_triad():
        np.multiply(hc, np.float32(3.0), out=tmp)
        return np.add(hb, tmp, out=ha)
    # Two passes (a temporary: NumPy has no fused triad): 5 arrays moved.
    t_host = _median_seconds(host_triad, reps)
    out = {"mib": mib, "reps": reps, "copy_gbs": 2 * nbytes / t_copy / 1e9,
           "triad_gbs": 3 * nbytes / t_triad / 1e9,
           "numpy_triad_gbs": 5 * nbytes / t_host / 1e9}
    out["bandwidth_gbs"] = max(out["triad_gbs"], out["numpy_triad_gbs"])
    return out


@dataclasses.dataclass(frozen=True)
class Roof:
    """This machine's measured limits: float32 (and bfloat16) matmul GFLOP/s and the
    memory bandwidth in GB/s (the triad's)."""

    peak_gflops: float
    bandwidth_gbs: float
    copy_gbs: Optional[float] = None
    peak_gflops_bf16: Optional[float] = None

    def peak(self, dtype: str = "float32") -> float:
        if dtype == "bfloat16" and self.peak_gflops_bf16:
            return self.peak_gflops_bf16
        return self.peak_gflops

    def seconds(self, cost: Cost, dtype: str = "float32") -> float:
        """The least time `cost` takes here: max(FLOPs / peak, bytes / bandwidth)."""
        return max(cost.flops / (self.peak(dtype) * 1e9),
                   cost.bytes / (self.bandwidth_gbs * 1e9))

    def bound(self, cost: Cost, dtype: str = "float32") -> str:
        """'compute' or 'memory': which side of the ridge `cost` falls on."""
        compute = cost.flops / (self.peak(dtype) * 1e9)
        return "compute" if compute >= cost.bytes / (self.bandwidth_gbs * 1e9) else "memory"

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which float32 work is compute-bound here."""
        return self.peak_gflops / self.bandwidth_gbs


def measure_roof(matmul: Callable[..., Dict[str, Any]], size: int, reps: int,
                 stream_mib: int, bf16: bool = False) -> tuple:
    """(Roof, record) measured now: `matmul(size, reps[, dtype])` (harness.measure_matmul)
    and `measure_bandwidth(stream_mib)`."""
    mm = matmul(size, reps)
    bw = measure_bandwidth(stream_mib, max(3, reps))
    mm16 = matmul(size, reps, jnp.bfloat16) if bf16 else None
    roof = Roof(mm["gflops"], bw["bandwidth_gbs"], bw["copy_gbs"],
                None if mm16 is None else mm16["gflops"])
    record = {"matmul_gflops": mm["gflops"], "matmul_best_gflops": mm["best_gflops"],
              "bandwidth_gbs": bw["bandwidth_gbs"],
              "copy_gbs": bw["copy_gbs"], "triad_gbs": bw["triad_gbs"],
              "numpy_triad_gbs": bw["numpy_triad_gbs"], "stream_mib": stream_mib,
              "ridge_flops_per_byte": roof.ridge}
    if mm16 is not None:
        record["matmul_gflops_bf16"] = mm16["gflops"]
    return roof, record


def row_record(costs: Sequence[Optional[Cost]], seconds: Sequence[float], roof: Roof,
               dtype: str = "float32") -> Dict[str, Any]:
    """The roofline fields of a row whose timed rounds cost `costs` and took `seconds`
    (empty where some round's cost is unknown)."""
    if not costs or any(c is None for c in costs):
        return {"fraction_of_roofline": None}
    whole = total(costs)
    bound_s = sum(roof.seconds(c, dtype) for c in costs)
    n = len(costs)
    return {"xla_flops_per_round": whole.flops / n, "xla_bytes_per_round": whole.bytes / n,
            "roofline_seconds": bound_s / n, "roofline_bound": roof.bound(whole, dtype),
            "flops_per_byte": whole.intensity,
            "fraction_of_roofline": bound_s / sum(seconds),
            # The compute side alone: XLA's FLOPs at the matmul rate over the time.
            "fraction_of_compute_roof": whole.flops / (roof.peak(dtype) * 1e9)
            / sum(seconds)}


# ----------------------------------------------------------------------------------------
# What a round costs
# ----------------------------------------------------------------------------------------

def _one(tree: PyTree) -> PyTree:
    """One client's slice of a stack (arrays or their shapes)."""
    return None if tree is None else tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), abstract(tree))


def _stack(tree: PyTree, g: int) -> PyTree:
    return None if tree is None else tree_map(
        lambda x: jax.ShapeDtypeStruct((g, *np.shape(x)), x.dtype), abstract(tree))


def batch_arrays(data: Any, rows: int) -> tuple:
    """The shapes of the client data a step reads, as if the data held `rows` examples
    and one client: XLA costs a gather as reading its whole operand, and a step reads
    only its batch's rows (so the whole training set would be counted once per step)."""
    images, labels, table = data.images, data.labels, data.index_table
    return (jax.ShapeDtypeStruct((rows, *images.shape[1:]), images.dtype),
            jax.ShapeDtypeStruct((rows, *labels.shape[1:]), labels.dtype),
            jax.ShapeDtypeStruct((1, *table.shape[1:]), table.dtype))


# Programs costed for the last few (algorithm, data) pairs: executors of one workload
# (loop, vmap) share their client functions, so a second row compiles nothing new. The
# entries hold their algorithm and data, so no id is reused while they live.
_SHARED: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_SHARED_ENTRIES = 2


def _shared_cache(program: Any, data: Any) -> Dict[Any, Cost]:
    key = (id(program.algorithm), id(data), program.batch_size, repr(program.augment))
    if key not in _SHARED:
        _SHARED[key] = (program.algorithm, data, {})
        while len(_SHARED) > _SHARED_ENTRIES:
            _SHARED.popitem(last=False)
    _SHARED.move_to_end(key)
    return _SHARED[key][2]


class EngineCost:
    """XLA's cost of a `Simulation`'s rounds, built from the functions its executor
    compiles (`ClientProgram.step`, `init`, `order`, `finish`) and its server update.

    Lone clients (the `loop` strategy, and `vmap` blocks of one) take `step_rows` rows at
    each step; a block of G > 1 clients takes its longest client's steps of the vmapped,
    masked step on G x B rows. The sharded strategy is not modelled (None).
    """

    def __init__(self, sim: Any):
        self.sim = sim
        ex = getattr(sim, "executor", None)
        self.program = getattr(ex, "program", None)
        block = getattr(ex, "block_size", 1)
        self.supported = (self.program is not None and getattr(ex, "mesh", None) is None
                          and hasattr(sim, "cohort") and hasattr(sim, "data"))
        self.block = 1 if getattr(ex, "single", True) else int(block)
        self._cache: Dict[Any, Cost] = (_shared_cache(self.program, sim.data)
                                        if self.supported else {})

    # The arguments a client's functions see, as shapes.
    def _args(self, state: Any, cohort: Any, g: int) -> Dict[str, Any]:
        data, p = self.sim.data, self.program
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        ids = np.asarray(cohort.ids)
        client_state = _one(abstract(cohort.client_states))
        ctx = ClientContext(abstract(cohort.rngs[0]), i32, i32, i32, i32,
                            abstract(data.label_counts[int(ids[0])]))
        info = (i32, i32, abstract(cohort.data_keys[0]), i32)
        server = abstract(state.server)
        carry = jax.eval_shape(p.init, server, client_state, ctx)
        order = jax.eval_shape(p.order, info, i32)
        if g > 1:
            client_state, ctx, info, carry, order = (
                _stack(x, g) for x in (client_state, ctx, info, carry, order))
        arrays = batch_arrays(data, p.batch_size)
        return {"arrays": arrays, "server": server, "client_state": client_state,
                "ctx": ctx, "info": info, "carry": carry, "order": order}

    def _cached(self, key: Any, make: Callable[[], Cost]) -> Cost:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _client_parts(self, a: Dict[str, Any], g: int) -> Dict[str, Cost]:
        """Per client (g = 1) or per block (g > 1): init, one epoch's order, finish."""
        p = self.program
        over = (lambda f, axes: jax.vmap(f, in_axes=axes)) if g > 1 else (lambda f, _: f)
        w = jax.ShapeDtypeStruct((g,) if g > 1 else (), jnp.float32)

        def finish(server, carry, weight, out_sum):
            out, state, acc = over(p.finish, (None, 0, 0))(server, carry, weight)
            # The executors add each weighted output to the round's running sum.
            if not p.stacked:
                out = tree_map(lambda o: jnp.sum(o, 0) if g > 1 else o, out)
                out = tree_map(jnp.add, out_sum, out)
            return out, state, acc

        def out_sum():
            if p.stacked:
                return None
            out = jax.eval_shape(over(p.finish, (None, 0, 0)), a["server"], a["carry"], w)[0]
            return tree_map(lambda o: jax.ShapeDtypeStruct(o.shape[1:] if g > 1 else o.shape,
                                                           o.dtype), out)
        return {
            "init": self._cached(("init", g), lambda: program_cost(
                over(p.init, (None, 0, 0)), a["server"], a["client_state"], a["ctx"])),
            "order": self._cached(("order", g), lambda: program_cost(
                over(p.order, (0, None)), a["info"], jax.ShapeDtypeStruct((), jnp.int32))),
            "finish": self._cached(("finish", g), lambda: program_cost(
                finish, a["server"], a["carry"], w, out_sum())),
        }

    def _step(self, a: Dict[str, Any], rows: int, g: int) -> Cost:
        p = self.program
        t = jax.ShapeDtypeStruct((), jnp.int32)
        if g == 1:
            def step(arrays, server, carry, info, t, order):
                return p.step(arrays, server, carry, info, t, order, masked=False,
                              rows=None if rows == p.batch_size else rows)
        else:
            step = jax.vmap(lambda arrays, server, carry, info, t, order: p.step(
                arrays, server, carry, info, t, order, masked=True),
                in_axes=(None, None, 0, 0, None, 0))
        return self._cached(("step", rows, g), lambda: program_cost(
            step, a["arrays"], a["server"], a["carry"], a["info"], t, a["order"]))

    def _server(self, state: Any, cohort: Any) -> Cost:
        sim = self.sim
        m = len(cohort.ids)
        weights = jax.ShapeDtypeStruct((m,), jnp.float32)
        info = RoundInfo(jax.ShapeDtypeStruct((), jnp.int32),
                         jax.ShapeDtypeStruct((m,), jnp.int32), weights,
                         sim.data.num_clients)
        alg = sim.algorithm
        server = abstract(state.server)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        ctx = ClientContext(abstract(cohort.rngs[0]), i32, i32, i32, i32,
                            abstract(sim.data.label_counts[0]))
        one = jax.eval_shape(
            lambda s, cs, c: self.program.finish(s, self.program.init(s, cs, c),
                                                 jnp.float32(1.0))[0],
            server, _one(abstract(cohort.client_states)), ctx)
        outputs = _stack(one, m) if alg.aggregator.stacked else one
        # The round's own aggregate-and-update where the simulation has one, else the
        # streaming rule's public composition.
        update = getattr(sim, "_aggregate_and_update", None)
        if update is None:
            if alg.aggregator.stacked:
                return Cost()
            def update(server, outputs, weights, info):  # noqa: E306
                return alg.server_update(server, alg.aggregator.finalize(
                    outputs, jnp.sum(weights)), info)
        return self._cached(("server", m), lambda: program_cost(
            update, server, outputs, weights, info))

    def round(self, state: Any) -> Optional[Cost]:
        """The cost of the round `sim.round(state)` runs next (None: not modelled)."""
        if not self.supported:
            return None
        cohort = self.sim.cohort(state, state.round)
        if not len(cohort.ids):
            return Cost()
        return self.cohort_cost(state, cohort)

    def rows(self, cohort: Any) -> int:
        """Batch rows the cohort computes, padding included (the round's
        'computed_examples')."""
        return sum(rows * g * n for rows, g, n in self._plan(cohort))

    def _plan(self, cohort: Any) -> list:
        """(rows, clients per call, calls) of every step shape the cohort runs."""
        sizes = self.sim.data.sizes[np.asarray(cohort.ids)]
        steps = np.asarray(cohort.steps)
        b = self.program.batch_size
        if self.block == 1:
            counts: Dict[int, int] = {}
            for n, s in zip(sizes, steps):
                for r in step_rows(int(n), int(s), b):
                    counts[r] = counts.get(r, 0) + 1
            return [(r, 1, c) for r, c in sorted(counts.items())]
        longest = [int(np.max(steps[g[g >= 0]])) for g in self.sim.executor.blocks(steps)]
        return [(b, self.block, sum(longest))]

    def cohort_cost(self, state: Any, cohort: Any) -> Cost:
        g = self.block
        a = self._args(state, cohort, g)
        parts = self._client_parts(a, g)
        sizes = self.sim.data.sizes[np.asarray(cohort.ids)]
        steps = np.asarray(cohort.steps)
        per_epoch = -(-sizes // self.program.batch_size)
        epochs = int(np.sum(-(-steps // per_epoch)))
        calls = len(cohort.ids) if g == 1 else math.ceil(len(cohort.ids) / g)
        work = total(self._step(a, rows, g) * n for rows, _, n in self._plan(cohort))
        # Blocks draw their orders under a cond: count each client's epochs once.
        order = parts["order"] * (epochs if g == 1 else epochs / g)
        return (work + order + (parts["init"] + parts["finish"]) * calls
                + self._server(state, cohort))


def round_costs(sim: Any) -> Callable[[Any], Optional[Cost]]:
    """state -> XLA's cost of the round `sim.round(state)` runs next (None where the round
    is not modelled: drivers of their own, the sharded strategy, a program that does not
    lower on its own, which is said once on stderr)."""
    model = EngineCost(sim)

    def cost(state: Any) -> Optional[Cost]:
        try:
            return model.round(state)
        except (TypeError, ValueError, AttributeError, NotImplementedError) as e:
            print(f"[roofline] round not modelled: {type(e).__name__}: {e}"[:300],
                  file=sys.stderr)
            model.supported = False
            return None
    return cost


class LoopCost:
    """XLA's cost of a host loop's round: one jitted step per batch, its short last
    batches interpolated between two compiled shapes (rows 1 and B), plus the per-client
    programs (init, final) once each and the per-round ones (the server's) once."""

    def __init__(self, step_at: Callable[[int], Cost], batch_size: int,
                 per_client: Cost = Cost(), per_round: Cost = Cost()):
        self.batch_size, self.step_at = batch_size, step_at
        self.full = step_at(batch_size)
        self.one: Optional[Cost] = None  # compiled when a short batch first needs it
        self.per_client, self.per_round = per_client, per_round

    def step(self, rows: int) -> Cost:
        if rows == self.batch_size or self.batch_size == 1:
            return self.full
        if self.one is None:
            self.one = self.step_at(1)
        k = (rows - 1) / (self.batch_size - 1)
        return self.one * (1 - k) + self.full * k

    def round(self, sizes: Sequence[int], epochs: int) -> Cost:
        """Clients of `sizes` running `epochs` epochs of batches (the last one short)."""
        out = self.per_round
        for n in sizes:
            full, rest = divmod(int(n), self.batch_size)
            out = out + (self.full * full + (self.step(rest) if rest else Cost())) * epochs
            out = out + self.per_client
        return out
