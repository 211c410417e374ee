"""Where the K clients' persistent states live: the device, the host, or disk.

`place` picks by size (`PLACES`; the config's `execution.client_states`): on the device
while the K states take at most half its memory (accelerators report it), else in host
memory while they take at most half of it, else on disk. The numbers are the same in every
place; the host costs a transfer of each cohort's states per round, disk a read and a
write of them.

Each place is a `ClientStates` (`DeviceStates`, `HostStates`, `DiskStates`; `NoStates`
for a stateless algorithm) with one small API: `gather` a cohort's states for the
executor, `scatter` its new ones back, and hooks for a round's start and a checkpoint's
save and restore. `tree` is what a `SimState` holds and a checkpoint saves: the stacked
arrays themselves on the device or the host, the `DiskStates` (a pytree whose one leaf is
the K slot numbers) on disk; `wrap` gives back the store of such a tree.

    states = create("auto", template, num_clients=100)
    states = states.scatter(ids, new)      # new: stacked over ids
    wrap(states.tree, states.place).gather(ids)  # the store of what a SimState holds
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import weakref
from typing import Any, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.engine import distributed

PyTree = Any
PLACES = ("auto", "device", "host", "disk")
FOLDER = "client_states"  # inside a run's workdir
_SHARE_BYTES = 1 << 28  # per broadcast when processes share a restored store


def host_memory() -> int:
    """This machine's physical memory in bytes (0 where it cannot tell)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def device_memory() -> int:
    """Memory of this process's first device in bytes, 0 where it reports none (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        stats = {}
    return int(stats.get("bytes_limit") or 0)


def place(choice: str, nbytes: int) -> str:
    """Where K clients' states of `nbytes` in all live: `choice`, or for 'auto' the device
    while they take at most half its memory, then the host likewise, else disk."""
    if choice not in PLACES:
        raise ValueError(f"unknown place for client states {choice!r}; expected one of "
                         f"{PLACES}")
    if choice != "auto":
        return choice
    device, host = device_memory(), host_memory()
    if device and nbytes <= device // 2:
        return "device"
    if not host or nbytes <= host // 2:
        # CPU backends report no device memory: their "device" is host memory.
        return "host" if device else "device"
    return "disk"


class ClientStates:
    """K clients' persistent states in one place (module docstring). Methods that a place
    needs no work for do nothing here."""

    place: str = ""  # PLACES' name of this store
    # Clients whose states are read at once where every client's are needed (personal
    # evaluation); None: all K at once (they are in memory already).
    chunk: Optional[int] = None

    @property
    def tree(self) -> PyTree:
        """What a `SimState` holds and a checkpoint saves (`wrap` inverts it)."""
        raise NotImplementedError

    @property
    def num_clients(self) -> int:
        raise NotImplementedError

    def gather(self, ids: np.ndarray) -> PyTree:
        """Clients `ids`' states stacked in `ids` order, as jax arrays (the executor's)."""
        raise NotImplementedError

    def scatter(self, ids: np.ndarray, new: PyTree) -> "ClientStates":
        """These states with clients `ids`' set to `new` (stacked in `ids` order)."""
        raise NotImplementedError

    def template(self) -> PyTree:
        """One client's state (its shapes and dtypes)."""
        raise NotImplementedError

    def everyone(self) -> PyTree:
        """All K clients' states stacked, where this store keeps them."""
        raise NotImplementedError

    def chunks(self, size: int) -> Iterator[Tuple[np.ndarray, PyTree]]:
        """(ids, `gather(ids)`) over all clients, `size` at a time."""
        for start in range(0, self.num_clients, size):
            ids = np.arange(start, min(start + size, self.num_clients))
            yield ids, self.gather(ids)

    def start_round(self) -> None:
        """A round begins (after the last one's state was saved, if it was)."""

    def flush(self) -> None:
        """A checkpoint is about to save `tree`."""

    def checkpointed(self) -> None:
        """A checkpoint of `tree` was written."""

    def resumed(self) -> None:
        """`tree` was restored from a checkpoint (in every process of a run)."""


class NoStates(ClientStates):
    """A stateless algorithm's (its `tree` is None): nothing to gather, keep or save."""

    @property
    def tree(self) -> None:
        return None

    @property
    def num_clients(self) -> int:
        return 0

    def gather(self, ids: np.ndarray) -> None:
        return None

    def scatter(self, ids: np.ndarray, new: PyTree) -> "NoStates":
        return self

    def template(self) -> None:
        return None

    def everyone(self) -> None:
        return None


class _Stacked(ClientStates):
    """States stacked over all K clients on a leading axis of each leaf (in memory)."""

    def __init__(self, tree: PyTree):
        self._tree = tree

    @property
    def tree(self) -> PyTree:
        return self._tree

    @property
    def num_clients(self) -> int:
        return len(jax.tree_util.tree_leaves(self._tree)[0])

    def gather(self, ids: np.ndarray) -> PyTree:
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x[ids]), self._tree)

    def template(self) -> PyTree:
        return jax.tree_util.tree_map(lambda x: x[0], self._tree)

    def everyone(self) -> PyTree:
        return self._tree


# Shared by every device store: compiled once per state layout.
_device_scatter = jax.jit(lambda all_, ids, new: jax.tree_util.tree_map(
    lambda a, n: a.at[ids].set(n), all_, new), donate_argnums=(0,))


class DeviceStates(_Stacked):
    """Jax arrays on the device; a scatter donates the arrays it replaces (updated in
    place: a state it started from is gone after it). Arrays restored from a checkpoint
    (host arrays) are put back on the device by the first scatter."""

    place = "device"

    @classmethod
    def create(cls, template: PyTree, num_clients: int, directory: Optional[str] = None
               ) -> "DeviceStates":
        """Every one of `num_clients` clients holding `template` (`directory` unused)."""
        del directory
        return cls(jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x, (num_clients, *np.shape(x))), template))

    def scatter(self, ids: np.ndarray, new: PyTree) -> "DeviceStates":
        return DeviceStates(_device_scatter(self._tree, jnp.asarray(ids), new))


class HostStates(_Stacked):
    """NumPy arrays in host memory; a scatter writes in place, as the device's donated
    one (the arrays a state it started from holds change with it)."""

    place = "host"

    @classmethod
    def create(cls, template: PyTree, num_clients: int, directory: Optional[str] = None
               ) -> "HostStates":
        """Every one of `num_clients` clients holding `template` (`directory` unused)."""
        del directory
        return cls(jax.tree_util.tree_map(
            lambda x: np.repeat(np.asarray(x)[None], num_clients, axis=0), template))

    def scatter(self, ids: np.ndarray, new: PyTree) -> "HostStates":
        # A restored array may be read-only (or a jax array's view): copied once.
        tree = jax.tree_util.tree_map(
            lambda a: a if isinstance(a, np.ndarray) and a.flags.writeable else np.array(a),
            self._tree)
        for a, n in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(new)):
            a[ids] = np.asarray(n)
        return HostStates(tree)


class StoreWriteError(OSError):
    """A write of the client states' files failed (a full disk, say); `filename` is their
    folder. Raised only by `DiskStates` (a run reports it as a workdir fault)."""


@contextlib.contextmanager
def _writing(directory: str) -> Iterator[None]:
    """A filesystem fault inside the block as a `StoreWriteError` naming `directory`."""
    try:
        yield
    except StoreWriteError:
        raise
    except OSError as e:
        code = e.errno or errno.EIO
        raise StoreWriteError(code, e.strerror or os.strerror(code), directory) from e


def free_space(path: str) -> int:
    """Free bytes on the filesystem of `path` (or of its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _pwrite_all(fd: int, data, offset: int) -> None:
    """All of `data` at `offset`: a write cut short goes on from where it stopped (the
    next one reports why, e.g. ENOSPC); one that writes nothing is a full disk."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[n:], offset + n


class _Slots:
    """One file per leaf of a client's state, in slots of one state each (`pread`/`pwrite`,
    not memory maps: a process's resident memory then holds only what it reads).

    Slot 0 holds the state every client starts with. A slot is in use while some client's
    current state is in it, `retired` for the rest of the round after it was replaced (the
    state the round started from stays readable), and `protected` while the last
    checkpoint refers to it; the others are free.
    """

    def __init__(self, directory: str, template: PyTree, owned: bool, clients: int = 1):
        self.directory = directory
        self.owned = owned  # a temporary folder of this process: removed on close
        leaves, self.treedef = jax.tree_util.tree_flatten(template)
        self.shapes = [np.shape(x) for x in leaves]
        self.dtypes = [np.asarray(x).dtype for x in leaves]
        self.sizes = [int(np.prod(s, dtype=np.int64)) * d.itemsize
                      for s, d in zip(self.shapes, self.dtypes)]
        names = [os.path.join(directory, f"leaf_{i:03d}.bin") for i in range(len(leaves))]
        self.fds: List[int] = []
        # Closed (and a temporary folder removed) when no state refers to it any more.
        self._closer = weakref.finalize(self, _close, self.fds, directory if owned else None)
        with _writing(directory):
            # The files reach `clients` slots once every client has trained: a disk that
            # cannot hold them is refused before any round, not found full in the middle.
            needed = clients * self.nbytes - sum(os.path.getsize(n) for n in names
                                                 if os.path.isfile(n))
            free = free_space(directory)
            if needed > free:
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({clients} "
                              f"clients' states need {needed / 2**20:.1f} MiB more, "
                              f"{free / 2**20:.1f} MiB free)")
            os.makedirs(directory, exist_ok=True)
            meta = {"shapes": [list(s) for s in self.shapes],
                    "dtypes": [d.str for d in self.dtypes]}
            meta_path = os.path.join(directory, "layout.json")
            if os.path.exists(meta_path):
                with open(meta_path) as f:
                    if json.load(f) != meta:
                        raise ValueError(f"{directory} holds client states of another "
                                         "layout")
            else:
                with open(meta_path, "w") as f:
                    json.dump(meta, f)
            for name in names:
                self.fds.append(os.open(name, os.O_RDWR | os.O_CREAT, 0o644))
        self.capacity = 1
        self.free: List[int] = []
        self.retired: List[int] = []
        self.protected = np.zeros(1, bool)
        self.write([0], [np.asarray(x)[None] for x in leaves])

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def read(self, slots: np.ndarray) -> List[np.ndarray]:
        """Each leaf stacked over `slots` (host arrays)."""
        out = []
        for fd, shape, dtype, size in zip(self.fds, self.shapes, self.dtypes, self.sizes):
            a = np.empty((len(slots), *shape), dtype)
            flat = a.reshape(len(slots), -1).view(np.uint8)
            for j, s in enumerate(slots):
                data = os.pread(fd, size, int(s) * size)
                if len(data) != size:
                    raise OSError(f"client state slot {int(s)} is missing from "
                                  f"{self.directory} (file cut short)")
                flat[j] = np.frombuffer(data, np.uint8)
            out.append(a)
        return out

    def write(self, slots, leaves: List[np.ndarray]) -> None:
        """Each leaf's rows into `slots`; a failed write raises `StoreWriteError`."""
        with _writing(self.directory):
            for fd, size, x in zip(self.fds, self.sizes, leaves):
                x = np.ascontiguousarray(x)
                for j, s in enumerate(slots):
                    if size:
                        _pwrite_all(fd, x[j].reshape(-1).view(np.uint8), int(s) * size)

    def allocate(self, n: int) -> np.ndarray:
        """`n` free slots (more slots are added as needed)."""
        while len(self.free) < n:
            grow = max(n - len(self.free), self.capacity // 2, 16)
            self.free.extend(range(self.capacity + grow - 1, self.capacity - 1, -1))
            self.capacity += grow
            self.protected = np.concatenate([self.protected, np.zeros(grow, bool)])
        taken, self.free = self.free[-n:], self.free[:-n]
        return np.asarray(taken[::-1], np.int64)

    def retire(self, slots: np.ndarray) -> None:
        self.retired.extend(int(s) for s in slots if s != 0)

    def next_round(self) -> None:
        """Slots replaced before this round are free now, unless a checkpoint holds them."""
        self.free.extend(s for s in self.retired if not self.protected[s])
        self.retired = []

    def flush(self) -> None:
        """On disk, not only in the page cache (before a checkpoint refers to it)."""
        with _writing(self.directory):
            for fd in self.fds:
                os.fsync(fd)

    def protect(self, in_use: np.ndarray) -> None:
        """The last checkpoint refers to `in_use`; slots the one before it held, and no
        state uses now, become free."""
        was = np.flatnonzero(self.protected)
        self.protected[:] = False
        self.protected[np.asarray(in_use, np.int64)] = True
        self.protected[0] = True
        live = set(int(s) for s in in_use) | set(self.retired)
        self.free.extend(int(s) for s in was if s != 0 and s not in live
                         and not self.protected[s])
        self.free = sorted(set(self.free), reverse=True)

    def restart(self, in_use: np.ndarray) -> None:
        """After a restore: `in_use` is all that holds states; every other slot is free."""
        size = max((os.fstat(fd).st_size // s for fd, s in zip(self.fds, self.sizes) if s),
                   default=1)
        self.capacity = max(int(size), int(np.max(in_use, initial=0)) + 1, 1)
        self.protected = np.zeros(self.capacity, bool)
        self.protected[np.asarray(in_use, np.int64)] = True
        self.protected[0] = True
        self.free = sorted(set(range(self.capacity)) - set(int(s) for s in in_use) - {0},
                           reverse=True)
        self.retired = []

    def close(self) -> None:
        self._closer()
        self.fds[:] = []


def _close(fds: List[int], temporary: Optional[str]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)


class DiskStates(ClientStates):
    """K clients' persistent states on disk: client k's state is slot `slots[k]` of
    `files` (`_Slots`). Clients that never trained share slot 0, so the files grow with
    the clients that trained, not with K. A pytree whose one leaf is `slots` (its own
    `tree`): a checkpoint saves K int32s, not a second copy of the states (the slots it
    names are kept until the next checkpoint), and restores into the same files."""

    place = "disk"
    chunk = 256  # all K at once need not fit in memory

    def __init__(self, files: _Slots, slots: np.ndarray):
        self.files, self.slots = files, slots

    @classmethod
    def create(cls, template: PyTree, num_clients: int, directory: Optional[str] = None
               ) -> "DiskStates":
        """Every one of `num_clients` clients holding `template`, in `directory` (a
        temporary folder if None). Raises `StoreWriteError` (ENOSPC) before writing where
        the disk cannot hold a state for every client, as any later write that fails does."""
        owned = directory is None
        if owned:
            directory = tempfile.mkdtemp(prefix="fedjax_pan-client-states-")
        files = _Slots(directory, jax.tree_util.tree_map(np.asarray, template), owned,
                       clients=num_clients)
        return cls(files, np.zeros(num_clients, np.int32))

    @property
    def tree(self) -> "DiskStates":
        return self

    @property
    def num_clients(self) -> int:
        return len(self.slots)

    def read(self, ids: np.ndarray) -> PyTree:
        """Clients `ids`' states, stacked (host arrays)."""
        leaves = self.files.read(np.asarray(self.slots)[np.asarray(ids)])
        return jax.tree_util.tree_unflatten(self.files.treedef, leaves)

    def gather(self, ids: np.ndarray) -> PyTree:
        return jax.tree_util.tree_map(jnp.asarray, self.read(ids))

    def everyone(self) -> PyTree:
        return self.read(np.arange(self.num_clients))

    def template(self) -> PyTree:
        """One client's state as it starts (slot 0)."""
        leaves = [x[0] for x in self.files.read(np.zeros(1, np.int64))]
        return jax.tree_util.tree_unflatten(self.files.treedef, leaves)

    def scatter(self, ids: np.ndarray, new: PyTree) -> "DiskStates":
        """These states with clients `ids`' set to `new` (stacked in `ids` order), written
        to free slots: the slots this state names stay as they are."""
        ids = np.asarray(ids)
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(new))]
        slots = self.files.allocate(len(ids))
        self.files.write(slots, leaves)
        self.files.retire(np.asarray(self.slots)[ids])
        out = np.array(self.slots)
        out[ids] = slots
        return DiskStates(self.files, out)

    def start_round(self) -> None:
        """Slots replaced before this round are free now, unless a checkpoint holds them."""
        self.files.next_round()

    def flush(self) -> None:
        """On disk, not only in the page cache (the checkpoint names these slots)."""
        self.files.flush()

    def checkpointed(self) -> None:
        """The checkpoint's slots are kept until the next checkpoint."""
        self.files.protect(self.slots)

    def resumed(self) -> None:
        """After a restore: only the slots this state names hold states (in every process
        of a multi-process run, from process 0's files)."""
        if distributed.process_count() > 1:
            self.share_from_primary()
        else:
            self.files.restart(np.asarray(self.slots))

    def share_from_primary(self) -> None:
        """In a multi-process run, after a restore: every process's files hold process 0's
        contents of the slots in use (broadcast a few hundred MB at a time)."""
        if distributed.process_count() == 1:
            return
        in_use = np.unique(np.concatenate([[0], np.asarray(self.slots)])).astype(np.int64)
        step = max(1, _SHARE_BYTES // max(self.files.nbytes, 1))
        for start in range(0, len(in_use), step):
            part = in_use[start:start + step]
            leaves = self.files.read(part) if distributed.is_primary() else [
                np.zeros((len(part), *s), d) for s, d in zip(self.files.shapes,
                                                             self.files.dtypes)]
            leaves = distributed.broadcast_tree(leaves)
            if not distributed.is_primary():
                self.files.write(part, leaves)
        self.files.restart(np.asarray(self.slots))


jax.tree_util.register_pytree_node(
    DiskStates, lambda d: ((d.slots,), d.files),
    # Children as given: pytree utilities pass through values of every kind (a broadcast's
    # global arrays, say); the methods read them as numpy.
    lambda files, children: DiskStates(files, children[0]))


PLACED = {"device": DeviceStates, "host": HostStates, "disk": DiskStates}


def create(choice: str, template: PyTree, num_clients: int,
           directory: Optional[str] = None) -> ClientStates:
    """Every one of `num_clients` clients holding `template` (one client's state; None:
    a stateless algorithm's), where `place(choice, their size)` says; on disk in
    `directory` (a temporary folder if None)."""
    if template is None:
        return NoStates()
    nbytes = num_clients * sum(np.asarray(x).nbytes
                               for x in jax.tree_util.tree_leaves(template))
    return PLACED[place(choice, nbytes)].create(template, num_clients, directory)


def wrap(tree: PyTree, where: Optional[str] = None) -> ClientStates:
    """The store of a `SimState`'s client states `tree` (a `ClientStates.tree`): by what it
    holds (None, a `DiskStates`, NumPy arrays: the host's, jax arrays: the device's), except
    that host arrays go back to the device where `where` is 'device' (a restored
    checkpoint's arrays, or a caller's copy)."""
    if tree is None:
        return NoStates()
    if isinstance(tree, DiskStates):
        return tree
    leaves = jax.tree_util.tree_leaves(tree)
    if leaves and isinstance(leaves[0], np.ndarray) and where != "device":
        return HostStates(tree)
    return DeviceStates(tree)
