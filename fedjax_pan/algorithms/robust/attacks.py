"""Malicious clients, as a wrapper over any algorithm (optax style), following the SageFlow
authors' code (`update.py`, `utils1.sign_attack`, the backdoor variant's `utils2`).

Who attacks (`config.attack.draw`): 'fixed', a set of round(fraction K) clients drawn once
per seed (`draw_malicious`), or 'per_round', as the SageFlow authors' scripts
(`Sageflow_synchronous_setup.py`, `Sageflow.py`: `attack_users = np.random.choice(
idxs_users, int(m * attack_ratio))`): exactly int(M fraction) of each round's sampled
cohort of M, drawn afresh from (seed, round) (`draw_round`), so a rule told f attackers a
round (Multi-Krum, Zeno) meets exactly f. Attackers act from round `start_round` on; the
others run the algorithm untouched. Kinds:

  model_poisoning  sends -scale * w, its weights negated and scaled (authors: 0.1), in
                   place of its trained model;
  sign_flip        sends its update negated, times scale (4, as Siren's code):
                   w_s - scale (w - w_s);
  gaussian         adds N(0, scale^2) noise (scale 1) to every trained parameter;
  label_shift      trains on labels (y + 1) mod C (the authors' data poisoning);
  label_flip       trains on labels C - 1 - y (pairs 0-9, 1-8, ...: Siren's flipping);
  backdoor         in each batch, the first floor(n * poisoned) of its n examples carry a
                   12-pixel pattern in the top-left corner (set to 1.0 in normalised
                   units, as the authors) and the target label (2); the update is boosted
                   x `boost` (10: model replacement), w_s + boost (w - w_s).

w is the client's trained model, w_s the broadcast it started from. Output attacks need
the algorithm's `model_view` (FedAvg's family); they change trainable parameters only,
BatchNorm statistics are sent as trained. Each kind is its function(s) in the tables
`DATA_ATTACKS` (the batch) and `MODEL_ATTACKS` (the parameters sent), its `REFERENCES`
entry and its `DEFAULT_SCALE`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections.config_dict import placeholder

from fedjax_pan.algorithms.core import FeatureEntry, FederatedAlgorithm
from fedjax_pan.algorithms.wrapping import map_sent_model, nest_local
from fedjax_pan.engine.simulation import sampled_clients
from fedjax_pan.references import SAGEFLOW, SIREN, Reference
from fedjax_pan.rules import between, one_of

PyTree = Any
tree_map = jax.tree_util.tree_map
DRAWS = ("fixed", "per_round")
# Each kind's reference (`fedjax_pan.fidelity`).
_SAGEFLOW_PAPER = ("Park et al., 'Sageflow: Robust Federated Learning against Both "
                   "Stragglers and Adversaries', NeurIPS 2021")
_SIREN_PAPER = ("Guo et al., 'Siren: Byzantine-robust Federated Learning via Proactive "
                "Alarming', SoCC 2021")
_FIXED = ("the attackers are a fixed set drawn once per seed by default (a compromised "
          "device stays compromised); `attack.draw='per_round'` draws int(M fraction) of "
          "each cohort as the SageFlow authors' scripts")
REFERENCES: Dict[str, Reference] = {
    "model_poisoning": Reference(
        _SAGEFLOW_PAPER + " (model poisoning: -0.1 w)",
        SAGEFLOW + ": Sageflow_code/utils1.py (sign_attack)",
        ("applied to trainable parameters only; BatchNorm statistics are sent as trained",
         _FIXED)),
    "sign_flip": Reference(_SIREN_PAPER + " (sign flipping: -4 x the update)",
                           SIREN + ": malicious_agent.py (mal_agent_other)", (_FIXED,)),
    "gaussian": Reference(
        "Gaussian attack: N(0, sigma^2) added to every weight (Blanchard et al., NeurIPS "
        "2017, Sect. 5's Gaussian Byzantine workers)", None,
        ("noise is added to the trained model (Blanchard et al.'s workers send noise in "
         "place of a gradient): the scale is `attack.scale`, 1 by default",
         _FIXED)),
    "label_shift": Reference(_SAGEFLOW_PAPER + " (data poisoning: y -> (y + 1) mod C)",
                             SAGEFLOW + ": Sageflow_code/update.py", (_FIXED,)),
    "label_flip": Reference(_SIREN_PAPER + " (label flipping: y -> C - 1 - y)",
                            SIREN + ": malicious_agent.py (mal_agent_other)", (_FIXED,)),
    "backdoor": Reference(
        _SAGEFLOW_PAPER + " (backdoor: a 12-pixel pattern, target 2, 20 of each 64 "
        "images, the update boosted x10)", SAGEFLOW + ": backdoor_FL/utils2.py, update.py",
        ("attackers train as many local epochs as honest clients (the authors': 10 against "
         "1): the attack has no epoch count of its own",
         "the poisoned share is per batch, the first floor(n 20/64) rows of a batch of n "
         "(the authors' 20 of each 64 at B = 64)",
         "by default it starts at a third of the rounds (`attack.start_round`; the "
         "`authors` preset uses round 10, theirs)",
         _FIXED)),
}
# Every kind, 'none' first (each needs its entry in REFERENCES and its function(s) in
# DATA_ATTACKS / MODEL_ATTACKS below).
ATTACKS = ("none",) + tuple(REFERENCES)
# Each kind's `scale` when the config leaves it unset.
DEFAULT_SCALE = {"model_poisoning": 0.1, "sign_flip": 4.0, "gaussian": 1.0, "backdoor": 10.0}
# The authors' MNIST pattern, (row, column) in the top-left corner.
PATTERN = ((0, 0), (1, 0), (2, 0), (0, 1), (1, 2), (2, 3), (0, 5), (1, 4), (4, 0), (4, 1),
           (4, 2), (4, 3))
_MALICIOUS_STREAM, _NOISE_STREAM, _ROUND_STREAM = 0xA7, 0xA9, 0xAB


class Attack(NamedTuple):
    kind: str
    num_classes: int
    scale: float = 1.0  # DEFAULT_SCALE[kind] from the config
    target: int = 2  # backdoor's label
    poisoned: float = 20 / 64  # backdoor's share of each batch
    start_round: int = 0


class AttackedLocal(NamedTuple):
    inner: PyTree
    malicious: jax.Array  # this client attacks this round
    rng: jax.Array


def draw_malicious(fraction: float, num_clients: int, seed: int) -> np.ndarray:
    """(K,) bool: round(fraction * K) clients, drawn once from the seed."""
    count = int(round(fraction * num_clients))
    rng = np.random.default_rng([seed, _MALICIOUS_STREAM])
    out = np.zeros(num_clients, bool)
    out[rng.choice(num_clients, count, replace=False)] = True
    return out


def draw_round(fraction: float, ids: np.ndarray, seed: int, round_index: int) -> np.ndarray:
    """(M,) bool over round `round_index`'s cohort `ids`: exactly int(M * fraction) of them
    (the authors' `int(m * attack_ratio)`), drawn from (seed, round) alone."""
    m = len(ids)
    rng = np.random.default_rng([seed, round_index, _ROUND_STREAM])
    out = np.zeros(m, bool)
    out[rng.choice(m, int(m * fraction), replace=False)] = True
    return out


def round_table(fraction: float, cohorts: Sequence[np.ndarray], seed: int,
                num_clients: int) -> np.ndarray:
    """(R, K) bool: row r marks round r's attackers among `cohorts[r]` (`draw_round`)."""
    table = np.zeros((len(cohorts), num_clients), bool)
    for r, ids in enumerate(cohorts):
        ids = np.asarray(ids, np.int64)
        table[r, ids[draw_round(fraction, ids, seed, r)]] = True
    return table


def malicious_from_config(cfg: Any, num_clients: int, sampling: str) -> np.ndarray:
    """`config.attack`'s attackers: (K,) bool for draw 'fixed', (rounds, K) for
    'per_round' (each round's cohort as the engine samples it under `sampling`, the
    resolved `config.sampling`), all False for kind none."""
    a = cfg.attack
    if a.kind == "none":
        return np.zeros(num_clients, bool)
    if a.get("draw", "fixed") == "fixed":
        return draw_malicious(a.fraction, num_clients, cfg.seed)
    if a.draw != "per_round":
        raise ValueError(f"unknown attack.draw {a.draw!r}; expected one of {DRAWS}")
    # The engine's own sampler: the attack draws among the cohort each round has.
    cohorts = [sampled_clients(cfg.seed, num_clients, cfg.participation, sampling, r)
               for r in range(cfg.rounds)]
    return round_table(a.fraction, cohorts, cfg.seed, num_clients)


def attacking(malicious: np.ndarray, round_index: int, ids: np.ndarray) -> np.ndarray:
    """(M,) bool: which of the clients `ids` are attackers in round `round_index`, from a
    (K,) or (R, K) table (`malicious_from_config`)."""
    malicious = np.asarray(malicious, bool)
    if malicious.ndim == 1:
        return malicious[ids]
    return malicious[min(round_index, len(malicious) - 1), ids]


def add_pattern(images: jax.Array) -> jax.Array:
    """`images` (N, H, W, C) with the backdoor pattern's pixels set to 1.0 (all channels)."""
    rows, cols = zip(*PATTERN)
    return images.at[:, np.asarray(rows), np.asarray(cols), :].set(1.0)


def _label_shift(batch: dict, attack: Attack) -> dict:
    return {**batch, "y": (batch["y"] + 1) % attack.num_classes}


def _label_flip(batch: dict, attack: Attack) -> dict:
    return {**batch, "y": attack.num_classes - 1 - batch["y"]}


def _backdoor_batch(batch: dict, attack: Attack) -> dict:
    y = batch["y"]
    n = jnp.sum(batch["mask"]).astype(jnp.int32)  # real rows come first
    hit = jnp.arange(y.shape[0]) < jnp.floor(n * attack.poisoned).astype(jnp.int32)
    x = jnp.where(hit[:, None, None, None], add_pattern(batch["x"]), batch["x"])
    return {**batch, "x": x, "y": jnp.where(hit, attack.target, y)}


def _model_poisoning(trained: PyTree, broadcast: PyTree, key: jax.Array, s: float) -> PyTree:
    return tree_map(lambda w: -s * w, trained)


def _sign_flip(trained: PyTree, broadcast: PyTree, key: jax.Array, s: float) -> PyTree:
    return tree_map(lambda w, b: b - s * (w - b), trained, broadcast)


def _gaussian(trained: PyTree, broadcast: PyTree, key: jax.Array, s: float) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(trained)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        w + s * jax.random.normal(k, w.shape, w.dtype) for w, k in zip(leaves, keys)])


def _boost(trained: PyTree, broadcast: PyTree, key: jax.Array, s: float) -> PyTree:
    return tree_map(lambda w, b: b + s * (w - b), trained, broadcast)


# The kinds that poison what an attacker trains on: fn(batch, attack) -> its batch.
DATA_ATTACKS: Dict[str, Callable[[dict, Attack], dict]] = {
    "label_shift": _label_shift, "label_flip": _label_flip, "backdoor": _backdoor_batch}
# The kinds that change the model an attacker sends:
# fn(trained, broadcast, key, scale) -> the parameters it sends in place of `trained`.
MODEL_ATTACKS: Dict[str, Callable[[PyTree, PyTree, jax.Array, float], PyTree]] = {
    "model_poisoning": _model_poisoning, "sign_flip": _sign_flip, "gaussian": _gaussian,
    "backdoor": _boost}


def poison_batch(batch: dict, attack: Attack) -> dict:
    """The batch a malicious client trains on (data attacks; others: unchanged)."""
    poison = DATA_ATTACKS.get(attack.kind)
    return batch if poison is None else poison(batch, attack)


def attack_params(attack: Attack, trained: PyTree, broadcast: PyTree, key: jax.Array
                  ) -> PyTree:
    """The parameters a malicious client sends in place of `trained` (module docstring)."""
    send = MODEL_ATTACKS.get(attack.kind)
    return trained if send is None else send(trained, broadcast, key, attack.scale)


def with_attack(algorithm: FederatedAlgorithm, attack: Attack, malicious: np.ndarray
                ) -> FederatedAlgorithm:
    """`algorithm` whose clients flagged in `malicious` attack as `attack` says from round
    `attack.start_round` on: (K,) the same clients every round, or (R, K) round r's in row
    r (rounds past R read the last row). Looked up by each client's id and round, so every
    execution strategy gives the same attackers."""
    if attack.kind not in ATTACKS:
        raise ValueError(f"unknown attack {attack.kind!r}; expected one of {ATTACKS}")
    if attack.kind in MODEL_ATTACKS and algorithm.model_view is None:
        raise ValueError(f"attack {attack.kind!r} changes the model a client sends, and "
                         f"this algorithm's output is not a model or an update")
    table = jnp.asarray(malicious, bool)
    poison, send = DATA_ATTACKS.get(attack.kind), MODEL_ATTACKS.get(attack.kind)
    nested = nest_local(algorithm)

    def client_init(server, client_state, ctx):
        inner = algorithm.client_init(server, client_state, ctx)
        if table.ndim == 1:
            bad = table[ctx.client_id]
        else:
            bad = table[jnp.minimum(ctx.round, table.shape[0] - 1), ctx.client_id]
        on = bad & (ctx.round >= attack.start_round)
        return AttackedLocal(inner, on, jax.random.fold_in(ctx.rng, _NOISE_STREAM))

    def client_step(local, batch, server):
        bad = poison(batch, attack)
        batch = tree_map(lambda p, b: jnp.where(local.malicious, p, b), bad, batch)
        return nested.client_step(local, batch, server)

    def client_output(local, server):
        output, client_state = nested.client_output(local, server)
        bad, _ = map_sent_model(algorithm, server, output, lambda trained, broadcast: (
            send(trained, broadcast, local.rng, attack.scale), None))
        return tree_map(lambda b, o: jnp.where(local.malicious, b, o), bad, output), client_state

    return nested._replace(
        client_init=client_init,
        client_step=nested.client_step if poison is None else client_step,
        client_output=nested.client_output if send is None else client_output)


def start_round(cfg: Any) -> int:
    """The round from which `config.attack`'s attackers act."""
    return int(cfg.attack.start_round)


def backdoor_target(cfg: Any) -> int:
    """The label `config.attack`'s backdoor steers patterned images to."""
    return int(cfg.attack.target)


def from_config(algorithm: FederatedAlgorithm, cfg: Any, num_clients: int, num_classes: int,
                sampling: str, malicious: Optional[np.ndarray] = None) -> FederatedAlgorithm:
    """`algorithm` with `config.attack`'s malicious clients; `malicious`: their table where
    the caller has it, else `malicious_from_config` under the resolved `sampling`."""
    a = cfg.attack
    scale = DEFAULT_SCALE.get(a.kind, 1.0) if a.scale is None else a.scale
    if a.kind == "backdoor" and a.target >= num_classes:
        raise ValueError(f"attack.target must be a class below {num_classes}, got {a.target}")
    attack = Attack(a.kind, num_classes, scale, a.target, a.poisoned, a.start_round)
    if malicious is None:
        malicious = malicious_from_config(cfg, num_clients, sampling)
    return with_attack(algorithm, attack, malicious)


def _probes(cfg: Any, images: Any, labels: Any) -> Dict[str, Tuple[Any, Any]]:
    """The backdoor's success: test images of the other classes, patterned, scored
    against the target label."""
    if cfg.attack.kind != "backdoor":
        return {}
    others = np.asarray(labels) != cfg.attack.target
    return {"backdoor_success": (add_pattern(images[others]),
                                 np.full(int(others.sum()), cfg.attack.target))}


FEATURE = FeatureEntry(
    "attack",
    options={"kind": "none", "fraction": 0.2, "start_round": 0, "scale": placeholder(float),
             "target": 2, "poisoned": 20 / 64, "draw": "fixed"},
    rules={"kind": one_of(ATTACKS), "fraction": between(0, 1),
           "start_round": between(0, 1e6, integer=True),
           "scale": between(0, 1e4, optional=True), "target": between(0, 1e5, integer=True),
           "poisoned": between(0, 1), "draw": one_of(DRAWS)},
    off=(("kind", "none"),),
    wrap=lambda algorithm, b: from_config(algorithm, b.cfg, b.num_clients, b.num_classes,
                                          b.sampling),
    needs_model=lambda cfg: cfg.attack.kind in MODEL_ATTACKS, probes=_probes,
    summary="malicious clients (module docstring): `fraction` of them, drawn once per seed "
            "(draw 'fixed'), or exactly int(M fraction) of each round's cohort of M "
            "('per_round', the SageFlow authors'), from round start_round; scale unset: "
            "the kind's default (DEFAULT_SCALE); backdoor: `poisoned` of each batch carry "
            "the pattern and label `target`")


__all__ = ["FEATURE", "from_config", "start_round", "backdoor_target", "Attack", "ATTACKS",
           "DRAWS", "DATA_ATTACKS", "MODEL_ATTACKS", "DEFAULT_SCALE", "PATTERN", "draw_malicious",
           "draw_round", "round_table", "malicious_from_config", "attacking", "add_pattern",
           "poison_batch", "attack_params", "with_attack"]
