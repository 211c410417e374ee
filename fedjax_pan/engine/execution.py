"""How the sampled clients' local work executes: the engine's choice, never the algorithm's.

Strategies (all give the same numbers up to float32 summation order):
  loop     a Python loop over clients of one jitted step (fast for convnets on CPU, where
           vmapped convs are ~5x and convs inside compiled loops ~30x slower);
  vmap     blocks of G clients of similar step counts, vmapped, each block's whole local
           training (init, steps, output) in one compiled call whose step loop runs the
           block's longest client; clients that ran out of steps are frozen by a mask;
           a block of one client is not vmapped (what `auto` picks on CPU for dense models)
           and computes its last partial batches on fewer rows (`clients.tail_rows`); on
           CPU two such lone clients run side by side, each from a host thread
           (`default_workers`; the FedJAX workload of `benchmarks/throughput.py`: 9,646
           examples/s against 8,996 one at a time, 2 cores), their sums added in cohort
           order;
  sharded  the vmap path with the client axis sharded over jax.devices(): over every
           process's devices in a multi-process run (`fedjax_pan.engine.distributed`), each
           block's sums, new client states and stacked outputs gathered to every process;
  auto     vmap on accelerators (sharded when there are several devices); sharded in a
           multi-process run, which the other strategies refuse; on CPU, loop for
           models with convolutions and vmap for dense ones. Grouped (Fed2) models follow
           the same rule (measured, 2 cores, `benchmarks.run --only grouped_conv`: a
           grouped VGG9 round takes 0.16 s with loop, 2.1 s with vmap; a grouped MLP
           round 0.51-0.61 s with vmap, 0.58-0.66 s with loop over two runs, a tie).
Step counts are loop bounds, not shapes, and every tail shape the data holds is compiled
in the first round, so nothing recompiles after it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
from typing import Any, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_pan.engine.protocol import ClientContext, FederatedAlgorithm, tree_bytes
from fedjax_pan.engine.clients import (ClientData, LocalWork, augment_batch, augment_key,
                                       batch_order, computed_alone, make_batch, step_batch,
                                       step_rows, tail_rows)
from fedjax_pan.workdir import raise_pending_signal

PyTree = Any
STRATEGIES = ("auto", "loop", "vmap", "sharded")
tree_map = jax.tree_util.tree_map
# The metric sums that carry the clients' upload bytes (`pop_upload_bytes` joins them).
UPLOAD_MIB, UPLOAD_REST = "upload_bytes_mib", "upload_bytes_rest"


def pop_upload_bytes(sums: Dict[str, Any]) -> float:
    """The bytes a cohort sent, taken out of its executor's metric sums (exact)."""
    return float(int(sums.pop(UPLOAD_MIB)) * (1 << 20) + int(sums.pop(UPLOAD_REST)))


class Cohort(NamedTuple):
    """One round's sampled clients (host arrays, except the keys)."""

    ids: np.ndarray  # (M,) client ids
    steps: np.ndarray  # (M,) local steps
    weights: np.ndarray  # (M,) aggregation weights
    data_keys: jax.Array  # (M,) batch-order keys
    rngs: jax.Array  # (M,) keys handed to client_init (in its ClientContext)
    client_states: PyTree  # stacked (M, ...) or None
    round: int = 0  # the round's index


class CohortResult(NamedTuple):
    output_sum: PyTree  # sum_k w_k * output_k (streaming aggregators), else None
    client_states: PyTree  # stacked (M, ...) in cohort order, or None
    metrics: Dict[str, jax.Array]  # sums over clients and steps
    computed_examples: int  # batch rows computed, padding included
    outputs: PyTree = None  # stacked (M, ...) in cohort order (stacked aggregators)


class ClientProgram:
    """The per-client computations every strategy is assembled from (pure functions).

    With a stacked aggregator `finish` returns each client's own output (the executors
    stack them); otherwise its weighted output (the executors sum them).
    """

    def __init__(self, algorithm: FederatedAlgorithm, work: LocalWork, data: ClientData):
        self.algorithm = algorithm
        # No batch needs more rows than the largest client holds: with B above every
        # client's size a batch is the whole client either way (same steps, same batches),
        # and padding to B would compute B rows for it (B = 100,000 on 200 examples).
        self.batch_size = min(work.batch_size, data.max_size)
        self.augment = work.augment
        self.stacked = algorithm.aggregator.stacked
        self.width = data.max_size
        self._batch = jax.eval_shape(lambda: step_batch(
            data.images, data.labels, data.index_table[0], jnp.int32(1),
            jax.random.PRNGKey(0), jnp.int32(0), self.batch_size))
        self._metric_shapes = None

    def metric_zeros(self, server, client_state, ctx) -> Dict[str, jax.Array]:
        """Zeros shaped like one step's metrics (the start of their sums)."""
        if self._metric_shapes is None:
            def one_step(server, client_state, ctx, batch):
                local = self.algorithm.client_init(server, client_state, ctx)
                return self.algorithm.client_step(local, batch, server)[1]
            self._metric_shapes = jax.eval_shape(one_step, server, client_state, ctx,
                                                 self._batch)
        return tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self._metric_shapes)

    def init(self, server, client_state, ctx):
        local = self.algorithm.client_init(server, client_state, ctx)
        return local, self.metric_zeros(server, client_state, ctx)

    def order(self, info, epoch):
        """The client's batch order for `epoch` (`clients.batch_order`): drawn once per
        epoch and handed to each of the epoch's steps."""
        _, size, key, _ = info
        return batch_order(key, epoch, size, self.width, self.batch_size)

    def step(self, arrays, server, carry, info, t, order, masked: bool = True,
             rows: Optional[int] = None):
        """One local step on `rows` batch rows, `order` being step `t`'s epoch order;
        if `masked`, a client past its step count keeps its state.

        The mask is a select over the whole state (a full extra memory pass), so callers
        that know every client is active pass masked=False.
        """
        local, acc = carry
        images, labels, table = arrays
        client, size, key, steps = info
        per_epoch = (size + self.batch_size - 1) // self.batch_size
        batch = make_batch(images, labels, table[client], size, order, t % per_epoch,
                           self.batch_size, rows)
        if self.augment is not None:
            batch = {**batch, "x": augment_batch(batch["x"], augment_key(key, t), self.augment)}
        new_local, metrics = self.algorithm.client_step(local, batch, server)
        if not masked:
            return new_local, tree_map(jnp.add, acc, metrics)
        active = t < steps
        local = tree_map(lambda n, o: jnp.where(active, n, o), new_local, local)
        acc = tree_map(lambda a, m: a + jnp.where(active, m, 0.0), acc, metrics)
        return local, acc

    def train_alone(self, arrays, server, carry, info, tails: tuple, tail_index):
        """All of one client's steps, unmasked. Its last partial batch of an epoch runs on
        `tails[tail_index - 1]` rows; tail_index 0: it has none, or runs it on B rows.

        Every tail shape is a branch of one `lax.switch`, so one program serves all
        clients and the step count is a loop bound, not a shape.
        """
        _, size, _, steps = info
        per_epoch = (size + self.batch_size - 1) // self.batch_size
        full = per_epoch - (tail_index > 0)

        def step(order, rows=None):
            return lambda t, c: self.step(arrays, server, c, info, t, order, masked=False,
                                          rows=rows)

        def epoch(e, c):
            t0 = e * per_epoch
            order = self.order(info, e)
            one = step(order)
            n = jnp.minimum(t0 + full, steps) - t0  # full batches this epoch
            # Two steps per iteration: the first writes fresh buffers, the second the loop's
            # own, whose old values are dead by then, so XLA updates the weights in place
            # instead of copying them every step (one step per iteration keeps the old
            # weights alive for the backward pass while the new ones are written).
            c = jax.lax.cond(n % 2 == 1, lambda c: one(t0, c), lambda c: c, c)
            start = t0 + n % 2
            c = jax.lax.fori_loop(0, n // 2, lambda i, c: one(start + 2 * i + 1,
                                                              one(start + 2 * i, c)), c)
            # A partial last epoch (fractional E, 'steps' mode) may stop before its tail.
            which = jnp.where(t0 + full < steps, tail_index, 0)
            branches = [lambda t, c: c] + [step(order, r) for r in tails]
            return jax.lax.switch(which, branches, t0 + full, c)
        return jax.lax.fori_loop(0, (steps + per_epoch - 1) // per_epoch, epoch, carry)

    def finish(self, server, carry, weight):
        """(weighted output, or the output itself for a stacked aggregator; the new client
        state; the client's metric sums with its 'upload_bytes')."""
        local, acc = carry
        output, client_state = self.algorithm.client_output(local, server)
        upload = jnp.where(weight > 0, self.upload_bytes(output, local), 0)
        # Filler slots of a vmap block weigh 0 and send nothing. The count is summed as
        # whole MiB and the rest in int32: exact for up to 2,047 clients a call (float32
        # sums of ~1e8 bytes are not).
        acc = {**acc, UPLOAD_MIB: upload >> 20, UPLOAD_REST: upload & ((1 << 20) - 1)}
        if not self.stacked:
            output = tree_map(lambda o: o * weight.astype(o.dtype), output)
        return output, client_state, acc

    def upload_bytes(self, output, local) -> jax.Array:
        """Bytes the client sends (int32): the algorithm's count, else its whole output's."""
        if self.algorithm.upload_bytes is not None:
            count = jnp.asarray(self.algorithm.upload_bytes(output, local))
            return jnp.round(count).astype(jnp.int32)
        return jnp.int32(tree_bytes(output))

    def total_zeros(self, server, client_state, ctx) -> Dict[str, jax.Array]:
        """Zeros shaped like a client's metric sums as `finish` returns them."""
        return {**self.metric_zeros(server, client_state, ctx),
                UPLOAD_MIB: jnp.zeros((), jnp.int32), UPLOAD_REST: jnp.zeros((), jnp.int32)}

    def output_zeros(self, server, client_state, ctx):
        """A compiled function returning zeros shaped like one client's weighted output
        (the start of an output sum)."""
        shapes = jax.eval_shape(
            lambda: self.finish(server, self.init(server, client_state, ctx),
                                jnp.float32(1.0))[0])
        return jax.jit(lambda: tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def _add(a: PyTree, b: PyTree) -> PyTree:
    return tree_map(jnp.add, a, b)


def _sum0(tree: PyTree) -> PyTree:
    return tree_map(lambda x: jnp.sum(x, axis=0), tree)


def _take(tree: PyTree, i) -> PyTree:
    return None if tree is None else tree_map(lambda x: x[i], tree)


def _client_args(data: ClientData, cohort: Cohort, m):
    """(client_state, ctx, info) of cohort slot(s) m (an int or an index array)."""
    ids = np.asarray(cohort.ids)[m]
    sizes = jnp.asarray(data.sizes[ids], jnp.int32)
    steps = jnp.asarray(np.asarray(cohort.steps)[m], jnp.int32)
    ctx = ClientContext(cohort.rngs[m], steps, sizes, jnp.asarray(ids, jnp.int32),
                        jnp.full(np.shape(ids), cohort.round, jnp.int32),
                        data.label_counts[ids])
    info = (jnp.asarray(ids, jnp.int32), sizes, cohort.data_keys[m], steps)
    return _take(cohort.client_states, m), ctx, info


def _stack(states: list) -> PyTree:
    return None if states[0] is None else tree_map(lambda *s: jnp.stack(s), *states)


@dataclasses.dataclass
class LoopExecutor:
    """Clients one after another, one compiled call per local step.

    `donate` lets each step update the working state in place. On CPU that saves a few
    percent for dense models but costs ~12% per step for small convnets (measured:
    47 -> 53 ms for VGG9 at width 1/4, B=64), so `make_executor` donates for dense models
    only.
    """

    program: ClientProgram
    data: ClientData
    donate: bool = True

    def __post_init__(self):
        p = self.program
        self._init = jax.jit(p.init)
        self._reset = jax.jit(lambda carry, *args: p.init(*args), donate_argnums=(0,))
        self._order = jax.jit(p.order)
        # Clients run exactly their own steps here, so no step needs a mask.
        self._step = jax.jit(lambda arrays, server, carry, info, t, order, rows: p.step(
            arrays, server, carry, info, t, order, masked=False, rows=rows),
            static_argnums=(6,), donate_argnums=(2,) if self.donate else ())
        self._end = jax.jit(self._accumulate, donate_argnums=(3, 4))
        self._arrays = (self.data.images, self.data.labels, self.data.index_table)
        self._compiled: Optional[dict] = None
        self._zeros = None

    def _accumulate(self, server, carry, weight, out_sum, metrics):
        """Adds the client's weighted output to `out_sum` (or, for a stacked aggregator,
        returns it: `out_sum` is then None)."""
        out, state, acc = self.program.finish(server, carry, weight)
        out = out if out_sum is None else _add(out_sum, out)
        return out, _add(metrics, acc), state

    def computed_examples(self, sizes: np.ndarray, steps: np.ndarray) -> int:
        """Batch rows computed for clients of `sizes` taking `steps`, padding included."""
        return computed_alone(sizes, steps, self.program.batch_size)

    def _compile(self, server, carry, info) -> dict:
        # Every step shape the data holds, compiled before any client runs: no later round
        # (whose cohort may hold new tail sizes) compiles.
        b = self.program.batch_size
        shapes = {b} | {int(r) for r in tail_rows(self.data.sizes, b) if r}
        order = jax.eval_shape(self.program.order, info, jnp.int32(0))
        return {r: self._step.lower(self._arrays, server, carry, info, jnp.int32(0), order,
                                    r).compile() for r in sorted(shapes)}

    def run(self, server: PyTree, cohort: Cohort) -> CohortResult:
        p = self.program
        metrics, states, outputs, carry, out_sum = None, [], [], None, None
        for m, client in enumerate(cohort.ids):
            raise_pending_signal()  # a SIGINT/SIGTERM: the round is dropped, its state kept
            client_state, ctx, info = _client_args(self.data, cohort, m)
            if carry is None:
                carry = self._init(server, client_state, ctx)
                metrics = p.total_zeros(server, client_state, ctx)
                if not p.stacked:
                    if self._zeros is None:
                        self._zeros = p.output_zeros(server, client_state, ctx)
                    out_sum = self._zeros()
            else:
                carry = self._reset(carry, server, client_state, ctx)
            if self._compiled is None:
                self._compiled = self._compile(server, carry, info)
            size = int(self.data.sizes[client])
            per_epoch = -(-size // p.batch_size)
            for t, r in enumerate(step_rows(size, int(cohort.steps[m]), p.batch_size)):
                if t % per_epoch == 0:
                    order = self._order(info, jnp.int32(t // per_epoch))
                carry = self._compiled[r](self._arrays, server, carry, info, jnp.int32(t),
                                          order)
            result, metrics, state = self._end(server, carry, jnp.float32(cohort.weights[m]),
                                               out_sum, metrics)
            if p.stacked:
                outputs.append(result)
            else:
                out_sum = result
            states.append(state)
        return CohortResult(out_sum, _stack(states), metrics,
                            self.computed_examples(self.data.sizes[cohort.ids], cohort.steps),
                            _stack(outputs) if p.stacked else None)


@dataclasses.dataclass
class VmapExecutor:
    """Blocks of `block_size` clients, vmapped, one compiled call per block.

    Clients are sorted by step count so a block's members finish together (bucketing);
    a short last block is filled with weight-0 clients that take no steps.
    """

    program: ClientProgram
    data: ClientData
    block_size: int
    mesh: Optional[Mesh] = None
    # Blocks of one client in flight at once, each from its own host thread (its sums
    # added in cohort order afterwards, so the numbers do not depend on it).
    workers: int = 1

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        p = self.program
        self.single = self.block_size == 1
        if self.mesh is not None:
            ndev = self.mesh.devices.size
            if self.block_size % ndev:
                raise ValueError(f"block_size {self.block_size} must be a multiple of the "
                                 f"{ndev} devices for the sharded strategy")
            self._split = NamedSharding(self.mesh, PartitionSpec("clients"))
            self._repl = NamedSharding(self.mesh, PartitionSpec())
        # Several processes: a block's results are gathered to all of them (the rest of
        # the engine works on process-local arrays, the same in every process).
        self._gathered = self.mesh is not None and self.mesh.is_multi_process
        arrays = (self.data.images, self.data.labels, self.data.index_table)
        self._arrays = self._replicate(arrays)
        over_clients = functools.partial(_over_clients, single=self.single)
        # Lockstep blocks: clients past their step count are masked (a lone client runs
        # `train_alone`, unmasked).
        step = jax.vmap(functools.partial(p.step, masked=True),
                        in_axes=(None, None, 0, 0, None, 0))
        orders_of = jax.vmap(p.order)

        def lockstep(arrays, server, info, t, c):
            """One step of every client in the block; a client starting an epoch draws
            its order first (outside the vmap, so steps without one skip the sort)."""
            carry, orders = c
            per_epoch = (info[1] + p.batch_size - 1) // p.batch_size
            starts = t % per_epoch == 0
            orders = jax.lax.cond(
                jnp.any(starts),
                lambda o: jnp.where(starts[:, None], orders_of(info, t // per_epoch), o),
                lambda o: o, orders)
            return step(arrays, server, carry, info, t, orders), orders

        def run_block(arrays, server, client_states, ctx, info, num_steps, tail_index,
                      weights, out_sum, metrics):
            """The block's local training; adds its weighted outputs to `out_sum` (or,
            for a stacked aggregator, returns them: `out_sum` is then None)."""
            carry = self._constrain(over_clients(p.init, (None, 0, 0))(server, client_states,
                                                                       ctx))
            if self.single:  # squeezed, not vmapped: a size-1 vmap slows dense layers
                local = p.train_alone(arrays, server, _take(carry, 0), _take(info, 0),
                                      self.tails, tail_index)
                carry = tree_map(lambda x: x[None], local)
            else:
                orders = jnp.zeros((self.block_size, p.width + p.batch_size), jnp.int32)
                carry, _ = jax.lax.fori_loop(
                    0, num_steps, lambda t, c: lockstep(arrays, server, info, t, c),
                    (carry, orders))
            outs, states, acc = over_clients(p.finish, (None, 0, 0))(
                server, self._constrain(carry), weights)
            outs = outs if out_sum is None else _add(out_sum, _sum0(outs))
            return self._gather((outs, _add(metrics, _sum0(acc)), states))

        # Lone clients run their tails on fewer rows: every tail shape the data holds.
        rows = tail_rows(self.data.sizes, p.batch_size) if self.single else []
        self.tails = tuple(sorted({int(r) for r in rows if r}))
        self._tail_slot = {r: i + 1 for i, r in enumerate(self.tails)}
        self._run_block = jax.jit(run_block, donate_argnums=(8, 9))
        self._zeros = None
        self._add = jax.jit(_add, donate_argnums=(0,))
        self.concurrent = self.workers > 1 and self.single
        self._compiled = False

    def _constrain(self, carry):
        # Pins the client axis' sharding inside the block program.
        if self.mesh is None:
            return carry
        return tree_map(lambda x: jax.lax.with_sharding_constraint(x, self._split), carry)

    def _gather(self, tree):
        # Replicated over all processes' devices (an all-gather of the client axis).
        if not self._gathered:
            return tree
        return tree_map(lambda x: jax.lax.with_sharding_constraint(x, self._repl), tree)

    def _local(self, tree):
        """A block's results on this process's first device: slicing them there needs no
        collective (several multi-device programs in flight at once can leave XLA:CPU's
        collectives waiting on a device that never runs its part)."""
        if self.mesh is None or tree is None:
            return tree
        if self._gathered:  # replicated over all processes: this process's copy
            return tree_map(lambda x: x.addressable_data(0), tree)
        return jax.device_put(tree, jax.local_devices()[0])

    def _put(self, tree, sharding):
        if self._gathered:
            # Arrays of this process go to the global mesh from the host (there is no
            # device-to-device transfer across processes); each process holds the same.
            tree = tree_map(lambda x: x if isinstance(x, jax.Array) and x.sharding == sharding
                            else np.asarray(x), tree)
        return jax.device_put(tree, sharding)

    def _replicate(self, tree):
        return tree if self.mesh is None else self._put(tree, self._repl)

    def _split_put(self, tree):
        return tree if self.mesh is None else self._put(tree, self._split)

    def blocks(self, steps: np.ndarray) -> list:
        """Cohort slots per block (padded with -1), longest-running clients first."""
        order = np.argsort(-np.asarray(steps), kind="stable")
        n_blocks = math.ceil(len(order) / self.block_size)
        padded = np.full(n_blocks * self.block_size, -1)
        padded[:len(order)] = order
        return list(padded.reshape(n_blocks, self.block_size))

    def computed_examples(self, sizes: np.ndarray, steps: np.ndarray) -> int:
        """Batch rows computed for clients of `sizes` taking `steps`, padding included."""
        if self.single:
            return computed_alone(sizes, steps, self.program.batch_size)
        longest = [int(np.max(np.asarray(steps)[g[g >= 0]])) for g in self.blocks(steps)]
        return sum(longest) * self.block_size * self.program.batch_size

    def _tail_index(self, size: int) -> int:
        """Which `lax.switch` branch runs this client's tail (0: none)."""
        if not self.single:
            return 0
        rows = int(tail_rows(np.asarray([size]), self.program.batch_size)[0])
        return self._tail_slot.get(rows, 0)

    def _block_args(self, server: PyTree, cohort: Cohort, g: np.ndarray) -> tuple:
        real = g >= 0
        slots = np.where(real, g, g[0])
        client_states, ctx, info = _client_args(self.data, cohort, slots)
        # Filler slots take no steps and weigh nothing.
        steps = jnp.asarray(np.where(real, cohort.steps[slots], 0), jnp.int32)
        ctx, info = ctx._replace(num_steps=steps), info[:3] + (steps,)
        weights = jnp.asarray(np.where(real, cohort.weights[slots], 0.0), jnp.float32)
        return (self._arrays, server, self._split_put(client_states),
                self._split_put(ctx), self._split_put(info),
                jnp.int32(np.max(cohort.steps[slots[real]])),
                jnp.int32(self._tail_index(self.data.sizes[cohort.ids[g[0]]])),
                self._split_put(weights))

    def run(self, server: PyTree, cohort: Cohort) -> CohortResult:
        p = self.program
        server = self._replicate(server)
        metrics, out_sum = None, None
        slot_states = [None] * len(cohort.ids)
        slot_outputs = [None] * len(cohort.ids)
        one_state, one_ctx, _ = _client_args(self.data, cohort, 0)
        if not p.stacked and self._zeros is None:
            self._zeros = p.output_zeros(server, one_state, one_ctx)

        def zeros():
            return (None if p.stacked else self._replicate(self._zeros()),
                    self._replicate(p.total_zeros(server, one_state, one_ctx)))
        blocks = self.blocks(cohort.steps)
        calls = (self._block_args(server, cohort, g) for g in blocks)
        pool = done = None
        if self.concurrent and len(blocks) > 1:
            # Each block from zero sums, `workers` at a time, its sums added below in block
            # order. The executor's first block runs alone: threads calling a program not
            # compiled yet would each compile it.
            pool = concurrent.futures.ThreadPoolExecutor(self.workers)

            def one(args):
                return jax.block_until_ready(self._run_block(*args, *zeros()))
            first = [] if self._compiled else [one(next(calls))]
            self._compiled = True
            done = itertools.chain(first, _in_order(pool, one, calls, 2 * self.workers))
        else:
            # One block after another, each adding to the running sums it is given.
            out_sum, metrics = zeros()
        try:
            for g in blocks:
                raise_pending_signal()  # a SIGINT/SIGTERM: the round is dropped, its state kept
                if done is None:
                    result, metrics, new_states = self._run_block(*next(calls), out_sum,
                                                                  metrics)
                    if self.mesh is not None and jax.default_backend() == "cpu":
                        # One multi-device program at a time on CPU (see `_local`).
                        jax.block_until_ready((result, metrics, new_states))
                    out_sum = None if p.stacked else result
                else:
                    result, acc, new_states = next(done)
                    metrics = acc if metrics is None else self._add(metrics, acc)
                    if not p.stacked:
                        out_sum = result if out_sum is None else self._add(out_sum, result)
                if p.stacked:
                    result = self._local(result)
                    for j, slot in enumerate(g):
                        if slot >= 0:
                            slot_outputs[slot] = _take(result, j)
                if new_states is not None:
                    new_states = self._local(new_states)
                    for j, slot in enumerate(g):
                        if slot >= 0:
                            slot_states[slot] = _take(new_states, j)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
        return CohortResult(self._local(out_sum), _stack(slot_states), self._local(metrics),
                            self.computed_examples(self.data.sizes[cohort.ids], cohort.steps),
                            _stack(slot_outputs) if p.stacked else None)


def _in_order(pool: concurrent.futures.Executor, fn, items, window: int):
    """fn(item) for each item, computed by `pool`, yielded in order; at most `window` in
    flight or done and not yet taken (`Executor.map` submits them all at once, and a
    cohort of 1,000 clients would then hold up to 1,000 model-sized outputs)."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _over_clients(fn, in_axes, single: bool):
    """vmap over the leading client axis; with a single client, squeeze it instead
    (a size-1 vmap lowers dense layers to batched matmuls that run 2-3x slower on CPU)."""
    if not single:
        return jax.vmap(fn, in_axes=in_axes)

    def squeezed(*args):
        args = [a if ax is None else _take(a, 0) for a, ax in zip(args, in_axes)]
        return tree_map(lambda x: x[None], fn(*args))
    return squeezed


def has_convolutions(variables: PyTree) -> bool:
    """True when some parameter is a 4-D conv kernel."""
    return any(np.ndim(x) == 4 for x in jax.tree_util.tree_leaves(variables))


def resolve_strategy(strategy: str, variables: PyTree) -> str:
    """The concrete strategy `auto` stands for on this backend and model."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown execution strategy {strategy!r}; expected one of {STRATEGIES}")
    if jax.process_count() > 1:
        if strategy not in ("auto", "sharded"):
            raise ValueError(f"strategy {strategy!r} runs every client in every one of the "
                             f"{jax.process_count()} processes; use 'sharded' or 'auto'")
        return "sharded"
    if strategy != "auto":
        return strategy
    if jax.default_backend() == "cpu":
        return "loop" if has_convolutions(variables) else "vmap"
    return "sharded" if jax.device_count() > 1 else "vmap"


def make_executor(strategy: str, algorithm: FederatedAlgorithm, work: LocalWork,
                  data: ClientData, variables: PyTree, clients_per_round: int,
                  block_size: Optional[int] = None, workers: Optional[int] = None):
    """An executor for `strategy` ('auto' resolved against backend and model); `workers`
    lone clients in flight at once (None: `default_workers`)."""
    program = ClientProgram(algorithm, work, data)
    concrete = resolve_strategy(strategy, variables)
    if concrete == "loop":
        return LoopExecutor(program, data, donate=not has_convolutions(variables))
    mesh = None
    if concrete == "sharded":
        devices = np.asarray(jax.devices())
        mesh = Mesh(devices, ("clients",))
        block_size = block_size or clients_per_round
        block_size = math.ceil(block_size / len(devices)) * len(devices)
    block_size = block_size or default_block_size(clients_per_round)
    workers = default_workers(block_size) if workers is None else workers
    return VmapExecutor(program, data, block_size, mesh, workers if block_size == 1 else 1)


def default_workers(block_size: int) -> int:
    """On CPU, two lone clients at a time: each one's small matmuls split over the cores
    synchronise every op, two clients side by side keep both cores busy. The environment
    variable FEDJAX_PAN_WORKERS overrides it (the test suite, dominated by compilation and
    run by two processes at once, sets 1: side by side cost it about 30%)."""
    given = os.environ.get("FEDJAX_PAN_WORKERS")
    if given:
        try:
            workers = int(given)
        except ValueError:
            workers = 0
        if workers < 1:
            raise ValueError(f"FEDJAX_PAN_WORKERS must be a positive integer, got {given!r}")
        return workers
    if jax.default_backend() == "cpu" and block_size == 1 and (os.cpu_count() or 1) >= 2:
        return 2
    return 1


def default_block_size(clients_per_round: int) -> int:
    """On CPU vmapping more clients gains nothing, so small blocks keep padding low."""
    if jax.default_backend() == "cpu":
        return 1
    return clients_per_round

