"""Simulated time: clients that answer late, and what the server does about them.

A round starts at simulated time T and its clients are those sampled (as without
stragglers) that are not still busy with an earlier round's work. Each draws a delay of d
rounds: uniform over {0, ..., max_delay} (the SageFlow authors' model, max 2), or `slow`:
a fixed share of the clients, drawn once per seed, always takes max_delay and the rest 0.
With `forced` (d_0, d_1, ...), the first free clients of each round in a random order from
(seed, round) take those delays instead: the SageFlow authors' `Sageflow.py` gives the
first three free clients of its (randomly ordered) cohort delays 0, 1, 2 so that every
staleness group has a member (`forced=(0, 1, 2)`); the default () forces none.
A client trains on the model it received at T and its output reaches the server at
T + 1 + d; it is busy (not selectable) until then. The server's policy:

  wait_all    waits for every output: the round lasts 1 + max d, and every output is
              used fresh (the numbers of the synchronous engine, at a longer time);
  wait_share  waits for the first `wait_share` of the round's outputs (the authors'
              "waiting 50%"): the round lasts 1 + that share's largest delay, later
              outputs are dropped;
  ignore      a round lasts 1; only delay-0 outputs are used, later ones dropped;
  stale       a round lasts 1; a late output is kept in flight and used in round t + d
              with staleness d (how it is weighed is the aggregation rule's: the mean
              ignores it, FedAsync and SageFlow discount it).

A round whose outputs all arrive in it, with no client busy and nothing stale arriving,
runs exactly as the synchronous engine's: with every delay 0, results equal it bit for
bit, and only the `sim_*` fields are added to the metrics.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
POLICIES = ("wait_all", "wait_share", "ignore", "stale")
DELAYS = ("uniform", "slow")
_DELAY_STREAM, _SLOW_STREAM, _FORCED_STREAM = 0x5D, 0x51, 0x5F
# The share of the available memory the outputs in flight may fill: a round copies them
# once more as it stores its late outputs, and a checkpoint once more as it writes them.
MEMORY_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """The delay model and the server's policy (module docstring)."""

    max_delay: int
    policy: str = "stale"
    delays: str = "uniform"
    slow_share: float = 0.0
    wait_share: float = 0.5
    forced: Tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "forced", tuple(int(d) for d in self.forced))
        if forced_error(self.forced) or any(d > self.max_delay for d in self.forced):
            raise ValueError(f"straggler.forced must be delays in [0, max_delay = "
                             f"{self.max_delay}], got {self.forced}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown straggler policy {self.policy!r}; expected one of "
                             f"{POLICIES}")
        if self.delays not in DELAYS:
            raise ValueError(f"unknown delay model {self.delays!r}; expected one of {DELAYS}")
        if self.max_delay < 0 or not 0 <= self.slow_share <= 1 or not 0 < self.wait_share <= 1:
            raise ValueError(f"stragglers need max_delay >= 0, slow_share in [0, 1] and "
                             f"wait_share in (0, 1], got {self.max_delay}, "
                             f"{self.slow_share}, {self.wait_share}")

    def slow_clients(self, seed: int, num_clients: int) -> np.ndarray:
        """(K,) bool: the slow clients of the `slow` model, drawn once from the seed."""
        slow = np.zeros(num_clients, bool)
        if self.delays == "slow":
            count = int(round(self.slow_share * num_clients))
            rng = np.random.default_rng([seed, _SLOW_STREAM])
            slow[rng.choice(num_clients, count, replace=False)] = True
        return slow

    def draw(self, seed: int, round_index: int, ids: np.ndarray, slow: np.ndarray,
             free: Optional[np.ndarray] = None) -> np.ndarray:
        """(M,) delays of round `round_index`'s sampled clients `ids`, from (seed, round)
        alone (a resumed run draws the same); `free` (M,) bool: those not busy, the ones
        `forced` applies to (None: all)."""
        if self.delays == "slow":
            delays = np.where(slow[ids], self.max_delay, 0).astype(np.int64)
        else:
            rng = np.random.default_rng([seed, round_index, _DELAY_STREAM])
            delays = rng.integers(0, self.max_delay + 1, len(ids)).astype(np.int64)
        if self.forced:
            free = np.ones(len(ids), bool) if free is None else np.asarray(free, bool)
            order = np.random.default_rng([seed, round_index, _FORCED_STREAM]).permutation(
                np.flatnonzero(free))[:len(self.forced)]
            delays[order] = self.forced[:len(order)]
        return delays


def forced_error(value: Any) -> Optional[str]:
    """None when `value` is a sequence of delays (integers in [0, 100]), else what it must
    be (the schema's rule for `straggler.forced`)."""
    want = "a tuple of integer delays in [0, 100]"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return want
    ok = all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and 0 <= d <= 100
             for d in value)
    return None if ok else want


class Plan(NamedTuple):
    """What happens to round t's sampled clients (host arrays over the sample)."""

    active: np.ndarray  # (M,) bool: not busy, so they train
    delays: np.ndarray  # (M,) int: each one's delay
    used: np.ndarray  # (M,) bool: their outputs are used this round
    kept: np.ndarray  # (M,) bool: their outputs stay in flight (policy stale)
    duration: float  # the round's simulated length


def plan(model: Stragglers, now: float, free_at: np.ndarray, ids: np.ndarray,
         delays: np.ndarray) -> Plan:
    """Round plan at simulated time `now` under `model`'s policy (module docstring)."""
    active = free_at[ids] <= now
    late = delays > 0
    if model.policy == "wait_all":
        wait = int(delays[active].max()) if active.any() else 0
    elif model.policy == "wait_share":
        ordered = np.sort(delays[active])
        wait = int(ordered[math.ceil(model.wait_share * len(ordered)) - 1]) if len(ordered) else 0
    else:
        wait = 0
    used = active & (delays <= wait)
    kept = active & late if model.policy == "stale" else np.zeros_like(active)
    return Plan(active, delays, used, kept, 1.0 + wait)


class TimeState(NamedTuple):
    """Simulated time and the outputs in flight (checkpointed with the run).

    `clock` (1,) the time the next round starts; `free_at` (K,) when each client's last
    job ends. In flight (policy stale), slots of `entries` (None otherwise) with their
    `weight`, `arrival` round (-1: empty), `origin` round and `clients` (S, C) ids (-1
    padded): one client's output per slot under a stacked rule, a group's weighted sum
    (the clients of one round with one delay) under a streaming one; S is
    `in_flight_slots`, and a late output takes the first empty slot (the order in which
    a streaming rule adds up what arrives together).
    """

    clock: np.ndarray
    free_at: np.ndarray
    entries: Optional[PyTree] = None
    weight: Optional[np.ndarray] = None
    arrival: Optional[np.ndarray] = None
    origin: Optional[np.ndarray] = None
    clients: Optional[np.ndarray] = None


def empty(num_clients: int, entries: Optional[PyTree] = None, width: int = 1) -> TimeState:
    """Time 0, every client free; with `entries` (stacked zeros, S slots) all S slots
    empty, each holding up to `width` clients."""
    clock, free = np.zeros(1), np.zeros(num_clients)
    if entries is None:
        return TimeState(clock, free)
    slots = len(jax.tree_util.tree_leaves(entries)[0])
    return TimeState(clock, free, entries, np.zeros(slots, np.float32),
                     np.full(slots, -1, np.int64), np.full(slots, -1, np.int64),
                     np.full((slots, width), -1, np.int64))


def in_flight_slots(max_delay: int, per_round: int, num_clients: int, stacked: bool) -> int:
    """The most slots outputs in flight fill under policy stale (D = `max_delay`, M =
    `per_round` clients a round, K = `num_clients`). An output kept in round t arrives by
    t + D, so what is in flight after a round was kept in its last D rounds. Stacked rule:
    a slot a client, D * M (its aggregator sees every slot: the stack's length is part of
    its numbers). Streaming: a slot a group (a round's clients of one delay); of the round
    j back only delays above j are still in flight, so at most sum(min(i, M), i = 1..D)
    groups, and at most K (each holds a client, busy until its output has arrived)."""
    if stacked:
        return max_delay * per_round
    groups = sum(min(i, per_round) for i in range(1, max_delay + 1))
    return min(groups, num_clients)


def resized(st: TimeState, slots: int) -> TimeState:
    """`st` with `slots` slots in flight: empty ones added, or empty ones past the first
    `slots` dropped (a checkpoint written when a streaming rule kept D * D slots: first
    empty slot first, the late ones' slots never reach past the most in flight)."""
    have = len(st.arrival)
    if have == slots:
        return st
    if have > slots and (np.asarray(st.arrival)[slots:] >= 0).any():
        raise ValueError(f"{have - slots} slots in flight past the first {slots} hold "
                         f"outputs: this state was not written by a run of this config")

    def fit(x, fill):
        x = np.asarray(x)
        if have > slots:
            return x[:slots]
        return np.concatenate([x, np.full((slots - have,) + x.shape[1:], fill, x.dtype)])
    return st._replace(entries=jax.tree_util.tree_map(lambda x: fit(x, 0), st.entries),
                       weight=fit(st.weight, 0), arrival=fit(st.arrival, -1),
                       origin=fit(st.origin, -1), clients=fit(st.clients, -1))


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup"
                     ) -> Optional[int]:
    """Bytes of memory this process may still take: the kernel's MemAvailable (or free
    pages where it has none), within a cgroup v2 limit where one is set; None: unknown."""
    found = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    try:
        with open(os.path.join(cgroup, "memory.max")) as f, \
                open(os.path.join(cgroup, "memory.current")) as g:
            limit = f.read().strip()
            if limit != "max":
                found = min(found, max(int(limit) - int(g.read()), 0))
    except (OSError, ValueError):
        pass
    return found


def in_flight_error(max_delay: int, per_round: int, num_clients: int, stacked: bool,
                    entry_bytes: int, available: Optional[int] = None) -> Optional[str]:
    """None when the outputs in flight of `in_flight_slots` fit in `MEMORY_SHARE` of the
    `available` memory (None: `available_memory()`, unknown: they fit), each
    `entry_bytes` (about the model's), else what to change (a config error's text)."""
    slots = in_flight_slots(max_delay, per_round, num_clients, stacked)
    need = slots * entry_bytes
    available = available_memory() if available is None else available
    if available is None or need <= MEMORY_SHARE * available:
        return None
    return (f"straggler.max_delay={max_delay} with {per_round} clients a round (of "
            f"{num_clients}) can keep {slots} outputs of {entry_bytes / 1e6:.1f} MB in "
            f"flight under straggler.policy='stale', about {need / 1e9:.1f} GB: more than "
            f"{MEMORY_SHARE:.0%} of the {available / 1e9:.1f} GB of memory available; lower "
            f"straggler.max_delay or participation, or set straggler.policy to 'ignore'")


class Flight:
    """The slots in flight during round `round_index`: those `arriving` now are read and
    freed; late outputs are stored into free ones (`keep`), written back by `stored`."""

    def __init__(self, st: TimeState, arriving: np.ndarray, round_index: int):
        self.st, self.round = st, round_index
        self.slots = None if st.entries is None else jax.tree_util.tree_map(jnp.asarray,
                                                                            st.entries)
        self.arriving = arriving
        self.weight, self.arrival, self.origin, self.clients = (
            None if x is None else np.array(x) for x in
            (st.weight, st.arrival, st.origin, st.clients))
        came = self.clients[arriving] if arriving.any() else np.zeros((0, 1), np.int64)
        self.arrived_ids = came[came >= 0]
        # One staleness per arrived client (a streamed slot holds a group).
        self.staleness = (np.repeat(round_index - self.origin[arriving], (came >= 0).sum(1))
                          if arriving.any() else np.zeros(0, np.int64))
        self.slot_weights = (np.zeros(0) if self.weight is None else
                             np.where(arriving, self.weight, 0.0))
        self.slot_staleness = (np.zeros(0) if self.origin is None else
                               np.where(arriving, round_index - self.origin, 0))
        if arriving.any():
            self.arrival[arriving] = -1  # read now, then free
        self._stored: list = []

    def arriving_entries(self):
        """(entry, weight) of each slot arriving now."""
        for slot in np.flatnonzero(self.arriving):
            yield (jax.tree_util.tree_map(lambda x: x[slot], self.slots),
                   float(self.slot_weights[slot]))

    def keep(self, entry: PyTree, ids: np.ndarray, weights: np.ndarray, delay: int) -> None:
        """Stores `entry` (clients `ids`' output, or their weighted sum) in a free slot,
        arriving `delay` rounds from now."""
        slot = int(np.flatnonzero(self.arrival < 0)[0])
        self.arrival[slot], self.origin[slot] = self.round + delay, self.round
        self.weight[slot] = float(np.sum(weights))
        self.clients[slot] = -1
        self.clients[slot, :len(ids)] = ids
        self._stored.append((slot, entry))

    def stored(self) -> TimeState:
        """The time state with this round's slots written."""
        slots = self.slots
        if self._stored:
            where = jnp.asarray([slot for slot, _ in self._stored])
            values = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                            *[e for _, e in self._stored])
            slots = jax.tree_util.tree_map(lambda s, v: s.at[where].set(v.astype(s.dtype)),
                                           slots, values)
        return self.st._replace(entries=slots, weight=self.weight, arrival=self.arrival,
                                origin=self.origin, clients=self.clients)


def arrivals_by_staleness(staleness: np.ndarray, max_delay: int) -> list:
    """Counts of a round's used outputs by staleness 0..max_delay."""
    return np.bincount(np.asarray(staleness, np.int64), minlength=max_delay + 1).tolist()


__all__ = ["Stragglers", "Plan", "TimeState", "Flight", "plan", "empty",
           "arrivals_by_staleness", "forced_error", "in_flight_slots", "resized",
           "available_memory", "in_flight_error", "POLICIES", "DELAYS", "MEMORY_SHARE"]
