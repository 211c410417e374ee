"""The ledger's hashes, Merkle roots, signatures, quorum arithmetic, storage, keys and
anchor, against hashlib on hand-built inputs."""

import hashlib
import json
import os
import stat
import struct

import numpy as np
import pytest

from fedjax_pan.algorithms.robust import ledger


def H(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_canonical_json_sorts_keys_without_spaces():
    assert ledger.canonical({"b": 1, "a": [1, "x"]}) == b'{"a":[1,"x"],"b":1}'
    assert ledger.sha256(b"abc") == hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(ValueError):
        ledger.canonical({"a": float("nan")})


def test_merkle_root_follows_rfc6962_by_hand():
    a, b, c, d, e = b"a", b"b", b"c", b"d", b"e"
    leaf = lambda x: H(b"\x00" + x)
    node = lambda l, r: H(b"\x01" + l + r)
    assert ledger.merkle_root([]) == H(b"").hex()
    assert ledger.merkle_root([a]) == leaf(a).hex()
    assert ledger.merkle_root([a, b]) == node(leaf(a), leaf(b)).hex()
    # Three leaves split 2 + 1; five split 4 + 1.
    assert ledger.merkle_root([a, b, c]) == node(node(leaf(a), leaf(b)), leaf(c)).hex()
    four = node(node(leaf(a), leaf(b)), node(leaf(c), leaf(d)))
    assert ledger.merkle_root([a, b, c, d, e]) == node(four, leaf(e)).hex()
    # Order matters, and a leaf is never confused with a node of the same bytes.
    assert ledger.merkle_root([b, a]) != ledger.merkle_root([a, b])
    assert ledger.merkle_root([leaf(a) + leaf(b)]) != ledger.merkle_root([a, b])


def _record(path, a):
    head = ('["%s","%s",%s]' % (path, a.dtype.str, str(list(a.shape)).replace(" ", ""))
            ).encode()
    raw = a.tobytes()
    return struct.pack(">I", len(head)) + head + struct.pack(">Q", len(raw)) + raw


def test_tree_encoding_and_state_root_by_hand():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5, -2.0], np.float32)
    tree = {"params": {"dense": {"kernel": w, "bias": b}}}
    records = [_record("params/dense/bias", b), _record("params/dense/kernel", w)]
    assert ledger.encode_tree(tree) == b"".join(records)
    assert ledger.state_root(tree) == ledger.merkle_root(records)
    flat = ledger.decode_tree(ledger.encode_tree(tree))
    np.testing.assert_array_equal(flat["params/dense/kernel"], w)
    assert ledger.unflatten(flat, tree)["params"]["dense"]["bias"].dtype == np.float32
    # One flipped bit of one weight changes the root.
    w2 = w.copy()
    w2.view(np.uint32)[1, 2] ^= 1
    assert ledger.state_root({"params": {"dense": {"kernel": w2, "bias": b}}}) != \
        ledger.state_root(tree)
    with pytest.raises(ValueError, match="differ"):
        ledger.unflatten({"params/dense/bias": b}, tree)
    with pytest.raises(ValueError, match="not an encoded"):
        ledger.decode_tree(b"\x00\x00\x00\x05abc")


def _keys(n=3):
    return [ledger.new_key() for _ in range(n)]


def test_keys_come_from_the_os_and_are_kept_private(tmp_path, monkeypatch):
    # Every key is fresh: no seed reproduces it.
    assert len({ledger.public_hex(k) for k in _keys(8)}) == 8
    drawn = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: drawn.append(n) or real(n))
    ledger.new_key()
    assert drawn == [32]  # its 32 private bytes are the OS's
    monkeypatch.undo()
    keys = ledger.Keys.generate(2, 3)
    path = keys.save(str(tmp_path))
    assert path == str(tmp_path / "keys" / "keys.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    back = ledger.Keys.load(str(tmp_path))
    assert [ledger.public_hex(k) for k in back.validators + back.devices] == \
        [ledger.public_hex(k) for k in keys.validators + keys.devices]
    with open(path, "w") as f:
        json.dump({**keys.to_json(), "extra": 1}, f)
    with pytest.raises(ValueError, match="extra key"):
        ledger.Keys.load(str(tmp_path))


def test_transactions_refuse_forgery_and_replay():
    keys = _keys()
    registered = {i: ledger.public_hex(k) for i, k in enumerate(keys)}
    tx = ledger.transaction(keys[1], 0, 5, 1, "ab" * 32, 100, 4096)
    assert ledger.check_transaction(tx, 0, 5, registered) is None
    # Forged: device 1's transaction signed by device 2's key.
    forged = ledger.transaction(keys[2], 0, 5, 1, "ab" * 32, 100, 4096)
    assert "signature" in ledger.check_transaction(forged, 0, 5, registered)
    # Tampered after signing: a different digest or example count.
    assert "signature" in ledger.check_transaction({**tx, "digest": "cd" * 32}, 0, 5,
                                                   registered)
    assert "signature" in ledger.check_transaction({**tx, "examples": 10 ** 6}, 0, 5,
                                                   registered)
    # Replayed: round 5's transaction offered in round 6, as is or relabelled.
    assert "replay" in ledger.check_transaction(tx, 0, 6, registered)
    assert "signature" in ledger.check_transaction({**tx, "round": 6}, 0, 6, registered)
    assert "channel" in ledger.check_transaction(tx, 1, 5, registered)
    assert "not registered" in ledger.check_transaction(
        ledger.transaction(keys[0], 0, 5, 7, "ab" * 32, 1, 1), 0, 5, registered)


@pytest.mark.parametrize("n,f,q", [(1, 0, 1), (2, 0, 2), (3, 0, 2), (4, 1, 3), (6, 1, 4),
                                   (7, 2, 5), (10, 3, 7), (13, 4, 9)])
def test_quorum_at_the_3f_plus_1_boundary(n, f, q):
    assert ledger.tolerated(n) == f
    assert ledger.quorum(n) == q


def test_quorums_intersect_in_an_honest_validator():
    for n in range(1, 60):
        f, q = ledger.tolerated(n), ledger.quorum(n)
        assert 3 * f + 1 <= n < 3 * (f + 1) + 1
        assert 2 * q - n >= f + 1  # two quorums share more than f validators
        assert q <= n - f  # the honest validators alone reach it


def test_votes_commit_a_block_only_at_the_quorum():
    validators = _keys(4)
    public = [ledger.public_hex(k) for k in validators]
    header = {"channel": 0, "height": 1}
    block = {"header": header, "hash": ledger.block_hash(header), "votes": []}

    def vote(v, key=None):
        return {"validator": v, "signature": ledger.sign(key or validators[v],
                                                         ledger.VOTE_DOMAIN,
                                                         bytes.fromhex(block["hash"]))}
    block["votes"] = [vote(0), vote(1), vote(2)]
    assert ledger.check_votes(block, public, 3) is None
    block["votes"] = [vote(0), vote(1)]
    assert "quorum is 3" in ledger.check_votes(block, public, 3)
    block["votes"] = [vote(0), vote(1), vote(1)]
    assert "validator 1 is not one validator's single vote" in \
        ledger.check_votes(block, public, 3)
    # Sorted by validator, each exactly {validator, signature}.
    block["votes"] = [vote(1), vote(0), vote(2)]
    assert "not sorted by validator" in ledger.check_votes(block, public, 3)
    block["votes"] = [vote(0), vote(1), {**vote(2), "weight": 9}]
    assert "extra key(s) 'weight'" in ledger.check_votes(block, public, 3)
    block["votes"] = [vote(0), vote(1), {"validator": 2}]
    assert "no 'signature'" in ledger.check_votes(block, public, 3)
    block["votes"] = [vote(0), vote(1), {**vote(2), "validator": True}]
    assert "no such validator" in ledger.check_votes(block, public, 3)
    block["votes"] = [vote(0), vote(1), vote(2, validators[3])]
    assert "validator 2" in ledger.check_votes(block, public, 3)
    # A vote is for one block: the same signature does not sign another hash.
    block["votes"] = [vote(0), vote(1), vote(2)]
    other = {**block, "hash": ledger.block_hash({"channel": 0, "height": 2})}
    assert "validator 0" in ledger.check_votes(other, public, 3)


def test_storage_is_content_addressed_and_append_only(tmp_path):
    store = ledger.Ledger(str(tmp_path / "ledger"))
    digest = store.put(b"update bytes")
    assert digest == hashlib.sha256(b"update bytes").hexdigest()
    assert store.get(digest) == b"update bytes"
    header = {"channel": 0, "height": 0}
    block = {"header": header, "hash": ledger.block_hash(header), "transactions": [],
             "votes": []}
    store.append(block)
    store.append(block)  # the same block again (a resumed run): nothing changes
    changed = {**block, "votes": [{"validator": 0, "signature": "00"}]}
    with pytest.raises(ledger.LedgerError, match="differs"):
        store.append(changed)
    gap = {"header": {"channel": 0, "height": 2}, "hash": "", "transactions": [], "votes": []}
    with pytest.raises(ledger.LedgerError, match="block 1 of channel 0 is missing"):
        store.append(gap)
    assert store.read(0, 0) == block


def test_anchor_records_validators_heads_and_votes(tmp_path):
    validators = [ledger.public_hex(k) for k in _keys(4)]
    assert ledger.fingerprint(validators) == \
        hashlib.sha256(json.dumps(validators, separators=(",", ":")).encode()).hexdigest()
    votes = [{"signature": "ab", "validator": 0}]
    head = {"header": {"height": 7}, "hash": "cd" * 32, "votes": votes}
    a = ledger.anchor({0: head}, validators)
    assert a == {"ledger_format": ledger.LEDGER_FORMAT,
                 "validators_sha256": ledger.fingerprint(validators),
                 "channels": [{"channel": 0, "height": 7, "head": "cd" * 32,
                               "head_votes": hashlib.sha256(
                                   b'[{"signature":"ab","validator":0}]').hexdigest()}]}
    assert ledger.check_anchor(a) is a
    for bad, why in [({**a, "x": 1}, "extra key"), ({**a, "ledger_format": 1}, "format 1"),
                     ({**a, "channels": a["channels"] * 2}, "twice"),
                     ({**a, "validators_sha256": "zz"}, "not a SHA-256")]:
        with pytest.raises(ValueError, match=why):
            ledger.check_anchor(bad)
    # The anchor file: the anchor itself, or a run's summary.json holding it.
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "summary.json").write_text(json.dumps({"final_accuracy": 0.5,
                                                       "ledger_anchor": a}))
    assert ledger.read_anchor(str(tmp_path / "a.json")) == a
    assert ledger.read_anchor(str(tmp_path / "summary.json")) == a
    # The expected validators: a fingerprint (with or without 'sha256:') or a file.
    fp = ledger.fingerprint(validators)
    assert ledger.read_validators(fp) == ledger.read_validators(f"sha256:{fp}") == fp
    (tmp_path / "v.json").write_text(json.dumps(validators))
    assert ledger.read_validators(str(tmp_path / "v.json")) == fp
    assert ledger.read_validators(str(tmp_path / "summary.json")) == fp
    with pytest.raises(OSError):
        ledger.read_validators(str(tmp_path / "none.json"))
