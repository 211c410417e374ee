"""FLChain: an honest run is FedAvg's to the bit (the loop executor's order); tampering proposers cannot commit; the
audit locates any flipped byte, and with the run's anchor any rewritten, re-signed, cut or
reordered history; keys come from the OS and stay out of the ledger; resume continues a
ledger and refuses one that does not verify, or whose keys are gone."""

import glob
import json
import os
import shutil
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedjax_pan.run import experiment
from fedjax_pan.algorithms.robust import ledger
from fedjax_pan.algorithms.robust import flchain, flchain_cli
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
    counts = flchain_cli.verify(path)
    assert counts["anchored"] is False  # internal consistency only
    assert flchain_cli.verify(path, anchor=summary["ledger_anchor"])["anchored"] is True
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


@pytest.mark.reference("algorithm", "flchain")
def test_every_committed_model_is_eq_7_of_its_block_written_in_numpy(honest):
    # Eq. 7, w(t+1) = w(t) + sum_i a_i (w_i(t) - w(t)) / sum_i a_i, read from the ledger's
    # own files: a_i = 1 under the genesis rule's uniform weights, |D_i| under num_examples.
    path, _ = honest
    store = ledger.Ledger(os.path.join(path, "ledger"))
    genesis = store.read(0, 0)["header"]
    assert genesis["rule"] == {"lr": 1.0, "momentum": 0.0, "optimizer": "sgd",
                               "weights": "uniform"}
    model = ledger.decode_tree(store.get(genesis["model"]))
    for height in range(1, ROUNDS + 1):
        block = store.read(0, height)
        updates = [ledger.decode_tree(store.get(tx["digest"])) for tx in block["transactions"]
                   if tx["type"] == "update"]
        assert updates
        a = np.ones(len(updates))
        want = {k: np.asarray(w, np.float64) + sum(
            ai * np.asarray(u["delta/" + k.split("/", 1)[1]], np.float64)
            for ai, u in zip(a, updates)) / a.sum() for k, w in model.items()}
        model = ledger.decode_tree(store.get(block["header"]["model"]))
        assert set(model) == set(want)
        for k in want:
            np.testing.assert_allclose(model[k], want[k], rtol=1e-5, atol=1e-7)


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
            flchain_cli.verify(copy)
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
        flchain_cli.verify(copy)
    assert where in str(e.value)


# --- keys and the anchor: what the run's owner holds outside the ledger --------------------

def _old_key(seed, role, index):
    """A key derived as FLChain derived them before format 2: from the config's seed, which
    config.json hands to anyone (the forger's key)."""
    rng = np.random.default_rng([seed, 0xF1C4, {"device": 0, "validator": 1}[role], index])
    return Ed25519PrivateKey.from_private_bytes(rng.bytes(32))


def _sign_votes(block, seed, keys=None):
    """`block`'s votes signed again: by the seed-derived keys, or by `keys` (the run's)."""
    digest = bytes.fromhex(block["hash"])
    key = (lambda v: keys.validators[v]) if keys else (lambda v: _old_key(seed, "validator", v))
    block["votes"] = [{"validator": v["validator"], "signature": ledger.sign(
        key(v["validator"]), ledger.VOTE_DOMAIN, digest)} for v in block["votes"]]


def _resign_everything(workdir, seed):
    """The forger's full rewrite: every channel's genesis names the seed-derived keys, and
    every registration, transaction, hash, link and vote is made again with them."""
    store = ledger.Ledger(os.path.join(workdir, "ledger"))
    for j in store.channels():
        prev = None
        for height in store.heights(j):
            block = store.read(j, height)
            h = block["header"]
            for tx in block["transactions"]:
                key = _old_key(seed, "device", tx["device"])
                if height == 0:
                    tx["public_key"] = ledger.public_hex(key)
                tx["signature"] = ledger.sign(key, ledger.TX_DOMAIN,
                                              ledger.canonical(ledger.tx_body(tx)))
            h["tx_root"] = ledger.merkle_root([ledger.canonical(t)
                                               for t in block["transactions"]])
            if height == 0:
                h["validators"] = [ledger.public_hex(_old_key(seed, "validator", v))
                                   for v in range(len(h["validators"]))]
            else:
                h["prev_hash"], h["prev_votes"] = prev["hash"], ledger.votes_digest(prev["votes"])
            block["hash"] = ledger.block_hash(h)
            _sign_votes(block, seed)
            open(store.block_path(j, height), "wb").write(ledger.canonical(block))
            prev = block


def test_keys_are_the_os_s_kept_private_beside_the_ledger(honest):
    path, summary = honest
    keys = ledger.Keys.load(path)
    assert stat.S_IMODE(os.stat(ledger.keys_path(path)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(path, "keys")).st_mode) == 0o700
    genesis = ledger.Ledger(os.path.join(path, "ledger")).read(0, 0)
    seed = summary.experiment.config.seed
    assert genesis["header"]["validators"] == [ledger.public_hex(k) for k in keys.validators]
    assert genesis["header"]["validators"][0] != \
        ledger.public_hex(_old_key(seed, "validator", 0))  # not the seed's
    assert genesis["header"]["format"] == ledger.LEDGER_FORMAT
    # No private key is anywhere in the ledger or the run's other records.
    secrets = keys.to_json()["validators"] + keys.to_json()["devices"]
    for name in glob.glob(os.path.join(path, "**", "*"), recursive=True):
        if os.path.isfile(name) and not name.startswith(os.path.join(path, "keys")):
            data = open(name, "rb").read()
            assert not any(x.encode() in data for x in secrets), name
    # The anchor in the summary is the ledger's head.
    head = ledger.Ledger(os.path.join(path, "ledger")).read(0, ROUNDS)
    assert summary["ledger_anchor"] == ledger.anchor({0: head}, genesis["header"]["validators"])
    assert json.load(open(os.path.join(path, "summary.json")))["ledger_anchor"] == \
        summary["ledger_anchor"]


def _block_key(b):
    b["note"] = "x"


@pytest.mark.parametrize("case,where,why", [
    # The forgery: block 3's header rewritten, its votes re-signed with seed-derived keys.
    ("forged_votes", "000003.json", "vote of validator 0: the signature does not sign"),
    # The whole ledger re-signed with seed-derived keys passes every internal check; the
    # anchor's validators do not match.
    ("forged_ledger", "000000.json", "validators' keys .* are not the anchor's"),
    # Whoever holds the run's keys (its operator) can rewrite and re-sign the head, or
    # append a block: internally consistent, but not the anchor's head.
    ("rewritten_with_keys", "000003.json", "is not the anchor's head .*the chain was rewritten"),
    ("deleted_last", "000003.json", "block 3 of channel 0 is missing: the anchor's head is "
                                    "block 3"),
    ("appended", "000004.json", "lies beyond the anchor's head"),
    ("vote_removed", "000002.json", "its votes are not those block 3's header records"),
    ("head_vote_removed", "000003.json", "its votes are not the anchor's head's"),
    ("votes_reordered", "000002.json", "not sorted by validator"),
    ("vote_twice", "000002.json", "validator 1 is not one validator's single vote"),
    ("block_key", "000002.json", "the block has the extra key"),
    ("header_key", "000002.json", "its header has the extra key"),
    ("transaction_key", "000002.json", r"transaction 0 \(device \d+\) has the extra key"),
    ("registration_key", "000000.json", r"transaction 0 \(device \d+\) has the extra key"),
    ("vote_key", "000002.json", "a vote has the extra key"),
    ("vote_missing_key", "000002.json", "a vote has no 'signature'"),
])
def test_a_rewritten_history_fails_against_the_anchor(honest, tmp_path, case, where, why):
    path, summary = honest
    seed = summary.experiment.config.seed
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    store = ledger.Ledger(os.path.join(copy, "ledger"))
    block = lambda height: store.block_path(0, height)
    if case == "forged_votes":
        def forge(b):
            b["header"]["proposer"] = (b["header"]["proposer"] + 1) % 4
            b["hash"] = ledger.block_hash(b["header"])
            _sign_votes(b, seed)
        _edit_block(block(3), forge)
    elif case == "forged_ledger":
        _resign_everything(copy, seed)
        assert flchain_cli.verify(copy)["blocks"] == ROUNDS + 1  # internally consistent
    elif case == "deleted_last":
        os.remove(block(3))
        assert not flchain_cli.verify(copy)["anchored"]  # passes without the anchor
    elif case == "rewritten_with_keys":
        def rewrite(b):
            b["header"]["proposer"] = (b["header"]["proposer"] + 1) % 4
            b["hash"] = ledger.block_hash(b["header"])
            _sign_votes(b, seed, ledger.Keys.load(copy))
        _edit_block(block(3), rewrite)
        assert flchain_cli.verify(copy)["blocks"] == ROUNDS + 1
    elif case == "appended":  # an empty block (the model unchanged), signed by the run's keys
        head = store.read(0, 3)
        nxt = json.loads(json.dumps(head))
        nxt["transactions"] = []
        nxt["header"].update(height=4, round=3, prev_hash=head["hash"],
                             prev_votes=ledger.votes_digest(head["votes"]),
                             tx_root=ledger.merkle_root([]))
        nxt["hash"] = ledger.block_hash(nxt["header"])
        _sign_votes(nxt, seed, ledger.Keys.load(copy))
        open(block(4), "wb").write(ledger.canonical(nxt))
        assert flchain_cli.verify(copy)["blocks"] == ROUNDS + 2
    elif case in ("vote_removed", "head_vote_removed"):
        height = 2 if case == "vote_removed" else 3
        assert len(store.read(0, height)["votes"]) > ledger.quorum(4)  # one beyond the quorum
        _edit_block(block(height), lambda b: b["votes"].pop())
        if height == 3:  # the head's votes: only the anchor binds them
            assert flchain_cli.verify(copy)["blocks"] == ROUNDS + 1
    elif case == "votes_reordered":
        _edit_block(block(2), lambda b: b["votes"].reverse())
    elif case == "vote_twice":
        _edit_block(block(2), lambda b: b["votes"].__setitem__(slice(None), [
            b["votes"][0], b["votes"][1], b["votes"][1]]))
    elif case == "block_key":
        _edit_block(block(2), _block_key)
    elif case == "header_key":
        _edit_block(block(2), lambda b: _block_key(b["header"]))
    elif case == "transaction_key":
        _edit_block(block(2), lambda b: _block_key(b["transactions"][0]))
    elif case == "registration_key":
        _edit_block(block(0), lambda b: _block_key(b["transactions"][0]))
    elif case == "vote_key":
        _edit_block(block(2), lambda b: _block_key(b["votes"][0]))
    else:
        _edit_block(block(2), lambda b: b["votes"][0].pop("signature"))
    with pytest.raises(ledger.LedgerError, match=why) as e:
        flchain_cli.verify(copy, anchor=summary["ledger_anchor"])
    assert where in str(e.value) and "\n" not in str(e.value)


def test_the_expected_validators_are_checked_without_an_anchor(honest, tmp_path):
    path, summary = honest
    genesis = ledger.Ledger(os.path.join(path, "ledger")).read(0, 0)["header"]
    assert flchain_cli.verify(path, validators=genesis["validators"])["blocks"] == ROUNDS + 1
    assert flchain_cli.verify(path, validators="sha256:" + ledger.fingerprint(
        genesis["validators"]))["anchored"] is False
    with pytest.raises(ledger.LedgerError, match=r"000000\.json.*not the expected"):
        flchain_cli.verify(path, validators=genesis["validators"][::-1])


def test_a_ledger_written_before_format_2_is_refused(honest, tmp_path):
    path, _ = honest
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    genesis = ledger.Ledger(os.path.join(copy, "ledger")).block_path(0, 0)
    _edit_block(genesis, lambda b: b["header"].pop("format"))
    with pytest.raises(ledger.LedgerFormatError,
                       match=r"000000\.json.*ledger format 1 written before .*this verifier "
                             r"reads format 2") as e:
        flchain_cli.verify(copy)
    assert e.value.status == 2
    with pytest.raises(ConfigError, match="ledger does not verify.*ledger format 1"):
        experiment.train(config(rounds=ROUNDS, algorithm="flchain",
                                execution__strategy="loop"), copy, resume=True, progress=False)


def test_command_line_arguments():
    assert flchain_cli._arguments(["w"]) == ("w", None, None)
    assert flchain_cli._arguments(["--anchor", "a.json", "w", "--validators=sha256:ab"]) == \
        ("w", "a.json", "sha256:ab")
    for argv, why in [([], "one WORKDIR"), (["w", "v"], "unexpected"),
                      (["--help"], "unexpected"), (["w", "--anchor"], "needs a value"),
                      (["w", "--anchor", "a", "--anchor", "b"], "twice")]:
        with pytest.raises(ValueError, match=why):
            flchain_cli._arguments(argv)


def test_the_command_line_anchors_the_audit(honest, tmp_path, capsys):
    """`python -m fedjax_pan.algorithms.robust.flchain_cli`'s own code, in this process (the slow
    test below runs it as a command)."""
    path, summary = honest

    def run(*argv):
        code = flchain_cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err
    code, out, _ = run(path)
    assert code == 0 and f"{ROUNDS + 1} blocks" in out
    # Without --anchor, the summary's, with a note that it lies in the same folder.
    assert "verified against the anchor in" in out and "summary.json" in out
    assert "note: that anchor lies in the folder it vouches for" in out
    owner = str(tmp_path / "owner_anchor.json")
    with open(owner, "w") as f:
        json.dump(summary["ledger_anchor"], f)
    fp = summary["ledger_anchor"]["validators_sha256"]
    code, out, err = run(path, "--anchor", owner, "--validators", f"sha256:{fp}")
    assert code == 0, err
    assert f"verified against the anchor in {owner}" in out and "note:" not in out
    # A workdir without a summary: internal consistency only, and it says so.
    bare = str(tmp_path / "bare")
    shutil.copytree(path, bare)
    os.remove(os.path.join(bare, "summary.json"))
    code, out, _ = run(bare)
    assert code == 0 and "internal consistency only" in out and "no anchor given" in out
    os.remove(os.path.join(bare, "ledger", "channel_0", f"{ROUNDS:06d}.json"))
    code, _, err = run(bare, "--anchor", owner)
    assert code == 1 and err.count("\n") == 1
    assert f"block {ROUNDS} of channel 0 is missing" in err
    code, _, err = run(path, "--validators", "sha256:" + "0" * 64)
    assert code == 1 and "not the expected validators'" in err
    code, out, _ = run(path, "--help")
    assert code == 0 and out.startswith("usage: python -m fedjax_pan.algorithms.robust.flchain_cli")
    for args in ([str(tmp_path / "none")], [], [path, path], ["--bad"],
                 [path, "--anchor", str(tmp_path / "none.json")], [path, "--anchor"],
                 [path, "--validators", "nothing"]):
        code, _, err = run(*args)
        assert code == 2, args
        assert err.count("\n") == 1 and err.startswith("error:"), args


@pytest.mark.slow  # four interpreters start
def test_verify_from_the_command_line(honest, tmp_path):
    path, summary = honest
    run = lambda d, *args: subprocess.run(
        [sys.executable, "-m", "fedjax_pan.algorithms.robust.flchain_cli", d, *args],
        capture_output=True, text=True, cwd=ROOT)
    ok = run(path)
    assert ok.returncode == 0, ok.stderr
    assert f"{ROUNDS + 1} blocks" in ok.stdout and "note:" in ok.stdout
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    block = os.path.join(copy, "ledger", "channel_0", "000002.json")
    text = open(block).read()
    open(block, "w").write(text.replace('"round":1', '"round":2', 1))
    bad = run(copy)
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and "000002.json" in bad.stderr
    assert "hash does not match" in bad.stderr
    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    _edit_block(os.path.join(old, "ledger", "channel_0", "000000.json"),
                lambda b: b["header"].pop("format"))
    refused = run(old)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "ledger format 1 written before" in refused.stderr
    wrong = run(str(tmp_path / "none"))
    assert wrong.returncode == 2
    assert wrong.stderr.count("\n") == 1 and wrong.stderr.startswith("error:")


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
    flchain_cli.verify(str(tmp_path))


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
        flchain_cli.verify(str(tmp_path))


@pytest.mark.slow  # the backdoored model trains through an executor of its own
def test_a_central_server_inserting_a_backdoored_model_is_caught_by_the_audit(tmp_path):
    _run(tmp_path, rounds=2, flchain__validators=1, flchain__faulty=1,
         flchain__tamper="backdoor", flchain__tamper_from=1)
    with pytest.raises(ledger.LedgerError, match=r"000002\.json.*signature is not the "
                                                 r"device's"):
        flchain_cli.verify(str(tmp_path))


def test_more_than_f_faulty_validators_stall_the_channel(tmp_path):
    summary = _run(tmp_path, rounds=1, flchain__validators=4, flchain__faulty=2)
    rows = metrics(str(tmp_path))
    assert [r["sim_blocks"] for r in rows] == [0]
    assert ledger.Ledger(str(tmp_path / "ledger")).heights(0) == [0]
    start = jax.tree_util.tree_leaves(summary.experiment.variables["params"])
    for a, b in zip(start, _params(summary)):
        np.testing.assert_array_equal(np.asarray(a), b)


def _ledger_bytes(workdir):
    root = os.path.join(workdir, "ledger")
    return {os.path.relpath(p, root): open(p, "rb").read()
            for p in sorted(glob.glob(os.path.join(root, "*", "*")))}


def test_resume_continues_the_ledger_and_refuses_a_tampered_one(honest, tmp_path,
                                                                 monkeypatch):
    path, full = honest
    part = str(tmp_path / "part")
    # The honest run's keys (as if drawn again): the same ledger, byte for byte.
    monkeypatch.setattr(ledger.Keys, "generate", lambda n, k: ledger.Keys.load(path))
    _run(part, rounds=ROUNDS, checkpoint_every=2)
    monkeypatch.undo()
    # A crash after round 3's block was committed but before its checkpoint landed.
    shutil.rmtree(os.path.join(part, "checkpoints", str(ROUNDS)))
    bad, keyless, other = (str(tmp_path / n) for n in ("bad", "keyless", "other"))
    for copy in (bad, keyless, other):
        shutil.copytree(part, copy)
    resume = lambda d: experiment.train(config(rounds=ROUNDS, algorithm="flchain",
                                               checkpoint_every=2, execution__strategy="loop"),
                                        d, resume=True, progress=False)
    resumed = resume(part)
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    assert flchain_cli.verify(part, anchor=full["ledger_anchor"])["blocks"] == ROUNDS + 1
    assert _ledger_bytes(part) == _ledger_bytes(path)
    _flip(glob.glob(os.path.join(bad, "ledger", "channel_0", "000001.json"))[0], 40)
    with pytest.raises(ConfigError, match="ledger does not verify.*000001.json"):
        resume(bad)
    # Without its keys no block can be signed: refused in one line.
    shutil.rmtree(os.path.join(keyless, "keys"))
    with pytest.raises(ConfigError, match=r"cannot resume .*private keys .*keys\.json are "
                                          r"missing") as e:
        resume(keyless)
    assert "\n" not in str(e.value) and e.value.status == 2
    ledger.Keys.generate(4, len(full.experiment.client_indices)).save(other)
    with pytest.raises(ConfigError, match="not those the genesis block of channel 0 "
                                          "registered"):
        resume(other)


def test_keys_do_not_change_the_run(honest, tmp_path):
    """Two runs of one seed draw different keys and train the same models."""
    path, full = honest
    again = _run(tmp_path, rounds=1)
    first = lambda d: ledger.Ledger(os.path.join(d, "ledger")).read(0, 1)
    assert first(path)["header"]["state_root"] == first(str(tmp_path))["header"]["state_root"]
    assert first(path)["votes"] != first(str(tmp_path))["votes"]
    assert again["ledger_anchor"]["validators_sha256"] != \
        full["ledger_anchor"]["validators_sha256"]


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
    assert flchain_cli.verify(str(tmp_path))["channels"] == 2
    # Each device is scored on its own channel's model.
    correct = count = 0.0
    for j, server in enumerate(summary.state.server["channels"]):
        part = summary.experiment.client_evaluate(chain.rule.eval_variables(server))
        mine = chain.channel_of == j
        correct += part["correct"][mine].sum()
        count += part["count"][mine].sum()
    assert metrics(str(tmp_path))[-1]["pfl_accuracy"] == pytest.approx(correct / count)


def test_more_channels_than_devices_are_refused_before_the_data_loads(tmp_path):
    from fedjax_pan.config import schema
    cfg = config(algorithm="flchain", flchain__channels=21)  # 20 devices
    with pytest.raises(ConfigError, match=r"^config.flchain.channels=21 exceeds the 20 "
                                          r"devices \(partition.num_clients=20\): .*"
                                          r"set flchain.channels <= 20$"):
        schema.validate(cfg)  # touches no data
    with pytest.raises(ConfigError, match="flchain.channels=21"):
        _run(tmp_path / "w", flchain__channels=21)
    assert not os.path.exists(tmp_path / "w")
    schema.validate(config(algorithm="flchain", flchain__channels=20))


def test_a_channel_without_devices_holds_no_model(tmp_path):
    # Seed 1: 'random' leaves channel 0 of 10 without any of the 20 devices.
    live = np.bincount(flchain.select_channels(20, 10, "random", 1), minlength=10) > 0
    assert not live[0] and live[1:].all()
    summary = _run(tmp_path, rounds=2, seed=1, flchain__channels=10,
                   flchain__selection="random", partition__test_fraction=0.2)
    chain, state = summary.experiment.simulation, summary.state
    channels = state.server["channels"]
    assert channels[0] is None and all(c is not None for c in channels[1:])
    # Nine models in the state and so in each checkpoint, not ten.
    one = len(jax.tree_util.tree_leaves(channels[1]))
    assert len(jax.tree_util.tree_leaves(channels)) == 9 * one
    # The empty channel's model is the initial one: the global metrics score it, its
    # genesis is its head in the anchor, and the ledger verifies.
    initial = summary.experiment.variables
    for a, b in zip(jax.tree_util.tree_leaves(chain.evaluation(state.server)[1]),
                    jax.tree_util.tree_leaves(initial)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    heads = {c["channel"]: c["height"] for c in summary["ledger_anchor"]["channels"]}
    assert heads[0] == 0 and len(heads) == 10
    assert flchain_cli.verify(str(tmp_path), anchor=summary["ledger_anchor"])["channels"] == 10
    # Each device is still scored on its own channel's model.
    correct = count = 0.0
    for j in np.flatnonzero(live):
        part = summary.experiment.client_evaluate(chain.rule.eval_variables(channels[j]))
        mine = chain.channel_of == j
        correct += part["correct"][mine].sum()
        count += part["count"][mine].sum()
    assert metrics(str(tmp_path))[-1]["pfl_accuracy"] == pytest.approx(correct / count)
    # A resumed run restores the nine models and goes on.
    again = experiment.train(config(rounds=3, seed=1, algorithm="flchain",
                                    execution__strategy="loop", flchain__channels=10,
                                    flchain__selection="random", partition__test_fraction=0.2),
                             str(tmp_path), resume=True, progress=False)
    assert again.state.server["channels"][0] is None and len(metrics(str(tmp_path))) == 3


def test_channels_that_cannot_fit_in_memory_are_refused(tmp_path, monkeypatch):
    from fedjax_pan import models
    from fedjax_pan.algorithms.core import tree_bytes
    cfg = config(algorithm="flchain")
    exp = experiment.build(cfg)
    chain = exp.simulation
    server = chain.rule.server_init(exp.variables)
    # The estimate by hand: the server state twice (the run's, a checkpoint's copy) and
    # the model once (the per-device evaluation's stack).
    per_channel = 2 * tree_bytes(server) + tree_bytes(exp.variables)
    shapes = jax.eval_shape(lambda: models.init(exp.model, jax.random.PRNGKey(0),
                                                exp.dataset.input_shape))
    assert flchain.channel_bytes(jax.eval_shape(chain.rule.server_init, shapes), shapes) \
        == per_channel
    monkeypatch.setattr(flchain, "available_memory", lambda: 4 * per_channel - 1)
    with pytest.raises(ConfigError, match=r"flchain.channels=4: its 4 channels with devices "
                                          r"would hold about .* GiB \(.* MiB each: .*\), "
                                          r"more than the .* GiB available \(MemAvailable"):
        _run(tmp_path / "w", flchain__channels=4)
    assert not os.path.exists(tmp_path / "w")  # refused before anything was written
    monkeypatch.setattr(flchain, "available_memory", lambda: 4 * per_channel)
    experiment.build(config(algorithm="flchain", flchain__channels=4))
    monkeypatch.setattr(flchain, "available_memory", lambda: None)  # not Linux: no check
    experiment.build(config(algorithm="flchain", flchain__channels=4))


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
