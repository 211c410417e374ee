"""Each registered algorithm's round against FedAvg's, assembled as every run is."""

from __future__ import annotations

from typing import Any, Dict

import jax
import numpy as np

from benchmarks.harness import Log, Settings, Workload, mlp_workload, summarize, time_engine
from benchmarks.roofline import Roof
from fedjax_pan import models
from fedjax_pan.algorithms import tree_bytes
from fedjax_pan.config.defaults import set_keys
from fedjax_pan.engine import Simulation, resolve_strategy
from fedjax_pan.models.grouped import GroupedConfig


def _bench_round(cfg: Any, model: Any, variables: Any, w: "Workload") -> Any:
    """The round `cfg.algorithm` runs on the bench's clients, assembled as every run is
    (`assembly.make_round`); an algorithm using public data gets the first 500 training
    examples, one testing on each client's own part (Siren) the first tenth of each
    client's rows (the speed is what is measured here, not held-out accuracy)."""
    from fedjax_pan.algorithms import registry
    from fedjax_pan.run.assembly import make_round
    from fedjax_pan.engine.evaluation import make_client_evaluator
    entry = registry.ALGORITHMS[cfg.algorithm]
    public = w.data.images[:500] if entry.public else None
    labels = np.asarray(w.data.labels)[:500] if entry.public else None
    client_evaluate = None
    if "client_evaluate" in entry.driver_needs:
        table = np.asarray(w.data.index_table)
        parts = [table[k, :max(1, int(n) // 10)] for k, n in enumerate(w.data.sizes)]
        client_evaluate = make_client_evaluator(model, w.data.images, w.data.labels, parts)
    return make_round(cfg, model, variables, w.data, w.work, public, labels, client_evaluate)


def _bench_config(settings: Settings, w: "Workload", per_round: int) -> Any:
    """The default config with the bench's optimiser (plain momentum SGD at the bench's
    rate, no weight decay, no clipping, no warm-up), participation and seed."""
    from fedjax_pan.config.defaults import default_config
    cfg = default_config()
    cfg.seed = settings.seed
    cfg.participation = per_round / w.data.num_clients
    cfg.partition.num_clients = w.data.num_clients
    opt = cfg.optimizer
    opt.lr, opt.momentum, opt.weight_decay, opt.grad_clip, opt.warmup = (
        settings.learning_rate, settings.momentum, 0.0, 0.0, "none")
    return cfg


def algorithms_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """The MLP bench round (training and aggregation, no evaluation) per registered
    algorithm with its default options, relative to FedAvg; the memory each keeps per
    client (all K) and a stacked aggregation rule's buffer (M outputs)."""
    from fedjax_pan.algorithms import registry

    w = mlp_workload(settings, settings.mlp_clients)
    m_per = settings.mlp_per_round
    cfg = _bench_config(settings, w, m_per)
    strategy = resolve_strategy("auto", w.variables)
    reps = 1 if settings.quick else settings.reps
    out: Dict[str, Any] = {}
    for name in registry.ALGORITHMS:
        cfg.algorithm = name
        model, variables = w.model, w.variables
        if name == "fed2":  # needs a grouped network: the bench MLP, last 3 layers in 10 groups
            model = w.model.clone(grouped=GroupedConfig(groups=10, depth=3))
            variables = models.init(model, jax.random.PRNGKey(settings.seed),
                                    tuple(w.data.images.shape[1:]))
        sim = _bench_round(cfg, model, variables, w)
        if not isinstance(sim, Simulation):
            continue  # its own driver for this config: `driver_rows` below
        m = time_engine(sim, variables, None, settings.warmup, reps, settings.slow_round_s,
                        cost=not settings.quick)
        rec = summarize(m, w.flops_per_example, roof)
        state = sim.init(variables)
        rec = {"seconds_per_round": rec["seconds_per_round"], "reps": rec["reps"],
               "compiles_timed": rec["compiles_timed"],
               "fraction_of_roofline": rec["fraction_of_roofline"],
               "client_state_mib": tree_bytes(state.client_states) / 2**20,
               "server_state_mib": tree_bytes(state.server) / 2**20}
        out[name] = rec
        log(f"[algorithms] {name}: {rec['seconds_per_round']:.3f} s/round, client state "
            f"{rec['client_state_mib']:.1f} MiB")
    for rec in out.values():
        rec["vs_fedavg"] = rec["seconds_per_round"] / out["fedavg"]["seconds_per_round"]

    def fedavg_variant(changes):
        variant = set_keys(cfg.copy_and_resolve_references(), {"algorithm": "fedavg", **changes})
        sim = _bench_round(variant, w.model, w.variables, w)
        m = time_engine(sim, w.variables, None, settings.warmup, reps, settings.slow_round_s,
                        cost=False)
        seconds = summarize(m, w.flops_per_example, roof)["seconds_per_round"]
        return {"seconds_per_round": seconds,
                "vs_fedavg": seconds / out["fedavg"]["seconds_per_round"]}

    # A stacked rule (median) keeps every sampled client's output: M FedAvg deltas.
    median = {**fedavg_variant({"aggregation.rule": "median"}),
              "stacked_outputs_mib": m_per * tree_bytes(w.variables) / 2**20}
    log(f"[algorithms] fedavg + median: {median['seconds_per_round']:.3f} s/round, "
        f"{median['stacked_outputs_mib']:.1f} MiB of stacked outputs")
    # The PAN paper's shuffling during local training (Alg. 2, Fig. 5: P_sf = 0.1).
    shuffled = {}
    for n_sf in (1.0, 5.0):
        shuffled[f"{n_sf:g}"] = fedavg_variant({"shuffle.n_sf": n_sf, "shuffle.p_sf": 0.1})
        log(f"[algorithms] fedavg + Alg. 2 shuffling, N_sf {n_sf:g}: "
            f"{shuffled[f'{n_sf:g}']['seconds_per_round']:.3f} s/round")
    tuned = fine_tuned_evaluation(settings, w, cfg, out["fedavg"]["seconds_per_round"])
    log(f"[algorithms] fedavg-c evaluation (every client fine-tunes for an epoch): "
        f"{tuned['seconds']:.3f} s, {tuned['vs_fedavg_round']:.2f}x a FedAvg round")
    return {"strategy": strategy, "workload": w.describe(m_per), "algorithms": out,
            "median_aggregation": median, "shuffled": shuffled, "fine_tuned": tuned,
            "drivers": driver_rows(settings, w, cfg, strategy, log)}


def fine_tuned_evaluation(settings: Settings, w: Workload, cfg: Any,
                          fedavg_round: float) -> Dict[str, Any]:
    """FedAvg-C's evaluation on the bench: the seconds for every one of the K clients to
    fine-tune the global model for an epoch of its own data (`eval.finetune_epochs` = 1;
    the scoring itself not included), the median of `reps` after one untimed call, and
    over a FedAvg round (which trains the sampled M of them for E epochs)."""
    import time

    variant = set_keys(cfg.copy_and_resolve_references(),
                       {"algorithm": "fedavg", "eval.finetune_epochs": 1.0,
                        "partition.test_fraction": 0.25})
    sim = _bench_round(variant, w.model, w.variables, w)
    state = sim.init(w.variables)
    jax.block_until_ready(sim.personal_evaluation(state))  # compiles
    times = []
    for _ in range(1 if settings.quick else settings.reps):
        start = time.perf_counter()
        jax.block_until_ready(sim.personal_evaluation(state))
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    return {"seconds": seconds, "vs_fedavg_round": seconds / fedavg_round,
            "clients": int(w.data.num_clients)}


def driver_rows(settings: Settings, w: Workload, cfg: Any, strategy: str,
                log: Log) -> Dict[str, Any]:
    """Each algorithm with its own driver (FedMA, KT-pFL in the paper's order) against
    FedAvg, both on the MLP bench at `driver_hidden` widths without PANs: seconds per
    round (FedMA's layers grow, so each of its rounds compiles anew: included), bytes
    sent up (and down, where the driver counts them) per round."""
    from fedjax_pan.algorithms import registry

    model = models.resized(w.model, {f"fc{i}": h for i, h in
                                     enumerate(settings.driver_hidden, start=1)})
    variables = models.init(model, jax.random.PRNGKey(settings.seed),
                            tuple(w.data.images.shape[1:]))
    m_per = settings.mlp_per_round
    sim = _bench_round(set_keys(cfg.copy_and_resolve_references(),
                                {"algorithm": "fedavg", "execution.strategy": strategy}),
                       model, variables, w)
    reps = 1 if settings.quick else settings.reps
    base = time_engine(sim, variables, None, settings.warmup, reps, settings.slow_round_s,
                       cost=False)
    model_bytes = float(tree_bytes(variables))
    fedavg_rec = {"seconds_per_round": float(np.median(base.train_s)),
                  "upload_mib": m_per * model_bytes / 2**20,
                  "download_mib": m_per * model_bytes / 2**20}
    out = {}
    for name, entry in registry.ALGORITHMS.items():
        if entry.driver is None:
            continue
        cfg.algorithm, cfg.execution.strategy = name, strategy
        driver = _bench_round(cfg, model, variables, w)
        if isinstance(driver, Simulation):
            continue  # one compiled round for this config
        m = time_engine(driver, variables, None, settings.warmup, reps, settings.slow_round_s,
                        cost=False)
        stats = m.last_stats
        rec = {"seconds_per_round": float(np.median(m.train_s)), "reps": len(m.train_s),
               "compiles_timed": m.compiles_timed, "compile_s_timed": m.compile_s_timed,
               "upload_mib": stats["upload_bytes"] / 2**20,
               "download_mib": (stats["download_bytes"] / 2**20
                                if "download_bytes" in stats else None),
               "widths": [int(stats[f"train_width_fc{i}"])
                          for i in range(1, len(settings.driver_hidden) + 1)
                          if f"train_width_fc{i}" in stats]}
        rec["vs_fedavg"] = rec["seconds_per_round"] / fedavg_rec["seconds_per_round"]
        out[name] = rec
        log(f"[algorithms] {name}: {rec['seconds_per_round']:.2f} s/round "
            f"({rec['vs_fedavg']:.1f}x FedAvg's on hidden {settings.driver_hidden}), "
            f"{rec['upload_mib']:.1f} MiB up")
    return {"hidden": list(settings.driver_hidden), "fedavg": fedavg_rec, "algorithms": out}
