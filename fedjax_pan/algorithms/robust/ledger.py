"""A permissioned ledger per FL channel: blocks, transactions, signatures, content-addressed
arrays and the audit that replays them (FLChain, Majeed & Hong 2019; the driver, whose
update rule the audit is given, is `fedjax_pan.algorithms.robust.flchain`).

Layout under `<workdir>/ledger/`:
    objects/<sha256>              arrays (a device's update, a global model), named by digest
    channel_<j>/<height:06d>.json one block per file, height 0 the channel's genesis

Every hash is SHA-256 over a canonical encoding: JSON with sorted keys and no spaces
(`canonical`), arrays as `encode_tree` writes them (each leaf's path, dtype and shape, then
its little-endian bytes, leaves sorted by path). Merkle roots follow RFC 6962 (leaves
hashed under prefix 0x00, nodes under 0x01, the split at the largest power of two below the
count). The global model's "state trie" is the Merkle tree over its leaves' records in path
order: `state_root`, whose per-leaf proofs would locate a changed layer.

A block: {"header": ..., "hash": sha256(canonical(header)), "transactions": [...],
"votes": [{"validator", "signature"}]}, with exactly these keys (as are a transaction's,
a vote's and a header's: `BLOCK_KEYS` and the rest; any key extra or missing is a fault).
Its header holds the channel, height, round, the previous block's hash and the digest of
the previous block's votes (`votes_digest`: so every vote but the head's is hashed into
the chain, as Tendermint's LastCommitHash), the Merkle root of its transactions, the state
root and digest of the global model it commits, its proposer, the proposals rejected before
it, and its simulated timing. A genesis header names the ledger format (`LEDGER_FORMAT`),
the validators' public keys, the quorum, the initial model and the update rule. Votes are
Ed25519 signatures of the block hash by the validators that accepted it, sorted by
validator, one each; the quorum counts distinct validators of the genesis's (distinct)
keys. Transactions are signed by their devices.

Keys (`Keys`): every device's and validator's Ed25519 key is drawn from the OS's entropy
(`os.urandom`), never from the config's seed (config.json would hand them to anyone who
reads it), so a run's numbers stay a function of the seed alone: keys only sign. The
private keys never enter the ledger; they live in `<workdir>/keys/keys.json` (folder mode
0700, file 0600), which a resumed run needs (`--resume` refuses without it).

Trust anchor (`anchor`): whoever holds the keys can re-sign any history, and whoever
controls the folder can cut its end off; the internal checks cannot tell. The anchor, taken
at the end of a run, is {"ledger_format", "validators_sha256": `fingerprint` of the
genesis's validator keys, "channels": [{"channel", "height", "head": the head block's hash,
"head_votes": the `votes_digest` of its votes}]}. The run records it in its summary.json
(`ledger_anchor`) and prints it; its owner keeps a copy outside the workdir, since an
anchor inside the folder an attacker controls anchors nothing.

What `verify` checks: every object against its digest; each block's exact keys, hash,
previous-block link, previous votes' digest, Merkle root, votes (signature, order, one per
validator, quorum), every transaction's signature and round, and every global model
recomputed from the stored updates by the update rule it is given (FLChain's
`flchain.audit`); with `validators`, the genesis's validator keys; with
`anchor`, those keys and each channel's head hash, its votes and its height (a block
deleted from the end, or one appended). Without an anchor it checks internal consistency
only, and says so (`counts["anchored"]` False). Its command line is FLChain's:
`python -m fedjax_pan.algorithms.robust.flchain_cli WORKDIR [--anchor FILE] [--validators ...]`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (Ed25519PrivateKey,
                                                               Ed25519PublicKey)

from fedjax_pan import workdir as workdir_lib
from fedjax_pan.errors import RunError

__all__ = ["LedgerError", "LedgerFormatError", "LEDGER_FORMAT", "canonical", "sha256",
           "merkle_root", "encode_tree", "decode_tree", "encode_with_root", "state_root",
           "new_key", "Keys", "keys_path", "public_hex", "sign", "signature_valid",
           "transaction", "registration", "tx_body", "block_hash", "votes_digest",
           "fingerprint", "anchor", "read_anchor", "Ledger", "verify", "ReplayRule", "quorum",
           "tolerated"]

# 1: the first ledgers (keys drawn from the seed, no format field, votes outside the chain);
# 2: keys from the OS, `prev_votes` in every header, exact key sets, a trust anchor.
LEDGER_FORMAT = 2
GENESIS_PREV = "0" * 64
# Domain separation: a signature over one kind of message is never valid for another.
TX_DOMAIN = b"fedjax_pan/flchain/transaction\n"
VOTE_DOMAIN = b"fedjax_pan/flchain/vote\n"
KEYS_DIR, KEYS_FILE = "keys", "keys.json"  # under the workdir; never inside the ledger
# Each object's exact keys (a key extra or missing is a fault).
BLOCK_KEYS = frozenset({"header", "hash", "transactions", "votes"})
GENESIS_KEYS = frozenset({"format", "channel", "height", "round", "prev_hash", "tx_root",
                          "state_root", "model", "rule", "validators", "quorum"})
HEADER_KEYS = frozenset({"channel", "height", "round", "prev_hash", "prev_votes", "tx_root",
                         "state_root", "model", "proposer", "rejected", "sim"})
RULE_KEYS = frozenset({"optimizer", "lr", "momentum", "weights"})
SIM_KEYS = frozenset({"seconds", "pool_seconds", "consensus_seconds", "download_seconds",
                      "attempts"})
REJECTED_KEYS = frozenset({"proposer", "votes", "reason"})
UPDATE_KEYS = frozenset({"type", "channel", "round", "device", "digest", "examples", "bytes",
                         "signature"})
REGISTER_KEYS = frozenset({"type", "channel", "device", "public_key", "signature"})
VOTE_KEYS = frozenset({"validator", "signature"})
ANCHOR_KEYS = frozenset({"ledger_format", "validators_sha256", "channels"})
ANCHOR_CHANNEL_KEYS = frozenset({"channel", "height", "head", "head_votes"})


class LedgerError(RunError):
    """A ledger that does not verify: the message locates the fault in one line."""

    status = 1


class LedgerFormatError(LedgerError):
    """A ledger of a format this verifier does not read (bad input, not a found fault)."""

    status = 2


def key_fault(obj: Any, expected: frozenset, what: str) -> Optional[str]:
    """Why `obj` is not a JSON object with exactly the keys `expected` (None: it is)."""
    if not isinstance(obj, dict):
        return f"{what} is not an object"
    extra, missing = sorted(set(obj) - expected), sorted(expected - set(obj))
    if extra or missing:
        parts = ([f"the extra key(s) {', '.join(map(repr, extra))}"] if extra else []) + \
            ([f"no {', '.join(map(repr, missing))}"] if missing else [])
        return f"{what} has {' and '.join(parts)}"
    return None


def canonical(obj: Any) -> bytes:
    """The canonical bytes of a JSON value: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def merkle_root(leaves: Sequence[bytes]) -> str:
    """RFC 6962's Merkle tree hash of `leaves` (hex)."""
    def mth(items):
        if not items:
            return hashlib.sha256(b"").digest()
        if len(items) == 1:
            return hashlib.sha256(b"\x00" + items[0]).digest()
        k = 1 << ((len(items) - 1).bit_length() - 1)  # largest power of two < n
        return hashlib.sha256(b"\x01" + mth(items[:k]) + mth(items[k:])).digest()
    return mth(list(leaves)).hex()


def _path(keys: tuple) -> str:
    parts = []
    for k in keys:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def _leaves(tree: Any) -> List[Tuple[str, np.ndarray]]:
    """(path, array) for each leaf of `tree`, sorted by path."""
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return sorted(((_path(p), np.asarray(x)) for p, x in flat), key=lambda e: e[0])


def _record(path: str, a: np.ndarray) -> bytes:
    head = canonical([path, a.dtype.newbyteorder("<").str, list(a.shape)])
    raw = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False)).tobytes()
    return struct.pack(">I", len(head)) + head + struct.pack(">Q", len(raw)) + raw


def encode_tree(tree: Any) -> bytes:
    """The canonical bytes of a pytree of arrays (the records of its leaves in path order)."""
    return b"".join(_record(p, a) for p, a in _leaves(tree))


def encode_with_root(variables: Any) -> Tuple[bytes, str]:
    """`encode_tree(variables)` and `state_root(variables)` from one pass over the leaves
    (a committed model is stored and its root checked)."""
    records = [_record(p, a) for p, a in _leaves(variables)]
    return b"".join(records), merkle_root(records)


def decode_tree(data: bytes) -> Dict[str, np.ndarray]:
    """{path: array} from `encode_tree`'s bytes; ValueError where they are not such bytes."""
    out, i = {}, 0
    try:
        while i < len(data):
            (n,) = struct.unpack_from(">I", data, i)
            path, dtype, shape = json.loads(data[i + 4:i + 4 + n])
            i += 4 + n
            (m,) = struct.unpack_from(">Q", data, i)
            i += 8
            a = np.frombuffer(data[i:i + m], np.dtype(dtype))
            out[path] = a.reshape(shape)
            i += m
    except (struct.error, ValueError, TypeError) as e:
        raise ValueError(f"not an encoded array tree ({e})") from None
    return out


def unflatten(flat: Dict[str, np.ndarray], template: Any) -> Any:
    """`flat` ({path: array}) in `template`'s structure; ValueError naming the first path
    that differs in name, dtype or shape."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    want = {_path(p): x for p, x in leaves}
    if set(want) != set(flat):
        extra = sorted(set(flat) ^ set(want))
        raise ValueError(f"its leaves differ from the model's (first: {extra[0]!r})")
    for p, x in want.items():
        if (np.dtype(flat[p].dtype) != np.dtype(x.dtype)
                or tuple(flat[p].shape) != tuple(np.shape(x))):
            raise ValueError(f"leaf {p!r} is {flat[p].dtype}{list(flat[p].shape)}, the "
                             f"model's {np.dtype(x.dtype)}{list(np.shape(x))}")
    return jax.tree_util.tree_unflatten(treedef, [flat[_path(p)] for p, _ in leaves])


def state_root(variables: Any) -> str:
    """The root of the global model's state trie: the Merkle root of its leaves' records."""
    return merkle_root([_record(p, a) for p, a in _leaves(variables)])


# --- keys and signatures -------------------------------------------------------------

def new_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 key from the OS's entropy (never from a seed: see the module doc)."""
    return Ed25519PrivateKey.from_private_bytes(os.urandom(32))


def public_hex(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw).hex()


def _private_hex(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption()).hex()


def keys_path(workdir: str) -> str:
    """Where a run keeps its private keys: `<workdir>/keys/keys.json`."""
    return os.path.join(workdir, KEYS_DIR, KEYS_FILE)


class Keys(NamedTuple):
    """A run's private keys: its validators' (by index) and its devices' (by device id)."""

    validators: List[Ed25519PrivateKey]
    devices: List[Ed25519PrivateKey]

    @staticmethod
    def generate(validators: int, devices: int) -> "Keys":
        return Keys([new_key() for _ in range(validators)], [new_key() for _ in range(devices)])

    def to_json(self) -> Dict[str, Any]:
        return {"ledger_format": LEDGER_FORMAT,
                "validators": [_private_hex(k) for k in self.validators],
                "devices": [_private_hex(k) for k in self.devices]}

    @staticmethod
    def from_json(obj: Any) -> "Keys":
        """The keys `to_json` wrote; ValueError saying what is wrong."""
        why = key_fault(obj, frozenset({"ledger_format", "validators", "devices"}), "it")
        if why:
            raise ValueError(why)
        try:
            return Keys(*[[Ed25519PrivateKey.from_private_bytes(bytes.fromhex(k))
                           for k in obj[role]] for role in ("validators", "devices")])
        except (TypeError, ValueError) as e:
            raise ValueError(f"a key is not 32 hex-encoded bytes ({e})") from None

    def save(self, workdir: str) -> str:
        """Writes the keys to `keys_path(workdir)` (folder 0700, file 0600, whole or not at
        all); returns the path."""
        path = keys_path(workdir)
        folder = os.path.dirname(path)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)  # makedirs' mode is subject to the umask
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_json()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    @staticmethod
    def load(workdir: str) -> "Keys":
        """The keys `save` wrote; OSError where the file is missing, ValueError where it is
        not such a file."""
        with open(keys_path(workdir)) as f:
            text = f.read()
        try:
            obj = json.loads(text)
        except ValueError:
            raise ValueError("not JSON") from None
        return Keys.from_json(obj)


def sign(key: Ed25519PrivateKey, domain: bytes, message: bytes) -> str:
    return key.sign(domain + message).hex()


def signature_valid(public: str, domain: bytes, message: bytes, signature: str) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(
            bytes.fromhex(signature), domain + message)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def tx_body(tx: Dict[str, Any]) -> Dict[str, Any]:
    """What a transaction's signature covers: everything but the signature."""
    return {k: v for k, v in tx.items() if k != "signature"}


def transaction(key: Ed25519PrivateKey, channel: int, round_index: int, device: int,
                digest: str, examples: int, nbytes: int) -> Dict[str, Any]:
    """Device `device`'s signed local-model update for `round_index` on `channel`."""
    body = {"type": "update", "channel": channel, "round": round_index, "device": device,
            "digest": digest, "examples": int(examples), "bytes": int(nbytes)}
    return {**body, "signature": sign(key, TX_DOMAIN, canonical(body))}


def registration(key: Ed25519PrivateKey, channel: int, device: int) -> Dict[str, Any]:
    """Device `device` registering its public key with `channel` (signed by that key)."""
    body = {"type": "register", "channel": channel, "device": device,
            "public_key": public_hex(key)}
    return {**body, "signature": sign(key, TX_DOMAIN, canonical(body))}


def block_hash(header: Dict[str, Any]) -> str:
    return sha256(canonical(header))


def votes_digest(votes: List[Dict[str, Any]]) -> str:
    """The digest of a block's votes, which the next block's header (`prev_votes`) and the
    anchor (`head_votes`) record."""
    return sha256(canonical(votes))


def fingerprint(validators: Sequence[str]) -> str:
    """SHA-256 of the validators' public keys (hex, in index order) as canonical JSON."""
    return sha256(canonical(list(validators)))


def anchor(heads: Dict[int, Dict[str, Any]], validators: Sequence[str]) -> Dict[str, Any]:
    """The trust anchor of a ledger whose channels end in `heads` ({channel: head block})
    under genesis `validators` (public keys): see the module docstring."""
    return {"ledger_format": LEDGER_FORMAT, "validators_sha256": fingerprint(validators),
            "channels": [{"channel": j, "height": heads[j]["header"]["height"],
                          "head": heads[j]["hash"], "head_votes": votes_digest(heads[j]["votes"])}
                         for j in sorted(heads)]}


def _hex64(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def check_anchor(obj: Any) -> Dict[str, Any]:
    """`obj` if it is an anchor (`anchor`'s form), else ValueError saying why."""
    why = key_fault(obj, ANCHOR_KEYS, "the anchor")
    if why is None and obj["ledger_format"] != LEDGER_FORMAT:
        why = (f"the anchor is of ledger format {obj['ledger_format']}; this verifier reads "
               f"format {LEDGER_FORMAT}")
    if why is None and not _hex64(obj["validators_sha256"]):
        why = "the anchor's validators_sha256 is not a SHA-256 in hex"
    if why is None and not isinstance(obj["channels"], list):
        why = "the anchor's channels are not a list"
    for c in obj["channels"] if why is None else []:
        why = why or key_fault(c, ANCHOR_CHANNEL_KEYS, "a channel of the anchor")
        if why is None and not (isinstance(c["channel"], int) and isinstance(c["height"], int)
                                and _hex64(c["head"]) and _hex64(c["head_votes"])):
            why = f"the anchor's channel {c['channel']!r} is malformed"
    if why is None and len({c["channel"] for c in obj["channels"]}) != len(obj["channels"]):
        why = "the anchor names a channel twice"
    if why:
        raise ValueError(why)
    return obj


def read_anchor(path: str) -> Dict[str, Any]:
    """The anchor in JSON file `path`: the anchor itself, or a run's summary.json holding it
    (`ledger_anchor`). OSError or ValueError saying why not."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except ValueError:
            raise ValueError(f"{path} is not JSON") from None
    if isinstance(obj, dict) and "ledger_anchor" in obj:
        obj = obj["ledger_anchor"]
    try:
        return check_anchor(obj)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_validators(text: str) -> str:
    """The validators' fingerprint `text` names: 'sha256:HEX' or HEX, or a JSON file holding
    their public keys (a list), an anchor or a summary.json with one. ValueError/OSError."""
    bare = text[len("sha256:"):] if text.startswith("sha256:") else text
    if _hex64(bare.lower()) and not os.path.exists(text):
        return bare.lower()
    with open(text) as f:
        try:
            obj = json.load(f)
        except ValueError:
            raise ValueError(f"{text} is neither a SHA-256 fingerprint nor a JSON file") from None
    if isinstance(obj, list) and all(_hex64(k) for k in obj) and obj:
        return fingerprint(obj)
    if isinstance(obj, dict) and ("ledger_anchor" in obj or "validators_sha256" in obj):
        return read_anchor(text)["validators_sha256"]
    raise ValueError(f"{text} holds neither a list of validators' public keys nor an anchor")


def tolerated(n: int) -> int:
    """f: the faulty validators n tolerate (n >= 3f + 1)."""
    return (n - 1) // 3


def quorum(n: int) -> int:
    """Votes a block needs among n validators: ceil((n + f + 1) / 2), i.e. 2f + 1 at
    n = 3f + 1 (PBFT). Any two quorums share an honest validator."""
    return -(-(n + tolerated(n) + 1) // 2)


# --- storage -------------------------------------------------------------------------

class Ledger:
    """The ledger files under `root` (`<workdir>/ledger`)."""

    def __init__(self, root: str):
        self.root = root

    def object_path(self, digest: str) -> str:
        return os.path.join(self.root, "objects", digest)

    def put(self, data: bytes) -> str:
        """Stores `data` under its digest (once); returns the digest."""
        digest = sha256(data)
        path = self.object_path(digest)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return digest

    def get(self, digest: str) -> bytes:
        with open(self.object_path(digest), "rb") as f:
            return f.read()

    def block_path(self, channel: int, height: int) -> str:
        return os.path.join(self.root, f"channel_{channel}", f"{height:06d}.json")

    def append(self, block: Dict[str, Any]) -> None:
        """Writes `block` after its channel's head; a block already there must be the same
        (a resumed run re-deriving a committed block)."""
        h = block["header"]
        path = self.block_path(h["channel"], h["height"])
        data = canonical(block)
        if os.path.exists(path):
            with open(path, "rb") as f:
                if f.read() != data:
                    raise LedgerError(f"{path}: the rerun's block {h['height']} of channel "
                                      f"{h['channel']} differs from the one on the ledger")
            return
        if h["height"] and not os.path.exists(self.block_path(h["channel"], h["height"] - 1)):
            raise LedgerError(f"{path}: block {h['height'] - 1} of channel {h['channel']} "
                              f"is missing")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        workdir_lib.write_atomic(path, data.decode())

    def channels(self) -> List[int]:
        if not os.path.isdir(self.root):
            return []
        names = [n for n in os.listdir(self.root) if n.startswith("channel_")]
        return sorted(int(n.split("_", 1)[1]) for n in names)

    def heights(self, channel: int) -> List[int]:
        d = os.path.join(self.root, f"channel_{channel}")
        return sorted(int(n[:-5]) for n in os.listdir(d) if n.endswith(".json"))

    def read(self, channel: int, height: int) -> Dict[str, Any]:
        """Block `height` of `channel`, checked to be canonical JSON (LedgerError)."""
        path = self.block_path(channel, height)
        with open(path, "rb") as f:
            data = f.read()
        try:
            block = json.loads(data)
        except ValueError:
            raise LedgerError(f"{path}: not valid JSON (block {height} of channel "
                              f"{channel})") from None
        if canonical(block) != data:
            raise LedgerError(f"{path}: not in canonical form (block {height} of channel "
                              f"{channel} was edited)")
        return block


# --- audit ---------------------------------------------------------------------------

def check_transaction(tx: Dict[str, Any], channel: int, round_index: int,
                      keys: Dict[int, str]) -> Optional[str]:
    """Why `tx` is not a valid update of `channel`'s round `round_index` from a device
    registered with the public `keys` (None: it is)."""
    device = tx.get("device")
    if tx.get("type") != "update":
        return f"transaction of device {device} is not an update"
    if tx.get("channel") != channel:
        return f"transaction of device {device} is for channel {tx.get('channel')}"
    if tx.get("round") != round_index:
        return (f"transaction of device {device} is for round {tx.get('round')}, not "
                f"{round_index} (a replay)")
    if device not in keys:
        return f"transaction of device {device}: the device is not registered"
    if not signature_valid(keys[device], TX_DOMAIN, canonical(tx_body(tx)),
                           str(tx.get("signature", ""))):
        return f"transaction of device {device}: the signature is not the device's"
    return None


def check_votes(block: Dict[str, Any], validators: List[str], needed: int) -> Optional[str]:
    """Why `block`'s votes do not commit it (None: `needed` valid votes of distinct
    validators, each {"validator", "signature"} and sorted by validator, sign its hash)."""
    votes = block["votes"]
    if not isinstance(votes, list):
        return "its votes are not a list"
    ids = []
    for vote in votes:
        why = key_fault(vote, VOTE_KEYS, "a vote")
        if why:
            return f"{why} (vote {len(ids)})"
        v = vote["validator"]
        if type(v) is not int or not 0 <= v < len(validators):
            return f"vote of validator {v!r}: no such validator"
        ids.append(v)
    if len(set(ids)) != len(ids):
        twice = next(v for v in ids if ids.count(v) > 1)
        return f"vote of validator {twice} is not one validator's single vote (it votes twice)"
    if ids != sorted(ids):
        return f"its votes are not sorted by validator ({ids}: reordered)"
    for vote in votes:
        v = vote["validator"]
        if not signature_valid(validators[v], VOTE_DOMAIN, bytes.fromhex(block["hash"]),
                               str(vote["signature"])):
            return f"vote of validator {v}: the signature does not sign the block's hash"
    if len(ids) < needed:
        return f"{len(ids)} votes commit it, and the quorum is {needed}"
    return None


class _Located(LedgerError):
    """A fault whose message already names the block it lies in (not the one checked)."""


# rule(genesis header, its devices' keys {id: public key}, the initial model as a flat
# {path: array}) -> the channel's replayed state after its genesis, under the update rule
# the header names: `genesis_header`, `keys`, `round`, `root` and `digest` (of its global
# model), `decode_update(bytes)`, and `apply(updates, examples, round)` -> the state after
# a block (FLChain's `flchain.Replay`).
ReplayRule = Callable[[Dict[str, Any], Dict[int, str], Dict[str, np.ndarray]], Any]


def verify(workdir: str, rule: ReplayRule, *, anchor: Optional[Dict[str, Any]] = None,
           validators: Union[None, str, Sequence[str]] = None,
           progress: bool = False) -> Dict[str, Any]:
    """Replays the ledger of the run in `workdir`: every block's keys, hash link, votes,
    Merkle and state root, every signature, every object's digest, and every global model
    recomputed from the stored updates by the channel's update rule, `rule` (internal
    consistency; FLChain's is `flchain.audit(server_optimizer)`). With
    `validators` (their fingerprint, or their public keys) each genesis must name exactly
    those validators; with `anchor` (`anchor`'s form) too, and each channel must end in the
    anchor's head: its hash, its votes' digest, its height. Returns counts and
    `anchored` (whether the anchor was checked: without it, a history rewritten by whoever
    holds the keys, or cut short, passes). Raises LedgerError locating the first fault
    (LedgerFormatError for a ledger of another format)."""
    if anchor is not None:
        check_anchor(anchor)
    expected = []  # (fingerprint, whose) the genesis validators must have
    if validators is not None:
        expected.append((validators if isinstance(validators, str) else
                         fingerprint(validators), "the expected validators'"))
    if anchor is not None:
        expected.append((anchor["validators_sha256"], "the anchor's"))
    expected = [(f[len("sha256:"):] if f.startswith("sha256:") else f, w) for f, w in expected]
    ledger = Ledger(os.path.join(workdir, "ledger"))
    channels = ledger.channels()
    if not channels:
        raise LedgerError(f"{ledger.root}: no ledger (not an FLChain run's workdir?)")
    counts: Dict[str, Any] = {"channels": len(channels), "blocks": 0, "transactions": 0,
                              "objects": 0, "anchored": anchor is not None}
    heads = {c["channel"]: c for c in (anchor or {}).get("channels", [])}
    if anchor is not None and set(heads) != set(channels):
        j = min(set(heads) ^ set(channels))
        raise LedgerError(
            f"{os.path.join(ledger.root, f'channel_{j}')}: channel {j} "
            + ("is not in the anchor (added after it was taken)" if j in channels else
               "of the anchor has no blocks (deleted)"))
    # Every stored array, referenced or not (a rejected proposal's), matches its name.
    objects = os.path.join(ledger.root, "objects")
    for name in sorted(os.listdir(objects)) if os.path.isdir(objects) else []:
        if name.endswith(".tmp"):  # a write cut short, never referenced
            continue
        _object(ledger, name, f"object {name}")
        counts["objects"] += 1
    from tqdm.auto import tqdm

    # On a terminal only (disable=None): the one-line error stays one line elsewhere.
    heights = {j: ledger.heights(j) for j in channels}
    bar = tqdm(total=sum(map(len, heights.values())), desc="verifying",
               unit="block", disable=None if progress else True, leave=False)
    try:
        for j in channels:
            state = None
            prev = None
            if heights[j] != list(range(len(heights[j]))):
                missing = sorted(set(range(max(heights[j]) + 1)) - set(heights[j]))
                raise LedgerError(f"{ledger.block_path(j, missing[0])}: block {missing[0]} of "
                                  f"channel {j} is missing")
            for height in heights[j]:
                bar.update(1)
                block = ledger.read(j, height)
                where = f"{ledger.block_path(j, height)} (block {height} of channel {j})"
                try:
                    state = _check_block(ledger, block, j, height, prev, state, rule)
                    if height == 0:
                        ours = fingerprint(block["header"]["validators"])
                        for want, whose in expected:
                            if ours != want:
                                raise LedgerError(
                                    f"its validators' keys (sha256 {ours[:16]}...) are not "
                                    f"{whose} (sha256 {want[:16]}...): a ledger signed by "
                                    f"other keys")
                except _Located:
                    raise
                except LedgerError as e:
                    raise type(e)(f"{where}: {e}") from None
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                    raise LedgerError(f"{where}: malformed ({type(e).__name__}: {e})") from None
                prev = block
                counts["blocks"] += 1
                counts["transactions"] += len(block["transactions"])
            if anchor is not None:
                _check_head(ledger, j, heights[j][-1], heads[j])
    finally:
        bar.close()
    return counts


def _check_head(ledger: Ledger, channel: int, last: int, head: Dict[str, Any]) -> None:
    """Channel `channel`, whose last block is `last`, ends in the anchor's `head`."""
    h = head["height"]
    if last < h:
        raise LedgerError(f"{ledger.block_path(channel, last + 1)}: block {last + 1} of channel "
                          f"{channel} is missing: the anchor's head is block {h} (the ledger was "
                          f"cut after block {last})")
    if last > h:
        raise LedgerError(f"{ledger.block_path(channel, h + 1)}: block {h + 1} of channel "
                          f"{channel} lies beyond the anchor's head, block {h} (appended after "
                          f"the anchor was taken)")
    block = ledger.read(channel, h)
    where = f"{ledger.block_path(channel, h)} (block {h} of channel {channel})"
    if block["hash"] != head["head"]:
        raise LedgerError(f"{where}: its hash {block['hash'][:16]}... is not the anchor's head "
                          f"{head['head'][:16]}... (the chain was rewritten)")
    if votes_digest(block["votes"]) != head["head_votes"]:
        raise LedgerError(f"{where}: its votes are not the anchor's head's (a vote was "
                          f"removed, added or changed)")


def _object(ledger: Ledger, digest: str, what: str) -> bytes:
    path = ledger.object_path(digest)
    if not os.path.exists(path):
        raise LedgerError(f"{what}: object {path} is missing")
    data = ledger.get(digest)
    if sha256(data) != digest:
        raise LedgerError(f"{what}: object {path} does not match its digest (changed on disk)")
    return data


def _structure(block: Dict[str, Any], height: int) -> None:
    """LedgerError where `block` or its parts have a key extra or missing (genesis: where it
    is of another ledger format)."""
    why = key_fault(block, BLOCK_KEYS, "the block")
    if why:
        raise LedgerError(why)
    h = block["header"]
    if not isinstance(h, dict):
        raise LedgerError("its header is not an object")
    if height == 0:
        version = h.get("format", 1)
        if version != LEDGER_FORMAT:
            raise LedgerFormatError(
                f"ledger format {version} "
                + ("written before keys came from the OS, votes were chained and the anchor "
                   "existed (fedjax_pan before the ledger format was versioned)"
                   if version == 1 else "unknown")
                + f"; this verifier reads format {LEDGER_FORMAT} (rerun the experiment to get "
                  f"a ledger it can audit)")
    why = key_fault(h, GENESIS_KEYS if height == 0 else HEADER_KEYS, "its header")
    if why is None and height == 0:
        why = key_fault(h["rule"], RULE_KEYS, "its header's rule")
    if why is None and height:
        why = key_fault(h["sim"], SIM_KEYS, "its header's sim")
        for r in h["rejected"] if why is None and isinstance(h["rejected"], list) else []:
            why = why or key_fault(r, REJECTED_KEYS, "a rejected proposal of its header")
        if why is None and not isinstance(h["rejected"], list):
            why = "its header's rejected proposals are not a list"
    if why:
        raise LedgerError(why)
    if not isinstance(block["transactions"], list):
        raise LedgerError("its transactions are not a list")
    for n, tx in enumerate(block["transactions"]):
        kind = tx.get("type") if isinstance(tx, dict) else None
        want = REGISTER_KEYS if height == 0 else UPDATE_KEYS
        why = key_fault(tx, want, f"transaction {n} (device "
                                  f"{tx.get('device') if isinstance(tx, dict) else None})")
        if why is None and kind != ("register" if height == 0 else "update"):
            why = f"transaction {n} (device {tx['device']}) is not " + \
                ("a registration" if height == 0 else "an update")
        if why:
            raise LedgerError(why)


def _check_block(ledger: Ledger, block: Dict[str, Any], channel: int, height: int,
                 prev: Optional[Dict[str, Any]], replay: Any, rule: ReplayRule) -> Any:
    """One block against its predecessor (`replay`: the channel's replayed state before it,
    from `rule`); returns the channel's replayed state after it."""
    _structure(block, height)
    h = block["header"]
    if block_hash(h) != block["hash"]:
        raise LedgerError("its hash does not match its header")
    if h["channel"] != channel or h["height"] != height:
        raise LedgerError(f"its header names channel {h['channel']}, height {h['height']}")
    if h["prev_hash"] != (GENESIS_PREV if prev is None else prev["hash"]):
        raise LedgerError("its previous-block hash does not link to the block before it")
    txs = block["transactions"]
    if merkle_root([canonical(t) for t in txs]) != h["tx_root"]:
        raise LedgerError("the Merkle root of its transactions does not match its header")
    if height == 0:
        keys = {}
        if block["votes"]:
            raise LedgerError("a genesis block carries votes")
        validators = h["validators"]
        if not (isinstance(validators, list) and validators and all(map(_hex64, validators))):
            raise LedgerError("its validators are not a list of public keys")
        if len(set(validators)) != len(validators):
            raise LedgerError("its validators' keys are not distinct (the quorum counts "
                              "distinct validators)")
        for tx in txs:
            if tx.get("channel") != channel:
                raise LedgerError(f"genesis transaction {tx.get('device')} is not a "
                                  f"registration with this channel")
            if tx["device"] in keys:
                raise LedgerError(f"device {tx['device']} registers twice")
            if not signature_valid(tx["public_key"], TX_DOMAIN, canonical(tx_body(tx)),
                                   tx["signature"]):
                raise LedgerError(f"registration of device {tx['device']}: bad signature")
            keys[tx["device"]] = tx["public_key"]
        if h["quorum"] != quorum(len(h["validators"])):
            raise LedgerError(f"its quorum {h['quorum']} is not that of "
                              f"{len(h['validators'])} validators")
        model = decode_tree(_object(ledger, h["model"], "its initial model"))
        if state_root(model) != h["state_root"]:  # paths are the flat dict's keys
            raise LedgerError("its initial model does not match its state root")
        return rule(h, keys, model)
    genesis = replay.genesis_header
    why = check_votes(block, genesis["validators"], genesis["quorum"])
    if why:
        raise LedgerError(why)
    if h["prev_votes"] != votes_digest(prev["votes"]):
        raise _Located(f"{ledger.block_path(channel, height - 1)} (block {height - 1} of "
                       f"channel {channel}): its votes are not those block {height}'s header "
                       f"records (a vote was removed, added or changed)")
    if h["round"] <= replay.round:
        raise LedgerError(f"its round {h['round']} does not follow round {replay.round}")
    devices = set()
    updates = []
    for tx in txs:
        why = check_transaction(tx, channel, h["round"], replay.keys)
        if why is None and tx["device"] in devices:
            why = f"device {tx['device']} has two transactions"
        if why:
            raise LedgerError(why)
        devices.add(tx["device"])
        data = _object(ledger, tx["digest"],
                       f"the update of device {tx['device']} (round {h['round']})")
        if len(data) != tx["bytes"]:
            raise LedgerError(f"the update of device {tx['device']} has {len(data)} bytes, "
                              f"its transaction says {tx['bytes']}")
        try:
            updates.append(replay.decode_update(data))
        except ValueError as e:
            raise LedgerError(f"the update of device {tx['device']}: {e}") from None
    replay = replay.apply(updates, [tx["examples"] for tx in txs], h["round"])
    if replay.root != h["state_root"]:
        raise LedgerError("its state root is not the aggregate of its transactions' updates "
                          "(Eq. 7 recomputed from the stored updates)")
    model = _object(ledger, h["model"], "its global model")
    if replay.digest != h["model"] or sha256(model) != h["model"]:
        raise LedgerError("its global model file is not the replayed global model")
    return replay


def anchor_text(workdir: str, anchor: Dict[str, Any]) -> str:
    """What a run prints at its end: its anchor, to be kept outside the workdir."""
    return (f"ledger anchor of {workdir} (keep a copy outside it; `python -m "
            f"fedjax_pan.algorithms.robust.flchain_cli {workdir} --anchor COPY` checks the ledger "
            f"against it):\n" + json.dumps(anchor, sort_keys=True))
