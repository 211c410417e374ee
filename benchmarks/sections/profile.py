"""One local step taken apart (the floor no engine can beat on this machine), and one
engine round profiled: where the time outside the compiled steps goes."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks import profile_step
from benchmarks.harness import Log, Settings
from benchmarks.roofline import Roof


def profile_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """One MLP-bench local step taken apart (`profile_step.profile`) and one MLP-bench
    round under the profiler (`profile_step.round_profile`, `auto`'s strategy)."""
    rows = profile_step.profile(settings.batch_size, 5 if settings.quick else 20,
                                roof.peak_gflops, roof)
    log(f"[profile] step {1e3 * rows['step']['seconds']:.2f} ms, floor "
        f"{1e3 * rows['floor']['seconds']:.2f} ms ({rows['floor']['fraction_of_ceiling']:.3f} "
        "of the ceiling)")
    round_ = profile_step.round_profile("auto", settings.quick)
    log("[profile] " + profile_step.format_round_profile(round_))
    return {"batch_size": settings.batch_size, "rows": rows, "round": round_}
