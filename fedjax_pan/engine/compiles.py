"""Counts XLA compilations (backend compiles) while a context is open."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

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
