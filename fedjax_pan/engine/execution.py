"""How the sampled clients' local work executes: the engine's choice, never the algorithm's.

Strategies (all give the same numbers up to float32 summation order):
  loop     a Python loop over clients of one jitted step (fast for convnets on CPU, where
           vmapped convs are ~5x and convs inside lax.scan ~30x slower);
  vmap     groups of G clients of similar step counts, vmapped, stepping inside lax.scan in
           power-of-two chunks of at most `chunk` steps (a group's longest client decides
           how many: no step is rounded up); clients that ran out of steps are frozen;
  sharded  the vmap path with the client axis sharded over jax.devices();
  auto     vmap on accelerators (sharded when there are several devices); on CPU, loop for
           models with convolutions and vmap for dense ones.
Every compiled program has fixed shapes for a given configuration, so nothing recompiles
after the first round.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_pan.algorithms.core import ClientContext, FederatedAlgorithm
from fedjax_pan.engine.clients import ClientData, LocalWork, make_batch

PyTree = Any
STRATEGIES = ("auto", "loop", "vmap", "sharded")
tree_map = jax.tree_util.tree_map


class Cohort(NamedTuple):
    """One round's sampled clients (host arrays, except the keys)."""

    ids: np.ndarray  # (M,) client ids
    steps: np.ndarray  # (M,) local steps
    weights: np.ndarray  # (M,) aggregation weights
    data_keys: jax.Array  # (M,) batch-order keys
    rngs: jax.Array  # (M,) keys handed to client_init (in its ClientContext)
    client_states: PyTree  # stacked (M, ...) or None


class CohortResult(NamedTuple):
    output_sum: PyTree  # sum_k w_k * output_k
    client_states: PyTree  # stacked (M, ...) in cohort order, or None
    metrics: Dict[str, jax.Array]  # sums over clients and steps
    computed_steps: int  # client-steps computed, padding included


def _zeros_metrics() -> Dict[str, jax.Array]:
    return {"loss_sum": jnp.zeros((), jnp.float32), "num_examples": jnp.zeros((), jnp.float32)}


class ClientProgram:
    """The per-client computations every strategy is assembled from (pure functions)."""

    def __init__(self, algorithm: FederatedAlgorithm, work: LocalWork):
        self.algorithm = algorithm
        self.batch_size = work.batch_size

    def init(self, server, client_state, ctx):
        return self.algorithm.client_init(server, client_state, ctx), _zeros_metrics()

    def step(self, arrays, carry, info, t, masked: bool = True):
        """One local step; if `masked`, a client past its step count keeps its state.

        The mask is a select over the whole state (a full extra memory pass), so callers
        that know every client is active pass masked=False.
        """
        local, acc = carry
        images, labels, table = arrays
        client, size, key, steps = info
        batch = make_batch(images, labels, table[client], size, key, t, self.batch_size)
        new_local, metrics = self.algorithm.client_step(local, batch)
        if not masked:
            return new_local, tree_map(jnp.add, acc, metrics)
        active = t < steps
        local = tree_map(lambda n, o: jnp.where(active, n, o), new_local, local)
        acc = tree_map(lambda a, m: a + jnp.where(active, m, 0.0), acc, metrics)
        return local, acc

    def finish(self, server, local, weight):
        output, client_state = self.algorithm.client_output(local, server)
        return tree_map(lambda o: o * weight.astype(o.dtype), output), client_state


def _add(a: PyTree, b: PyTree) -> PyTree:
    return tree_map(jnp.add, a, b)


def _sum0(tree: PyTree) -> PyTree:
    return tree_map(lambda x: jnp.sum(x, axis=0), tree)


def _take(tree: PyTree, i) -> PyTree:
    return None if tree is None else tree_map(lambda x: x[i], tree)


@dataclasses.dataclass
class LoopExecutor:
    """Clients one after another, one compiled call per local step."""

    program: ClientProgram
    data: ClientData

    def __post_init__(self):
        p = self.program
        self._init = jax.jit(p.init)
        # Clients run exactly their own steps here, so no step needs a mask.
        self._step = jax.jit(functools.partial(p.step, masked=False), donate_argnums=(1,))
        self._finish = jax.jit(p.finish)
        self._add = jax.jit(_add, donate_argnums=(0,))
        self._arrays = (self.data.images, self.data.labels, self.data.index_table)

    def run(self, server: PyTree, cohort: Cohort) -> CohortResult:
        out_sum, metrics, states = None, _zeros_metrics(), []
        for m, client in enumerate(cohort.ids):
            size, steps = jnp.int32(self.data.sizes[client]), jnp.int32(cohort.steps[m])
            ctx = ClientContext(cohort.rngs[m], steps, size)
            carry = self._init(server, _take(cohort.client_states, m), ctx)
            info = (jnp.int32(client), size, cohort.data_keys[m], steps)
            for t in range(int(cohort.steps[m])):
                carry = self._step(self._arrays, carry, info, jnp.int32(t))
            local, acc = carry
            out, state = self._finish(server, local, jnp.float32(cohort.weights[m]))
            out_sum = out if out_sum is None else self._add(out_sum, out)
            metrics = self._add(metrics, acc)
            states.append(state)
        stacked = None if states[0] is None else tree_map(lambda *s: jnp.stack(s), *states)
        return CohortResult(out_sum, stacked, metrics, int(np.sum(cohort.steps)))


@dataclasses.dataclass
class VmapExecutor:
    """Groups of `group_size` clients vmapped; `chunk` masked steps per compiled call.

    Clients are sorted by step count so a group's members finish together (bucketing);
    a short last group is filled with weight-0 clients that take no steps.
    """

    program: ClientProgram
    data: ClientData
    group_size: int
    chunk: int
    mesh: Optional[Mesh] = None

    def __post_init__(self):
        if self.group_size < 1 or self.chunk < 1:
            raise ValueError(f"group_size and chunk must be >= 1, got {self.group_size}, "
                             f"{self.chunk}")
        p = self.program
        if self.mesh is not None:
            ndev = self.mesh.devices.size
            if self.group_size % ndev:
                raise ValueError(f"group_size {self.group_size} must be a multiple of the "
                                 f"{ndev} devices for the sharded strategy")
            self._split = NamedSharding(self.mesh, PartitionSpec("clients"))
            self._repl = NamedSharding(self.mesh, PartitionSpec())
        arrays = (self.data.images, self.data.labels, self.data.index_table)
        self._arrays = self._replicate(arrays)

        over_clients = functools.partial(_over_clients, single=self.group_size == 1)
        # One client per group has no one to wait for: its steps need no mask.
        masked = self.group_size > 1

        def init(server, client_states, ctx):
            return self._constrain(over_clients(p.init, (None, 0, 0))(server, client_states,
                                                                       ctx))

        def run_chunk(length, arrays, carry, info, t0):
            single = self.group_size == 1
            step = functools.partial(p.step, masked=masked)
            if single:  # squeeze once per chunk, not once per step
                carry, info = _take(carry, 0), _take(info, 0)
            else:
                step = jax.vmap(step, in_axes=(None, 0, 0, None))

            def body(c, t):
                return step(arrays, c, info, t), None
            carry, _ = jax.lax.scan(body, carry, t0 + jnp.arange(length, dtype=jnp.int32))
            return self._constrain(tree_map(lambda x: x[None], carry) if single else carry)

        def finish_group(server, carry, weights, metrics):
            """The group's weighted output sum, updated metrics, and new client states."""
            local, acc = carry
            outs, states = over_clients(p.finish, (None, 0, 0))(server, local, weights)
            return _sum0(outs), _add(metrics, _sum0(acc)), states

        def finish(server, carry, weights, out_sum, metrics):
            group_sum, metrics, states = finish_group(server, carry, weights, metrics)
            return _add(out_sum, group_sum), metrics, states

        self._init = jax.jit(init)
        self._chunk = jax.jit(run_chunk, static_argnums=(0,), donate_argnums=(2,))
        # Powers of 4 up to `chunk`: few programs to compile, at most 3 calls of each
        # smaller size per group.
        self.chunk_sizes = sorted({4 ** i for i in range(int(math.log(self.chunk, 4)) + 1)}
                                  | {self.chunk}, reverse=True)
        self._compiled = None
        self._finish = jax.jit(finish, donate_argnums=(3,))
        self._first_finish = jax.jit(finish_group)

    def _constrain(self, carry):
        # Pins the client axis' sharding so chunk outputs feed the next (precompiled) chunk.
        if self.mesh is None:
            return carry
        return tree_map(lambda x: jax.lax.with_sharding_constraint(x, self._split), carry)

    def _replicate(self, tree):
        return tree if self.mesh is None else jax.device_put(tree, self._repl)

    def _split_put(self, tree):
        return tree if self.mesh is None else jax.device_put(tree, self._split)

    def groups(self, steps: np.ndarray) -> list:
        """Cohort slots per group (padded with -1), longest-running clients first."""
        order = np.argsort(-np.asarray(steps), kind="stable")
        n_groups = math.ceil(len(order) / self.group_size)
        padded = np.full(n_groups * self.group_size, -1)
        padded[:len(order)] = order
        return list(padded.reshape(n_groups, self.group_size))

    def chunks(self, num_steps: int) -> list:
        """(start, length) pieces covering num_steps, largest power-of-two pieces first."""
        pieces, t = [], 0
        for size in self.chunk_sizes:
            while num_steps - t >= size:
                pieces.append((t, size))
                t += size
        return pieces

    def computed_steps(self, steps: np.ndarray) -> int:
        longest = [int(np.max(np.asarray(steps)[g[g >= 0]])) for g in self.groups(steps)]
        return sum(longest) * self.group_size

    def _compile_chunks(self, carry, info) -> dict:
        # Every chunk length is compiled up front, so no later round ever compiles.
        return {n: self._chunk.lower(n, self._arrays, carry, info, jnp.int32(0)).compile()
                for n in self.chunk_sizes}

    def run(self, server: PyTree, cohort: Cohort) -> CohortResult:
        server = self._replicate(server)
        out_sum, metrics = None, self._replicate(_zeros_metrics())
        slot_states = [None] * len(cohort.ids)
        for g in self.groups(cohort.steps):
            real = g >= 0
            slots = np.where(real, g, g[0])
            steps = np.where(real, cohort.steps[slots], 0)
            weights = np.where(real, cohort.weights[slots], 0.0)
            ids = cohort.ids[slots]
            sizes = jnp.asarray(self.data.sizes[ids], jnp.int32)
            steps_j = jnp.asarray(steps, jnp.int32)
            info = self._split_put((jnp.asarray(ids, jnp.int32), sizes, cohort.data_keys[slots],
                                    steps_j))
            states = self._split_put(_take(cohort.client_states, slots))
            ctx = self._split_put(ClientContext(cohort.rngs[slots], steps_j, sizes))
            carry = self._init(server, states, ctx)
            if self._compiled is None:
                self._compiled = self._compile_chunks(carry, info)
            for start, length in self.chunks(int(steps.max())):
                carry = self._compiled[length](self._arrays, carry, info, jnp.int32(start))
            w = self._split_put(jnp.asarray(weights, jnp.float32))
            if out_sum is None:
                out_sum, metrics, new_states = self._first_finish(server, carry, w, metrics)
            else:
                out_sum, metrics, new_states = self._finish(server, carry, w, out_sum, metrics)
            if new_states is not None:
                for j, slot in enumerate(g):
                    if slot >= 0:
                        slot_states[slot] = _take(new_states, j)
        stacked = None
        if slot_states[0] is not None:
            stacked = tree_map(lambda *s: jnp.stack(s), *slot_states)
        return CohortResult(out_sum, stacked, metrics, self.computed_steps(cohort.steps))


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
    if strategy != "auto":
        return strategy
    if jax.default_backend() == "cpu":
        return "loop" if has_convolutions(variables) else "vmap"
    return "sharded" if jax.device_count() > 1 else "vmap"


def make_executor(strategy: str, algorithm: FederatedAlgorithm, work: LocalWork,
                  data: ClientData, variables: PyTree, clients_per_round: int,
                  group_size: Optional[int] = None, chunk: Optional[int] = None):
    """An executor for `strategy` ('auto' resolved against backend and model)."""
    program = ClientProgram(algorithm, work)
    concrete = resolve_strategy(strategy, variables)
    if concrete == "loop":
        return LoopExecutor(program, data)
    mesh = None
    if concrete == "sharded":
        devices = np.asarray(jax.devices())
        mesh = Mesh(devices, ("clients",))
        group_size = group_size or clients_per_round
        group_size = math.ceil(group_size / len(devices)) * len(devices)
    group_size = group_size or default_group_size(clients_per_round)
    return VmapExecutor(program, data, group_size, chunk or 16, mesh)


def default_group_size(clients_per_round: int) -> int:
    """On CPU vmapping more clients gains nothing, so small groups keep padding low."""
    if jax.default_backend() == "cpu":
        return 1
    return clients_per_round

