"""FLChain (Majeed & Hong 2019; slides 001, Algorithm 1): FL whose global models live on a
permissioned ledger per channel instead of a trusted server.

Setup: each channel j holds one global model M_j. Devices inquire the channels (their
loads), select one (`selection`: 'random', or 'least_loaded': fewest registered, ties
to the lower id) and register with it: a signed registration in the channel's genesis
block, which also fixes the validators' keys, the quorum, the initial model and the
update rule. Each round, the sampled devices of channel j download w_j(t), take their
local steps (FedAvg's clients, as configured), store their update content-addressed and
forward a signed transaction (device, channel, round, digest, examples) to the pool.
The global model is Eq. (7), w_j(t+1) = sum_i |D_i| w_ij(t) / sum_i |D_i| (as FedAvg's
server computes it, with the configured server optimiser; sgd(1) is Eq. 7 itself).

Consensus (the paper leaves it open; assumed here: PBFT-style, rotating proposer). n
validators tolerate f = (n - 1) // 3 faults; a block commits with ceil((n + f + 1) / 2)
votes, 2f + 1 of 3f + 1. The round's proposer (validator (t + j + a) % n at attempt a)
builds a block: the pool's transactions, their Merkle root, the state root of the model
they aggregate to, the previous block's hash. Each honest validator checks every
signature and round, that the block holds exactly the pool, and recomputes the aggregate
from the stored updates; it signs the block's hash only if the state root matches. A
rejected proposal is retried by the next proposer after a view-change `timeout`.

Faults: validators 0 .. `faulty` - 1 are faulty from round `tamper_from` on. A faulty
proposer tampers (`tamper`): 'scale' multiplies the global model by `tamper_scale`;
'drop' leaves out one device's transaction; 'backdoor' inserts the model of a registered
device trained on backdoored data (attacks.py's pattern, boosted x10) under that device's
name, which it cannot sign. Faulty validators vote for faulty proposals and against
honest ones. With n = 1 the one validator is a central server: its own vote commits.

Latency (simulated, logged with each block's header): every validator receives the
round's updates (latency + pool bytes / bandwidth); an attempt is PBFT's three phases: a
pre-prepare, the proposer sending the block to n - 1 validators (latency + (n - 1)(block
bytes / bandwidth + message_seconds)), then prepare and commit, each validator receiving
n - 1 votes of 100 bytes (latency + (n - 1)(100 / bandwidth + message_seconds) each); a
rejected attempt adds a view-change `timeout`; devices download the model (latency +
model bytes / bandwidth); a round lasts at least `block_interval`. Channels share the
validators' links and time (bandwidth / channels, message_seconds x channels each).

Alg. 1's loop `while ||w(t) - w(t-1)|| > epsilon` (the slide's inequality inverted): a
channel whose committed model moved by <= `epsilon` has converged and stops (epsilon 0:
only a model that did not move).

What channels cost: there are at most as many channels as devices
(`partition.num_clients`). A channel no device selected (possible under 'random') keeps
its genesis block but no model of its own, in memory or in checkpoints: its model is the
initial one, held once. A run whose channels with devices would not fit in the memory
available (`channel_bytes` each, against `services.available_memory`) is refused before
it starts.

Keys and the anchor (`algorithms.robust.ledger`'s docstring has the formats): every
validator's and device's Ed25519 key is drawn from the OS's entropy when a run starts,
never from the seed, and kept in `<workdir>/keys/keys.json` (folder 0700, file 0600; a run
without a
workdir keeps them in memory); a resumed run loads them there and refuses to resume
without them, or with keys its ledger's genesis did not register. The keys only sign: the
training, the sampling and every model are the seed's alone. At the end of a run `report`
puts the ledger's trust anchor (the validators' key fingerprint, each channel's head hash,
its votes' digest and its height) into summary.json as `ledger_anchor`, and the command
line prints it for its owner to keep outside the workdir.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan import models as models_lib
from fedjax_pan.engine import distributed
from fedjax_pan.algorithms.robust import ledger as ledger_lib
from fedjax_pan import workdir as workdir_lib
from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms.core import Aggregator, AlgorithmEntry, tree_bytes
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.engine.services import RoundDefaults, Services, SimState, available_memory
from fedjax_pan.errors import ConfigError
from fedjax_pan.references import Reference
from fedjax_pan.rules import between, one_of

PyTree = Any
tree_map = jax.tree_util.tree_map
SELECTIONS = ("random", "least_loaded")
TAMPERS = ("scale", "drop", "backdoor")
OPTIONS = {"channels": 1, "selection": "least_loaded", "validators": 4, "faulty": 0,
           "tamper": "scale", "tamper_from": 0, "tamper_scale": -1.0, "block_interval": 1.0,
           "bandwidth": 1.25e7, "latency": 0.02, "message_seconds": 1e-4, "timeout": 2.0,
           "epsilon": 0.0}
RULES = {"channels": between(1, 1000, integer=True), "selection": one_of(SELECTIONS),
         "validators": between(1, 1000, integer=True), "faulty": between(0, 1000, integer=True),
         "tamper": one_of(TAMPERS), "tamper_from": between(0, 1e9, integer=True),
         "tamper_scale": between(-1e6, 1e6), "block_interval": between(0, 1e6),
         "bandwidth": between(1, 1e15), "latency": between(0, 1e3),
         "message_seconds": between(0, 1e3),
         "timeout": between(0, 1e6), "epsilon": between(0, 1e12)}
VOTE_BYTES = 100  # a vote: validator id, block hash (32), Ed25519 signature (64)
_SELECT_STREAM = 0xC4A2
_KEPT = lambda: "the blocks committed before are kept"  # noqa: E731 - what a fault leaves
# The clients' outputs, each kept (they become transactions).
_EACH = Aggregator(lambda outputs, weights, arrivals=None: outputs, stacked=True)
# server_optimizer(name, lr, momentum): the server optimiser a genesis's rule names
# (`fedjax_pan.algorithms.server_optimizer`).
ServerOptimizer = Callable[[str, float, float], optax.GradientTransformation]


def select_channels(num_devices: int, channels: int, selection: str, seed: int) -> np.ndarray:
    """(K,) each device's channel: devices inquire the channels' loads in id order and pick
    one at random (from the seed) or the least loaded (ties: the lower id)."""
    if selection not in SELECTIONS:
        raise ValueError(f"unknown selection {selection!r}; expected one of {SELECTIONS}")
    if selection == "random":
        return np.random.default_rng([seed, _SELECT_STREAM]).integers(0, channels, num_devices)
    load = np.zeros(channels, np.int64)
    out = np.zeros(num_devices, np.int64)
    for i in range(num_devices):
        out[i] = int(np.argmin(load))  # argmin takes the first of equal loads
        load[out[i]] += 1
    return out


def channel_bytes(server: PyTree, variables: PyTree) -> int:
    """Bytes a channel with devices holds at the run's peak, from its `server` state and
    its model's `variables` (arrays or shape-dtype structs): the server state in the run's
    state, a host copy of it while a checkpoint is written, and its model in the stack each
    device is scored from (`FLChain.personal_evaluation`)."""
    return 2 * tree_bytes(server) + tree_bytes(variables)


def check_memory(channels: int, live: int, per_channel: int,
                 available: Optional[int]) -> None:
    """ValueError (naming `flchain.channels` and the estimate) where `live` channels with
    devices, `per_channel` bytes each (`channel_bytes`), need more than `available`."""
    need = live * per_channel
    if available is not None and need > available:
        gib = 2.0 ** 30
        raise ValueError(
            f"flchain.channels={channels}: its {live} channels with devices would hold about "
            f"{need / gib:.1f} GiB ({per_channel / 2**20:.1f} MiB each: the channel's server "
            f"state, its copy while a checkpoint is written, its model in the per-device "
            f"evaluation), more than the {available / gib:.1f} GiB available (MemAvailable "
            f"in /proc/meminfo, within a cgroup limit): lower flchain.channels or the model's size")


def round_seconds(options: Dict[str, float], validators: int, channels: int, pool_bytes: int,
                  block_bytes: int, model_bytes: int, attempts: int) -> Dict[str, float]:
    """A channel round's simulated duration under the latency model (module docstring)."""
    o = options
    bw = o["bandwidth"] / channels  # the channels' traffic shares every link
    check = o["message_seconds"] * channels  # and every validator's time per message
    pool = o["latency"] + pool_bytes / bw
    attempt = 0.0
    if validators > 1:
        pre_prepare = o["latency"] + (validators - 1) * (block_bytes / bw + check)
        vote_phase = o["latency"] + (validators - 1) * (VOTE_BYTES / bw + check)
        attempt = pre_prepare + 2 * vote_phase
    consensus = attempts * attempt + (attempts - 1) * o["timeout"]
    download = o["latency"] + model_bytes / bw
    return {"seconds": max(o["block_interval"], pool + consensus + download),
            "pool_seconds": pool, "consensus_seconds": consensus,
            "download_seconds": download}


class ChannelRule:
    """A channel's global-model update from its transactions' updates: Eq. (7) through
    FedAvg's server update with `server_tx` (the optimiser `rule` names), summed in
    transaction order as the engine's loop executor sums (so an honest channel is FedAvg's
    run under that executor to the bit; under vmap, to float32 rounding)."""

    def __init__(self, rule: Dict[str, Any], server_tx: optax.GradientTransformation):
        self.rule = dict(rule)
        alg = fedavg(None, None, server_tx)
        self.server_init = alg.server_init
        self.eval_variables = alg.eval_variables
        self._add = jax.jit(lambda acc, out, w: tree_map(
            lambda a, o: a + o * w.astype(o.dtype), acc, out))
        self._update = jax.jit(lambda server, total, w: alg.server_update(
            server, alg.aggregator.finalize(total, jnp.sum(w)), None))

    def weights(self, examples: List[int]) -> np.ndarray:
        if self.rule["weights"] == "uniform":
            return np.ones(len(examples))
        return np.asarray(examples, np.float64)

    def step(self, server: Any, updates: List[PyTree], examples: List[int]) -> Any:
        w = self.weights(examples)
        total = tree_map(jnp.zeros_like, updates[0])
        for update, wi in zip(updates, w):
            total = self._add(total, update, jnp.float32(wi))
        return self._update(server, total, jnp.asarray(w, jnp.float32))


@functools.lru_cache(maxsize=8)
def _rule(encoded: bytes, server_optimizer: ServerOptimizer) -> ChannelRule:
    """The rule a genesis block names, built (and compiled) once per process."""
    rule = json.loads(encoded)
    return ChannelRule(rule, server_optimizer(rule["optimizer"], rule["lr"], rule["momentum"]))


class Replay(NamedTuple):
    """A channel's state as the audit replays it (`ledger.verify` with `audit`): its
    genesis, device keys, the update rule, and the server state after the blocks so far,
    with its model's state root and digest."""

    genesis_header: Dict[str, Any]
    keys: Dict[int, str]
    rule: ChannelRule
    template: PyTree  # an update's structure: {'delta': params, 'model_state': ...}
    server: Any
    round: int
    root: str
    digest: str

    @staticmethod
    def genesis(header: Dict[str, Any], keys: Dict[int, str], model: Dict[str, np.ndarray],
                rule: ChannelRule) -> "Replay":
        """The channel after its genesis `header` (its devices' `keys`, the initial `model`
        flat), replayed under `rule` (the one `header` names)."""
        variables = _nest(model)
        server = rule.server_init(variables)
        params = variables["params"]
        template = {"delta": params, "model_state": {k: v for k, v in variables.items()
                                                     if k != "params"}}
        return Replay(header, keys, rule, template, server, -1, header["state_root"],
                      header["model"])

    def decode_update(self, data: bytes) -> PyTree:
        return ledger_lib.unflatten(ledger_lib.decode_tree(data), self.template)

    def apply(self, updates: List[PyTree], examples: List[int], round_index: int) -> "Replay":
        if not updates:  # a block without transactions leaves the model as it was
            return self._replace(round=round_index)
        server = self.rule.step(self.server, updates, examples)
        model, root = ledger_lib.encode_with_root(self.rule.eval_variables(server))
        return self._replace(server=server, round=round_index, root=root,
                             digest=ledger_lib.sha256(model))


def audit(server_optimizer: ServerOptimizer) -> ledger_lib.ReplayRule:
    """The update rule `ledger.verify` replays any FLChain ledger with: each channel's
    Eq. (7) under the rule its genesis names, whose server optimiser `server_optimizer`
    builds from its name (`fedjax_pan.algorithms.server_optimizer`)."""
    def genesis(header: Dict[str, Any], keys: Dict[int, str],
                model: Dict[str, np.ndarray]) -> Replay:
        return Replay.genesis(header, keys, model,
                              _rule(ledger_lib.canonical(header["rule"]), server_optimizer))
    return genesis


def _nest(flat: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """{'a/b/c': x} -> {'a': {'b': {'c': x}}}."""
    out: Dict[str, Any] = {}
    for path, x in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = x
    return out


class FLChain(RoundDefaults):
    """FLChain's channels, ledgers and consensus as an `engine.protocol.Round`."""

    def __init__(self, model: nn.Module, client_tx: optax.GradientTransformation,
                 services: Services, options: Dict[str, Any], rule: Dict[str, Any],
                 seed: int, bn: str, num_classes: int, backdoor_target: int = 2):
        self.services, self.o, self.seed = services, dict(options), seed
        self.num_sampled = services.num_sampled
        self.n = int(self.o["validators"])
        self.num_channels = int(self.o["channels"])
        self.quorum = ledger_lib.quorum(self.n)
        # `rule` names the optimiser `services.server_tx` is (the genesis records the names).
        self.rule = ChannelRule(rule, services.server_tx)
        self.algorithm = fedavg(model, client_tx, services.server_tx,
                                bn=bn)._replace(aggregator=_EACH)
        k = services.num_clients
        self.channel_of = select_channels(k, self.num_channels, self.o["selection"], seed)
        # (C,) bool: a device registered with the channel (under 'random' one may have
        # none: it holds no model of its own, see `_genesis`).
        self.live = np.bincount(self.channel_of, minlength=self.num_channels) > 0
        self._initial: Any = None  # the initial server state, every empty channel's
        # Drawn from the OS (or loaded on resume) by `attach`, or by `init` without a workdir.
        self.keys: Optional[ledger_lib.Keys] = None
        self.num_classes, self.backdoor_target = num_classes, backdoor_target
        self.ledger: Optional[ledger_lib.Ledger] = None
        self._heads: Dict[int, Dict[str, Any]] = {}
        self._keys: Dict[int, Dict[int, str]] = {}
        self._attacked: Optional[Any] = None  # the backdoor's algorithm, built on first use

    # --- the ledger's place ------------------------------------------------------------

    def attach(self, workdir: str, resume: bool) -> None:
        """Keeps the ledger in `workdir/ledger` and the keys in `workdir/keys/` (fresh from
        the OS; a resumed run's, loaded, and its ledger must verify)."""
        root = os.path.join(workdir, "ledger")

        def keys() -> Dict[str, Any]:
            """(process 0) The run's keys, as JSON (every process signs with them)."""
            path = ledger_lib.keys_path(workdir)
            if resume and ledger_lib.Ledger(root).channels():
                if not os.path.isfile(path):
                    raise ConfigError(
                        f"cannot resume {workdir!r}: its ledger's private keys {path} are "
                        f"missing, and without them no validator or device can sign another "
                        f"block (restore the file, or start over with --overwrite)")
                try:
                    ledger_lib.verify(workdir, self._replay)
                except ledger_lib.LedgerError as e:
                    raise ConfigError(f"cannot resume {workdir!r}: its ledger does not "
                                      f"verify: {e}") from None
                found = self._load_keys(workdir, path)
                self._check_keys(root, found, workdir, path)
            elif resume and os.path.isfile(path):  # cut short before its genesis was written
                found = self._load_keys(workdir, path)
            else:
                found = ledger_lib.Keys.generate(self.n, self.services.num_clients)
                with workdir_lib.writing(f"the ledger's keys in {path}", _KEPT):
                    found.save(workdir)
            return found.to_json()

        self.keys = ledger_lib.Keys.from_json(distributed.on_primary(keys, "the ledger's keys"))
        self.ledger = ledger_lib.Ledger(root)

    def _replay(self, header: Dict[str, Any], keys: Dict[int, str],
                model: Dict[str, np.ndarray]) -> Replay:
        """A channel of the ledger this run resumes, replayed under this run's rule (the
        `ledger.ReplayRule` its audit on resume uses)."""
        if header["rule"] != self.rule.rule:
            raise ledger_lib.LedgerError(f"its update rule {header['rule']} is not this "
                                         f"run's {self.rule.rule}")
        return Replay.genesis(header, keys, model, self.rule)

    def _load_keys(self, workdir: str, path: str) -> ledger_lib.Keys:
        try:
            found = ledger_lib.Keys.load(workdir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot resume {workdir!r}: its keys {path} cannot be read "
                              f"({e})") from None
        if (len(found.validators), len(found.devices)) != (self.n, self.services.num_clients):
            raise ConfigError(f"cannot resume {workdir!r}: {path} holds {len(found.validators)} "
                              f"validators' and {len(found.devices)} devices' keys, the run "
                              f"{self.n} and {self.services.num_clients}")
        return found

    def _check_keys(self, root: str, found: ledger_lib.Keys, workdir: str, path: str) -> None:
        """The keys `found` are those each channel's genesis registered."""
        validators = [ledger_lib.public_hex(k) for k in found.validators]
        devices = [ledger_lib.public_hex(k) for k in found.devices]
        store = ledger_lib.Ledger(root)
        for j in store.channels():
            genesis = store.read(j, 0)
            registered = {tx["device"]: tx["public_key"] for tx in genesis["transactions"]}
            if genesis["header"]["validators"] != validators or any(
                    not 0 <= i < len(devices) or devices[i] != key
                    for i, key in registered.items()):
                raise ConfigError(f"cannot resume {workdir!r}: the keys in {path} are not "
                                  f"those the genesis block of channel {j} registered")

    def device_key(self, i: int) -> Any:
        return self.keys.devices[i]

    @property
    def validator_keys(self) -> List[Any]:
        return self.keys.validators

    def devices(self, channel: int) -> np.ndarray:
        return np.flatnonzero(self.channel_of == channel)

    def init(self, variables: PyTree) -> SimState:
        if self.ledger is None:  # no workdir (a notebook): a ledger deleted with the driver
            self._tmp = tempfile.TemporaryDirectory(prefix="fedjax_pan_flchain_")
            self.ledger = ledger_lib.Ledger(os.path.join(self._tmp.name, "ledger"))
        if self.keys is None:  # no workdir: keys that live as long as the driver
            self.keys = ledger_lib.Keys.generate(self.n, self.services.num_clients)
        with workdir_lib.writing(f"the ledger in {self.ledger.root}", _KEPT):
            return self._genesis(variables)

    def _genesis(self, variables: PyTree) -> SimState:
        """Each channel's genesis block written; the state before round 0."""
        variables = jax.device_get(variables)
        server = self.rule.server_init(variables)
        model, root = ledger_lib.encode_with_root(variables)
        digest = self.ledger.put(model)
        for j in range(self.num_channels):
            txs = [ledger_lib.registration(self.device_key(int(i)), j, int(i))
                   for i in self.devices(j)]
            header = {"format": ledger_lib.LEDGER_FORMAT, "channel": j, "height": 0,
                      "round": -1, "prev_hash": ledger_lib.GENESIS_PREV,
                      "tx_root": ledger_lib.merkle_root([ledger_lib.canonical(t) for t in txs]),
                      "state_root": root, "model": digest, "rule": self.rule.rule,
                      "validators": [ledger_lib.public_hex(key) for key in self.validator_keys],
                      "quorum": self.quorum}
            block = {"header": header, "hash": ledger_lib.block_hash(header),
                     "transactions": txs, "votes": []}
            self.ledger.append(block)
            self._heads[j] = block
        # A channel without devices never trains: None in the state (nothing to hold or
        # checkpoint), its model the initial one (`_server`).
        self._initial = server
        servers = tuple(server if live else None for live in self.live)
        c = self.num_channels
        return SimState({"channels": servers, "height": jnp.zeros(c, jnp.int32),
                         "converged": jnp.zeros(c, bool), "time": jnp.zeros((), jnp.float32)},
                        None, 0)

    def _head(self, j: int, height: int, server: Any) -> Dict[str, Any]:
        """Channel j's last block (height `height`), checked to hold `server`'s model."""
        head = self._heads.get(j)
        if head is None or head["header"]["height"] != height:
            path = self.ledger.block_path(j, height)
            if not os.path.exists(path):
                raise ConfigError(f"{path} is missing: the ledger of channel {j} ends before "
                                  f"the checkpoint's block {height}")
            head = self.ledger.read(j, height)
            if head["header"]["state_root"] != ledger_lib.state_root(
                    self.rule.eval_variables(server)):
                raise ConfigError(f"{path}: the ledger's block {height} of channel {j} does "
                                  f"not hold the checkpoint's global model")
            self._heads[j] = head
        return head

    def report(self, state: SimState) -> Dict[str, Any]:
        """What the run's summary records: the ledger's trust anchor at `state`'s heads."""
        heights = np.asarray(state.server["height"])
        heads = {j: self._head(j, int(heights[j]), self._server(state.server, j))
                 for j in range(self.num_channels)}
        return {"ledger_anchor": ledger_lib.anchor(
            heads, [ledger_lib.public_hex(k) for k in self.validator_keys])}

    # --- the engine's contract ---------------------------------------------------------

    def _server(self, server: Dict[str, Any], j: int) -> Any:
        """Channel j's server state in the state's `server` (an empty channel's: the
        initial one)."""
        found = server["channels"][j]
        return self._initial if found is None else found

    def evaluation(self, server: Dict[str, Any]) -> tuple:
        return None, self.rule.eval_variables(self._server(server, 0))

    def personal_evaluation(self, state: SimState) -> Optional[PyTree]:
        """Each device scored on its own channel's model (None with one channel)."""
        if self.num_channels == 1:
            return None
        # The channels with devices only: no device is scored on an empty one.
        models = [self.rule.eval_variables(state.server["channels"][j])
                  for j in np.flatnonzero(self.live)]
        stacked = tree_map(lambda *x: jnp.stack(x), *models)
        row = np.cumsum(self.live) - 1  # a channel's row among those with devices
        return tree_map(lambda x: x[jnp.asarray(row[self.channel_of])], stacked)

    def personal_groups(self, state: SimState) -> None:
        return None

    def round(self, state: SimState) -> tuple:
        t, s = state.round, state.server
        ids = self.services.sample(t)
        heights = np.asarray(s["height"]).copy()
        converged = np.asarray(s["converged"]).copy()
        servers = list(s["channels"])
        sums, computed, real, download, trained = None, 0, 0, 0.0, []
        sim = {"sim_round_seconds": 0.0, "sim_attempts": 0, "sim_rejected": 0,
               "sim_blocks": 0}
        for j in range(self.num_channels):
            mine = ids[self.channel_of[ids] == j]
            if converged[j] or not len(mine):
                continue
            head = self._head(j, int(heights[j]), servers[j])
            broadcast = self.rule.eval_variables(servers[j])
            cohort = self.services.cohort(mine, t, None)
            result = self.services.train("flchain", self.algorithm, broadcast, cohort,
                                         servers[j])
            metrics = jax.device_get(result.metrics)
            sums = metrics if sums is None else tree_map(lambda a, b: a + b, sums, metrics)
            computed += result.computed_examples
            real += self.services.real_examples(mine)
            download += float(len(mine) * tree_bytes(broadcast))
            trained += list(mine)
            outputs = jax.device_get(result.outputs)
            updates = [tree_map(lambda x: x[m], outputs) for m in range(len(mine))]
            with workdir_lib.writing(f"the ledger in {self.ledger.root}", _KEPT):
                committed = self._consensus(j, t, head, servers[j], mine, updates)
            if committed is None:  # no quorum: the channel stalls this round
                continue
            block, server, timing = committed
            moved = _distance(broadcast["params"], server.params)
            servers[j], heights[j] = server, block["header"]["height"]
            converged[j] = moved <= self.o["epsilon"]
            sim["sim_round_seconds"] = max(sim["sim_round_seconds"], timing["seconds"])
            sim["sim_attempts"] += timing["attempts"]
            sim["sim_rejected"] += timing["attempts"] - 1
            sim["sim_blocks"] += 1
        if sums is None:
            stats = self.services.untrained()
        else:
            stats = self.services.statistics(sums, real_examples=real,
                                             computed_examples=computed,
                                             download_bytes=download, clients=len(trained))
        clock = float(s["time"]) + sim["sim_round_seconds"]
        stats.update(sim, sim_time=clock, sim_converged=int(converged.sum()))
        server = {"channels": tuple(servers), "height": jnp.asarray(heights, jnp.int32),
                  "converged": jnp.asarray(converged), "time": jnp.float32(clock)}
        return SimState(server, None, t + 1), stats

    # --- consensus -----------------------------------------------------------------------

    def _model(self, server: Any) -> tuple:
        """(server, its model's bytes, its state root): what a block commits."""
        return (server, *ledger_lib.encode_with_root(self.rule.eval_variables(server)))

    def _registered(self, j: int) -> Dict[int, str]:
        """Channel j's devices' public keys (as its genesis registers them)."""
        if j not in self._keys:
            self._keys[j] = {int(i): ledger_lib.public_hex(self.device_key(int(i)))
                             for i in self.devices(j)}
        return self._keys[j]

    def _faulty(self, v: int, t: int) -> bool:
        return v < self.o["faulty"] and t >= self.o["tamper_from"]

    def _consensus(self, j: int, t: int, head: Dict[str, Any], server: Any,
                   devices: np.ndarray, updates: List[PyTree]) -> Optional[tuple]:
        """Channel j's round t: the devices' transactions pooled, then proposals until one
        gathers a quorum. (committed block, new server state, timing), or None."""
        sizes = self.services.data.sizes
        pool, data = [], {}
        for i, update in zip(devices, updates):
            raw = ledger_lib.encode_tree(update)
            digest = self.ledger.put(raw)
            data[digest] = update
            pool.append(ledger_lib.transaction(self.device_key(int(i)), j, t, int(i), digest,
                                               int(sizes[i]), len(raw)))
        pool_bytes = sum(tx["bytes"] for tx in pool)
        honest = {}  # the aggregate an honest validator recomputes, per transaction set

        def aggregate(txs):
            """(new server state, its model's bytes, its state root) from `txs`."""
            key = tuple(tx["digest"] for tx in txs)
            if key not in honest:
                honest[key] = self._model(self.rule.step(
                    server, [data[tx["digest"]] for tx in txs], [tx["examples"] for tx in txs]))
            return honest[key]

        keys = self._registered(j)
        pooled = {ledger_lib.sha256(ledger_lib.canonical(tx)): tx for tx in pool}

        def check(block):
            """Why an honest validator rejects `block` (None: it votes for it)."""
            h = block["header"]
            if (h["prev_hash"] != head["hash"] or h["height"] != head["header"]["height"] + 1
                    or h["prev_votes"] != ledger_lib.votes_digest(head["votes"])):
                return "it does not extend the channel's head"
            for tx in block["transactions"]:
                why = ledger_lib.check_transaction(tx, j, t, keys)
                if why:
                    return why
            held = {ledger_lib.sha256(ledger_lib.canonical(tx)) for tx in block["transactions"]}
            if held != set(pooled):
                missing = [tx["device"] for h, tx in pooled.items() if h not in held]
                return (f"it omits the pooled transaction of device {missing[0]}" if missing
                        else "it holds a transaction not in the pool")
            txs = block["transactions"]
            if ledger_lib.merkle_root([ledger_lib.canonical(x) for x in txs]) != h["tx_root"]:
                return "its Merkle root does not match its transactions"
            if aggregate(txs)[2] != h["state_root"]:
                return "its state root is not the aggregate of its transactions' updates"
            return None

        rejected = []
        for attempt in range(self.n):
            proposer = (t + j + attempt) % self.n
            bad = self._faulty(proposer, t)
            txs, (new, model, root) = self._proposal(j, t, pool, data, server, aggregate,
                                                     bad, proposer)
            header = {"channel": j, "height": head["header"]["height"] + 1, "round": t,
                      "prev_hash": head["hash"],
                      "prev_votes": ledger_lib.votes_digest(head["votes"]),
                      "tx_root": ledger_lib.merkle_root([ledger_lib.canonical(x) for x in txs]),
                      "state_root": root, "model": ledger_lib.sha256(model),
                      "proposer": proposer,
                      "rejected": list(rejected)}
            block_bytes = len(ledger_lib.canonical({"header": header, "transactions": txs}))
            timing = round_seconds(self.o, self.n, self.num_channels, pool_bytes, block_bytes,
                                   len(model), attempt + 1)
            header["sim"] = {**timing, "attempts": attempt + 1}
            block = {"header": header, "hash": ledger_lib.block_hash(header),
                     "transactions": txs, "votes": []}
            why = check(block)
            yes = [v for v in range(self.n)
                   if (bad if self._faulty(v, t) else why is None)]
            if len(yes) >= self.quorum:
                digest = bytes.fromhex(block["hash"])
                block["votes"] = [{"validator": v, "signature": ledger_lib.sign(
                    self.validator_keys[v], ledger_lib.VOTE_DOMAIN, digest)} for v in yes]
                self.ledger.put(model)
                self.ledger.append(block)
                self._heads[j] = block
                return block, new, header["sim"]
            rejected.append({"proposer": proposer, "votes": len(yes),
                             "reason": why or "honest validators outvoted"})
        return None

    def _proposal(self, j: int, t: int, pool: List[Dict[str, Any]], data: Dict[str, Any],
                  server: Any, aggregate: Any, bad: bool, proposer: int) -> tuple:
        """(transactions, (new server state, its model's bytes, state root)) the proposer
        puts in its block."""
        if not bad:
            return pool, aggregate(pool)
        kind = self.o["tamper"]
        if kind == "scale":
            new = aggregate(pool)[0]
            scale = self.o["tamper_scale"]
            return pool, self._model(new._replace(params=tree_map(lambda w: w * scale,
                                                                  new.params)))
        if kind == "drop" and len(pool) > 1:
            txs = pool[1:]
            return txs, aggregate(txs)
        if kind == "drop":  # one device: dropping it leaves the model unchanged
            return [], self._model(server)
        # backdoor: a registered device's model trained on backdoored data, under its name.
        present = {tx["device"] for tx in pool}
        victim = next((int(i) for i in self.devices(j) if int(i) not in present),
                      pool[0]["device"])
        update = self._backdoored(victim, t, server)
        raw = ledger_lib.encode_tree(update)
        digest = self.ledger.put(raw)
        data[digest] = update
        forged = {"type": "update", "channel": j, "round": t, "device": victim,
                  "digest": digest, "examples": int(self.services.data.sizes[victim]),
                  "bytes": len(raw)}
        # Signed with the proposer's own key: it lacks the device's.
        forged["signature"] = ledger_lib.sign(self.validator_keys[proposer], ledger_lib.TX_DOMAIN,
                                              ledger_lib.canonical(forged))
        txs = sorted([tx for tx in pool if tx["device"] != victim] + [forged],
                     key=lambda tx: tx["device"])
        return txs, aggregate(txs)

    def _backdoored(self, device: int, t: int, server: Any) -> PyTree:
        if self._attacked is None:
            attack = attacks.Attack("backdoor", self.num_classes,
                                    attacks.DEFAULT_SCALE["backdoor"], self.backdoor_target)
            self._attacked = attacks.with_attack(self.algorithm, attack,
                                                 np.ones(self.services.num_clients, bool))
        cohort = self.services.cohort(np.asarray([device]), t, None, stage=1)
        result = self.services.train("flchain-backdoor", self._attacked,
                                     self.rule.eval_variables(server),
                                     cohort, server, per_round=1)
        return tree_map(lambda x: x[0], jax.device_get(result.outputs))


def _distance(a: PyTree, b: PyTree) -> float:
    """||a - b||_2 over all leaves."""
    return float(np.sqrt(sum(float(np.sum((np.asarray(x, np.float64)
                                           - np.asarray(y, np.float64)) ** 2))
                             for x, y in zip(jax.tree_util.tree_leaves(a),
                                             jax.tree_util.tree_leaves(b)))))


def _no_round(model, cfg, client_tx, server_tx):
    raise ValueError("flchain runs through its driver (`from_config`), not as one compiled "
                     "federated round")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                services: Services) -> FLChain:
    """The `FLChain` driver `config.flchain` describes."""
    # Refused here, not in `_check`: every shipped preset validates with every algorithm.
    if cfg.aggregation.rule != "mean":
        raise ValueError(f"aggregation.rule={cfg.aggregation.rule!r}: a channel's global "
                         f"model is Eq. 7, the weighted mean its validators recompute (set "
                         f"aggregation.rule='mean')")
    s = cfg.server
    rule = {"optimizer": s.optimizer, "lr": float(s.lr), "momentum": float(s.momentum),
            "weights": cfg.aggregation.weights}
    chain = FLChain(model, client_tx, services, cfg.flchain.to_dict(), rule, cfg.seed,
                    cfg.aggregation.bn, int(services.data.label_counts.shape[1]),
                    attacks.backdoor_target(cfg))
    # Shapes only: the model is neither initialised nor compiled here.
    variables = jax.eval_shape(lambda: models_lib.init(model, jax.random.PRNGKey(0),
                                                       services.data.images.shape[1:]))
    check_memory(chain.num_channels, int(chain.live.sum()),
                 channel_bytes(jax.eval_shape(chain.rule.server_init, variables), variables),
                 available_memory())
    return chain


def _check(cfg: Any) -> None:
    o = cfg.flchain
    k = cfg.partition.num_clients
    if o.channels > k:
        raise ValueError(f"flchain.channels={o.channels} exceeds the {k} devices "
                         f"(partition.num_clients={k}): a channel trains only with devices "
                         f"registered with it, and {k} devices register with at most {k} "
                         f"channels; set flchain.channels <= {k}")
    if o.faulty > o.validators:
        raise ValueError(f"flchain.faulty={o.faulty} exceeds flchain.validators="
                         f"{o.validators}")
    if cfg.aggregation.bn != "mean":
        raise ValueError(f"aggregation.bn={cfg.aggregation.bn!r}: a channel's ledger holds "
                         f"one global model, statistics included (set aggregation.bn='mean')")


REFERENCE = Reference(
    "Majeed & Hong, 'FLchain: Federated Learning via MEC-enabled Blockchain Network', "
    "APNOMS 2019; slides 001, Algorithm 1 (channels, registration, Eq. 7)", None,
    ("consensus is PBFT-style (quorum ceil((n + f + 1) / 2), rotating proposer, a view "
     "change after `timeout`): the paper leaves the protocol open",
     "validators recompute Eq. 7 from the stored updates before they vote: the paper does "
     "not say what validation checks, and this is what makes a tampered model detectable",
     "the state trie is an RFC 6962 Merkle tree over the model's leaves in path order, not "
     "a Patricia trie: it locates a changed layer and is simpler",
     "Eq. 7's weights |D_i| are `aggregation.weights='num_examples'`; the default 'uniform' "
     "counts each device 1; the update goes through FedAvg's server optimiser (sgd(1), "
     "the default, is Eq. 7 itself)",
     "the stopping rule's '<=' is read as the loop's exit condition (as printed, the loop "
     "would never run)",
     "channel selection is `least_loaded` or `random` (the paper leaves the policy open)",
     "latency is simulated (links, PBFT phases, timeouts), not a MEC network",
     "all keys are kept by one process (WORKDIR/keys), where a permissioned chain gives "
     "each party its own: the run's anchor outside the ledger is the root of trust",
     "faulty validators and tampering modes, the anchor, chained votes and the ledger "
     "format are this simulator's additions (tests of the audit), not the paper's"))

ENTRY = AlgorithmEntry(_no_round, OPTIONS, RULES, driver=from_config, check=_check,
                       reference=REFERENCE)
