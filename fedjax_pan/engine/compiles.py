"""Counts XLA compilations (backend compiles) while a context is open; the persistent
compilation cache of the command lines."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Optional

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCount:
    count: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCount]:
    """`with count_compiles() as c: ...` then `c.count` compilations took `c.seconds`."""
    counter = CompileCount()

    def listener(event: str, duration: float, **_) -> None:
        if event == _EVENT:
            counter.count += 1
            counter.seconds += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
DEFAULT_CACHE = os.path.join("~", ".cache", "fedjax_pan", "xla")


def use_compilation_cache(path: Optional[str] = DEFAULT_CACHE) -> Optional[str]:
    """Points JAX's persistent compilation cache at `path` (the command lines call this), so
    a second run of a job, or a resumed one, loads its programs instead of compiling them
    (the FedJAX workload's first round: 2.1 s of compilation cold, 0.15 s warm; see
    benchmarks/RESULTS.md). A cache directory already set in the environment wins; None or
    '' leaves the cache off. Returns the directory in use, if any."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    if not path:
        return None
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Small programs too: a round's many little ones add up to a second.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
