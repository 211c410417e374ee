"""Execution strategies agree with the sequential reference, and never recompile."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import ROOT, max_rel_err, tiny_clients, tiny_fedavg
from fedjax_pan.engine import Augment, LocalWork, Simulation, count_compiles, make_executor
from fedjax_pan.engine.execution import (ClientProgram, LoopExecutor, VmapExecutor,
                                         has_convolutions, resolve_strategy)
from fedjax_pan.engine.reference import reference_round
from fedjax_pan.pan import PANConfig

# Client sizes whose last batches (B=8) hold >= 3 examples, so BatchNorm is well conditioned;
# run alone, their tails take 4, 6 or (39: 7 real, rounded up to B) 8 rows.
SIZES = [27, 39, 19, 36, 62, 13]
WORK = LocalWork(batch_size=8, epochs=1.5)


def _run(strategy, algo, cd, variables, rounds=2, block_size=None, weights="num_examples",
         workers=None):
    ex = make_executor(strategy, algo, WORK, cd, variables, 3, block_size=block_size,
                       workers=workers)
    sim = Simulation(algo, cd, WORK, ex, participation=0.5, aggregation=weights, seed=7)
    state, losses = sim.init(variables), []
    for _ in range(rounds):
        state, stats = sim.round(state)
        losses.append(stats["train_loss"])
    return sim, state, losses


def _reference(sim, algo, cd, variables, rounds=2):
    state, losses = sim.init(variables), []
    for r in range(rounds):
        server, states, loss = reference_round(algo, cd, WORK.batch_size, state.server,
                                               sim.cohort(state, r))
        state = state._replace(server=server, round=r + 1)
        losses.append(loss)
    return state, losses


# GroupNorm has no state to average; BatchNorm (with its masked statistics) is the hard case.
@pytest.mark.parametrize("norm", [pytest.param("none", marks=pytest.mark.slow), "batch"])
def test_strategies_match_the_sequential_reference(norm):
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg(norm=norm, pan=PANConfig("mul", 1.0, 0.2))
    runs = {f"{s}/{g}": _run(s, algo, cd, variables, block_size=g)
            for s, g in [("loop", None), ("vmap", 1), ("vmap", 2), ("vmap", 3)]}
    runs["vmap/1 one at a time"] = _run("vmap", algo, cd, variables, block_size=1, workers=1)
    sim = runs["loop/None"][0]
    ref_state, ref_losses = _reference(sim, algo, cd, variables)
    for name, (_, state, losses) in runs.items():
        assert max_rel_err(state.server, ref_state.server) < 1e-5, name
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)
    # Training changed the model (the comparison is not between two untouched inits).
    assert max_rel_err(ref_state.server.params, variables["params"]) > 1e-2


def test_augmented_batches_are_the_same_under_every_strategy():
    """Random crops and flips drawn per client, step and row: loop, vmap blocks and the
    sequential reference (short last batches) train on the same augmented images."""
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    work = LocalWork(batch_size=8, epochs=1.5, augment=Augment(pad=2, fill=(-0.5,)))
    states = {}
    for strategy, block in [("loop", None), ("vmap", 1), ("vmap", 3)]:
        ex = make_executor(strategy, algo, work, cd, variables, 3, block_size=block)
        sim = Simulation(algo, cd, work, ex, participation=0.5, seed=7)
        states[f"{strategy}/{block}"] = sim.round(sim.init(variables))[0]
    ref, _, _ = reference_round(algo, cd, work.batch_size, sim.init(variables).server,
                                sim.cohort(sim.init(variables), 0), work.augment)
    plain, _, _ = reference_round(algo, cd, work.batch_size, sim.init(variables).server,
                                  sim.cohort(sim.init(variables), 0))
    for name, state in states.items():
        assert max_rel_err(state.server, ref) < 1e-5, name
    assert max_rel_err(plain, ref) > 1e-3  # augmentation changed what was trained on


def test_uniform_and_weighted_aggregation_both_match_reference():
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    for weights in ["uniform", "num_examples"]:
        sim, state, _ = _run("vmap", algo, cd, variables, block_size=2, weights=weights)
        ref_state, _ = _reference(sim, algo, cd, variables)
        assert max_rel_err(state.server, ref_state.server) < 1e-5, weights


def test_no_recompilation_after_the_first_round():
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    for strategy, g in [("loop", None), ("vmap", 1), ("vmap", 2)]:
        ex = make_executor(strategy, algo, WORK, cd, variables, 3, block_size=g)
        sim = Simulation(algo, cd, WORK, ex, participation=0.5, seed=1)
        state = sim.init(variables)
        with count_compiles() as first:
            state, _ = sim.round(state)
        with count_compiles() as later:
            for _ in range(4):  # different cohorts, different step counts
                state, _ = sim.round(state)
        assert first.count > 0, strategy
        assert later.count == 0, strategy


def test_vmap_bucketing_limits_padding():
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    ex = make_executor("vmap", algo, WORK, cd, variables, 6, block_size=2)
    steps = WORK.num_steps(cd.sizes)  # [6, 8, 5, 8, 12, 3]
    blocks = [sorted(steps[g].tolist()) for g in ex.blocks(steps)]
    assert blocks == [[8, 12], [6, 8], [3, 5]]  # sorted by step count
    assert ex.computed_examples(cd.sizes, steps) == 2 * (12 + 8 + 5) * 8


def test_lone_clients_compute_short_last_batches_on_fewer_rows():
    # B=8 (tail granule 2), 1.5 epochs. 27 = 3*8 + 3: 4 steps/epoch, 6 steps: 3 full,
    # a tail of 3 real on 4 rows, 2 full -> 5*8 + 4 rows. A partial second epoch never
    # reaches its tail. 39 = 4*8 + 7: no separate tail, 8 steps of 8 rows.
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    steps = WORK.num_steps(cd.sizes)
    rows = {27: 5 * 8 + 4, 39: 8 * 8, 19: 4 * 8 + 4, 36: 7 * 8 + 4, 62: 11 * 8 + 6,
            13: 2 * 8 + 6}
    total = sum(rows[n] for n in cd.sizes)
    for strategy, g in [("loop", None), ("vmap", 1)]:
        ex = make_executor(strategy, algo, WORK, cd, variables, 6, block_size=g)
        sim = Simulation(algo, cd, WORK, ex, participation=1.0)
        _, stats = sim.round(sim.init(variables))
        assert stats["computed_examples"] == total, strategy
        # Padding rows: 27 and 19 one each (3 real on 4), 39 one (7 on 8), 13 one (5 on 6).
        assert stats["real_examples"] == total - 4, strategy
    vmap2 = make_executor("vmap", algo, WORK, cd, variables, 6, block_size=2)
    assert vmap2.computed_examples(cd.sizes, steps) > total  # lockstep blocks pad


def test_lone_clients_side_by_side_give_the_sequential_numbers():
    """workers=2 keeps two lone clients in flight at once and adds their sums in cohort
    order: the server, the metrics and every client's state equal one client at a time,
    for a streamed mean, a stacked rule and per-client states."""
    from fedjax_pan.algorithms import median
    import test_scaffold as sc
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg(norm="batch")
    for a in (algo, algo._replace(aggregator=median())):
        (s1, one, l1), (s2, two, l2) = (_run("vmap", a, cd, variables, block_size=1,
                                             workers=w) for w in (1, 2))
        assert not s1.executor.concurrent and s2.executor.concurrent
        assert max_rel_err(one.server, two.server) < 1e-6
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        assert max_rel_err(two.server.params, variables["params"]) > 1e-2
    sc_variables, _, scaffold = sc._tiny_scaffold()
    states = []
    for w in (1, 2):
        ex = make_executor("vmap", scaffold, sc.WORK, cd, sc_variables, 4, block_size=1,
                           workers=w)
        sim = Simulation(scaffold, cd, sc.WORK, ex, participation=0.67, seed=7)
        state = sim.init(sc_variables)
        for _ in range(2):
            state, _ = sim.round(state)
        states.append(state)
    assert max_rel_err(states[0].server, states[1].server) < 1e-6
    assert max_rel_err(states[0].client_states, states[1].client_states) < 1e-6
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        make_executor("vmap", algo, WORK, cd, variables, 3, block_size=1, workers=0)


def test_default_workers_by_backend_and_environment(monkeypatch):
    from fedjax_pan.engine.execution import default_workers
    monkeypatch.delenv("FEDJAX_PAN_WORKERS", raising=False)
    if jax.default_backend() == "cpu" and (os.cpu_count() or 1) >= 2:
        assert default_workers(1) == 2
    assert default_workers(4) == 1  # vmapped blocks: one program at a time
    monkeypatch.setenv("FEDJAX_PAN_WORKERS", "3")
    assert default_workers(1) == 3
    monkeypatch.setenv("FEDJAX_PAN_WORKERS", "two")
    with pytest.raises(ValueError, match="FEDJAX_PAN_WORKERS must be a positive integer, "
                                         "got 'two'"):
        default_workers(1)


def test_loop_without_donation_gives_the_same_numbers():
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg(norm="batch")
    states = []
    for donate in (True, False):
        ex = LoopExecutor(ClientProgram(algo, WORK, cd), cd, donate=donate)
        sim = Simulation(algo, cd, WORK, ex, participation=0.5, seed=3)
        state, _ = sim.round(sim.init(variables))
        states.append(state.server)
    assert max_rel_err(states[0], states[1]) < 1e-6
    assert max_rel_err(states[0].params, variables["params"]) > 1e-2


def test_auto_picks_by_backend_and_model():
    _, variables, _ = tiny_fedavg()
    conv = {"params": {"conv1": {"kernel": np.zeros((3, 3, 1, 4))}}}
    assert not has_convolutions(variables) and has_convolutions(conv)
    if jax.default_backend() == "cpu":
        assert resolve_strategy("auto", variables) == "vmap"
        assert resolve_strategy("auto", conv) == "loop"
    assert resolve_strategy("loop", variables) == "loop"
    with pytest.raises(ValueError, match="pmap"):
        resolve_strategy("pmap", variables)


def test_executor_types():
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    assert isinstance(make_executor("loop", algo, WORK, cd, variables, 3), LoopExecutor)
    assert make_executor("loop", algo, WORK, cd, variables, 3).donate
    conv = {"params": {"conv1": {"kernel": np.zeros((3, 3, 1, 4))}}}
    assert not make_executor("loop", algo, WORK, cd, conv, 3).donate  # slower for convs
    assert isinstance(make_executor("vmap", algo, WORK, cd, variables, 3), VmapExecutor)


SHARDED_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax
    assert jax.device_count() == 4, jax.devices()
    from conftest import max_rel_err, reference_rounds, tiny_clients, tiny_fedavg
    from test_execution import SIZES, _reference, _run
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg(norm="batch")
    sim, state, losses = _run("sharded", algo, cd, variables, block_size=None)
    assert sim.executor.block_size % 4 == 0 and sim.executor.mesh is not None
    ref_state, ref_losses = _reference(sim, algo, cd, variables)
    err = max_rel_err(state.server, ref_state.server)
    assert err < 1e-5, err
    # A stateful algorithm: the server and all K client states, against the reference.
    import test_scaffold as sc
    _, cd6 = tiny_clients(sc.SIZES)
    sc_variables, _, scaffold = sc._tiny_scaffold()
    sim, state = sc._run("sharded", scaffold, cd6, sc_variables)
    ref = reference_rounds(sim, scaffold, cd6, sc_variables, sc.WORK.batch_size)
    err_s = max(max_rel_err(state.server, ref.server),
                max_rel_err(state.client_states, ref.client_states))
    assert err_s < 1e-5, err_s
    # A stacked aggregation rule: every client's output gathered across the devices.
    from fedjax_pan.algorithms import median
    algo_m = algo._replace(aggregator=median())
    sim, state, _ = _run("sharded", algo_m, cd, variables, rounds=1)
    ref_m, _ = _reference(sim, algo_m, cd, variables, rounds=1)
    err_m = max_rel_err(state.server, ref_m.server)
    assert err_m < 1e-5, err_m
    print("sharded ok", err, err_s, err_m)
""")


@pytest.mark.slow  # about 10 s: a subprocess with four CPU devices compiles afresh
def test_sharded_strategy_on_four_cpu_devices():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    script = SHARDED_SCRIPT.format(tests=os.path.join(ROOT, "tests"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sharded ok" in out.stdout


def test_a_batch_larger_than_every_client_computes_only_the_clients_rows():
    """B far above every client's size: each epoch is one batch of the whole client, so
    a batch is never wider than the largest client (62 here) under any strategy, and the
    rounds equal the sequential reference's at that B (which pads each batch to B rows)."""
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    work = LocalWork(batch_size=100_000, epochs=2.0)
    ids = np.arange(len(SIZES))
    for strategy, block in (("loop", None), ("vmap", 1), ("vmap", 3)):
        ex = make_executor(strategy, algo, work, cd, variables, len(SIZES), block_size=block,
                           workers=1)
        sim = Simulation(algo, cd, work, ex, participation=1.0, aggregation="num_examples",
                         seed=7)
        state = sim.init(variables)
        cohort = sim.cohort(state, 0)
        assert sorted(cohort.ids.tolist()) == ids.tolist()
        result = ex.run(state.server, cohort)
        # Two epochs of one batch each. Alone, a client's rows rounded up to a quarter of
        # 62 (27 -> 32, 39 -> 48, 19 -> 32, 36 -> 48, 62, 13 -> 16); in lockstep, 62.
        alone = 2 * (32 + 48 + 32 + 48 + 62 + 16)
        assert result.computed_examples == (alone if block in (None, 1) else
                                            2 * len(SIZES) * 62), strategy
        new, _ = sim.round(state)
        server, _, _ = reference_round(algo, cd, work.batch_size, state.server, cohort)
        assert max_rel_err(new.server, server) < 1e-5, strategy


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_upload_bytes_are_summed_exactly_past_float32(strategy):
    # 2^24 + 1 bytes a client: float32 holds neither one client's count nor the sum.
    _, cd = tiny_clients([20, 30, 25, 18, 22, 16])
    _, variables, algo = tiny_fedavg()
    algo = algo._replace(upload_bytes=lambda output, local: 2**24 + 1)
    sim = Simulation(algo, cd, LocalWork(batch_size=8, epochs=1),
                     make_executor(strategy, algo, LocalWork(batch_size=8, epochs=1), cd,
                                   variables, 3), 0.5)
    _, stats = sim.round(sim.init(variables))
    assert stats["upload_bytes"] == 3 * (2**24 + 1)
