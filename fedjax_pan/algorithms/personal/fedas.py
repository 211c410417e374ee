"""FedAS (Yang, Huang and Ye, CVPR 2024, "FedAS: Bridging Inconsistency in Personalized
Federated Learning"): parameter alignment on the client, and aggregation weighted by each
client's Fisher information.

A model is a feature extractor f (the shared part: every layer but the output layer
`head`) and a head. Client i keeps its whole model and its class prototypes
p_c = mean_{y = c} f_i(x) (from its model as it last trained). A round:

1. Parameter alignment: the received global extractor f_g is fitted to the client's
   prototypes by SGD at rate `align_lr` on
       sum_{c in batch} MSE(f_g(x_{y=c}), p_c)     (the mean over the class's rows and D),
   then becomes the client's extractor; the client keeps its own head.
2. Local training of the whole model (FedAvg's local steps).
3. Client synchronisation: the client's Fisher information, the trace of the empirical
   FIM, F_i = sum_batches || grad_w mean_batch NLL(w; x, y) ||^2, is sent with its model;
   the server averages the models with weights F_i / sum_j F_j over the round's clients.

As PFLlib's clientas.py / serveras.py (the paper leaves these open):
- prototypes and F_i come from the model after training, in eval mode, one pass over the
  client's data; alignment runs the global model in eval mode (PFLlib's copy of an
  uploaded model, left in eval mode), its rate 0.01 (PFLlib's fixed SGD rate; no
  momentum, no warm-up), over one pass;
- the whole model (head included) is averaged; a client evaluates its own model as it
  last trained (the initial model before it has trained);
- a client keeps its own non-trainable state (BatchNorm statistics).

Deviations, each for a reason:
- Passes as local steps. Clients see data only as the round's batches, so the alignment
  is the first round(align_share x steps) local steps and the FIM pass the last
  round(fim_share x steps): `fedas.align_epochs` and `fedas.fim_epochs` come out of
  `local.epochs` (PFLlib: one epoch each besides local_epochs, alignment on batches of
  16; set both to 1 and local.epochs = E + 2 for that). The defaults (0.25 each) fit
  every preset, local.epochs = 1 included. Those steps train nothing and add nothing to
  the round's training loss.
- The prototypes come from the FIM pass of the client's previous round (the same model
  PFLlib computes them from at the next round's start: a client's model does not change
  between its rounds); a client that has not trained has none and skips alignment (PFLlib
  aligns to the initial model's class means).
- PFLlib's unselected clients also compute their FIM each round, unused by the
  aggregation: not done here. Where every F_i of a round is 0 the models are averaged with
  the engine's weights.
- The server's non-trainable state (used by the global model: alignment and global
  evaluation) is the F-weighted mean of the clients'; PFLlib's global model keeps the
  first uploaded client's (it copies that model and averages its parameters only).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, server_model)
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"align_epochs": 0.25, "fim_epochs": 0.25, "align_lr": 0.01}
RULES = {"align_epochs": between(0, 1000, lo_open=True),
         "fim_epochs": between(0, 1000, lo_open=True), "align_lr": between(0, 100)}


REFERENCE = Reference(
    "Yang, Huang and Ye, 'FedAS: Bridging Inconsistency in Personalized Federated Learning', "
    "CVPR 2024 (parameter alignment of the global extractor to the client's prototypes, "
    "and aggregation weighted by the trace of the empirical Fisher information)",
    pfllib("servers/serveras.py", "clients/clientas.py"),
    ("the alignment pass and the FIM pass are the first and last shares "
     "(fedas.align_epochs, fedas.fim_epochs) of local.epochs' steps on the round's batches; "
     "PFLlib adds one epoch each besides local_epochs, the alignment on batches of 16",
     "prototypes come from the FIM pass of the client's previous round; a client that has "
     "not trained skips alignment (PFLlib aligns to the initial model's class means)",
     "unselected clients compute no FIM (PFLlib computes it, unused by the aggregation); "
     "where every F_i of a round is 0 the engine's weights are used (PFLlib divides by 0)",
     "the server's BatchNorm statistics are the F-weighted mean of the clients'; PFLlib's "
     "global model keeps the first uploaded client's (it averages parameters only)"))


class AsServer(NamedTuple):
    params: PyTree  # the F-weighted global model
    model_state: PyTree
    round: jax.Array


class AsLocal(NamedTuple):
    train: local_lib.LocalState  # aligned extractor + own head, then trained
    protos: jax.Array  # (C, D) the client's prototypes (from its last round)
    has_proto: jax.Array  # (C,) 1.0 where it has one
    fim: jax.Array  # F_i so far
    proto_sums: jax.Array  # (C, D) this round's feature sums per class
    counts: jax.Array  # (C,) this round's examples per class
    t: jax.Array  # local steps taken
    align_steps: jax.Array
    fim_from: jax.Array  # the first FIM step


def alignment_loss(features: jax.Array, labels: jax.Array, mask: jax.Array,
                   protos: jax.Array, has_proto: jax.Array) -> jax.Array:
    """sum over the batch's classes c with a prototype of MSE(f(x_{y=c}), p_c), each the
    mean over that class's real rows and the D features (PFLlib's nn.MSELoss)."""
    feats = features.reshape(features.shape[0], -1).astype(jnp.float32)
    onehot = jax.nn.one_hot(labels, protos.shape[0]) * mask[:, None]
    err = jnp.sum((feats - protos[labels]) ** 2, axis=1)  # (B,)
    per_class = onehot.T @ err
    rows = jnp.sum(onehot, axis=0)
    use = (rows > 0) & (has_proto > 0)
    return jnp.sum(jnp.where(use, per_class / (jnp.maximum(rows, 1.0) * feats.shape[1]), 0.0))


def fisher_trace(model: nn.Module, params: PyTree, model_state: PyTree, batch
                 ) -> jax.Array:
    """|| grad_w mean NLL ||^2 of one batch, eval mode (PFLlib's FIM trace term)."""
    def nll(p):
        logits = model.apply({"params": p, **model_state}, batch["x"], train=False)
        ce = local_lib.masked_cross_entropy(logits, batch["y"], batch["mask"])
        return ce / jnp.maximum(jnp.sum(batch["mask"]), 1.0)
    g = jax.grad(nll)(params)
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
               for x in jax.tree_util.tree_leaves(g))


def fedas(model: nn.Module, client_tx: optax.GradientTransformation, align_share: float,
          fim_share: float, server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
          align_lr: float = 0.01) -> FederatedAlgorithm:
    """FedAS for a flax `model` sowing 'features' into its `head`; the first
    round(align_share x steps) local steps align, the last round(fim_share x steps) take
    the FIM and the prototypes."""
    del server_tx  # PFLlib's global model is the F-weighted mean itself
    local_lib.check_share(align_share, "FedAS's share of local steps for alignment")
    local_lib.check_share(fim_share, "FedAS's share of local steps for the FIM pass")
    if align_share + fim_share >= 1.0:
        raise ValueError(f"FedAS's alignment and FIM shares of the local steps must leave "
                         f"steps to train: got {align_share} + {fim_share} >= 1")
    check_options(RULES, "fedas", align_lr=align_lr)
    net = local_lib.WithFeatures(model)

    def dims(params) -> Tuple[int, int]:
        linear_head(params, "FedAS")
        return params[HEAD]["kernel"].shape  # (D, C)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        dims(params)
        return AsServer(params, model_state, jnp.zeros((), jnp.int32))

    def client_state_init(server):
        d, c = dims(server.params)
        return {"model": server_model(server), "protos": jnp.zeros((c, d), jnp.float32),
                "has_proto": jnp.zeros((c,), jnp.float32)}

    def client_init(server, client_state, ctx):
        own_params, own_state = local_lib.split_variables(client_state["model"])
        start = {**server.params, HEAD: own_params[HEAD]}  # global extractor, own head
        train = local_lib.init_local(client_tx, {"params": start, **own_state}, server.round)
        steps = jnp.asarray(ctx.num_steps, jnp.int32)
        d, c = dims(server.params)
        zero = jnp.zeros((), jnp.float32)
        return AsLocal(train, client_state["protos"], client_state["has_proto"], zero,
                       jnp.zeros((c, d), jnp.float32), jnp.zeros((c,), jnp.float32),
                       jnp.zeros((), jnp.int32), local_lib.phase_steps(align_share, steps),
                       steps - local_lib.phase_steps(fim_share, steps))

    none = lambda: {"loss_sum": jnp.zeros((), jnp.float32),  # noqa: E731
                    "num_examples": jnp.zeros((), jnp.float32)}

    def align_step(local, batch, server):
        params = local.train.params
        extractor = {k: v for k, v in params.items() if k != HEAD}

        def loss(ex):
            (_, feats), _ = local_lib.forward(net, {**ex, HEAD: server.params[HEAD]},
                                              server.model_state, batch, train=False)
            return alignment_loss(feats, batch["y"], batch["mask"], local.protos,
                                  local.has_proto)
        g = jax.grad(loss)(extractor)
        extractor = tree_map(lambda p, d: p - align_lr * d, extractor, g)
        train = local.train._replace(params={**params, **extractor})
        return local._replace(train=train, t=local.t + 1), none()

    def train_step(local, batch, server):
        del server
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch)
        return local._replace(train=train, t=local.t + 1), metrics

    def fim_step(local, batch, server):
        del server
        params, state = local.train.params, local.train.model_state
        fim = fisher_trace(model, params, state, batch)
        (_, feats), _ = local_lib.forward(net, params, state, batch, train=False)
        feats = feats.reshape(feats.shape[0], -1).astype(jnp.float32)
        onehot = jax.nn.one_hot(batch["y"], local.counts.shape[0]) * batch["mask"][:, None]
        return local._replace(fim=local.fim + fim,
                              proto_sums=local.proto_sums + onehot.T @ feats,
                              counts=local.counts + jnp.sum(onehot, axis=0),
                              t=local.t + 1), none()

    def client_step(local, batch, server):
        phase = jnp.where(local.t < local.align_steps, 0,
                          jnp.where(local.t >= local.fim_from, 2, 1))
        return jax.lax.switch(phase, [align_step, train_step, fim_step], local, batch, server)

    def client_output(local, server):
        del server
        variables = local_lib.model_variables(local.train)
        seen = local.counts > 0
        means = local.proto_sums / jnp.maximum(local.counts, 1.0)[:, None]
        protos = jnp.where(seen[:, None], means, local.protos)
        has = jnp.maximum(local.has_proto, seen.astype(jnp.float32))
        return ({"model": variables, "fim": local.fim},
                {"model": variables, "protos": protos, "has_proto": has})

    def server_update(server, outs, info):
        fim = outs["fim"] * (info.weights > 0)
        total = jnp.sum(fim)
        w = jnp.where(total > 0, fim / jnp.where(total > 0, total, 1.0), info.weights)
        mean = tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1), outs["model"])
        params, model_state = local_lib.split_variables(mean)
        return AsServer(params, model_state, server.round + 1)

    def personal_variables(server, client_state):
        del server
        return client_state["model"]

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               aggregator=every_output, personal_variables=personal_variables)


def _shares(cfg: Any) -> Tuple[float, float]:
    o, epochs = cfg.fedas, cfg.local.epochs
    align = local_lib.share_of_steps(o.align_epochs, epochs, "fedas.align_epochs",
                                     "the alignment pass is")
    fim = local_lib.share_of_steps(o.fim_epochs, epochs, "fedas.fim_epochs",
                                   "the FIM pass is")
    if o.align_epochs + o.fim_epochs >= epochs:
        raise ValueError(f"fedas.align_epochs + fedas.fim_epochs must be below local.epochs "
                         f"({epochs:g}) to leave local steps to train, got "
                         f"{o.align_epochs:g} + {o.fim_epochs:g}")
    return align, fim


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    align, fim = _shares(cfg)
    return fedas(model, client_tx, align, fim, server_tx, align_lr=cfg.fedas.align_lr)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_shares,
                       reference=REFERENCE)

__all__ = ["fedas", "alignment_loss", "fisher_trace", "AsServer", "AsLocal", "OPTIONS",
           "RULES", "ENTRY"]
