"""The benchmark suite: the machine's roof (matmul ceiling and memory bandwidth), then each
section (`benchmarks/sections/`: MLP bench, padding, conv nets, scaling, profile,
algorithms, defences, compression, grouped convs; throughput).

Every figure is measured in this one process after warm-up: each configuration runs
`warmup` untimed rounds (which absorb compilation; their compile count and seconds are
reported), then timed rounds whose median is reported. A round is timed with
`time.perf_counter()` around `Simulation.round` plus `jax.block_until_ready` on the new
server state; "end-to-end" adds evaluating the global model on the test set. Rounds
whose warm-up already exceeds `slow_round_s` (convnets under `vmap` on CPU, scaling at
50+ clients) are timed once instead of `reps` times, so the suite stays inside its time
budget. The roof is re-measured right before each section, which divides by its own
measurement.

FLOPs: the MLP bench counts 6 x parameters per real (unmasked) training example, as the
issue defines it; convnets count 3 x the forward FLOPs of XLA's cost analysis; grouped
convs count a grouped conv's real FLOPs (never a block-diagonal expansion's zeros). Padded
examples are never counted as useful work. The roofline of a row counts XLA's own FLOPs
and bytes accessed of the programs its rounds run (`benchmarks.roofline`), against the
measured matmul rate and memory bandwidth: `fraction_of_roofline` = the least time that
work takes here / the measured time.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Dict, Sequence

from benchmarks import throughput
from benchmarks.harness import (Log, Settings, device_peak_mib, machine_info, make_settings,
                                measure_roof, peak_rss_mib)
from benchmarks.sections.algorithms import algorithms_section
from benchmarks.sections.compression import compression_section
from benchmarks.sections.defences import defences_section
from benchmarks.sections.grouped_conv import grouped_conv_section
from benchmarks.sections.mlp import mlp_section
from benchmarks.sections.padding import padding_section
from benchmarks.sections.profile import profile_section
from benchmarks.sections.scaling import scaling_section
from benchmarks.sections.vgg import conv_section
from fedjax_pan.engine import count_compiles

__all__ = ["SECTIONS", "Settings", "make_settings", "run_suite"]

SECTIONS = ("mlp", "padding", "vgg", "scaling", "profile", "algorithms", "defences",
            "compression", "grouped_conv", "throughput")

SECTION_FUNCTIONS = {"mlp": mlp_section, "padding": padding_section, "vgg": conv_section,
                     "scaling": scaling_section, "profile": profile_section,
                     "algorithms": algorithms_section, "defences": defences_section,
                     "compression": compression_section,
                     "grouped_conv": grouped_conv_section,
                     "throughput": lambda settings, roof, log: throughput.throughput_section(
                         settings.throughput, roof, log)}


def run_suite(settings: Settings, only: Sequence[str] = SECTIONS,
              log: Log = lambda s: print(s, file=sys.stderr, flush=True)) -> Dict[str, Any]:
    """Measures the roof, runs the sections in `only`; returns the results tree."""
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown section(s) {sorted(unknown)}; expected some of {SECTIONS}")
    start = time.perf_counter()
    results: Dict[str, Any] = {"meta": machine_info(), "settings": dataclasses.asdict(settings)}
    with count_compiles() as compiles:
        _, results["roof"] = measure_roof(settings)
        roof = results["roof"]
        results["matmul"] = {"size": settings.matmul_size, "reps": settings.matmul_reps,
                             "gflops": roof["matmul_gflops"],
                             "best_gflops": roof["matmul_best_gflops"]}
        log(f"[roof] matmul {roof['matmul_gflops']:.1f} GFLOP/s, bandwidth "
            f"{roof['bandwidth_gbs']:.1f} GB/s (copy {roof['copy_gbs']:.1f}, triad "
            f"{roof['triad_gbs']:.1f}, NumPy triad {roof['numpy_triad_gbs']:.1f})")
        memory = {"after_matmul_mib": peak_rss_mib()}
        seconds = {"matmul": time.perf_counter() - start}
        ceilings, roofs = {}, {}
        for section in SECTIONS:
            if section in only:
                t0 = time.perf_counter()
                # Re-measured next to each section: on a shared machine the rate drifts,
                # and a fraction is only meaningful against the same conditions.
                roof, roofs[section] = measure_roof(settings)
                ceilings[section] = roof.peak_gflops
                log(f"[{section}] matmul ceiling {roof.peak_gflops:.1f} GFLOP/s, bandwidth "
                    f"{roof.bandwidth_gbs:.1f} GB/s")
                results[section] = SECTION_FUNCTIONS[section](settings, roof, log)
                seconds[section] = time.perf_counter() - t0
                memory[f"after_{section}_mib"] = peak_rss_mib()
    results["matmul"]["per_section_gflops"] = ceilings
    results["roof"]["per_section"] = roofs
    results["compiles"] = {"count": compiles.count, "seconds": compiles.seconds}
    results["section_seconds"] = seconds
    results["memory"] = {"peak_rss_mib": peak_rss_mib(), "device_peak_mib": device_peak_mib(),
                         **memory}
    results["meta"]["load_average_end"] = (list(os.getloadavg()) if hasattr(os, "getloadavg")
                                           else None)
    results["total_seconds"] = time.perf_counter() - start
    return results
