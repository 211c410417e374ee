"""Seconds per round and memory as the clients per round and the population grow."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Optional

import numpy as np

from benchmarks.harness import (MLP_PARAMS, Log, Settings, Workload, device_in_use_mib,
                                device_peak_mib, make_workload, mlp_workload, peak_rss_mib,
                                rss_mib, summarize, time_engine)
from benchmarks.roofline import Roof
from fedjax_pan import data as data_lib
from fedjax_pan import models
from fedjax_pan.engine import resolve_strategy, store


def scaling_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """MLP-bench round time against clients per round, with `auto`'s strategy.

    Each setting gets its own executor and warm-up; `compiles_timed` must be 0.
    `per_client_vs_first` is (t/M) / (t_first/M_first): 1.0 means linear cost.
    """
    # The population first: its peaks are this process's before any larger workload.
    population = population_section(settings, roof, log)
    per_round = [m for m in settings.scaling_per_round]
    w = mlp_workload(settings, max(settings.mlp_clients, max(per_round)))
    strategy = resolve_strategy("auto", w.variables)
    w_description = w.describe(per_round[0])
    points = []
    for m_per in per_round:
        sim = w.simulation(w.executor(strategy, m_per, settings), m_per, settings.seed)
        m = time_engine(sim, w.variables, None, settings.warmup, settings.scaling_reps,
                        settings.slow_round_s)
        rec = summarize(m, w.flops_per_example, roof)
        rec = {"clients_per_round": m_per, **{k: rec.get(k) for k in (
            "seconds_per_round", "round_seconds", "reps", "examples_per_second", "gflops",
            "fraction_of_ceiling", "fraction_of_roofline", "roofline_bound",
            "compiles_warmup", "compile_seconds_warmup", "compiles_timed")}}
        rec["seconds_per_client"] = rec["seconds_per_round"] / m_per
        points.append(rec)
        log(f"[scaling] {m_per} clients/round: {rec['seconds_per_round']:.3f} s/round, "
            f"{rec['compiles_timed']} compiles after warm-up")
    for p in points:
        p["per_client_vs_first"] = p["seconds_per_client"] / points[0]["seconds_per_client"]
    del w
    return {"strategy": strategy, "workload": w_description, "points": points,
            "compiles_after_warmup": sum(p["compiles_timed"] for p in points)
            + sum(p["compiles_timed"] for p in population["points"]),
            "population": population, "moon": moon_many_clients(settings, log)}


def population_workload(settings: Settings, num_clients: int) -> Workload:
    """The MLP bench network over `num_clients` clients of `population_examples` examples
    each, drawn without replacement within a client from a shared synthetic pool."""
    ds = data_lib.synthetic(settings.population_pool, settings.test_examples,
                            image_shape=(28, 28, 1), seed=settings.seed)
    rng = np.random.default_rng(settings.seed)
    n = settings.population_examples
    # Each client's rows: a random offset into one permutation of the pool (no repeats
    # within a client; clients overlap, as K * n may exceed the pool).
    perm = rng.permutation(settings.population_pool)
    starts = rng.integers(0, settings.population_pool - n + 1, num_clients)
    parts = [np.sort(perm[s:s + n]) for s in starts]
    return make_workload("mlp_population", models.build("mlp", 10), (28, 28, 1),
                         ds.train_images, ds.train_labels, parts, ds.test_images,
                         ds.test_labels, n, 1, settings, flops_per_example=6.0 * MLP_PARAMS)


def population_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """Round time and memory as the population K and the clients per round M grow
    (stateless FedAvg: memory must not grow with K).

    Memory after each point: this process's resident memory and the device's memory in
    use once the point's state is dropped but its workload kept (what a run of that K and
    M holds), and the peaks so far (K in increasing order: each peak bounds the points
    before it)."""
    points = []
    strategy = None
    for k in sorted(settings.population_sizes):
        gc.collect()  # the previous K's workload is gone before this one is built
        w = population_workload(settings, k)
        strategy = resolve_strategy("auto", w.variables)
        for m_per in sorted(m for m in settings.population_per_round if m <= k):
            sim = w.simulation(w.executor(strategy, m_per, settings), m_per, settings.seed)
            # No roofline here: its compilations would count in the memory figures.
            m = time_engine(sim, w.variables, None, 1, 1, settings.slow_round_s, cost=False)
            del sim
            gc.collect()
            rec = summarize(m, w.flops_per_example, roof)
            points.append({"num_clients": k, "clients_per_round": m_per,
                           **{key: rec[key] for key in ("seconds_per_round",
                                                        "examples_per_second",
                                                        "compiles_timed")},
                           "client_data_mib": (w.data.index_table.nbytes
                                               + w.data.sizes.nbytes) / 2**20,
                           "rss_mib": rss_mib(), "peak_rss_mib": peak_rss_mib(),
                           "device_in_use_mib": device_in_use_mib(),
                           "device_peak_mib": device_peak_mib()})
            log(f"[scaling] K={k}, {m_per} clients/round: {rec['seconds_per_round']:.3f} "
                f"s/round, RSS {points[-1]['rss_mib']:.0f} MiB (peak "
                f"{points[-1]['peak_rss_mib']:.0f})")
        del w
    return {"strategy": strategy, "examples_per_client": settings.population_examples,
            "pool": settings.population_pool, "points": points}


def moon_many_clients(settings: Settings, log: Log) -> Optional[Dict[str, Any]]:
    """MOON over `moon_clients` Fashion-MNIST clients with the MLP bench network (one
    previous model per client), run by `fedjax_pan.run.main` in a process of its own: its
    peak resident memory against the K previous models' size, and the disk it used."""
    if settings.moon_rounds < 1:
        return None
    k, m, rounds = settings.moon_clients, settings.moon_per_round, settings.moon_rounds
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="fedjax_pan-moon-", dir=_scratch()) as tmp:
        workdir = os.path.join(tmp, "run")
        cmd = [sys.executable, "-m", "fedjax_pan.run.main",
               f"--config={os.path.join(root, 'configs', 'fmnist_mlp.py')}:pans_off",
               f"--workdir={workdir}", "--noprogress", "--config.algorithm=moon",
               f"--config.partition.num_clients={k}", f"--config.participation={m / k}",
               # FEMNIST's protocol's B = 10 (configs/femnist_mlp.py), two epochs.
               "--config.local.epochs=2", "--config.local.batch_size=10",
               f"--config.rounds={rounds}",
               f"--config.eval.every={rounds}", "--config.optimizer.warmup=none",
               f"--config.checkpoint_every={max(1, rounds // 4)}"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        err = proc.stderr.read()
        proc.stderr.close()
        why = (err.strip().splitlines() or ["no message"])[-1]
        if os.waitstatus_to_exitcode(status) == 2:  # invalid input: no Fashion-MNIST here
            log(f"[scaling] MOON over many clients skipped: {why}")
            return None
        if status:
            raise RuntimeError(f"the MOON run failed: {why}")
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        states = os.path.join(workdir, store.FOLDER)
        disk = sum(os.path.getsize(os.path.join(states, f)) for f in os.listdir(states))
        with open(os.path.join(states, "layout.json")) as f:
            layout = json.load(f)
    state_bytes = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize
                      for s, d in zip(layout["shapes"], layout["dtypes"]))
    peak = peak_rss_mib(usage)
    rec = {"num_clients": k, "clients_per_round": m, "rounds": rounds,
           "state_mib_per_client": state_bytes / 2**20,
           "all_states_gib": k * state_bytes / 2**30,
           "host_memory_gib": store.host_memory() / 2**30,
           "disk_gib": disk / 2**30, "peak_rss_gib": peak / 2**10,
           "wall_seconds": seconds, "test_accuracy": summary["final_accuracy"]}
    log(f"[scaling] MOON, K={k}: states {rec['all_states_gib']:.1f} GiB in all, "
        f"{rec['disk_gib']:.1f} GiB on disk, peak RSS {rec['peak_rss_gib']:.2f} GiB")
    return rec


def _scratch() -> Optional[str]:
    """Where the MOON run writes (FEDJAX_PAN_SCRATCH, else the system's temporary folder)."""
    return os.environ.get("FEDJAX_PAN_SCRATCH") or None
