"""FLChain: an honest run is FedAvg's to the bit (the loop executor's order); tampering proposers cannot commit; the
audit locates any flipped byte; resume continues a ledger and refuses one that does not
verify."""

import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from fedjax_pan import experiment, ledger
from fedjax_pan.algorithms import flchain
from fedjax_pan.errors import ConfigError
from test_experiment import ROOT, config, metrics

ROUNDS = 3


def _params(summary, chain=True):
    server = summary.state.server
    server = server["channels"][0] if chain else server
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(server.params)]


def _run(path, **changes):
    cfg = config(rounds=changes.pop("rounds", ROUNDS), algorithm="flchain",
                 execution__strategy="loop", **changes)
    return experiment.train(cfg, str(path), progress=False)


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    path = tmp_path_factory.mktemp("flchain") / "honest"
    return str(path), _run(path)


def test_an_honest_chain_is_fedavg_to_the_bit(honest, tmp_path):
    path, chain = honest
    fedavg = experiment.train(config(rounds=ROUNDS, algorithm="fedavg",
                                     execution__strategy="loop"), str(tmp_path / "fedavg"),
                              progress=False)
    for a, b in zip(_params(fedavg, chain=False), _params(chain)):
        np.testing.assert_array_equal(a, b)
    keep = ("round", "test_accuracy", "test_loss", "train_loss", "upload_bytes",
            "download_bytes")
    assert [{k: r[k] for k in keep} for r in metrics(path)] == \
        [{k: r[k] for k in keep} for r in metrics(str(tmp_path / "fedavg"))]
    rows = metrics(path)
    assert [r["sim_blocks"] for r in rows] == [1] * ROUNDS
    assert [r["sim_rejected"] for r in rows] == [0] * ROUNDS


def test_the_ledger_records_every_round(honest):
    path, summary = honest
    counts = ledger.verify(path)
    store = ledger.Ledger(os.path.join(path, "ledger"))
    assert store.heights(0) == list(range(ROUNDS + 1))
    genesis = store.read(0, 0)
    k = len(summary.experiment.client_indices)
    assert len(genesis["transactions"]) == k  # every device registered
    m = summary.experiment.simulation.num_sampled
    assert counts["transactions"] == k + ROUNDS * m
    prev = genesis
    for height in range(1, ROUNDS + 1):
        block = store.read(0, height)
        h = block["header"]
        assert h["prev_hash"] == prev["hash"] == ledger.block_hash(prev["header"])
        assert h["round"] == height - 1
        assert len(block["votes"]) >= ledger.quorum(4)
        # The committed model is stored, and its root is the state trie's.
        model = ledger.decode_tree(store.get(h["model"]))
        assert ledger.merkle_root([ledger._record(p, model[p]) for p in sorted(model)]) \
            == h["state_root"]
        prev = block
    # The last block holds the run's final model.
    final = ledger.decode_tree(store.get(prev["header"]["model"]))
    np.testing.assert_array_equal(
        final["params/fc1/kernel"],
        np.asarray(summary.state.server["channels"][0].params["fc1"]["kernel"]))


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_any_flipped_byte_is_located(honest, tmp_path):
    path, _ = honest
    files = sorted(glob.glob(os.path.join(path, "ledger", "*", "*")))
    rng = np.random.default_rng(0)
    for n in range(24):
        copy = str(tmp_path / f"copy{n}")
        shutil.copytree(path, copy)
        name = os.path.relpath(files[rng.integers(len(files))], path)
        target = os.path.join(copy, name)
        _flip(target, int(rng.integers(os.path.getsize(target))))
        with pytest.raises(ledger.LedgerError) as e:
            ledger.verify(copy)
        message = str(e.value)
        assert "\n" not in message
        assert os.path.basename(target) in message, (name, message)
        shutil.rmtree(copy)


def _edit_block(path, change):
    """Rewrites block file `path` canonically after `change(block)`."""
    block = json.load(open(path))
    change(block)
    open(path, "wb").write(ledger.canonical(block))


def _rehash(block):
    """A forger's consistent rewrite: the roots and hash recomputed (the votes cannot be)."""
    h = block["header"]
    h["tx_root"] = ledger.merkle_root([ledger.canonical(t) for t in block["transactions"]])
    block["hash"] = ledger.block_hash(h)


def _examples(block):
    block["transactions"][0]["examples"] += 1


@pytest.mark.parametrize("case,where,why", [
    ("update", "objects", "does not match its digest"),
    ("model", "objects", "does not match its digest"),
    ("transaction", "000002.json", "Merkle root of its transactions"),
    ("header", "000002.json", "hash does not match its header"),
    ("vote", "000002.json", "vote of validator"),
    ("rewrite", "000002.json", "vote of validator"),
    ("registration", "000000.json", "Merkle root of its transactions"),
    ("missing", "000002.json", "block 2 of channel 0 is missing"),
])
def test_every_tamper_case_is_located(honest, tmp_path, case, where, why):
    path, _ = honest
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    store = ledger.Ledger(os.path.join(copy, "ledger"))
    block2 = store.block_path(0, 2)
    h = store.read(0, 2)
    if case in ("update", "model"):
        digest = h["transactions"][0]["digest"] if case == "update" else h["header"]["model"]
        _flip(store.object_path(digest), 100)
        where = digest
    elif case == "transaction":
        _edit_block(block2, _examples)
    elif case == "header":
        _edit_block(block2, lambda b: b["header"].update(proposer=3))
    elif case == "vote":
        _edit_block(block2, lambda b: b["votes"][0].update(
            signature=b["votes"][1]["signature"]))
    elif case == "rewrite":
        _edit_block(block2, lambda b: (_examples(b), _rehash(b)))
    elif case == "registration":
        _edit_block(store.block_path(0, 0), lambda b: b["transactions"][0].update(
            public_key=b["transactions"][1]["public_key"]))
    else:
        os.remove(block2)
    with pytest.raises(ledger.LedgerError, match=why) as e:
        ledger.verify(copy)
    assert where in str(e.value)


@pytest.mark.slow  # two interpreters start
def test_verify_from_the_command_line(honest, tmp_path):
    path, _ = honest
    run = lambda d: subprocess.run([sys.executable, "-m", "fedjax_pan.ledger", d],
                                   capture_output=True, text=True, cwd=ROOT)
    ok = run(path)
    assert ok.returncode == 0, ok.stderr
    assert f"{ROUNDS + 1} blocks" in ok.stdout
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    block = os.path.join(copy, "ledger", "channel_0", "000002.json")
    text = open(block).read()
    open(block, "w").write(text.replace('"round":1', '"round":2', 1))
    bad = run(copy)
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and "000002.json" in bad.stderr
    assert "hash does not match" in bad.stderr
    for args in ([str(tmp_path / "none")], [], [path, path], ["--help"]):
        wrong = subprocess.run([sys.executable, "-m", "fedjax_pan.ledger", *args],
                               capture_output=True, text=True, cwd=ROOT)
        assert wrong.returncode == 2, args
        assert wrong.stderr.count("\n") == 1 and wrong.stderr.startswith("error:"), args


@pytest.mark.parametrize("tamper,reason", [
    ("scale", "state root is not the aggregate"),
    ("drop", "omits the pooled transaction"),
    # Slow: the backdoored model trains through an executor of its own.
    pytest.param("backdoor", "signature is not the device's", marks=pytest.mark.slow)])
def test_a_tampering_proposer_cannot_commit(honest, tmp_path, tamper, reason):
    summary = _run(tmp_path, rounds=1, flchain__faulty=1, flchain__tamper=tamper)
    # Validator 0 proposes round 0 (and every 4th): rejected, the next proposer commits
    # the honest block of round 0.
    honest_block = ledger.Ledger(os.path.join(honest[0], "ledger")).read(0, 1)["header"]
    assert ledger.state_root(summary.experiment.simulation.rule.eval_variables(
        summary.state.server["channels"][0])) == honest_block["state_root"]
    store = ledger.Ledger(str(tmp_path / "ledger"))
    first = store.read(0, 1)["header"]
    assert first["proposer"] == 1 and first["sim"]["attempts"] == 2
    (rejected,) = first["rejected"]
    assert rejected["proposer"] == 0 and rejected["votes"] == 1
    assert reason in rejected["reason"]
    assert [r["sim_rejected"] for r in metrics(str(tmp_path))] == [1]
    ledger.verify(str(tmp_path))


def test_a_central_server_commits_its_tampering_and_the_audit_finds_it(honest, tmp_path):
    summary = _run(tmp_path, rounds=2, flchain__validators=1, flchain__faulty=1,
                   flchain__tamper_from=1, flchain__tamper_scale=-1.0)
    store = ledger.Ledger(str(tmp_path / "ledger"))
    clean_store = ledger.Ledger(os.path.join(honest[0], "ledger"))
    # Round 0 honest (the honest run's block); round 1's model is minus the aggregate.
    assert store.read(0, 1)["header"]["state_root"] == \
        clean_store.read(0, 1)["header"]["state_root"]
    assert store.read(0, 2)["header"]["proposer"] == 0
    rule = summary.experiment.simulation.rule
    final = rule.eval_variables(summary.state.server["channels"][0])["params"]
    model = ledger.decode_tree(clean_store.get(clean_store.read(0, 2)["header"]["model"]))
    np.testing.assert_array_equal(np.asarray(final["fc1"]["kernel"]),
                                  -model["params/fc1/kernel"])
    with pytest.raises(ledger.LedgerError, match=r"000002\.json.*state root is not the "
                                                 r"aggregate"):
        ledger.verify(str(tmp_path))


@pytest.mark.slow  # the backdoored model trains through an executor of its own
def test_a_central_server_inserting_a_backdoored_model_is_caught_by_the_audit(tmp_path):
    _run(tmp_path, rounds=2, flchain__validators=1, flchain__faulty=1,
         flchain__tamper="backdoor", flchain__tamper_from=1)
    with pytest.raises(ledger.LedgerError, match=r"000002\.json.*signature is not the "
                                                 r"device's"):
        ledger.verify(str(tmp_path))


def test_more_than_f_faulty_validators_stall_the_channel(tmp_path):
    summary = _run(tmp_path, rounds=1, flchain__validators=4, flchain__faulty=2)
    rows = metrics(str(tmp_path))
    assert [r["sim_blocks"] for r in rows] == [0]
    assert ledger.Ledger(str(tmp_path / "ledger")).heights(0) == [0]
    start = jax.tree_util.tree_leaves(summary.experiment.variables["params"])
    for a, b in zip(start, _params(summary)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_resume_continues_the_ledger_and_refuses_a_tampered_one(honest, tmp_path):
    path, full = honest
    part = str(tmp_path / "part")
    _run(part, rounds=ROUNDS, checkpoint_every=2)
    # A crash after round 3's block was committed but before its checkpoint landed.
    shutil.rmtree(os.path.join(part, "checkpoints", str(ROUNDS)))
    bad = str(tmp_path / "bad")
    shutil.copytree(part, bad)
    resumed = experiment.train(config(rounds=ROUNDS, algorithm="flchain", checkpoint_every=2,
                                      execution__strategy="loop"), part, resume=True,
                               progress=False)
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    assert ledger.verify(part)["blocks"] == ROUNDS + 1
    _flip(glob.glob(os.path.join(bad, "ledger", "channel_0", "000001.json"))[0], 40)
    with pytest.raises(ConfigError, match="ledger does not verify.*000001.json"):
        experiment.train(config(rounds=ROUNDS, algorithm="flchain", checkpoint_every=2,
                                execution__strategy="loop"), bad, resume=True, progress=False)


def test_channels_train_their_own_models(tmp_path):
    summary = _run(tmp_path, rounds=1, flchain__channels=2, partition__test_fraction=0.2)
    chain = summary.experiment.simulation
    for j in range(2):
        genesis = ledger.Ledger(str(tmp_path / "ledger")).read(j, 0)
        assert sorted(tx["device"] for tx in genesis["transactions"]) == \
            list(chain.devices(j))
        for height in ledger.Ledger(str(tmp_path / "ledger")).heights(j)[1:]:
            block = ledger.Ledger(str(tmp_path / "ledger")).read(j, height)
            assert all(chain.channel_of[tx["device"]] == j for tx in block["transactions"])
    models = [jax.tree_util.tree_leaves(s.params)[0] for s in summary.state.server["channels"]]
    assert not np.array_equal(np.asarray(models[0]), np.asarray(models[1]))
    assert ledger.verify(str(tmp_path))["channels"] == 2
    # Each device is scored on its own channel's model.
    correct = count = 0.0
    for j, server in enumerate(summary.state.server["channels"]):
        part = summary.experiment.client_evaluate(chain.rule.eval_variables(server))
        mine = chain.channel_of == j
        correct += part["correct"][mine].sum()
        count += part["count"][mine].sum()
    assert metrics(str(tmp_path))[-1]["pfl_accuracy"] == pytest.approx(correct / count)


def test_channel_selection():
    np.testing.assert_array_equal(flchain.select_channels(7, 3, "least_loaded", 0),
                                  [0, 1, 2, 0, 1, 2, 0])
    a = flchain.select_channels(500, 4, "random", 3)
    np.testing.assert_array_equal(a, flchain.select_channels(500, 4, "random", 3))
    assert not np.array_equal(a, flchain.select_channels(500, 4, "random", 4))
    assert set(a) == {0, 1, 2, 3} and abs(np.bincount(a) - 125).max() < 40


def test_latency_model_by_hand():
    o = {"bandwidth": 1000.0, "latency": 0.5, "message_seconds": 0.01, "timeout": 3.0,
         "block_interval": 1.0}
    # 4 validators, 2 channels (500 B/s and 0.02 s a message each), pool 1,000 B,
    # block 200 B, model 250 B, the second attempt commits.
    t = flchain.round_seconds(o, 4, 2, 1000, 200, 250, attempts=2)
    pool, download = 0.5 + 2.0, 0.5 + 0.5
    pre_prepare = 0.5 + 3 * (200 / 500 + 0.02)
    vote = 0.5 + 3 * (100 / 500 + 0.02)
    attempt = pre_prepare + 2 * vote
    assert t["pool_seconds"] == pytest.approx(pool)
    assert t["consensus_seconds"] == pytest.approx(2 * attempt + 3.0)
    assert t["seconds"] == pytest.approx(pool + 2 * attempt + 3.0 + download)
    # A central server votes alone; a round lasts at least the block interval.
    one = flchain.round_seconds({**o, "block_interval": 9.0}, 1, 1, 0, 200, 0, 1)
    assert one["consensus_seconds"] == 0 and one["seconds"] == 9.0


def test_a_converged_channel_stops(tmp_path):
    _run(tmp_path, rounds=2, flchain__epsilon=1e9)
    rows = metrics(str(tmp_path))
    assert [r["sim_blocks"] for r in rows] == [1, 0]
    assert [r["sim_converged"] for r in rows] == [1, 1]


def test_config_errors_name_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="flchain.faulty=5 exceeds flchain.validators=4"):
        _run(tmp_path / "a", flchain__faulty=5)
    with pytest.raises(ConfigError, match="shuffle.n_sf"):
        _run(tmp_path / "b", shuffle__n_sf=1)
    with pytest.raises(ConfigError, match="aggregation.rule='median'"):
        _run(tmp_path / "d", aggregation__rule="median")
    with pytest.raises(ConfigError, match="flchain.selection"):
        _run(tmp_path / "c", flchain__selection="nearest")
    assert not os.path.exists(tmp_path / "a")


def test_a_full_disk_under_the_ledger_ends_in_one_line(tmp_path, monkeypatch):
    from fedjax_pan.errors import WorkdirError
    put, calls = ledger.Ledger.put, []

    def full_after_genesis(self, data):
        calls.append(1)
        if len(calls) > 1:  # the initial model went in; round 0's first update does not
            raise OSError(28, "No space left on device")
        return put(self, data)
    monkeypatch.setattr(ledger.Ledger, "put", full_after_genesis)
    with pytest.raises(WorkdirError, match="cannot write the ledger in .*No space left") as e:
        _run(tmp_path / "w", rounds=1)
    assert e.value.status == 4 and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "w")  # nothing of the run was saved
