"""Client states on the device, the host or disk: the choice by size, every place's store
(`ClientStates`) and `DiskStates`'s slots against a plain list of states (the reference),
across rounds, checkpoints and restarts."""

import errno
import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import ROOT
from fedjax_pan.run import experiment
from fedjax_pan.engine import store
from fedjax_pan.engine.store import DiskStates, _Slots
from test_experiment import config, metrics

GB = 1 << 30


@pytest.mark.parametrize("device,host,nbytes,where", [
    (16 * GB, 64 * GB, 8 * GB, "device"),   # half the accelerator's memory
    (16 * GB, 64 * GB, 9 * GB, "host"),
    (16 * GB, 64 * GB, 33 * GB, "disk"),
    (0, 24 * GB, 12 * GB, "device"),        # CPU: the device is host memory
    (0, 24 * GB, 13 * GB, "disk"),
])
def test_auto_places_states_by_size(monkeypatch, device, host, nbytes, where):
    monkeypatch.setattr(store, "device_memory", lambda: device)
    monkeypatch.setattr(store, "host_memory", lambda: host)
    assert store.place("auto", nbytes) == where
    for choice in ("device", "host", "disk"):
        assert store.place(choice, nbytes) == choice  # the override wins
    with pytest.raises(ValueError, match="'ram'"):
        store.place("ram", nbytes)


def _template():
    return {"w": np.zeros((3, 4), np.float32), "c": {"n": np.zeros((), np.int32)}}


def _reference(k):
    return [_template() for _ in range(k)]


def _stack(states, ids):
    return jax.tree_util.tree_map(lambda *x: np.stack(x), *[states[i] for i in ids])


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                    jax.tree_util.tree_leaves(b)))


def _round(rng, states, ref, m, t):
    ids = np.sort(rng.choice(len(ref), m, replace=False))
    new = [{"w": rng.standard_normal((3, 4)).astype(np.float32),
            "c": {"n": np.int32(100 * t + i)}} for i in ids]
    for i, s in zip(ids, new):
        ref[i] = s
    states.start_round()
    return states.scatter(ids, jax.tree_util.tree_map(lambda *x: np.stack(x), *new))


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_every_place_keeps_the_reference_states(tmp_path, where):
    k, m = 12, 3
    rng = np.random.default_rng(2)
    states = store.create(where, _template(), k, str(tmp_path / "s"))
    assert states.place == where and isinstance(states, store.PLACED[where])
    ref = _reference(k)
    for t in range(6):
        states = _round(rng, states, ref, m, t)
        # What a SimState holds gives back the same store.
        states = store.wrap(states.tree, where)
        assert type(states) is store.PLACED[where]
        ids = np.array([7, 0, 3])
        got = states.gather(ids)
        assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(got))
        assert _equal(got, _stack(ref, ids))
        assert _equal(states.everyone(), _stack(ref, range(k)))
    chunks = list(states.chunks(5))
    assert [len(ids) for ids, _ in chunks] == [5, 5, 2]
    assert all(_equal(c, _stack(ref, ids)) for ids, c in chunks)
    assert jax.tree_util.tree_structure(states.template()) == \
        jax.tree_util.tree_structure(_template())
    # A checkpoint saves the stacked arrays (device, host) or K slot numbers (disk).
    leaves = jax.tree_util.tree_leaves(states.tree)
    if where == "disk":
        assert len(leaves) == 1 and leaves[0].shape == (k,)
    else:
        assert _equal(leaves, _stack(ref, range(k)))


def test_restored_arrays_go_back_where_they_were_placed():
    """A checkpoint restores host arrays (read-only, maybe): the host store copies them
    once before writing in place; the device store's first scatter puts them on the
    device. With no place given, NumPy arrays are the host's."""
    k = 4
    tree = jax.tree_util.tree_map(lambda x: np.repeat(x[None], k, 0), _template())
    for x in jax.tree_util.tree_leaves(tree):
        x.setflags(write=False)
    new = jax.tree_util.tree_map(lambda x: np.ones((1, *x.shape), x.dtype), _template())
    assert isinstance(store.wrap(tree), store.HostStates)
    host = store.wrap(tree, "host").scatter(np.array([2]), new).tree
    device = store.wrap(tree, "device").scatter(np.array([2]), new).tree
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(device))
    assert _equal(host, device)
    assert not any(np.any(x) for x in jax.tree_util.tree_leaves(tree))  # untouched
    assert isinstance(store.wrap(None), store.NoStates)
    assert store.create("disk", None, k).tree is None  # a stateless algorithm


def test_disk_states_follow_a_reference_and_grow_with_the_clients_trained(tmp_path):
    k, m = 50, 4
    rng = np.random.default_rng(0)
    states = DiskStates.create(_template(), k, str(tmp_path / "s"))
    ref = _reference(k)
    assert _equal(states.gather(np.arange(k)), _stack(ref, range(k)))
    trained = set()
    for t in range(30):
        before, ref_before = states, list(ref)
        states = _round(rng, states, ref, m, t)
        trained |= set(np.flatnonzero(states.slots))
        # The state the round started from is still readable (divergence saves it).
        assert _equal(before.gather(np.arange(k)), _stack(ref_before, range(k)))
        assert _equal(states.gather(np.arange(k)), _stack(ref, range(k)))
    # Untrained clients share slot 0; the files hold the trained ones plus one round's
    # replaced states, not K.
    assert (states.slots == 0).sum() == k - len(trained)
    assert states.files.capacity <= 1 + k + 2 * m + 16
    size = os.path.getsize(tmp_path / "s" / "leaf_000.bin")  # 'n' sorts first
    assert size <= states.files.capacity * 4
    assert _equal(states.template(), _template())


def test_checkpointed_slots_survive_later_rounds_and_a_restart(tmp_path):
    k, m = 20, 5
    rng = np.random.default_rng(1)
    folder = str(tmp_path / "s")
    states = DiskStates.create(_template(), k, folder)
    ref = _reference(k)
    for t in range(3):
        states = _round(rng, states, ref, m, t)
    states.flush()
    states.checkpointed()  # a checkpoint of round 3
    saved, ref_saved = DiskStates(states.files, states.slots.copy()), list(ref)
    for t in range(3, 20):  # rounds past the checkpoint, then a crash
        states = _round(rng, states, ref, m, t)
    assert _equal(saved.gather(np.arange(k)), _stack(ref_saved, range(k)))
    # A new process opens the folder at the checkpoint's slots and carries on.
    states.files.close()
    files = _Slots(folder, _template(), owned=False)
    restored = DiskStates(files, saved.slots)
    restored.resumed()
    assert _equal(restored.gather(np.arange(k)), _stack(ref_saved, range(k)))
    ref = ref_saved
    for t in range(3, 10):
        restored = _round(rng, restored, ref, m, t)
        assert _equal(restored.gather(np.arange(k)), _stack(ref, range(k)))
    assert restored.files.capacity < 1 + k + 4 * m + 32  # freed slots were reused


def test_a_folder_of_another_layout_is_refused(tmp_path):
    DiskStates.create(_template(), 3, str(tmp_path / "s"))
    with pytest.raises(ValueError, match="another layout"):
        DiskStates.create({"w": np.zeros(5, np.float32)}, 3, str(tmp_path / "s"))


def test_a_temporary_store_is_removed_when_closed():
    states = DiskStates.create(_template(), 4)
    folder = states.files.directory
    assert os.path.isdir(folder)
    states.files.close()
    assert not os.path.exists(folder)


def test_a_run_with_states_on_disk_resumes_exactly_and_checkpoints_only_their_slots(
        tmp_path):
    # (The same numbers as states in memory: test_simulation.py and the MOON test here.)
    cfg = dict(algorithm="scaffold", rounds=4, checkpoint_every=2)
    full, part = (str(tmp_path / n) for n in ("full", "part"))
    experiment.train(config(**cfg, execution__client_states="disk"), full, progress=False)
    # A crash after round 4's states were written, before its checkpoint landed: the
    # same files without that checkpoint.
    shutil.copytree(full, part)
    shutil.rmtree(os.path.join(part, "checkpoints", "4"))
    os.unlink(os.path.join(part, "summary.json"))
    summary = experiment.train(config(**cfg, execution__client_states="disk"), part,
                               resume=True, progress=False)
    assert summary["rounds"] == 4 and metrics(part) == metrics(full)
    states = os.path.join(full, store.FOLDER)
    assert os.path.isfile(os.path.join(states, "layout.json"))

    def size(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path)
                   for f in fs)
    # The checkpoint holds K slot numbers beside the server state, not the K control
    # variates (each as large as the model).
    with open(os.path.join(states, "layout.json")) as f:
        layout = json.load(f)
    one_state = sum(int(np.prod(shape)) * np.dtype(d).itemsize
                    for shape, d in zip(layout["shapes"], layout["dtypes"]))
    k = config().partition.num_clients
    on_disk = size(os.path.join(full, "checkpoints", "4"))
    assert on_disk < k * one_state / 5


def test_a_temporary_store_is_removed_once_unreferenced():
    import gc
    states = DiskStates.create(_template(), 4)
    folder = states.files.directory
    later = states.scatter(np.array([1]), jax.tree_util.tree_map(lambda x: x[None],
                                                                 _template()))
    del states
    gc.collect()
    assert os.path.isdir(folder)  # `later` still reads it
    del later
    gc.collect()
    assert not os.path.exists(folder)


def test_moon_on_disk_over_many_rounds_and_checkpoints_equals_moon_in_memory():
    """MOON's previous models on disk, slots reused round after round and protected by a
    checkpoint every 3 rounds, against the same run with its states on the device."""
    from conftest import tiny_clients, tiny_fedavg
    from fedjax_pan.algorithms import client_optimizer
    from fedjax_pan.algorithms.fedavg_family.moon import moon
    from fedjax_pan.engine import LocalWork, Simulation, make_executor
    model, variables, _ = tiny_fedavg()
    algo = moon(model, client_optimizer(0.05, 0.9), mu=1.0, tau=0.5)
    sizes = np.random.default_rng(3).integers(3, 12, 40)
    _, cd = tiny_clients(sizes)
    work = LocalWork(batch_size=4, epochs=1.0)
    finals = {}
    for place in ("device", "disk"):
        ex = make_executor("loop", algo, work, cd, variables, 6)
        sim = Simulation(algo, cd, work, ex, participation=0.15, seed=5, states_in=place)
        state = sim.init(variables)
        for _ in range(12):
            state, _ = sim.round(state)
            if state.round % 3 == 0:
                state.saved()
                state.checkpointed()
        finals[place] = state
    disk = finals["disk"].client_states
    assert disk.files.capacity < 1 + 40 + 6 * 4 + 32  # slots were reused
    on_disk = disk.gather(np.arange(40))
    for a, b in zip(jax.tree_util.tree_leaves((finals["device"].server,
                                               finals["device"].client_states)),
                    jax.tree_util.tree_leaves((finals["disk"].server, on_disk))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_faults_of_the_files_are_one_error_naming_their_folder(tmp_path, monkeypatch):
    folder = tmp_path / "s"
    one = sum(x.nbytes for x in jax.tree_util.tree_leaves(_template()))
    # K states that cannot fit are refused before anything is written.
    monkeypatch.setattr(store, "free_space", lambda path: 10 * one)
    with pytest.raises(store.StoreWriteError) as info:
        DiskStates.create(_template(), 11, str(folder))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(folder)
    assert "11 clients' states need" in info.value.strerror and not folder.exists()
    states = DiskStates.create(_template(), 10, str(folder))
    rng, ref = np.random.default_rng(4), _reference(10)
    # A write cut short is not a fault: it goes on from where it stopped.
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, data[:1], offset))
    states = _round(rng, states, ref, 3, 0)
    monkeypatch.setattr(os, "pwrite", real)
    assert _equal(states.gather(np.arange(10)), _stack(ref, range(10)))

    # A full disk: half a slot is written, then ENOSPC.
    def full(fd, data, offset):
        if len(data) > 1:
            return real(fd, data[:len(data) // 2], offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(store.StoreWriteError) as info:
        _round(rng, states, list(ref), 3, 1)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(folder)
    monkeypatch.setattr(os, "pwrite", real)
    assert _equal(states.gather(np.arange(10)), _stack(ref, range(10)))  # as it was

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(store.StoreWriteError) as info:
        states.flush()
    assert info.value.errno == errno.EIO and info.value.filename == str(folder)


def test_a_full_disk_under_the_client_states_exits_4_and_the_run_resumes(tmp_path, capsys,
                                                                          monkeypatch):
    from fedjax_pan.run import main
    w = tmp_path / "w"
    args = ["prog", "--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py") + ":smoke",
            "--noprogress", "--config.dataset.name=synthetic", "--config.algorithm=scaffold",
            "--config.execution.client_states=disk", "--config.rounds=3",
            "--config.checkpoint_every=1", "--config.model.options.hidden=(64, 64, 64)",
            f"--workdir={w}"]
    folder = os.path.join(w, store.FOLDER)

    def err():
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: cannot write the client "
                                                       "states: "), lines
        return lines[0]
    # At the start: the K states cannot fit. Nothing was saved, nothing is left.
    with monkeypatch.context() as m:
        m.setattr(store, "free_space", lambda path: 1 << 10)
        assert main.main(args) == 4
    line = err()
    assert "No space left on device (20 clients' states need" in line
    assert line.endswith(f"({folder}); no round of it was saved; free space; run the "
                         "command again") and not w.exists()
    # In round 2, once round 1 is saved.
    real = os.pwrite

    def full(fd, data, offset):
        if (w / "checkpoints" / "1").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)
    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", full)
        assert main.main(args) == 4
    kept = f"({folder}); {w} holds round 1 (checkpoint of round 1); free space; continue "
    assert err() == f"error: cannot write the client states: No space left on device {kept}" \
        "with --resume"
    # Resumed on a disk still full: the round kept is named (before it is read back).
    with monkeypatch.context() as m:
        m.setattr(store, "free_space", lambda path: 1 << 10)
        assert main.main(args + ["--resume"]) == 4
    assert err().endswith(f"MiB free) {kept}with --resume")
    # With space, it continues to the end.
    assert main.main(args + ["--resume"]) == 0
    assert [r["round"] for r in metrics(w)] == [1, 2, 3]
