"""Padding efficiency under Dirichlet label skew, bucketed against cohort order."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Tuple

import numpy as np

from benchmarks.harness import (MLP_PARAMS, Log, Settings, Workload, auto_summary,
                                make_workload, naive_baseline, strategies, summarize,
                                time_engine)
from benchmarks.roofline import Roof
from fedjax_pan import data as data_lib
from fedjax_pan import models
from fedjax_pan.engine import Simulation
from fedjax_pan.engine.clients import real_examples
from fedjax_pan.engine.execution import VmapExecutor


class CohortOrderVmapExecutor(VmapExecutor):
    """VmapExecutor without step-count bucketing: blocks follow the cohort's order."""

    def blocks(self, steps: np.ndarray) -> list:
        n = len(steps)
        padded = np.full(math.ceil(n / self.block_size) * self.block_size, -1)
        padded[:n] = np.arange(n)
        return list(padded.reshape(-1, self.block_size))


def _unbucketed(executor: VmapExecutor) -> CohortOrderVmapExecutor:
    # Same fields as the library-built executor, only the blocks differ.
    return CohortOrderVmapExecutor(**{f.name: getattr(executor, f.name)
                                      for f in dataclasses.fields(executor)})


def _padding_data(settings: Settings, log: Log) -> Tuple[data_lib.Dataset, str]:
    if settings.padding_dataset == "fashion_mnist":
        try:
            ds = data_lib.load("fashion_mnist")
            return dataclasses.replace(
                ds, train_images=data_lib.normalize(ds.train_images, "fashion_mnist"),
                test_images=data_lib.normalize(ds.test_images, "fashion_mnist")), ds.name
        except (data_lib.DataError, ImportError, OSError) as e:
            log(f"[padding] Fashion-MNIST unavailable ({e}); using synthetic data")
    n = settings.padding_clients * settings.mlp_examples
    return data_lib.synthetic(n, settings.test_examples, seed=settings.seed), "synthetic"


def padding_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """Unequal clients (Dirichlet by client): padding efficiency and time per configuration.

    'vmap' is the library's default blocks; 'vmap G=g' fixes the block size, bucketed
    (sorted by step count, the library) or unbucketed (cohort order, this module's
    subclass). With g = clients per round there is one block, so sorting cannot help.
    """
    ds, name = _padding_data(settings, log)
    parts = data_lib.partition(ds.train_labels, settings.padding_clients,
                               "dirichlet_by_client", settings.seed,
                               alpha=settings.padding_alpha)
    model = models.build("mlp", 10)
    w = make_workload(f"mlp_{name}_dirichlet", model, (28, 28, 1), ds.train_images,
                      ds.train_labels, parts, ds.test_images, ds.test_labels,
                      settings.batch_size, settings.padding_epochs, settings,
                      flops_per_example=6.0 * MLP_PARAMS)
    m_per = settings.padding_per_round
    executors = {s: w.executor(s, m_per, settings) for s in strategies()}
    for g in sorted(set(settings.padding_block_sizes) | {m_per}):
        bucketed = w.executor("vmap", m_per, settings, block_size=g)
        if g < m_per:
            executors[f"vmap G={g} bucketed"] = bucketed
        executors[f"vmap G={g} unbucketed"] = _unbucketed(bucketed)

    evaluate = w.evaluator(settings.eval_batch_size)
    configs, sim = {}, None
    for label, ex in executors.items():
        sim = w.simulation(ex, m_per, settings.seed)
        m = time_engine(sim, w.variables, evaluate, settings.warmup, settings.padding_reps,
                        settings.slow_round_s)
        rec = summarize(m, w.flops_per_example, roof)
        rec["block_size"] = getattr(ex, "block_size", 1)
        rec["expected_padding_efficiency"] = _expected_efficiency(
            w, sim, ex, settings.padding_cohorts)
        configs[label] = rec
        log(f"[padding] {label}: efficiency {rec['padding_efficiency']:.3f}, "
            f"{rec['seconds_per_round']:.3f} s/round")
    _, naive = naive_baseline(w, sim, settings, settings.padding_reps, configs, roof,
                               "padding", log)
    return {"dataset": name, "alpha": settings.padding_alpha,
            "workload": w.describe(m_per), "configs": configs, "naive": naive,
            "auto": auto_summary(configs, w.variables)}


def _expected_efficiency(w: Workload, sim: Simulation, executor: Any, cohorts: int) -> float:
    """real / computed examples over `cohorts` sampled rounds, without training."""
    real = computed = 0
    for r in range(cohorts):
        ids = sim.sample(r)
        steps = w.work.num_steps(w.data.sizes[ids])
        real += real_examples(w.work, w.data.sizes[ids])
        computed += executor.computed_examples(w.data.sizes[ids], steps)
    return real / computed
