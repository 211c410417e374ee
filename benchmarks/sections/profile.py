"""One local step taken apart: the floor no engine can beat on this machine."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks import profile_step
from benchmarks.harness import Log, Settings


def profile_section(settings: Settings, ceiling: float, log: Log) -> Dict[str, Any]:
    """One MLP-bench local step taken apart (`benchmarks.profile_step`)."""
    rows = profile_step.profile(settings.batch_size, 5 if settings.quick else 20, ceiling)
    log(f"[profile] step {1e3 * rows['step']['seconds']:.2f} ms, floor "
        f"{1e3 * rows['floor']['seconds']:.2f} ms ({rows['floor']['fraction_of_ceiling']:.3f} "
        "of the ceiling)")
    return {"batch_size": settings.batch_size, "rows": rows}
