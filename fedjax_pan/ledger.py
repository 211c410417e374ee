"""A permissioned ledger per FL channel: blocks, transactions, signatures, content-addressed
arrays and the audit that replays them (FLChain, Majeed & Hong 2019; the driver is
`fedjax_pan.algorithms.flchain`).

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
"votes": [{"validator", "signature"}]}. Its header holds the channel, height, round, the
previous block's hash, the Merkle root of its transactions, the state root and digest of
the global model it commits, its proposer, the proposals rejected before it, and its
simulated timing. Votes are Ed25519 signatures of the block hash by the validators that
accepted it. Transactions are signed by their devices (Ed25519, keys drawn from the seed).

    python -m fedjax_pan.ledger WORKDIR    # verify a run's ledger; exit 1 naming the fault
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (Ed25519PrivateKey,
                                                               Ed25519PublicKey)

from fedjax_pan import workdir as workdir_lib
from fedjax_pan.errors import RunError

__all__ = ["LedgerError", "canonical", "sha256", "merkle_root", "encode_tree",
           "decode_tree", "encode_with_root", "state_root", "signing_key", "public_hex", "sign",
           "signature_valid", "transaction", "registration", "tx_body", "block_hash",
           "Ledger", "verify", "quorum", "tolerated"]

GENESIS_PREV = "0" * 64
# Domain separation: a signature over one kind of message is never valid for another.
TX_DOMAIN = b"fedjax_pan/flchain/transaction\n"
VOTE_DOMAIN = b"fedjax_pan/flchain/vote\n"
_KEY_STREAM = 0xF1C4
ROLES = {"device": 0, "validator": 1}


class LedgerError(RunError):
    """A ledger that does not verify: the message locates the fault in one line."""

    status = 1


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

def signing_key(seed: int, role: str, index: int) -> Ed25519PrivateKey:
    """Participant `index`'s Ed25519 key (role 'device' or 'validator'), drawn from the seed."""
    rng = np.random.default_rng([seed, _KEY_STREAM, ROLES[role], index])
    return Ed25519PrivateKey.from_private_bytes(rng.bytes(32))


def public_hex(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw).hex()


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
    validators sign its hash)."""
    seen = set()
    for vote in block["votes"]:
        v = vote.get("validator")
        if not isinstance(v, int) or not 0 <= v < len(validators) or v in seen:
            return f"vote of validator {v!r} is not one validator's single vote"
        if not signature_valid(validators[v], VOTE_DOMAIN, bytes.fromhex(block["hash"]),
                               str(vote.get("signature", ""))):
            return f"vote of validator {v}: the signature does not sign the block's hash"
        seen.add(v)
    if len(seen) < needed:
        return f"{len(seen)} votes commit it, and the quorum is {needed}"
    return None


def verify(workdir: str, *, progress: bool = False) -> Dict[str, int]:
    """Replays the ledger of the run in `workdir`: every block's hash link, signature,
    vote, Merkle and state root, every object's digest, and every global model recomputed
    from the stored updates by the channel's rule. Returns counts; raises LedgerError
    locating the first fault."""
    from fedjax_pan.algorithms import flchain  # the channel's update rule

    ledger = Ledger(os.path.join(workdir, "ledger"))
    channels = ledger.channels()
    if not channels:
        raise LedgerError(f"{ledger.root}: no ledger (not an FLChain run's workdir?)")
    counts = {"channels": len(channels), "blocks": 0, "transactions": 0, "objects": 0}
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
            replay = None
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
                    replay = _check_block(ledger, block, j, height, prev, replay, flchain)
                except LedgerError as e:
                    raise LedgerError(f"{where}: {e}") from None
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    raise LedgerError(f"{where}: malformed ({type(e).__name__}: {e})") from None
                prev = block
                counts["blocks"] += 1
                counts["transactions"] += len(block["transactions"])
    finally:
        bar.close()
    return counts


def _object(ledger: Ledger, digest: str, what: str) -> bytes:
    path = ledger.object_path(digest)
    if not os.path.exists(path):
        raise LedgerError(f"{what}: object {path} is missing")
    data = ledger.get(digest)
    if sha256(data) != digest:
        raise LedgerError(f"{what}: object {path} does not match its digest (changed on disk)")
    return data


def _check_block(ledger: Ledger, block: Dict[str, Any], channel: int, height: int,
                 prev: Optional[Dict[str, Any]], replay: Any, flchain: Any) -> Any:
    """One block against its predecessor; returns the channel's replayed state after it."""
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
        for tx in txs:
            if tx.get("type") != "register" or tx.get("channel") != channel:
                raise LedgerError(f"genesis transaction {tx.get('device')} is not a "
                                  f"registration with this channel")
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
        return flchain.Replay.genesis(h, keys, model)
    genesis = replay.genesis_header
    why = check_votes(block, genesis["validators"], genesis["quorum"])
    if why:
        raise LedgerError(why)
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


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Bad input (exit 2) is a wrong command line or a folder without a ledger; a ledger
    # that does not verify, or cannot be read, exits 1.
    if len(argv) != 1 or argv[0].startswith("-"):
        print(f"error: expected one WORKDIR, got {argv}; usage: python -m fedjax_pan.ledger "
              f"WORKDIR (verifies the run's ledger)", file=sys.stderr)
        return 2
    if not os.path.isdir(os.path.join(argv[0], "ledger")):
        print(f"error: {argv[0]!r} holds no ledger (not an FLChain run's workdir)",
              file=sys.stderr)
        return 2
    try:
        counts = verify(argv[0], progress=True)
    except (LedgerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ledger of {argv[0]} verified: {counts['channels']} channel(s), "
          f"{counts['blocks']} blocks, {counts['transactions']} transactions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
