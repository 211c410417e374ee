"""Runs over several processes or hosts, on JAX's own multi-controller runtime.

Every process runs the same program on the same config: each loads the data, samples the
same cohorts and computes the same server update; the executor's client axis is sharded
over the devices of all processes (one global mesh), so each process trains the cohort
slots its own devices hold (block position p of the D global devices' B-client block goes
to device floor(p D / B): a deterministic assignment). Process 0 alone reads and writes the
workdir: it checks it (the others learn its verdict), restores a checkpoint (the others
receive the state from it, so no filesystem need be shared) and writes metrics,
checkpoints and summaries.

A process that stops, however it stops, stops the others within seconds instead of
leaving them waiting in their next collective (`_Watch`): one that fails posts its error
in the coordination service's key-value store before it exits, and the others end with
that error, named after it (`ending`); one that ends without a word (killed, out of
memory) is noticed by its pid where it ran on the same machine, else after
`peer_timeout` seconds without its heartbeat.
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import re
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple, TypeVar

import numpy as np

from fedjax_pan.errors import ConfigError, RunError

T = TypeVar("T")
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")
_MESSAGE_BYTES = 4096  # a broadcast error message is cut to this length
PEER_TIMEOUT = 60.0  # seconds without a process's heartbeat before the others stop
GRACE = 3.0  # seconds a process is given to end by itself once another has stopped
_KEYS = "fedjax_pan/"  # this run's keys in the coordination service's store


def port_in_use(port: int) -> bool:
    """Whether something on this host listens on TCP `port` (process 0's coordinator
    binds it on every interface; JAX crashes where it cannot)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family) as s:
                # An earlier run's connections in TIME_WAIT do not stop the coordinator.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True  # (any other error: no IPv6 on this host)
    return False


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, auto: bool = False,
               peer_timeout: float = PEER_TIMEOUT, workdir: Optional[str] = None) -> None:
    """Joins this process to a multi-process run (`jax.distributed.initialize`), before any
    JAX computation; nothing to do when no argument is given.

    `coordinator` ('host:port', process 0's address), `num_processes` and `process_id`
    come together; `auto` lets JAX read them from the cluster (SLURM, TPU pods, Open MPI).
    On CPU the processes' collectives run over gloo. A process that goes silent for
    `peer_timeout` seconds stops the others (JAX's own heartbeat, which aborts the
    process, is set later than that); `workdir` (where process 0 writes) lets the
    processes say how to go on.
    """
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    named = [k for k, v in given.items() if v is not None]
    if not named and not auto:
        return
    if auto and named:
        raise ConfigError(f"--distributed reads the cluster's settings itself; drop "
                          f"--{', --'.join(named)}, or drop --distributed")
    if not (isinstance(peer_timeout, (int, float)) and 0 < peer_timeout < math.inf):
        raise ConfigError(f"--peer_timeout={peer_timeout} must be a positive number of "
                          "seconds")
    if not auto:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ConfigError(f"--{', --'.join(missing)} must be given with "
                              f"--{', --'.join(named)}")
        m = _ADDRESS.match(coordinator)
        if m is None or not 0 < int(m.group(1)) < 65536:
            raise ConfigError(f"--coordinator={coordinator!r} is not host:port")
        if num_processes < 1:
            raise ConfigError(f"--num_processes={num_processes} must be at least 1")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process_id={process_id} must lie in [0, {num_processes})")
        # Process 0 serves the coordinator on every interface, whatever host is named.
        if (process_id == 0 and "JAX_COORDINATOR_BIND_ADDRESS" not in os.environ and
                port_in_use(int(m.group(1)))):
            raise ConfigError(f"--coordinator={coordinator}: port {m.group(1)} is in use on "
                              "this host, where process 0 serves the coordinator; pick a "
                              "free port")
    import jax

    # CPU processes exchange the client axis' sums over gloo (accelerators use their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX aborts every process once one has missed its heartbeats this long (it notices
    # within half of it); the watch below stops them first, with the error line.
    heartbeat = int(math.ceil(2 * (peer_timeout + 2 * GRACE))) + 10
    try:
        if auto:
            jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
        else:
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       heartbeat_timeout_seconds=heartbeat)
    except (ValueError, RuntimeError) as e:
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(f"cannot join the multi-process run: {detail}") from None
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed  # its client: the key-value store
        global _WATCH
        _WATCH = _Watch(jax_distributed.global_state.client, jax.process_index(),
                        jax.process_count(), peer_timeout, workdir)
        _WATCH.start()


def process_count() -> int:
    import jax
    return jax.process_count()


def is_primary() -> bool:
    """True in the process that reads and writes the workdir (process 0)."""
    import jax
    return jax.process_index() == 0


def broadcast_json(value: Any) -> Any:
    """Process 0's `value` (anything JSON can hold), in every process."""
    if process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    data = json.dumps(value).encode() if is_primary() else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    buffer = np.zeros(size, np.uint8)
    if is_primary():
        buffer[:] = np.frombuffer(data, np.uint8)
    buffer = multihost_utils.broadcast_one_to_all(buffer)
    return json.loads(np.asarray(buffer).tobytes().decode())


def broadcast_tree(tree: Any) -> Any:
    """Process 0's arrays (a pytree of the same structure and shapes in every process), as
    host arrays in every process."""
    if process_count() == 1:
        return tree
    import jax
    from jax.experimental import multihost_utils
    return jax.tree_util.tree_map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def on_primary(fn: Callable[[], T], what: str) -> Optional[T]:
    """Runs `fn` in process 0 and lets every process share its outcome: its result where
    it is JSON (else None elsewhere), or the error it raised (a RunError of the same
    class and message), so all processes stop together instead of waiting on each other.
    `what` names the step in the error other processes raise for an unexpected failure."""
    if process_count() == 1:
        return fn()
    outcome = {"ok": None}
    result = None
    if is_primary():
        try:
            result = fn()
            outcome = {"ok": result if _jsonable(result) else None}
        except RunError as e:
            outcome = {"error": type(e).__name__, "status": e.status,
                       "message": str(e)[:_MESSAGE_BYTES]}
            broadcast_json(outcome)
            raise
        except BaseException as e:
            broadcast_json({"error": "RunError", "status": 1,
                            "message": f"process 0 failed in {what}: {type(e).__name__}"})
            raise
    shared = broadcast_json(outcome)
    if is_primary():
        return result
    if "error" in shared:
        from fedjax_pan import errors
        cls = getattr(errors, shared["error"], RunError)
        error = cls(shared["message"])
        error.status = shared["status"]
        raise error
    return shared["ok"]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def check_same_config(config_json: str) -> None:
    """Raises ConfigError in every process unless all were given the same config."""
    if process_count() == 1:
        return
    from jax.experimental import multihost_utils
    import hashlib
    mine = np.frombuffer(hashlib.sha256(config_json.encode()).digest(), np.uint8)
    primary = np.asarray(multihost_utils.broadcast_one_to_all(mine))
    same = np.asarray(multihost_utils.process_allgather(np.int32(np.array_equal(mine,
                                                                                 primary))))
    if not same.all():
        bad = [int(i) for i in np.flatnonzero(same == 0)]
        raise ConfigError(f"processes {bad} were given a config other than process 0's; "
                          "every process must run the same command")


# ----------------------------------------------------------------------------------------
# One process's end reaching the others.
# ----------------------------------------------------------------------------------------

_WATCH: Optional["_Watch"] = None
# A collective that failed because a peer went away (gloo's, the coordination service's).
_PEER_GONE = re.compile(r"gloo|connection|peer|unavailable|socket", re.I)


def ending(text: str, status: int, message: Optional[str] = None) -> Tuple[str, int]:
    """The error line (without its `error: `) and exit status this process ends with:
    (`text`, `status`), its own, except in a multi-process run where another process
    failed first and this one's error followed from it: then that process's, named.
    `message` is `text` without its advice, where the error has one. The caller prints
    the line and exits; nothing changes outside a multi-process run."""
    if _WATCH is None:
        return text, status
    return _WATCH.ending(text, status, message or text)


def _machine() -> Optional[str]:
    """What makes a pid mean the same process to two processes: the kernel (its boot id)
    and the pid namespace; None where this cannot be told (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether process `pid` of this machine runs (a zombie, dead but not yet reaped by
    its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _advice(workdir: Optional[str], primary: bool) -> str:
    """How to go on from what `workdir` holds on this host (as `workdir.claim` says it);
    a process other than 0 that does not see it (another host) leaves that to process 0."""
    from fedjax_pan import workdir as workdir_lib
    if not workdir or not (primary or os.path.isdir(workdir)):
        return ("run the command again" if not workdir else
                "process 0's error line says whether to continue with --resume")
    if workdir_lib.made_progress(workdir):
        return "continue with --resume"
    if os.path.isdir(workdir) and os.listdir(workdir):
        return "run the command again with --overwrite"
    return "run the command again"


class _Watch:
    """One process's watch on the others, in a thread of its own: it beats (a counter in
    the key-value store), reads the errors other processes posted (`ended/<i>`), and
    declares a process that ended without one (its pid gone, where it ran on this
    machine, or its beat still for `peer_timeout` seconds) ended for it. Once another
    process has ended, this one is given `grace` seconds to end by itself (its collective
    fails, `ending` names the cause); after that the watch prints the line and exits the
    process. `client` is JAX's DistributedRuntimeClient (or a stand-in with its
    key_value_* methods)."""

    def __init__(self, client: Any, me: int, count: int, peer_timeout: float,
                 workdir: Optional[str], grace: float = GRACE):
        self.client, self.me, self.count = client, me, count
        self.peer_timeout, self.workdir, self.grace = peer_timeout, workdir, grace
        self.beat = max(0.1, min(1.0, peer_timeout / 10))
        self.lock = threading.Lock()  # whoever holds it and set `status` reports
        self.cause: Optional[Dict[str, Any]] = None  # the first other process's end
        self.deadline = math.inf  # when the watch ends this process itself
        self.status: Optional[int] = None  # this process's exit status, once known
        self.leaving = False  # past the run (JAX's shutdown may close the store)
        self.beats: Dict[int, Tuple[str, float]] = {}  # process: (its beat, when it moved)
        self.placed: Set[int] = set()  # the other processes whose machine is known
        self.pids: Dict[int, int] = {}  # process: pid, for those on this machine

    def start(self) -> None:
        self.client.key_value_set(f"{_KEYS}host/{self.me}", json.dumps(
            {"pid": os.getpid(), "machine": _machine()}), allow_overwrite=True)
        threading.Thread(target=self._run, name="fedjax_pan-peers", daemon=True).start()
        # atexit runs the newest first: this before JAX's own shutdown, whose barrier
        # would wait for processes that will never come.
        atexit.register(self._exit)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        n = 0
        while True:
            try:
                n += 1
                self.client.key_value_set(f"{_KEYS}beat/{self.me}", str(n),
                                          allow_overwrite=True)
                self.check(time.monotonic())
            except Exception:  # noqa: BLE001 - the store is gone (the run is over, or
                if self.leaving:  # process 0 is, and JAX ends this process), or did not
                    return  # answer this time
            if time.monotonic() >= self.deadline:
                self._stop()
            time.sleep(self.beat)

    def check(self, now: float) -> None:
        """Notes another process's end, posted or inferred (one pass of the watch)."""
        if self.cause is not None:
            return
        ended = self._ended()
        if ended is None and not self.leaving:  # (a finished run's processes exit freely)
            if len(self.placed) < self.count - 1:  # (processes post it as they join)
                here = _machine()
                for key, value in self.client.key_value_dir_get(f"{_KEYS}host/"):
                    who, info = int(key.rpartition("/")[2]), json.loads(value)
                    if who != self.me:
                        self.placed.add(who)
                        if here is not None and info["machine"] == here:
                            self.pids[who] = int(info["pid"])
            for who, pid in sorted(self.pids.items()):
                if not _alive(pid):
                    ended = self._declare(who, "it ended without a word (killed, out of "
                                               "memory, or crashed)")
                    break
        if ended is None and not self.leaving:
            for key, value in self.client.key_value_dir_get(f"{_KEYS}beat/"):
                who = int(key.rpartition("/")[2])
                if who == self.me:
                    continue
                if self.beats.get(who, ("",))[0] != value:
                    self.beats[who] = (value, now)
                elif now - self.beats[who][1] > self.peer_timeout:
                    ended = self._declare(who, f"no word from it for "
                                               f"{self.peer_timeout:g} s (killed, out of "
                                               "memory, or its host failed)")
                    break
        if ended is not None:
            self.cause = ended
            self.deadline = now + self.grace

    def _ended(self) -> Optional[Dict[str, Any]]:
        """The error of the lowest-numbered other process that posted one, if any."""
        posted = [json.loads(v) for _, v in self.client.key_value_dir_get(f"{_KEYS}ended/")]
        others = sorted((r for r in posted if r["process"] != self.me),
                        key=lambda r: r["process"])
        return others[0] if others else None

    def _declare(self, who: int, message: str) -> Dict[str, Any]:
        """Posts that process `who` ended without a word (once, whoever notices first; it
        may have posted its own error meanwhile) and returns what the store holds."""
        record = {"process": who, "status": 1, "message": message, "lost": True}
        key = f"{_KEYS}ended/{who}"
        try:
            self.client.key_value_set(key, json.dumps(record))
        except Exception:  # noqa: BLE001 - already posted, by it or by another process
            return json.loads(self.client.key_value_try_get(key))
        return record

    def _stop(self) -> None:
        """The grace is over and this process has not ended: report and exit."""
        with self.lock:
            if self.status is not None:  # it is ending by itself
                return
            text, self.status = self._line(self.cause), self.cause["status"]
            sys.stdout.flush()
            print(f"error: {text}", file=sys.stderr, flush=True)
            self._leave()

    # -- the process's end ---------------------------------------------------------------

    def _line(self, cause: Dict[str, Any]) -> str:
        return f"process {cause['process']} stopped: {cause['message']}; " \
               f"{_advice(self.workdir, self.me == 0)}"

    def ending(self, text: str, status: int, message: str) -> Tuple[str, int]:
        with self.lock:  # the watch reports nothing from now on
            self.status = status
        if status == 1:
            # An unforeseen error is most likely another process's end where a collective
            # failed (a posted error is read within a beat, a lost process takes longer).
            wait = 2 * self.beat + (self.peer_timeout if _PEER_GONE.search(text) else 0)
            limit = time.monotonic() + wait
            while self.cause is None and time.monotonic() < limit:
                time.sleep(min(self.beat, 0.1))
        cause = self.cause
        # Its own error, or one of the same kind as the first (a SIGTERM to every process,
        # an error every process raised): its own line; the others may follow from it.
        if cause is None or cause["status"] == status != 1:
            try:
                self.client.key_value_set(f"{_KEYS}ended/{self.me}", json.dumps(
                    {"process": self.me, "status": status,
                     "message": message[:_MESSAGE_BYTES]}))
            except Exception:  # noqa: BLE001 - posted already, or the store is gone
                pass
            return text, status
        self.status = cause["status"]
        return self._line(cause), cause["status"]

    def _exit(self) -> None:
        """At exit: a finished run leaves through JAX's shutdown (every process meets
        there); a failed one leaves at once, without that barrier."""
        self.leaving = True
        if self.status:
            self._leave()

    def _leave(self) -> None:
        """Says this process is leaving and exits with `status`; process 0, whose exit
        ends the coordination service (and JAX then aborts the others), waits until the
        others have left first (a few seconds at most)."""
        try:
            self.client.key_value_set(f"{_KEYS}left/{self.me}", "1", allow_overwrite=True)
            if self.me == 0:
                limit = time.monotonic() + 2 * (self.grace + 2 * self.beat)
                lost = {r["process"] for r in map(json.loads, dict(
                    self.client.key_value_dir_get(f"{_KEYS}ended/")).values())
                        if r.get("lost")}
                while time.monotonic() < limit:
                    left = {int(k.rpartition("/")[2])
                            for k, _ in self.client.key_value_dir_get(f"{_KEYS}left/")}
                    waiting = [i for i in range(1, self.count) if i not in left | lost and
                               (i not in self.pids or _alive(self.pids[i]))]
                    if not waiting:
                        break
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: nobody to wait for
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.status)
