"""FedPCL (Tan et al., NeurIPS 2022, "Federated Learning from Pre-Trained Models: A
Contrastive Learning Approach"): clients learn representations against shared class
prototypes, contrastively.

Every client keeps its own model and reports its local prototypes: the class means of its
normalised representation r = f(x) / ||f(x)|| (f: the head's input). The server sends
every client the global prototypes (the class means of the reported prototypes over the
clients reporting the class) and the set of the clients' own prototypes. A client trains
its representation on

    L = CE(r . G^T / tau, y) + (1 / |S|) sum_{s in S} CE(r . P_s^T / tau, y),

G the global prototypes, P_s client s's, both over the classes they hold (a class a
client lacks is no candidate in its term; a row whose label it lacks has no term there,
and S's mean runs over the clients holding the label: PFLlib assumes every client holds
every class), then reports its new prototypes from one pass
over its data with the trained model. It is scored by its own prototypes: the class j
maximising r . p_j, which is its network with the head replaced by its prototypes.

As PFLlib's clientpcl.py / serverpcl.py: a client that has never reported prototypes
only collects them in its first round (it does not train); the global prototypes and the
set S are those of the previous round's reporting clients; prototypes are not
renormalised after averaging; the head (unused by the loss) is never trained. PFLlib's
pass collecting prototypes is the last round(share x steps) local steps here
(`fedpcl.collect_epochs` out of `local.epochs`, 1.0: one pass); its gradient clipping
(norm 10) is the clients' optimiser's (`optimizer.grad_clip`). PFLlib's backbones are
frozen pre-trained networks with a trained projection; here the whole network trains
from its initialisation. Outputs are (C, D) prototypes whatever the network, so clients
may run several of one representation width (`model.architectures`). Each client
downloads the global prototypes and the set, and uploads its prototypes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        server_model, tree_bytes)
from fedjax_pan.algorithms.fedproto import NEVER, collecting_step
from fedjax_pan.algorithms.moon import _WithFeatures
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.rules import between

PyTree = Any
OPTIONS = {"tau": 1.0, "collect_epochs": 1.0}
RULES = {"tau": between(0.01, 100), "collect_epochs": between(0, 1000, lo_open=True)}


class PclServer(NamedTuple):
    params: PyTree  # this network's initial model (the global evaluation's)
    model_state: PyTree
    protos: jax.Array  # (K, C, D) each client's latest prototypes
    has: jax.Array  # (K, C) the classes each holds
    reported: jax.Array  # (K,) 1.0 for the last round's reporting clients (the set S)
    round: jax.Array


class PclLocal(NamedTuple):
    train: local_lib.LocalState
    collect_from: jax.Array
    active: jax.Array  # 1.0 once the client has prototypes of its own: it trains
    sums: jax.Array  # (C, D)
    counts: jax.Array  # (C,)


def normalised(z: jax.Array) -> jax.Array:
    """Rows of `z` over their norm (PyTorch's F.normalize, eps 1e-12)."""
    z = z.reshape(z.shape[0], -1)
    return z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-12)


def global_prototypes(protos: jax.Array, has: jax.Array, reported: jax.Array):
    """((C, D) the class means of the reporting clients' prototypes, (C,) present)."""
    w = has * reported[:, None]
    total = jnp.sum(w, axis=0)
    mean = jnp.einsum("kc,kcd->cd", w, protos) / jnp.maximum(total, 1.0)[:, None]
    return mean, (total > 0).astype(jnp.float32)


def contrastive_loss(r: jax.Array, labels: jax.Array, mask: jax.Array, protos: jax.Array,
                     has: jax.Array, reported: jax.Array, tau: float) -> jax.Array:
    """The sum over real rows of the global term plus the mean over the set S of the
    clients' terms (module docstring); r normalised (B, D). A row's term against a set of
    prototypes lacking its label is left out (and the mean runs over the clients holding
    it): its label is no candidate there."""
    def term(p, present):
        logits = jnp.where(present[None, :] > 0, r @ p.T / tau, NEVER)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.where(present[labels] > 0, ce, 0.0)
    g, g_present = global_prototypes(protos, has, reported)
    per_client = jax.vmap(term)(protos, has)  # (K, B)
    holders = reported[:, None] * has[:, labels]  # (K, B) the set's clients holding y
    n = jnp.maximum(jnp.sum(holders, axis=0), 1.0)
    rows = term(g, g_present) + jnp.sum(holders * per_client, axis=0) / n
    return jnp.sum(rows * mask)


def fedpcl(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
           collect_share: float, *, tau: float = 1.0) -> FederatedAlgorithm:
    """FedPCL for `num_clients` clients of a `model` that sows 'features' and ends in one
    linear head; the last round(collect_share x steps) local steps collect prototypes."""
    if not tau > 0:
        raise ValueError(f"FedPCL needs tau > 0, got {tau}")
    local_lib.check_share(collect_share, "FedPCL's share of local steps collecting "
                                         "prototypes")
    net = _WithFeatures(model)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        d, c = linear_head(params, "FedPCL")["kernel"].shape
        return PclServer(params, model_state, jnp.zeros((num_clients, c, d), jnp.float32),
                         jnp.zeros((num_clients, c), jnp.float32),
                         jnp.zeros((num_clients,), jnp.float32), jnp.zeros((), jnp.int32))

    def client_state_init(server):
        c, d = server.protos.shape[1:]
        return {"variables": {"params": server.params, **server.model_state},
                "protos": jnp.zeros((c, d), jnp.float32),
                "has": jnp.zeros((c,), jnp.float32)}

    def client_init(server, client_state, ctx):
        steps = jnp.asarray(ctx.num_steps, jnp.int32)
        return PclLocal(local_lib.init_local(client_tx, client_state["variables"], ctx.round),
                        steps - local_lib.phase_steps(collect_share, ctx.num_steps),
                        (jnp.sum(client_state["has"]) > 0).astype(jnp.float32),
                        jnp.zeros_like(client_state["protos"]),
                        jnp.zeros_like(client_state["has"]))

    def train_step(local, batch, server):
        def loss(outputs, labels, mask):
            return contrastive_loss(normalised(outputs[1]), labels, mask, server.protos,
                                    server.has, server.reported, tau)
        train, metrics = local_lib.sgd_step(net, client_tx, local.train, batch, loss=loss)
        # A client without prototypes of its own only collects them (PFLlib).
        train = jax.tree_util.tree_map(lambda new, old: jnp.where(local.active > 0, new, old),
                                       train, local.train)._replace(step=train.step)
        metrics = jax.tree_util.tree_map(lambda x: x * local.active, metrics)
        return local._replace(train=train), metrics

    def collect_step(local, batch, server):
        del server
        return collecting_step(net, local, batch, normalised)

    def client_step(local, batch, server):
        return jax.lax.cond(local.train.step < local.collect_from, train_step, collect_step,
                            local, batch, server)

    def client_output(local, server):
        del server
        has = (local.counts > 0).astype(jnp.float32)
        protos = local.sums / jnp.maximum(local.counts, 1.0)[:, None] * has[:, None]
        state = {"variables": {"params": local.train.params, **local.train.model_state},
                 "protos": protos, "has": has}
        return {"protos": protos, "has": has}, state

    def server_update(server, outputs, info):
        ids = info.client_ids
        # A slot of weight 0 holds no report.
        sent = (info.weights > 0).astype(jnp.float32)
        return server._replace(
            protos=server.protos.at[ids].set(outputs["protos"]),
            has=server.has.at[ids].set(outputs["has"] * sent[:, None]),
            reported=jnp.zeros_like(server.reported).at[ids].set(sent),
            round=server.round + 1)

    eval_variables = server_model

    def personal_variables(server, client_state):
        del server
        variables = client_state["variables"]
        params = dict(variables["params"])
        protos, has = client_state["protos"], client_state["has"]
        head = {"kernel": protos.T, "bias": jnp.where(has > 0, 0.0, NEVER)}
        anything = jnp.sum(has) > 0  # before its first report: its own head
        params[HEAD] = jax.tree_util.tree_map(lambda p, own: jnp.where(anything, p, own),
                                              head, params[HEAD])
        return {**variables, "params": params}

    def download_bytes(server, client_ids, round_index):
        del client_ids, round_index
        # The global prototypes and the set's: one (C, D) + (C,) each.
        one = tree_bytes((server.protos[0], server.has[0]))
        return (1 + jnp.sum(server.reported).astype(jnp.int32)) * one

    return FederatedAlgorithm(
        server_init, client_state_init, client_init, client_step, client_output,
        server_update, eval_variables,
        aggregator=every_output,
        personal_variables=personal_variables, download_bytes=download_bytes)


def _collect_share(cfg: Any) -> float:
    return local_lib.share_of_steps(cfg.fedpcl.collect_epochs, cfg.local.epochs,
                                    "fedpcl.collect_epochs", "the prototype pass is")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # no model is averaged
    return fedpcl(model, client_tx, cfg.partition.num_clients, _collect_share(cfg),
                  tau=cfg.fedpcl.tau)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_collect_share,
                       heterogeneous=True)
