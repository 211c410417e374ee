"""Round loop: sampling, determinism, aggregation validation."""

import jax
import numpy as np
import pytest

from conftest import tiny_clients, tiny_fedavg
from fedjax_pan.engine import LocalWork, Simulation, clients_per_round, make_executor, store
from fedjax_pan.engine.simulation import SimState

WORK = LocalWork(batch_size=8, epochs=1)


@pytest.mark.parametrize("r,k,want", [(0.1, 100, 10), (0.1, 4, 1), (0.01, 10, 1), (1.0, 7, 7),
                                      (0.4, 20, 8), (0.25, 10, 2)])
def test_clients_per_round(r, k, want):
    assert clients_per_round(r, k) == want


def _sim(seed=0, participation=0.5):
    _, cd = tiny_clients([20, 30, 25, 18, 22, 40, 16, 33])
    _, variables, algo = tiny_fedavg()
    ex = make_executor("vmap", algo, WORK, cd, variables, 4)
    return Simulation(algo, cd, WORK, ex, participation, seed=seed), variables


def test_sampling_is_without_replacement_seeded_and_varies_by_round():
    sim, _ = _sim()
    rounds = [sim.sample(r) for r in range(30)]
    for ids in rounds:
        assert len(ids) == 4 and len(set(ids.tolist())) == 4
    np.testing.assert_array_equal(sim.sample(3), _sim()[0].sample(3))
    assert len({tuple(ids) for ids in rounds}) > 10
    assert set(np.concatenate(rounds).tolist()) == set(range(8))
    assert not np.array_equal(_sim(seed=1)[0].sample(3), sim.sample(3)) or \
        not np.array_equal(_sim(seed=1)[0].sample(4), sim.sample(4))


def test_same_seed_gives_identical_metrics():
    def losses(seed):
        sim, variables = _sim(seed)
        state, out = sim.init(variables), []
        for _ in range(3):
            state, stats = sim.round(state)
            out.append(stats["train_loss"])
        return out
    a, b = losses(0), losses(0)
    assert a == b
    assert losses(5) != a


@pytest.mark.parametrize("kwargs,match", [(dict(participation=0.0), "participation"),
                                          (dict(participation=1.5), "participation"),
                                          (dict(aggregation="median"), "median")])
def test_bad_round_settings(kwargs, match):
    sim, _ = _sim()
    with pytest.raises(ValueError, match=match):
        Simulation(sim.algorithm, sim.data, WORK, sim.executor, **kwargs)


def test_client_updates_average_to_the_round_update():
    """Clients run alone reproduce the aggregated round (uniform weights)."""
    sim, variables = _sim()
    state = sim.init(variables)
    outputs = sim.client_updates(state)
    assert len(outputs) == sim.num_sampled
    new_state, _ = sim.round(state)
    mean = jax.tree_util.tree_map(lambda *d: sum(d) / len(d), *[o["delta"] for o in outputs])
    want = jax.tree_util.tree_map(lambda p, d: p + d, state.server.params, mean)
    for a, b in zip(jax.tree_util.tree_leaves(new_state.server.params),
                    jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_client_states_on_the_host_and_on_disk_give_the_same_numbers():
    from fedjax_pan.algorithms.fedavg_family.scaffold import scaffold
    from fedjax_pan.algorithms import client_optimizer
    from fedjax_pan.engine.store import DiskStates
    model, variables, _ = tiny_fedavg()
    algo = scaffold(model, client_optimizer(0.05, 0.9), 0.05, momentum=0.9)
    _, cd = tiny_clients([27, 39, 19, 36, 62, 13])
    work = LocalWork(batch_size=8, epochs=1.0)
    finals = {}
    for place in ("device", "host", "disk"):
        ex = make_executor("loop", algo, work, cd, variables, 3)
        sim = Simulation(algo, cd, work, ex, participation=0.5, seed=2, states_in=place)
        state = sim.init(variables)
        kind = {"device": jax.Array, "host": np.ndarray, "disk": DiskStates}[place]
        assert isinstance(state.client_states if place == "disk" else
                          jax.tree_util.tree_leaves(state.client_states)[0], kind)
        for _ in range(3):
            state, _ = sim.round(state)
        # Every client's state, wherever it is kept.
        finals[place] = state._replace(client_states=store.wrap(
            state.client_states).everyone())
    for place in ("host", "disk"):
        for a, b in zip(jax.tree_util.tree_leaves(finals["device"]),
                        jax.tree_util.tree_leaves(finals[place])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Some clients' control variates moved, others (never sampled) stayed zero.
    c = np.asarray(jax.tree_util.tree_leaves(finals["host"].client_states)[0])
    moved = np.abs(c.reshape(len(c), -1)).max(axis=1) > 0
    assert moved.any()


@pytest.mark.parametrize("place", ["device", "host", "disk"])
@pytest.mark.parametrize("stateful", [True, False])
def test_a_state_saved_and_restored_in_each_place_goes_on_as_it_was(place, stateful):
    """`SimState.saved` after 2 rounds, restored as a checkpoint restores it (host arrays),
    then 2 rounds more: the run of 4 rounds in one go, bit for bit (a stateless algorithm
    too). A restored state on disk reads the slots the save named, though the run it
    came from went on in the same files."""
    from fedjax_pan.algorithms.fedavg_family.scaffold import scaffold
    from fedjax_pan.algorithms import client_optimizer
    model, variables, algo = tiny_fedavg()
    if stateful:
        algo = scaffold(model, client_optimizer(0.05, 0.9), 0.05, momentum=0.9)
    _, cd = tiny_clients([27, 39, 19, 36, 62, 13])
    ex = make_executor("loop", algo, WORK, cd, variables, 3)
    sim = Simulation(algo, cd, WORK, ex, participation=0.5, seed=4, states_in=place)
    state = sim.init(variables)
    assert (state.client_states is None) != stateful
    for _ in range(2):
        state, _ = sim.round(state)
    saved = state.saved()
    tree = jax.tree_util.tree_map(np.array, saved)  # a copy: later rounds donate
    state.checkpointed()
    for _ in range(2):
        state, _ = sim.round(state)
    want = jax.tree_util.tree_map(np.asarray, (state.server, store.wrap(
        state.client_states).everyone()))
    again = SimState.restored(jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(saved), jax.tree_util.tree_leaves(tree)), 2)
    for _ in range(2):
        again, _ = sim.round(again)
    got = (again.server, store.wrap(again.client_states).everyone())
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(a, np.asarray(b))
    if stateful and place == "device":  # back on the device after a round
        assert all(isinstance(x, jax.Array)
                   for x in jax.tree_util.tree_leaves(again.client_states))


def _fixed_recruiter(rounds):
    """Recruits rounds[t] in round t; its state counts the rounds it recruited for."""
    from fedjax_pan.engine.protocol import Recruiter
    return Recruiter(
        init=lambda k: {"count": np.zeros(1)},
        select=lambda state, t: (np.asarray(rounds[t]), {"count": state["count"] + 1},
                                 {"recruit_count": len(rounds[t])}),
        observe=lambda state, ids, report, t: (state, {"recruit_seen": list(map(int, ids))}))


def test_a_recruiter_chooses_each_round_and_its_state_is_checkpointed():
    sim, variables = _sim()
    rounds = [[0, 3], [1], [], [2, 4, 5]]
    recruited = Simulation(sim.algorithm, sim.data, WORK, sim.executor,
                           recruiter=_fixed_recruiter(rounds))
    state = recruited.init(variables)
    assert recruited.cohort(state, 0).ids.tolist() == [0, 3]
    for t, ids in enumerate(rounds):
        before = state.server
        state, stats = recruited.round(state)
        assert stats["recruit_count"] == len(ids)
        assert stats.get("recruit_seen", []) == ids  # observed after the server update
        assert float(state.selection["count"][0]) == t + 1
        same = jax.tree_util.tree_all(jax.tree_util.tree_map(
            lambda a, b: bool(np.array_equal(a, b)), before.params, state.server.params))
        assert same == (not ids)  # nobody recruited: the server stays as it was
    saved = state.saved()
    assert isinstance(saved[-1], dict) and float(saved[-1]["selection"]["count"][0]) == 4
    back = SimState.restored(saved, state.round)
    assert back.timing is None and float(back.selection["count"][0]) == 4
    # A state without a recruiter saves exactly what it saved before recruiters existed.
    assert len(sim.init(variables).saved()) == 2


def test_a_recruiter_refuses_poisson_sampling():
    sim, _ = _sim()
    with pytest.raises(ValueError, match="sampling='uniform'"):
        Simulation(sim.algorithm, sim.data, WORK, sim.executor, sampling="poisson",
                   recruiter=_fixed_recruiter([[0]]))
