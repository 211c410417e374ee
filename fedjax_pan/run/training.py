"""The training loop: rounds into a workdir (metrics, checkpoints, summary), resumable,
with every way it can end early reported in one line (`fedjax_pan.errors`)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Dict, List, Optional

import jax
import ml_collections

from fedjax_pan import algorithms
from fedjax_pan.engine import distributed, store
from fedjax_pan.run import reporting, tensorboard
from fedjax_pan import data as data_lib
from fedjax_pan import workdir as workdir_lib
from fedjax_pan.algorithms import sampling
from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.run.assembly import Experiment, build_counted, validate
from fedjax_pan.engine import count_compiles, resolve_strategy
from fedjax_pan.engine.evaluation import client_metrics
from fedjax_pan.engine.simulation import SimState
from fedjax_pan.errors import TrainingDiverged
from fedjax_pan.models.precision import matmul_precision
from fedjax_pan.run.resume import check_workdir, read_metrics

__all__ = ["COUNTERS", "Summary", "train", "train_into", "train_rounds", "evaluate_clients"]


# What a run's summary adds up over all the processes that ran it (kept in checkpoints).
COUNTERS = ("wall_seconds", "real_examples", "computed_examples", "compiles",
            "compiles_after_first_round", "processes", "upload_bytes", "download_bytes")


class Summary(dict):
    """A run's summary (what summary.json holds), carrying the `Experiment` it ran and its
    final `SimState` (`.experiment`, `.state`) for analyses of the trained models."""

    def __init__(self, summary: Dict[str, Any], experiment: Experiment, state: SimState):
        super().__init__(summary)
        self.experiment = experiment
        self.state = state


def train(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool = False,
          overwrite: bool = False, progress: bool = True, desc: str = "") -> Summary:
    """Runs `cfg` into `workdir`; returns the summary (also written to summary.json), with
    the experiment and its final state attached (`Summary`).

    The config, the workdir request and the data are all checked before anything is
    written; see `workdir.claim` for how `overwrite` keeps the old results until this
    run succeeds. In a multi-process run (`fedjax_pan.engine.distributed`) every process trains
    and process 0 alone reads and writes the workdir.
    """
    validate(cfg)
    check_run(cfg, workdir, resume=resume, overwrite=overwrite)
    exp = build_counted(cfg)
    workdir_lib.raise_pending_signal()  # a Ctrl-C while the data loaded: nothing written
    with claim(workdir, overwrite=overwrite, resume=resume):
        return train_into(exp, workdir, resume=resume, progress=progress, desc=desc)


def check_run(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool,
              overwrite: bool) -> None:
    """Every process was given the same config, and process 0 finds `workdir` usable
    (`resume.check_workdir`); a refusal stops every process with the same error."""
    distributed.check_same_config(cfg.to_json())
    distributed.on_primary(lambda: check_workdir(cfg, workdir, resume=resume,
                                                 overwrite=overwrite), "checking the workdir")


def claim(workdir: str, *, overwrite: bool, resume: bool):
    """`workdir.claim` in the process that writes the workdir; nothing in the others."""
    if not distributed.is_primary():
        return contextlib.nullcontext()
    return workdir_lib.claim(workdir, overwrite=overwrite, resume=resume)


def _divergence(loss: float, cfg: ml_collections.ConfigDict) -> Optional[str]:
    """What is wrong with a round's training loss (None: nothing)."""
    if math.isfinite(loss) and loss <= cfg.max_train_loss:
        return None
    why = ("is not finite" if not math.isfinite(loss) else
           f"exceeds config.max_train_loss={cfg.max_train_loss:g}")
    return f"training loss {loss:.4g} {why}"


def _alive(state: SimState) -> bool:
    """Whether none of `state`'s arrays was donated to (and deleted by) a later call."""
    return not any(isinstance(x, jax.Array) and x.is_deleted()
                   for x in jax.tree_util.tree_leaves((state.server, state.client_states)))


def _noisy_features(cfg: ml_collections.ConfigDict) -> List[str]:
    """The settings of features on in `cfg` that put noise or hostile updates into
    training: DP-FedAvg's noise, malicious clients (`attack.scale` where the kind has one)."""
    out = []
    p, a = cfg.get("privacy"), cfg.get("attack")
    if p is not None and p.clip > 0 and p.noise_multiplier > 0:
        out.append(f"privacy.noise_multiplier={p.noise_multiplier:g} (noise of std "
                   f"{p.noise_multiplier:g} x privacy.clip={p.clip:g} on the updates' sum)")
    if a is not None and a.kind != "none":
        if a.kind in attacks.DEFAULT_SCALE:
            scale = attacks.DEFAULT_SCALE[a.kind] if a.scale is None else a.scale
            what = f"attack.scale={scale:g}" + (f" ({a.kind}'s default)" if a.scale is None
                                                else f" ({a.kind})")
        else:
            what = f"attack.kind={a.kind!r}"
        out.append(f"{what} with attack.fraction={a.fraction:g}")
    return out


def _divergence_advice(cfg: ml_collections.ConfigDict) -> str:
    """What to change after a diverged run: the learning rate, or first the settings that
    are likelier causes where there are any: features adding noise or attacks, then the
    algorithm's options set away from their defaults."""
    defaults = algorithms.ALGORITHMS[cfg.algorithm].options
    own = cfg.get(cfg.algorithm) or {}
    changed = [f"{cfg.algorithm}.{k}={own[k]!r}" for k in defaults
               if k in own and own[k] != defaults[k]]
    suspects = _noisy_features(cfg)
    if changed:
        suspects.append(f"{', '.join(changed)} (changed from the default)")
    advice = "lower optimizer.lr or optimizer.grad_clip"
    if suspects:
        advice = f"check {', '.join(suspects)}, or {advice}"
    return advice


def evaluate_clients(exp: Experiment, state: SimState, net: Any, global_variables: Any
                     ) -> Dict[str, float]:
    """Each client's own model (or the global one) on its own test part: the PFLlib
    aggregate and the spread over clients (`engine.evaluation.client_metrics`)."""
    groups = exp.simulation.personal_groups(state)
    if groups is not None:  # clients of several networks: each group on its own network
        correct = count = 0.0
        for group_net, ids, stacked in groups:
            # Vmapped like training, except where training loops (CPU convnets).
            one = jax.tree_util.tree_map(lambda x: x[0], stacked)
            looped = resolve_strategy(exp.config.execution.strategy, one) == "loop"
            part = exp.client_evaluate(stacked, personal=True, vmapped=not looped,
                                       net=group_net, clients=ids)
            correct, count = correct + part["correct"], count + part["count"]
        return client_metrics(correct, count)
    personal = exp.simulation.personal_evaluation(state)
    if personal is None:
        counts = exp.client_evaluate(global_variables, net=net)
    else:
        counts = exp.client_evaluate(personal, personal=True, vmapped=exp.strategy != "loop")
    return client_metrics(counts["correct"], counts["count"])


def train_rounds(exp: Experiment, state: SimState, rounds: int, *, progress: bool = True,
                 desc: str = "rounds") -> tuple:
    """`rounds` more rounds of `exp` without a workdir (analyses, notebooks): the new state
    and each round's statistics. Stops with TrainingDiverged as `train` does."""
    from tqdm.auto import tqdm

    history = []
    for _ in tqdm(range(rounds), desc=desc, disable=not progress, leave=False,
                  dynamic_ncols=True):
        workdir_lib.raise_pending_signal()
        with matmul_precision(exp.config.execution.matmul_precision):
            new_state, stats = exp.simulation.round(state)
        why = _divergence(stats["train_loss"], exp.config)
        if why:
            raise TrainingDiverged(f"training diverged in round {new_state.round}: {why}")
        state = new_state
        history.append(stats)
    return state, history


def _per_client(stats: Dict[str, Any]) -> Dict[str, float]:
    """The round's bytes per client that took part (where the round says how many did):
    what one client sent and received, on average (cohorts vary under Poisson sampling;
    downloads with the rounds a client missed)."""
    n = stats.get("clients")
    if not n:
        return {}
    return {"upload_bytes_per_client": stats["upload_bytes"] / n,
            **({"download_bytes_per_client": stats["download_bytes"] / n}
               if "download_bytes" in stats else {})}


class _Run:
    """One process's share of a run: counters on top of those restored from a checkpoint."""

    def __init__(self, base: Dict[str, Any], setup_compiles: int):
        self.base = {k: base.get(k, 0) for k in COUNTERS}
        self.start = time.time()
        self.real = self.computed = self.rounds = 0
        self.upload = self.download = 0.0
        self.compiles = setup_compiles
        self.first_round_compiles: Optional[int] = None

    def totals(self) -> Dict[str, Any]:
        if not self.rounds:  # e.g. resuming a finished run: its record stands
            return dict(self.base)
        own = {"wall_seconds": time.time() - self.start, "real_examples": self.real,
               "computed_examples": self.computed, "compiles": self.compiles,
               "compiles_after_first_round": self.compiles - self.first_round_compiles,
               "processes": 1, "upload_bytes": self.upload, "download_bytes": self.download}
        return {k: self.base[k] + own[k] for k in COUNTERS}


def train_into(exp: Experiment, workdir: str, *, resume: bool, progress: bool,
               desc: str) -> Summary:
    """The rounds of `exp` into `workdir` (already claimed), resumed from its last
    checkpoint where `resume`; its summary, written to summary.json. Only process 0 of a
    multi-process run touches the workdir; the others receive a resumed state from it."""
    from tqdm.auto import tqdm

    cfg = exp.config
    primary = distributed.is_primary()
    ckpt: Optional[workdir_lib.Checkpoints] = None
    last_saved = 0

    def safe() -> str:
        # A resumed run's rounds count before its checkpoint is read back.
        last = max([last_saved, *workdir_lib.saved_rounds(workdir)])
        if last:
            return (f"{workdir} holds {workdir_lib.rounds_text(last)} (checkpoint of "
                    f"round {last}); free space")
        return "no round of it was saved; free space"

    # The run's float32 products and convolutions at its execution.matmul_precision,
    # JAX's own setting restored after it (each variant of a config sets its own).
    matmuls = matmul_precision(cfg.execution.matmul_precision)
    # The client states' files on disk (engine/store.py) are written by the engine, not
    # here: their faults are reported like the workdir's own.
    with count_compiles() as compiles, matmuls, workdir_lib.writing(
            "the client states", safe, only=(store.StoreWriteError,)):
        # A driver that keeps records beside the run (FLChain's ledger) learns where.
        exp.simulation.attach(workdir, resume)
        state = exp.simulation.init(exp.variables)
        metrics_path = os.path.join(workdir, "metrics.jsonl")
        restored = {"tree": None}

        def open_workdir() -> Dict[str, Any]:
            """(process 0) The checkpoints, and what a resumed run starts from."""
            nonlocal ckpt
            with workdir_lib.writing(f"checkpoints in {workdir}", safe):
                ckpt = workdir_lib.Checkpoints(workdir)
            start = {"round": 0, "counters": {}, "rows": None}
            if resume and ckpt.latest() is not None:
                # The checkpoint's own record of the rows: metrics.jsonl may end in a line
                # a crash cut.
                restored["tree"], start["counters"], start["rows"] = ckpt.restore(
                    ckpt.latest(), state.saved(), saved_shapes=exp.simulation.shapes_change)
                start["round"] = ckpt.latest()
            if start["rows"] is None:
                start["rows"] = read_metrics(metrics_path, start["round"])
            with workdir_lib.writing(f"{workdir}/config.json", safe):
                workdir_lib.write_atomic(os.path.join(workdir, "config.json"),
                                         cfg.to_json(indent=2))
                # drops rows past the restored checkpoint
                workdir_lib.write_atomic(metrics_path, "".join(reporting.json_text(r) + "\n"
                                                               for r in start["rows"]))
            return start
        start = distributed.on_primary(open_workdir, "reading the workdir")
        if start["round"]:
            tree = distributed.broadcast_tree(restored["tree"] if primary else state.saved())
            state = SimState.restored(tree, start["round"])
            last_saved = state.round
        counters, rows = start["counters"], start["rows"]
        run = _Run(counters, exp.setup_compiles)

        saved_totals = run.totals()

        def save(s: SimState) -> None:
            nonlocal last_saved, saved_totals
            totals = run.totals()
            if primary:
                with workdir_lib.writing(f"the checkpoint of round {s.round}", safe):
                    ckpt.save(s.round, s.saved(), totals,
                              [reporting.finite(r) for r in rows if r["round"] <= s.round])
                s.checkpointed()
            last_saved, saved_totals = s.round, totals

        # Client k's expected accuracy on a test set with its own label mix (eval.local).
        counts = data_lib.client_label_counts(exp.dataset.train_labels, exp.client_indices,
                                              exp.dataset.num_classes)
        label_mix = counts / counts.sum(axis=1, keepdims=True)

        def open_events() -> Optional[tensorboard.Writer]:
            """(process 0) TensorBoard's copy of the rows, rebuilt from those kept; a
            finished run that is resumed rewrites nothing."""
            if state.round >= cfg.rounds:
                return None
            with workdir_lib.writing(f"the event files in {workdir}", safe):
                return tensorboard.Writer(workdir, rows)
        events = distributed.on_primary(open_events, "opening the event files")
        bar = tqdm(total=cfg.rounds, initial=state.round, desc=desc or "rounds",
                   disable=not (progress and primary), unit="round", dynamic_ncols=True)
        try:
            while state.round < cfg.rounds:
                workdir_lib.raise_pending_signal()
                t0 = time.time()
                new_state, stats = exp.simulation.round(state)
                # Once a round has run, its evaluation, files and checkpoint complete before a
                # signal is acted on: the state it started from may be gone (donated buffers).
                with workdir_lib.deferred_interrupts():
                    loss, r = stats["train_loss"], new_state.round
                    why = _divergence(loss, cfg)
                    if why:
                        if state.round > last_saved and _alive(state):
                            save(state)
                        kept = (f"the last good checkpoint (round {last_saved}) is kept in "
                                f"{os.path.abspath(os.path.join(workdir, workdir_lib.CHECKPOINTS))}"
                                if last_saved else
                                "no round completed, so nothing was kept")
                        raise TrainingDiverged(f"training diverged in round {r}: {why}; {kept}; "
                                               f"{_divergence_advice(cfg)}")
                    row = None
                    if r % cfg.eval.every == 0 or r == cfg.rounds:
                        net, evaluated = exp.simulation.evaluation(new_state.server)
                        ev = exp.evaluate(evaluated, net)
                        # The algorithm's own metrics (train_*) follow the engine's.
                        row = {"round": r, "test_accuracy": ev["accuracy"],
                               "test_loss": ev["loss"],
                               **{k: v for k, v in stats.items() if k.startswith("train_")},
                               "upload_bytes": stats["upload_bytes"],
                               **({"download_bytes": stats["download_bytes"]}
                                  if "download_bytes" in stats else {}),
                               # every round's bytes so far, unevaluated rounds included
                               "upload_bytes_total": (run.base["upload_bytes"] + run.upload
                                                      + stats["upload_bytes"]),
                               "download_bytes_total": (run.base["download_bytes"]
                                                        + run.download
                                                        + stats.get("download_bytes", 0.0)),
                               **_per_client(stats),
                               # simulated time and arrivals (stragglers: engine/timing.py),
                               # the round's recruits (recruitment: engine's Recruiter)
                               **{k: v for k, v in stats.items()
                                  if k.startswith(("sim_", "recruit_"))},
                               "seconds": time.time() - t0}
                        for name, probe in exp.probes.items():
                            row[name] = probe(evaluated, net)["accuracy"]
                        for name, field in exp.round_fields.items():
                            row[name] = field(r)
                        if exp.client_evaluate is not None:
                            row.update(evaluate_clients(exp, new_state, net, evaluated))
                        if cfg.eval.local:
                            local_acc = label_mix @ ev["class_accuracy"]
                            row.update(local_test_accuracy_mean=float(local_acc.mean()),
                                       local_test_accuracy_min=float(local_acc.min()),
                                       local_test_accuracy_std=float(local_acc.std()))
                    state = new_state
                    run.rounds += 1
                    run.real += stats["real_examples"]
                    run.computed += stats["computed_examples"]
                    run.upload += stats["upload_bytes"]
                    run.download += stats.get("download_bytes", 0.0)
                    run.compiles = exp.setup_compiles + compiles.count
                    if run.first_round_compiles is None:
                        run.first_round_compiles = run.compiles
                    if row is not None:
                        rows.append(row)
                    if row is not None and primary:
                        with workdir_lib.writing(metrics_path, safe):
                            with open(metrics_path, "a") as f:
                                f.write(reporting.json_text(row) + "\n")
                        with workdir_lib.writing(f"the event files in {workdir}", safe):
                            events.write(r, row)
                        bar.set_postfix(acc=f"{100 * row['test_accuracy']:.2f}%",
                                        loss=f"{loss:.3f}")
                    if r % cfg.checkpoint_every == 0 or r == cfg.rounds:
                        save(state)
                    bar.update(1)
        except KeyboardInterrupt as e:
            with workdir_lib.deferred_interrupts():  # a second Ctrl-C must not cut the save
                # A round cut short may have consumed its starting state's buffers; then the
                # last checkpoint stands (its record of the rows goes with it).
                if state.round > last_saved and _alive(state):
                    save(state)
            done = (f"{workdir_lib.rounds_text(last_saved)} "
                    f"{'is' if last_saved == 1 else 'are'} saved in {workdir}"
                    if last_saved else "no round of it was saved")
            # After the last round (a signal while its files were written) only the
            # summary is missing; --resume writes it.
            when = (f"in round {state.round + 1}" if state.round < cfg.rounds
                    else f"after round {state.round}")
            raise workdir_lib.interrupted(e, f"interrupted {when}; {done}") from None
        finally:
            bar.close()
            if ckpt is not None:
                ckpt.close()
            if events is not None:
                events.close()

    totals = saved_totals  # the final round is always saved: its record is the run's
    summary = {**reporting.summarize(rows), "rounds": state.round,
               "wall_seconds": totals["wall_seconds"], "strategy": exp.strategy, "num_clients": len(exp.client_indices),
               "clients_per_round": exp.simulation.num_sampled,
               "sampling": sampling.cohort_sampling(cfg),
               "padding_efficiency": (totals["real_examples"] / totals["computed_examples"]
                                      if totals["computed_examples"] else None),
               "compiles": totals["compiles"],
               "compiles_after_first_round": totals["compiles_after_first_round"],
               "processes": totals["processes"],
               "distributed_processes": distributed.process_count()}
    summary.update(exp.simulation.report(state))  # a driver's own record (FLChain's anchor)
    # summary.json marks a finished run (scripts read it back on --resume), so it comes
    # after the curve, and a signal waits until both are written.
    if not primary:
        return Summary(summary, exp, state)
    with workdir_lib.deferred_interrupts(), \
            workdir_lib.writing(f"the summary of {workdir}", safe):
        reporting.plot_curves({desc or "run": rows}, os.path.join(workdir, "curve.png"),
                    f"{cfg.model.name} on {cfg.dataset.name}")
        workdir_lib.write_atomic(os.path.join(workdir, "summary.json"),
                                 reporting.json_text(summary, indent=2))
    return Summary(summary, exp, state)
