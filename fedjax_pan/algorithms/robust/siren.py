"""Siren (Guo et al., SoCC 2021): Byzantine-robust FL by proactive alarming, as the authors'
code (AISIGSJTU/Siren: `agents.alarm`, `main.server_detect` and its round loop).

Client side. Each client keeps a test part of its own data (`partition.test_fraction`;
the authors' 10%) and its model from its last round. When sampled again it scores both
on that part and raises an alarm when its own model beats the global one by more than
C_c of its own accuracy (acc_own > acc_global + C_c acc_own, C_c = 0.04); an alarming
client trains on from its own model instead of the global one. It sends its update
against the global model either way. Malicious clients (`config.attack`, from its
`start_round`) alarm in every round they attack, as the authors' `mal_agent_other` and
`mal_agent_mp` do (`alarm=1` unconditionally), and train from the global model as theirs;
`malicious_alarm='never'` makes them silent in every round instead (our earlier reading),
which leaves the server's check idle in rounds where no honest client alarms.

Server side, on its own held-out data (`dataset.public_size`, the authors' root set of
100) scoring each client's model (global + update) by accuracy, with C_s = 0.1:
  - two or more alarms: the best alarming client is the reference; alarming clients
    worse than (1 - C_s) of its accuracy, or whose update has cosine <= 0 with its, are
    abnormal. If some are, only the normal alarming clients are used. If none are, the
    silent clients are checked the same way against their own best: if that best is
    below (1 - C_s) of the alarming best, only the alarming clients are used; otherwise
    the alarms were false and only the silent clients that pass are used;
  - one alarm: every client is checked against the best of all;
  - no alarm: every client is used.
Penalty and reward: a client not used gains a penalty point, one used loses `forgive`
(0.5) of a point; at `prohibit` (0.45) x the run's rounds it is barred for good. When
clients were rejected the server also rolls back: it adds the used updates to the global
model of one round earlier (of two rounds earlier when rejections came twice running),
undoing what the attackers slipped in before the alarms. The used updates are averaged
uniformly (the authors' alpha = 1 / used). The rollback's bookkeeping is the authors' as
coded (`main.py`'s `flag` and `exist_mal`): it is skipped in a round whose used clients
number as many as the barred ones, their `prohibited` counting the clients not yet barred.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.aggregation import public_scorer
from fedjax_pan.algorithms.core import (Aggregator, AlgorithmEntry, FederatedAlgorithm,
                                        tree_bytes)
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.engine.services import RoundDefaults, Services, SimState
from fedjax_pan.rules import between, one_of
from fedjax_pan.references import SIREN as SIREN_CODE, Reference

PyTree = Any
tree_map = jax.tree_util.tree_map
MALICIOUS_ALARMS = ("always", "never")
OPTIONS = {"client_c": 0.04, "server_c": 0.1, "prohibit": 0.45, "forgive": 0.5,
           # Attackers raise an alarm every round ('always': the authors' code) or never.
           "malicious_alarm": "always"}
RULES = {"client_c": between(0, 1), "server_c": between(0, 1),
         "prohibit": between(0, 1, lo_open=True), "forgive": between(0, 10),
         "malicious_alarm": one_of(MALICIOUS_ALARMS)}
ROOT_SIZE = 100  # the authors' server-side set


class SirenServer(NamedTuple):
    base: Any  # FedAvg's ServerState: the global model
    penalty: jax.Array  # (K,) penalty points
    history: PyTree  # (2, ...) the global parameters of the last two rounds
    rejected: jax.Array  # (2,) bool: clients were rejected this round / the one before
    flag: jax.Array  # () bool: the authors' `flag` (rejections seen, not yet rolled back)


def siren_clients(model: nn.Module, client_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    """FedAvg's clients, each keeping its last model and starting from it when its state
    says it raised an alarm (client state {'model', 'alarm'}). Outputs are stacked for
    the server's checks."""
    base = fedavg(model, client_tx, optax.sgd(1.0))

    def client_state_init(server):
        return {"model": base.eval_variables(server), "alarm": jnp.zeros((), bool),
                "trained": jnp.zeros((), bool)}

    def client_init(server, client_state, ctx):
        own, glob = client_state["model"], base.eval_variables(server)
        start = tree_map(lambda a, b: jnp.where(client_state["alarm"], a, b), own, glob)
        return local_lib.init_local(client_tx, start, server.round)

    def client_output(local, server):
        output, _ = base.client_output(local, server)
        return output, {"model": {"params": local.params, **local.model_state},
                        "alarm": jnp.zeros((), bool), "trained": jnp.ones((), bool)}

    return base._replace(client_state_init=client_state_init, client_init=client_init,
                         client_output=client_output,
                         aggregator=Aggregator(lambda outs, w, a=None: outs, stacked=True))


def detect(alarm: np.ndarray, accuracy: np.ndarray, cosine: np.ndarray,
           barred: np.ndarray, server_c: float) -> np.ndarray:
    """(M,) bool: which of the round's clients the server uses (module docstring).
    `cosine` (M, M): between the clients' updates; `barred`: penalised out for good."""
    m = len(alarm)
    use = np.ones(m, bool)

    def best(among):
        """The most accurate of `among` that is not barred (None: none)."""
        idx = np.flatnonzero(among & ~barred)
        return None if not len(idx) else int(idx[np.argmax(accuracy[idx])])

    def fails(ref, among):
        return among & ((accuracy < (1 - server_c) * accuracy[ref]) | (cosine[ref] <= 0))

    alarms = alarm & ~barred
    if alarms.sum() > 1:
        ref = best(alarm)
        abnormal = fails(ref, alarms)
        if not abnormal.any():
            ref2 = best(~alarm)
            if ref2 is None or accuracy[ref2] < (1 - server_c) * accuracy[ref]:
                use[~alarm] = False
            else:
                use[alarm] = False
                use[fails(ref2, ~alarm)] = False
        else:
            use[~alarm] = False
            use[abnormal] = False
    elif alarms.sum() == 1:
        ref = best(np.ones(m, bool))
        use[fails(ref, np.ones(m, bool))] = False
    return use


def penalize(penalty: np.ndarray, ids: np.ndarray, use: np.ndarray, limit: int,
             forgive: float) -> tuple:
    """Penalty and reward: clients `ids` not used gain a point, and those at `limit` are
    barred (not used); a used client with points loses `forgive`. Returns (use, penalty)."""
    penalty = np.array(penalty, np.float64)
    penalty[ids[~use]] += 1
    use = use & (penalty[ids] < limit)
    penalty[ids[use & (penalty[ids] > 0)]] -= forgive
    return use, penalty


class Siren(RoundDefaults):
    """Siren's server logic as an `engine.protocol.Round` on the engine's `services`."""

    features = ("attack",)  # `config.attack`'s clients are among its own

    def __init__(self, model: nn.Module, client_tx: optax.GradientTransformation,
                 services: Services, public: Any, public_labels: Any, client_evaluate: Any,
                 malicious: np.ndarray, options: Dict[str, Any], rounds: int,
                 algorithm: FederatedAlgorithm, attack_start: int = 0):
        self.model, self.services = model, services
        self.num_sampled = services.num_sampled
        self.algorithm = algorithm  # `siren_clients`, with the config's attackers
        self.client_evaluate = client_evaluate
        self.malicious = np.asarray(malicious, bool)
        self.attack_start = int(attack_start)
        self.o = dict(options)
        # Penalty points that bar a client (at least one, on runs shorter than 1 / prohibit).
        self.limit = max(1, int(self.o["prohibit"] * rounds))
        score = public_scorer(model, public, public_labels)
        self._score = jax.jit(jax.vmap(lambda v: score(v)["accuracy"]))
        # Each client's model from its update: the clients' (FedAvg's) model view.
        self._models = jax.jit(jax.vmap(algorithm.model_view.to_model, in_axes=(None, 0)))

    def init(self, variables: PyTree) -> SimState:
        base = self.algorithm.server_init(variables)
        k = self.services.num_clients
        one = self.algorithm.client_state_init(base)
        states = tree_map(lambda x: jnp.broadcast_to(x, (k, *jnp.shape(x))), one)
        history = tree_map(lambda x: jnp.stack([x, x]), base.params)
        return SimState(SirenServer(base, jnp.zeros(k), history, jnp.zeros(2, bool),
                                    jnp.zeros((), bool)), states, 0)

    def evaluation(self, server: SirenServer) -> tuple:
        return None, self.algorithm.eval_variables(server.base)

    def personal_evaluation(self, state: SimState) -> None:
        return None

    def personal_groups(self, state: SimState) -> None:
        return None

    def attacking(self, t: int, ids: np.ndarray) -> np.ndarray:
        """(M,) bool: which of the clients `ids` attack in round `t`."""
        return attacks.attacking(self.malicious, t, ids) & (t >= self.attack_start)

    def alarms(self, state: SimState, ids: np.ndarray) -> np.ndarray:
        """(M,) bool: the clients `ids` that alarm. Honest ones (and attackers before they
        start) with a model when their own last model beats the global one on their test
        part by more than C_c of its accuracy; attackers as `malicious_alarm` says."""
        states = state.client_states
        had = np.asarray(jax.device_get(states["trained"]))[ids]
        own = tree_map(lambda x: x[ids], states["model"])
        mine = self.client_evaluate(own, personal=True, vmapped=True, clients=ids)
        glob = self.client_evaluate(self.algorithm.eval_variables(state.server.base))
        count = np.maximum(mine["count"][ids], 1.0)
        acc_own, acc_glob = mine["correct"][ids] / count, glob["correct"][ids] / count
        honest = had & (acc_own > acc_glob + acc_own * self.o["client_c"])
        if self.o["malicious_alarm"] == "never":
            return honest & ~attacks.attacking(self.malicious, state.round, ids)
        return honest | self.attacking(state.round, ids)

    def round(self, state: SimState) -> tuple:
        t, s = state.round, state.server
        ids = self.services.sample(t)
        alarm = self.alarms(state, ids)
        cohort_states = tree_map(lambda x: x[ids], state.client_states)
        # An alarming attacker still trains from the global model (the authors' agents).
        cohort_states = {**cohort_states,
                         "alarm": jnp.asarray(alarm & ~self.attacking(t, ids))}
        cohort = self.services.cohort(ids, t, cohort_states)
        result = self.services.train("siren", self.algorithm, self.algorithm.eval_variables(
            s.base), cohort, s.base)
        outputs = result.outputs
        accuracy = np.asarray(self._score(self._models(s.base, outputs)))
        flat = np.concatenate([np.asarray(x).reshape(len(ids), -1)
                               for x in jax.tree_util.tree_leaves(outputs["delta"])], axis=1)
        norms = np.linalg.norm(flat + 1e-9, axis=1)
        cosine = flat @ flat.T / np.outer(norms, norms)
        penalty = np.array(s.penalty, np.float64)
        use = detect(alarm, accuracy, cosine, penalty[ids] >= self.limit, self.o["server_c"])
        use, penalty = penalize(penalty, ids, use, self.limit, self.o["forgive"])
        base, rejected, flag = self._rollback(s, ids, use, penalty, t)
        params, model_state = base, s.base.model_state
        if use.any():
            w = jnp.asarray(use / use.sum(), jnp.float32)
            mean = tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1), outputs)
            params = tree_map(lambda b, d: b + d, base, mean["delta"])
            model_state = mean["model_state"]
        new_base = s.base._replace(params=params, model_state=model_state,
                                   round=s.base.round + 1)
        history = tree_map(lambda h, p: jnp.stack([p, h[0]]), s.history, s.base.params)
        client_states = dict(state.client_states)
        client_states = tree_map(lambda a, n: jnp.asarray(a).at[jnp.asarray(ids)].set(n),
                                 client_states,
                                 result.client_states)
        server = SirenServer(new_base, jnp.asarray(penalty, jnp.float32), history,
                             jnp.asarray(rejected), jnp.asarray(flag))
        sums = dict(jax.device_get(result.metrics))
        stats = self.services.statistics(sums, real_examples=self.services.real_examples(ids),
                                         computed_examples=result.computed_examples,
                                         download_bytes=float(len(ids) * tree_bytes(
                                             {"params": s.base.params,
                                              **s.base.model_state})))
        stats.update(train_alarms=float(alarm.sum()), train_rejected=float((~use).sum()))
        return SimState(server, client_states, t + 1), stats

    def _rollback(self, s: SirenServer, ids: np.ndarray, use: np.ndarray,
                  penalty: np.ndarray, t: int) -> tuple:
        """The global parameters the used updates are added to, and the new flags: the
        authors' `exist_mal` / `flag` bookkeeping."""
        rejected = np.array(s.rejected, bool)
        flag = bool(s.flag)
        if (~use).any():
            if not flag:
                rejected[0] = True
            flag = True
        open_ = int((penalty[ids] < self.limit).sum())
        if int(use.sum()) == len(ids) - open_ or not rejected[0]:
            flag = False
        current = s.base.params
        if flag and rejected[0]:
            if t >= 2 and rejected[1]:
                return tree_map(lambda h: h[1], s.history), np.zeros(2, bool), flag
            if t >= 1:
                return tree_map(lambda h: h[0], s.history), np.array([False, True]), flag
            return current, rejected, flag
        return current, np.array([False, rejected[0]]), flag


def _no_round(model, cfg, client_tx, server_tx):
    raise ValueError("Siren runs through its driver (`from_config`), not as one compiled "
                     "federated round")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                services: Services, *, public: Any, public_labels: Any,
                client_evaluate: Any) -> Siren:
    """The `Siren` driver `config.siren` describes, with `config.attack`'s attackers
    (`services.attack`)."""
    if client_evaluate is None:
        raise ValueError("siren's clients test on their own data: set "
                         "partition.test_fraction > 0 (the authors keep 10%)")
    malicious = attacks.malicious_from_config(cfg, services.num_clients, services.sampling)
    algorithm = siren_clients(model, client_tx)
    if services.attack is not None:
        algorithm = services.attack(algorithm, malicious)
    return Siren(model, client_tx, services, public, public_labels, client_evaluate,
                 malicious, cfg.siren.to_dict(), cfg.rounds, algorithm,
                 attack_start=attacks.start_round(cfg))


def _check(cfg: Any) -> None:
    if cfg.partition.test_fraction <= 0:
        raise ValueError(f"partition.test_fraction must be > 0 for algorithm 'siren': each "
                         f"client checks the global model on its own test part (the "
                         f"authors keep 10%: --config.partition.test_fraction=0.1), got "
                         f"{cfg.partition.test_fraction!r}")


REFERENCE = Reference(
    "Guo et al., 'Siren: Byzantine-robust Federated Learning via Proactive Alarming', "
    "SoCC 2021 (client alarms, server detection, penalty and rollback)",
    SIREN_CODE + ": agents.py, main.py, malicious_agent.py",
    ("the clients' optimiser is the config's (the robustness experiment: SGD 0.01, "
     "momentum 0.9), not the authors' default eta 1e-3",
     "the server's per-client bookkeeping is indexed by client id, theirs by position in "
     "the round (identical when every client takes part every round, as in their runs)",
     "their `def_delay` (FedAvg for the first rounds) is not offered (their default is 0)",
     "attackers alarm every round by default, as `malicious_agent.py`; "
     "`siren.malicious_alarm='never'` keeps them silent, a stronger setting for Siren than "
     "the authors'"))

ENTRY = AlgorithmEntry(_no_round, OPTIONS, RULES, driver=from_config, public=ROOT_SIZE,
                       check=_check,
                       driver_needs=("public_labels", "client_evaluate"),
                       reference=REFERENCE)
