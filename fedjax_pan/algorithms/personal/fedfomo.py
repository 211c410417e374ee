"""FedFomo (Zhang, Sapra, Fidler, Yeung & Alvarez, ICLR 2021): each client mixes the models
of the clients that help it most, weighted by a first-order estimate of how much each one
lowers its validation loss.

The server keeps every client's latest uploaded model theta_n (a (K, ...) stack, all the
initial model at first) and an affinity matrix P (K, K), the identity at first. A sampled
client i receives the M models of the largest entries of P[i] and, with theta_old its old
model and L its validation loss, weighs each received theta_n by

    w_n = max(0, (L(theta_old) - L(theta_n)) / (||theta_n - theta_old|| + 1e-5)),

normalised to sum 1; its model becomes sum_n w_n theta_n (where every w_n is 0 it keeps its
model as it is). It trains that model E epochs and uploads it; the server stores it in the
stack and adds the client's raw (unclipped) weights to P[i] at the received ids.

As PFLlib's serverfomo.py / clientfomo.py (the paper leaves these open):
- theta_old is the model the client's previous round started training from (PFLlib's
  `old_model`, cloned after the mix; the initial model before any round), while the model
  it keeps, evaluates and falls back on is the one it trained; so the client state holds
  both ("model" and "old").
- M = `fedfomo.m` (PFLlib's -M, 5), capped at the clients a round (PFLlib's
  min(M, num_join_clients)) and at K; ties in P go to the lower client id (`lax.top_k`).
- The distance is over the parameters alone; the mix replaces the parameters and keeps
  the client's own non-trainable state (BatchNorm statistics), as PFLlib's mix runs over
  `parameters()`.
- P[i] grows by the raw weights, negative ones included.

Deviations, each for a reason:
- Validation data. PFLlib holds out the last 20% of a client's training data as its
  validation set. Here clients see data only as the round's batches, so validation is the
  first round(val_share x steps) local steps of the round (as FedALA's ALA pass):
  `fedfomo.val_epochs` (0.2) comes out of `local.epochs`, so E = 1.2 is the validation pass
  plus one training epoch. Those steps train nothing; they add up, over their batches, the
  loss of the old model and of each received model (vmapped over the M candidates) in
  training mode as PFLlib's (BatchNorm on the batch's statistics, none updated), and L is
  the mean over their examples (PFLlib: the mean of its batches' means); they add nothing
  to the round's training loss. The validation examples (the start of the round's first
  epoch order, a random share of the client's data) are trained on afterwards, not held
  out. A client whose validation pass has no step (round(val_share x steps) = 0) keeps
  its model and adds nothing to P.
- Before any client has trained, every stored model is the initial one, equal to each
  client's old model: every weight is 0 and clients keep the initial model (PFLlib sends
  no models in round 0, to the same effect). `download_bytes` counts M models from round 1
  on, none in round 0, as PFLlib sends.
- There is no global model: the global evaluation shows the initial model.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, per_client, server_model,
                                        set_rows, tree_bytes)
from fedjax_pan.engine.simulation import clients_per_round
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"m": 5, "val_epochs": 0.2}
RULES = {"m": between(1, 100000, integer=True),
         "val_epochs": between(0, 1000, lo_open=True)}
EPS = 1e-5  # PFLlib's, added to the distance


REFERENCE = Reference(
    "Zhang, Sapra, Fidler, Yeung and Alvarez, 'Personalized Federated Learning with First "
    "Order Model Optimization', ICLR 2021 (FedFomo: the first-order weights w_n on the "
    "received models and the affinity matrix P, Algorithm 1)",
    pfllib("servers/serverfomo.py", "clients/clientfomo.py"),
    ("validation is the first round(val_epochs x steps) local steps of the round (the "
     "start of its first epoch's order, trained on afterwards); PFLlib holds out the last "
     "20% of a client's training data",
     "L is the mean loss over the validation examples; PFLlib's is the mean of its "
     "batches' means",
     "a client whose validation pass has no step keeps its model and adds nothing to P",
     "there is no global model: the global evaluation shows the initial model"))


class FomoServer(NamedTuple):
    params: PyTree  # the initial model (evaluated as the "global" one)
    model_state: Dict[str, PyTree]
    models: PyTree  # (K, ...) every client's latest uploaded variables
    affinity: jax.Array  # P (K, K)
    round: jax.Array


class FomoLocal(NamedTuple):
    train: local_lib.LocalState  # the mix, then trained
    own: PyTree  # the client's model's parameters before this round (the fallback)
    old: PyTree  # theta_old's parameters
    candidates: PyTree  # (M, ...) the received models' variables
    ids: jax.Array  # (M,) their clients
    distances: jax.Array  # (M,) ||theta_n - theta_old||
    sums: jax.Array  # (M + 1,) validation loss sums: theta_old, then each theta_n
    count: jax.Array  # validation examples seen
    val_steps: jax.Array  # validation steps left


def fomo_weights(old_loss: jax.Array, losses: jax.Array, distances: jax.Array
                 ) -> Tuple[jax.Array, jax.Array]:
    """(raw, mix): raw_n = (L(old) - L(theta_n)) / (||theta_n - old|| + 1e-5), and
    max(raw, 0) normalised to sum 1 (all 0 where no raw weight is positive)."""
    raw = (old_loss - losses) / (distances + EPS)
    clipped = jnp.maximum(raw, 0.0)
    total = jnp.sum(clipped)
    return raw, jnp.where(total > 0, clipped / jnp.where(total > 0, total, 1.0), 0.0)


def mix_params(weights: jax.Array, candidates: PyTree, own: PyTree) -> PyTree:
    """sum_n w_n theta_n, or `own` where every weight is 0."""
    keep = jnp.sum(weights) <= 0
    return tree_map(lambda c, o: jnp.where(keep, o, jnp.tensordot(weights.astype(c.dtype), c,
                                                                  axes=1)), candidates, own)


def fedfomo(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
            val_share: float, server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
            m: int = 5, loss: local_lib.LossSum = local_lib.masked_cross_entropy
            ) -> FederatedAlgorithm:
    """FedFomo over `num_clients` clients, each receiving min(m, num_clients) models; the
    first round(val_share x local steps) steps of a round are its validation pass."""
    del server_tx  # nothing is averaged
    local_lib.check_share(val_share, "FedFomo's share of local steps for validation")
    check_options(RULES, "fedfomo", m=m)
    m = min(int(m), int(num_clients))

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        return FomoServer(params, model_state, per_client(variables, num_clients),
                          jnp.eye(num_clients, dtype=jnp.float32), jnp.zeros((), jnp.int32))

    def client_state_init(server):
        return {"model": server_model(server), "old": server.params}

    def client_init(server, client_state, ctx):
        _, ids = jax.lax.top_k(server.affinity[ctx.client_id], m)
        candidates = tree_map(lambda s: s[ids], server.models)
        old = client_state["old"]

        def distance(params):
            return jnp.sqrt(sum(jnp.sum(jnp.square((p - o).astype(jnp.float32)))
                                for p, o in zip(jax.tree_util.tree_leaves(params),
                                                jax.tree_util.tree_leaves(old))))
        distances = jax.vmap(distance)(candidates["params"])
        train = local_lib.init_local(client_tx, client_state["model"], server.round)
        return FomoLocal(train, train.params, old, candidates, ids.astype(jnp.int32),
                         distances, jnp.zeros((m + 1,), jnp.float32),
                         jnp.zeros((), jnp.float32),
                         local_lib.phase_steps(val_share, ctx.num_steps))

    def weights_of(local):
        count = jnp.maximum(local.count, 1.0)
        return fomo_weights(local.sums[0] / count, local.sums[1:] / count, local.distances)

    def val_step(local, batch, server):
        del server
        # theta_old (with the client's statistics) evaluated alongside the candidates in one
        # vmap: a candidate equal to it gets exactly its loss, hence weight 0.
        old = {"params": local.old, **local.train.model_state}
        stacked = tree_map(lambda o, c: jnp.concatenate([o[None], c]), old, local.candidates)

        def loss_sum(variables):
            params, model_state = local_lib.split_variables(variables)
            # Training mode, as PFLlib's modules are when it validates: BatchNorm
            # normalises with the batch's statistics (the statistics it would update are
            # dropped), so a model's stored statistics do not weigh in its loss.
            logits, _ = local_lib.forward(model, params, model_state, batch, train=True)
            return loss(logits, batch["y"], batch["mask"])
        local = local._replace(sums=local.sums + jax.vmap(loss_sum)(stacked),
                               count=local.count + jnp.sum(batch["mask"]),
                               val_steps=local.val_steps - 1)
        # The mix of the sums so far; the last validation step's stands.
        _, weights = weights_of(local)
        start = mix_params(weights, local.candidates["params"], local.own)
        # Validation is not training: the round's training loss counts no example of it.
        zero = jnp.zeros((), jnp.float32)
        return (local._replace(train=local.train._replace(params=start)),
                {"loss_sum": zero, "num_examples": zero})

    def train_step(local, batch, server):
        del server
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch, loss=loss)
        return local._replace(train=train), metrics

    def client_step(local, batch, server):
        return jax.lax.cond(local.val_steps > 0, val_step, train_step, local, batch, server)

    def client_output(local, server):
        raw, weights = weights_of(local)
        vector = jnp.zeros((num_clients,), jnp.float32).at[local.ids].add(raw)
        variables = local_lib.model_variables(local.train)
        start = mix_params(weights, local.candidates["params"], local.own)
        return {"model": variables, "weights": vector}, {"model": variables, "old": start}

    def server_update(server, outputs, info):
        ids = info.client_ids
        return server._replace(models=set_rows(server.models, ids, outputs["model"]),
                               affinity=server.affinity.at[ids].add(outputs["weights"]),
                               round=server.round + 1)

    def personal_variables(server, client_state):
        del server
        return client_state["model"]

    def download_bytes(server, client_ids, round_index):
        # The M models of the client's largest affinities; none in round 0 (PFLlib's
        # M_ = min(M, uploads so far)).
        del client_ids
        one = tree_bytes(server_model(server))
        return jnp.where(jnp.asarray(round_index) == 0, 0, m * one).astype(jnp.int32)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               aggregator=every_output, personal_variables=personal_variables,
                               download_bytes=download_bytes)


_val_share = local_lib.epochs_share("fedfomo", "val_epochs", "the validation pass is")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    k = cfg.partition.num_clients
    # PFLlib: M = min(-M, clients a round).
    m = min(cfg.fedfomo.m, clients_per_round(cfg.participation, k))
    return fedfomo(model, client_tx, k, _val_share(cfg), server_tx, m=m)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_val_share,
                       reference=REFERENCE)

__all__ = ["fedfomo", "fomo_weights", "mix_params", "FomoServer", "FomoLocal", "OPTIONS",
           "RULES", "ENTRY"]
