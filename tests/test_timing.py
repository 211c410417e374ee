"""Stragglers: the delay model (and the authors' forced delays), the round plans by hand,
the in-flight buffer against a plain-Python event simulation (and its slots bounded by
what can be in flight, even for long delays), delay 0 (and waiting for everyone, or every
free client forced to 0) bit for bit the synchronous engine, resume with outputs in
flight (and from a checkpoint of the earlier D * D slots), and outputs in flight too big
for the memory refused before the data load."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_clients
from fedjax_pan.run import experiment
from fedjax_pan.algorithms.aggregation import median
from fedjax_pan.algorithms.core import FederatedAlgorithm
from fedjax_pan.data import sources
from fedjax_pan.engine import LocalWork, Simulation, make_executor, timing
from fedjax_pan.engine.protocol import tree_bytes

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config, metrics  # noqa: E402

WORK = LocalWork(batch_size=8, epochs=1)


def test_delays_are_seeded_uniform_or_a_fixed_slow_share():
    model = timing.Stragglers(2)
    ids = np.arange(40)
    no_slow = np.zeros(100, bool)
    d = model.draw(0, 3, ids, no_slow)
    np.testing.assert_array_equal(d, model.draw(0, 3, ids, no_slow))  # (seed, round) alone
    assert set(d.tolist()) == {0, 1, 2}
    assert not np.array_equal(d, model.draw(0, 4, ids, no_slow))
    slow_model = timing.Stragglers(3, delays="slow", slow_share=0.25)
    slow = slow_model.slow_clients(7, 100)
    assert slow.sum() == 25
    np.testing.assert_array_equal(slow, slow_model.slow_clients(7, 100))
    np.testing.assert_array_equal(slow_model.draw(7, 0, ids, slow), np.where(slow[ids], 3, 0))
    with pytest.raises(ValueError, match="unknown straggler policy"):
        timing.Stragglers(2, policy="hurry")


def test_forced_delays_go_to_the_first_free_clients_in_a_seeded_order():
    """The SageFlow authors' `Sageflow.py` gives the first three free clients of a round
    delays 0, 1, 2 (every staleness group gets one); the others keep their draw."""
    model = timing.Stragglers(2, forced=(0, 1, 2))
    plain = timing.Stragglers(2)
    ids, no_slow = np.arange(10, 30), np.zeros(100, bool)
    free = np.ones(len(ids), bool)
    free[[0, 3, 4, 9]] = False  # busy: never forced
    for r in range(6):
        d, base = model.draw(1, r, ids, no_slow, free), plain.draw(1, r, ids, no_slow)
        # The first three of a seeded permutation of the free positions take 0, 1, 2;
        # everyone else (the busy included) keeps the uniform draw.
        order = np.random.default_rng([1, r, timing._FORCED_STREAM]).permutation(
            np.flatnonzero(free))[:3]
        np.testing.assert_array_equal(d[order], [0, 1, 2])
        rest = np.ones(len(ids), bool)
        rest[order] = False
        np.testing.assert_array_equal(d[rest], base[rest])
        np.testing.assert_array_equal(d, model.draw(1, r, ids, no_slow, free))  # seeded
    # Fewer free clients than forced delays: those take the first ones.
    one = np.zeros(len(ids), bool)
    one[5] = True
    assert model.draw(1, 0, ids, no_slow, one)[5] == 0
    with pytest.raises(ValueError, match="straggler.forced"):
        timing.Stragglers(1, forced=(0, 1, 2))
    from fedjax_pan.run import assembly
    from fedjax_pan.errors import ConfigError
    with pytest.raises(ConfigError, match="straggler.forced"):
        assembly.validate(config(straggler__max_delay=1, straggler__forced=(0, 1, 2)))


def test_round_plans_by_hand():
    # Five sampled clients at time 10; client 3 is busy until 11.
    free_at = np.array([0.0, 10.0, 5.0, 11.0, 0.0, 0.0])
    ids = np.array([0, 1, 2, 3, 5])
    delays = np.array([0, 2, 1, 0, 1])
    active = [True, True, True, False, True]

    def plan(policy, share=0.5):
        return timing.plan(timing.Stragglers(2, policy, wait_share=share), 10.0, free_at,
                           ids, delays)

    p = plan("wait_all")  # waits for the delay-2 client: 3 time units
    np.testing.assert_array_equal(p.active, active)
    np.testing.assert_array_equal(p.used, active)
    assert p.duration == 3.0 and not p.kept.any()
    p = plan("wait_share")  # active delays sorted 0, 1, 1, 2: half = 2 outputs -> wait 1
    np.testing.assert_array_equal(p.used, [True, False, True, False, True])
    assert p.duration == 2.0
    assert plan("wait_share", 0.2).duration == 1.0  # ceil(0.2 * 4) = 1 output
    p = plan("ignore")
    np.testing.assert_array_equal(p.used, [True, False, False, False, False])
    assert p.duration == 1.0 and not p.kept.any()
    p = plan("stale")
    np.testing.assert_array_equal(p.kept, [False, True, True, False, True])
    assert p.duration == 1.0


def _tagging_algorithm(stacked: bool) -> FederatedAlgorithm:
    """Each client sends v = 100 * id + the round its broadcast is from; the server keeps
    the last aggregate of v and counts its updates. No training."""
    def client_init(server, client_state, ctx):
        return {"v": 100.0 * ctx.client_id.astype(jnp.float32) + server["round"]}

    def client_step(local, batch, server):
        return local, {"loss_sum": jnp.float32(0.0), "num_examples": jnp.float32(0.0)}

    def server_update(server, aggregate, info):
        return {"round": server["round"] + 1.0, "last": aggregate["v"],
                "updates": server["updates"] + 1.0}

    algo = FederatedAlgorithm(
        lambda v: {"round": jnp.float32(0), "last": jnp.float32(-1), "updates": jnp.float32(0)},
        lambda s: None, client_init, client_step, lambda local, server: (local, None),
        server_update, lambda s: s)
    return algo._replace(aggregator=median()) if stacked else algo


def _event_simulation(sim, model, rounds, stacked):
    """Who arrives when, in plain Python: the expected last aggregate after each round
    (None: no update), and the server's own round counter (its broadcast tag)."""
    free = {k: 0.0 for k in range(sim.data.num_clients)}
    in_flight = []  # (arrival round, value)
    clock, tag, expected = 0.0, 0.0, []
    for t in range(rounds):
        ids = sim.sample(t)
        delays = model.draw(sim.seed, t, ids, np.zeros(sim.data.num_clients, bool))
        now_values = []
        for k, d in zip(ids.tolist(), delays.tolist()):
            if free[k] > clock:
                continue  # busy
            free[k] = clock + 1 + d
            value = 100.0 * k + tag
            if d == 0:
                now_values.append(value)
            else:
                in_flight.append((t + d, value))
        now_values += [v for r, v in in_flight if r == t]
        in_flight = [(r, v) for r, v in in_flight if r != t]
        clock += 1.0
        if now_values:
            tag += 1.0
            agg = np.median(now_values) if stacked else np.mean(now_values)
            expected.append((agg, len(now_values)))
        else:
            expected.append((None, 0))
    return expected


@pytest.mark.parametrize("stacked", [False, True], ids=["streaming", "stacked"])
def test_stale_outputs_arrive_as_a_plain_event_simulation_says(stacked):
    _, cd = tiny_clients([9] * 12)
    algo = _tagging_algorithm(stacked)
    model = timing.Stragglers(2, "stale")
    ex = make_executor("loop", algo, WORK, cd, {}, 6)
    sim = Simulation(algo, cd, WORK, ex, 0.5, seed=3, stragglers=model)
    _check_against_event_simulation(sim, model, sim.init({}), 12, stacked)


def _check_against_event_simulation(sim, model, state, rounds, stacked):
    """Runs `rounds` rounds from `state`, each aggregate as `_event_simulation` says;
    returns the last state and the most slots in flight that held something."""
    want = _event_simulation(sim, model, rounds, stacked)
    late_seen, most = False, 0
    for t in range(rounds):
        last = float(state.server["last"])
        state, stats = sim.round(state)
        value, count = want[t]
        assert sum(stats["sim_arrivals"]) == count
        late_seen |= sum(stats["sim_arrivals"][1:]) > 0
        if value is None:
            assert float(state.server["last"]) == last  # nothing arrived: unchanged
        else:
            assert float(state.server["last"]) == pytest.approx(value, rel=1e-6)
        assert stats["sim_time"] == t + 1
        most = max(most, int((state.timing.arrival >= 0).sum()))
    assert late_seen
    return state, most


def test_in_flight_slots_count_what_can_be_in_flight():
    # Streaming, D = 2: a group of delay 1 or 2 from the last round, one of delay 2 from the
    # round before; D = 30 with 4 a round: 1 + 2 + 3 + 4 * 27 groups, or the K clients.
    assert timing.in_flight_slots(2, 4, 100, stacked=False) == 3
    assert timing.in_flight_slots(30, 4, 1000, stacked=False) == 114
    assert timing.in_flight_slots(30, 4, 20, stacked=False) == 20
    assert timing.in_flight_slots(30, 4, 20, stacked=True) == 120  # a client a slot


@pytest.mark.parametrize("stacked", [False, True], ids=["streaming", "stacked"])
def test_a_long_delay_keeps_a_slot_per_output_that_can_be_in_flight(stacked):
    """max_delay = 30 once kept D * D = 900 slots for a streaming rule; now the outputs in
    flight take at most a slot per client that can be late at once (K = 12), and arrive
    as the event simulation says."""
    _, cd = tiny_clients([9] * 12)
    algo = _tagging_algorithm(stacked)
    model = timing.Stragglers(30, "stale")
    ex = make_executor("loop", algo, WORK, cd, {}, 6)
    sim = Simulation(algo, cd, WORK, ex, 0.5, seed=3, stragglers=model)
    state, most = _check_against_event_simulation(sim, model, sim.init({}), 40, stacked)
    st = state.timing
    entry = tree_bytes(jax.tree_util.tree_map(lambda x: x[0], st.entries))
    held = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(st))
    slots = 30 * 6 if stacked else 12  # streaming: the K clients bound the groups
    assert len(st.arrival) == slots
    # The state: its slots' entries, their weight, arrival, origin and ids, and the clock
    # and the clients' free times.
    width = 1 if stacked else 6
    assert held == slots * (entry + 4 + 8 + 8 + 8 * width) + 8 + 12 * 8
    assert most == 12  # every client late at once: the K slots are all used


def test_a_checkpoint_of_the_earlier_layout_resumes_bit_for_bit(tmp_path):
    """Checkpoints written while a streaming rule kept D * D slots (here 9) resume: the
    first empty slot was always taken, so the slots past the ones now kept (6) are empty."""
    from fedjax_pan.engine import SimState
    from fedjax_pan.workdir import Checkpoints
    _, cd = tiny_clients([9] * 12)
    algo = _tagging_algorithm(False)
    model = timing.Stragglers(3, "stale")
    ex = make_executor("loop", algo, WORK, cd, {}, 6)
    sim = Simulation(algo, cd, WORK, ex, 0.5, seed=3, stragglers=model)
    state = sim.init({})
    for _ in range(4):
        state, _ = sim.round(state)
    assert len(state.timing.arrival) == 6 and (state.timing.arrival >= 0).any()
    legacy = state._replace(timing=timing.resized(state.timing, 9))
    ckpt = Checkpoints(str(tmp_path))
    ckpt.save(4, legacy.saved(), {})
    tree, _, _ = ckpt.restore(4, sim.init({}).saved())
    resumed = SimState.restored(tree, 4)
    assert len(resumed.timing.arrival) == 9
    for _ in range(5):
        state, stats = sim.round(state)
        resumed, resumed_stats = sim.round(resumed)
        assert resumed_stats == stats
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(resumed)):
            np.testing.assert_array_equal(a, b)  # the slots kept too: 6 again
    # A slot past those kept that holds an output: not a state of this config.
    full = legacy.timing._replace(arrival=np.where(np.arange(9) == 8, 7, -1))
    with pytest.raises(ValueError, match="past the first 6 hold outputs"):
        timing.resized(full, 6)


def test_outputs_in_flight_that_cannot_fit_are_refused_before_the_data_loads(monkeypatch):
    from fedjax_pan.algorithms import stragglers
    from fedjax_pan.errors import ConfigError
    from fedjax_pan.run import assembly

    def no_load(*args, **kwargs):
        raise AssertionError("the data were loaded")
    monkeypatch.setattr(assembly, "_load_dataset", no_load)
    assert timing.available_memory() > 100_000_000  # this machine's, read from the kernel
    monkeypatch.setattr(timing, "available_memory", lambda: 100_000_000)  # 0.1 GB
    big = config(straggler__max_delay=100, partition__num_clients=1000, participation=0.1)
    # 1000 groups (the K clients) of the 64-wide MLP's 236,840 bytes: 0.24 GB.
    assert stragglers.model_bytes(big) == 236840
    with pytest.raises(ConfigError, match=r"config\.straggler\.max_delay=100 with 100 clients "
                                          r"a round \(of 1000\) can keep 1000 outputs.*"
                                          r"about 0\.2 GB.*0\.1 GB of memory available"):
        assembly.build(big)
    # Those that fit, or keep nothing in flight, pass.
    assembly.validate(config(straggler__max_delay=2, partition__num_clients=1000,
                             participation=0.1))
    assembly.validate(config(straggler__max_delay=100, partition__num_clients=1000,
                             participation=0.1, straggler__policy="ignore"))
    # After the data load the engine checks the entry's own size (an output may be
    # larger than the model) before it allocates the slots.
    _, cd = tiny_clients([9] * 12)
    algo = _tagging_algorithm(True)
    sim = Simulation(algo, cd, WORK, make_executor("loop", algo, WORK, cd, {}, 6), 0.5,
                     stragglers=timing.Stragglers(30, "stale"))
    monkeypatch.setattr(timing, "available_memory", lambda: 1000)
    with pytest.raises(ConfigError, match="straggler.max_delay=30 with 6 clients a round"):
        sim.init({})


def test_the_model_size_known_before_the_data_load_is_the_built_models():
    from fedjax_pan.algorithms import stragglers
    from fedjax_pan.run import assembly
    cfg = config(straggler__max_delay=2, rounds=1)
    exp = assembly.build(cfg)
    assert stragglers.model_bytes(cfg) == tree_bytes(exp.variables)
    # The input shapes and classes the estimate assumes are those the data have.
    try:
        ds = assembly.load_dataset("fashion_mnist")
    except Exception:  # noqa: BLE001 - not installed here
        return
    assert sources.SHAPES["fashion_mnist"] == (ds.input_shape, ds.num_classes)


def test_every_delay_zero_is_the_synchronous_engine_bit_for_bit(tmp_path):
    plain = str(tmp_path / "plain")
    experiment.train(config(rounds=3), plain, progress=False)
    # Two ways nothing is ever late: a slow share of 0, and waiting for everyone (whose
    # rounds last longer but use every output fresh).
    for name, changes in (("slow0", dict(straggler__max_delay=2, straggler__delays="slow",
                                          straggler__slow_share=0.0)),
                          ("wait_all", dict(straggler__max_delay=2,
                                            straggler__policy="wait_all")),
                          # every free client forced to delay 0 (`straggler.forced`)
                          ("forced0", dict(straggler__max_delay=2,
                                           straggler__forced=(0,) * 100))):
        run = str(tmp_path / name)
        experiment.train(config(rounds=3, **changes), run, progress=False)
        got = metrics(run)
        for a, b in zip(metrics(plain), got):
            assert {k: v for k, v in b.items() if not k.startswith("sim_")} == a
        times = [r["sim_time"] for r in got]
        if name in ("slow0", "forced0"):
            assert times == [1.0, 2.0, 3.0]
        else:
            assert times[-1] > 3.0 and all(r["sim_busy"] == 0 for r in got)


def test_resume_with_outputs_in_flight_equals_an_uninterrupted_run(tmp_path):
    changes = dict(straggler__max_delay=2, checkpoint_every=2)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(config(rounds=5, **changes), full, progress=False)
    experiment.train(config(rounds=2, **changes), part, progress=False)
    experiment.train(config(rounds=5, **changes), part, resume=True, progress=False)
    assert metrics(part) == metrics(full)
    # Something was in flight at the checkpoint of round 2 (else the test shows nothing).
    assert any(sum(r["sim_arrivals"][1:]) for r in metrics(full)[2:])


def test_stragglers_are_refused_where_outputs_cannot_be_left_out():
    from fedjax_pan.run import assembly
    from fedjax_pan.errors import ConfigError
    with pytest.raises(ConfigError, match="straggler.max_delay"):
        assembly.build(config(algorithm="fedma", pan__amplitude=0.0, straggler__max_delay=2,
                              rounds=1))


def test_available_memory_reads_meminfo_within_the_cgroup_limit(tmp_path):
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemTotal:       16000 kB\nMemFree:  100 kB\nMemAvailable:    1234 kB\n")
    assert timing.available_memory(str(meminfo), str(cgroup)) == 1234 * 1024
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("5000\n")
    assert timing.available_memory(str(meminfo), str(cgroup)) == 1234 * 1024
    (cgroup / "memory.max").write_text("105000\n")  # 100,000 bytes left under the limit
    assert timing.available_memory(str(meminfo), str(cgroup)) == 100_000
    # Without MemAvailable (not Linux): the free pages the OS reports.
    meminfo.write_text("MemTotal:       16000 kB\n")
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < timing.available_memory(str(meminfo), str(tmp_path / "absent")) <= 2 * free
