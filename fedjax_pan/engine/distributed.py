"""Runs over several processes or hosts, on JAX's own multi-controller runtime.

Every process runs the same program on the same config: each loads the data, samples the
same cohorts and computes the same server update; the executor's client axis is sharded
over the devices of all processes (one global mesh), so each process trains the cohort
slots its own devices hold (block position p of the D global devices' B-client block goes
to device floor(p D / B): a deterministic assignment). Process 0 alone reads and writes the
workdir: it checks it (the others learn its verdict), restores a checkpoint (the others
receive the state from it, so no filesystem need be shared) and writes metrics,
checkpoints and summaries.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional, TypeVar

import numpy as np

from fedjax_pan.errors import ConfigError, RunError

T = TypeVar("T")
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")
_MESSAGE_BYTES = 4096  # a broadcast error message is cut to this length


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, auto: bool = False) -> None:
    """Joins this process to a multi-process run (`jax.distributed.initialize`), before any
    JAX computation; nothing to do when no argument is given.

    `coordinator` ('host:port', process 0's address), `num_processes` and `process_id`
    come together; `auto` lets JAX read them from the cluster (SLURM, TPU pods, Open MPI).
    On CPU the processes' collectives run over gloo.
    """
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    named = [k for k, v in given.items() if v is not None]
    if not named and not auto:
        return
    if auto and named:
        raise ConfigError(f"--distributed reads the cluster's settings itself; drop "
                          f"--{', --'.join(named)}, or drop --distributed")
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
    import jax

    # CPU processes exchange the client axis' sums over gloo (accelerators use their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        if auto:
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(coordinator, num_processes, process_id)
    except (ValueError, RuntimeError) as e:
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(f"cannot join the multi-process run: {detail}") from None


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
