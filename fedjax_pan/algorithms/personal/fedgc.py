"""FedGC (Niu and Deng, AAAI 2022, "Federated Learning for Face Recognition with Gradient
Correction"): a shared body, private class embeddings per client, and a server-side
softmax regulariser that supplies the cross-client gradient local training lacks.

Client k holds the classes C_k it has examples of and a private head: one class embedding
W_{k,j} (a column of the head's kernel) per class j in C_k. In a round it receives the
global body and its head, trains both on the softmax over its own classes only,

    local loss = -log( exp(W_{k,y} . h(x)) / sum_{j in C_k} exp(W_{k,j} . h(x)) ),

and sends the body's change and its head. The server averages the bodies (FedAvg), stores
the heads, and takes one gradient step of rate lam * lr on every stored head against

    Reg(W) = sum_k sum_{c in C_k} -log( exp(e_c . e_c) /
                 (exp(e_c . e_c) + sum_{k': c not in C_k'} sum_{j in C_k'} exp(W_{k',j} . e_c)) )

with e_c the class's embedding, held fixed (PFLlib differentiates a detached copy): it
pushes other clients' embeddings away from class c, the negative term the clients'
softmaxes miss (the paper's gradient correction; in its face-recognition setting every
identity belongs to one client, so e_c is W_{k,c} itself).

As PFLlib's clientgc.py / servergc.py: classes shared by several clients (label skew) get
e_c = the mean of their embeddings, and the term of class c counts once per client holding
it; the regulariser is summed, not averaged; the server's step is plain SGD at
lr * lam (`--lamda`, 1.0); the head has no bias: here the model's head bias stays at its
initial value (0 in fedjax_pan's models) and is never trained. A client is scored on its
own test data with the global body and its own head over its own classes (PFLlib's head
has outputs for them alone): the others get bias UNHELD_BIAS, never predicted.

Deviations: PFLlib's server knows every client's classes from the start and regularises
every head from round 0; here a client reports its classes with its first output, so its
head joins the regulariser once it has trained (before that it is the initial head, which
PFLlib would already be pushing). Every client starts from the global model's initial head
(PFLlib initialises each client's head separately). The global model (`eval_variables`,
which PFLlib does not score) is the averaged body with each class's embedding e_c (the
initial one where no client has reported the class).

State and messages: the server holds every client's head (K, F, C) and reported classes
(K, C); a client's own state is its id (-1 until it first trains), which its personal
model is looked up by. A client downloads the body, the model state and its held
classes' embeddings, and uploads the body's change, the model state and those embeddings
(its class list, C bits, is not counted). BatchNorm statistics are averaged with the body
(FedAvg's bn='mean'; 'local' is refused). The aggregator is stacked (the server needs
each client's head), so model-space defences, attacks and stragglers do not apply.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms import personal
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, per_client, set_rows,
                                        tree_bytes)
from fedjax_pan.algorithms.fedavg_family.fedavg import ServerState, initial_server
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"lam": 1.0}
RULES = {"lam": between(0, 1e4)}
KERNEL, BIAS = f"{personal.HEAD}/kernel", f"{personal.HEAD}/bias"
UNHELD_BIAS = -1e4  # a class a client holds no example of: never its prediction


REFERENCE = Reference(
    "Niu and Deng, 'Federated Learning for Face Recognition with Gradient Correction', "
    "AAAI 2022 (FedGC: local softmax over the client's own classes, and the server's "
    "softmax regulariser on the class embeddings, the gradient correction)",
    pfllib("servers/servergc.py", "clients/clientgc.py"),
    ("a client reports its classes with its first output, so its head joins the "
     "regulariser once it has trained; PFLlib's server knows every client's classes from "
     "the start and regularises every head from round 0",
     "every client starts from the global model's initial head (PFLlib initialises each "
     "client's head separately)",
     "BatchNorm statistics are averaged with the body (FedAvg's bn='mean'); PFLlib "
     "averages the body's parameters only and its clients keep their own statistics",
     "a client's test example of a class it holds no example of is scored wrong (that "
     "class is never predicted); PFLlib maps its label to the client's first held class",
     "the global model (eval_variables: the averaged body with each class's mean "
     "embedding) is evaluated here; PFLlib does not score one",
     "the aggregator is stacked (the server needs each client's head): model-space "
     "defences, attacks and stragglers do not apply"))


class GCServer(NamedTuple):
    base: ServerState  # the body (FedAvg); its head slot keeps the initial head
    heads: jax.Array  # (K, F, C) every client's class embeddings, as last trained
    held: jax.Array  # (K, C) bool: the classes each client reported (none: not yet)


class GCLocal(NamedTuple):
    train: local_lib.LocalState  # params: every parameter but the head's bias (flat)
    present: jax.Array  # (C,) bool: the classes its softmax runs over
    held: jax.Array  # (C,) bool: the classes it holds
    client_id: jax.Array


def _is_bias(path) -> bool:
    return "/".join(path) == BIAS


def held_softmax_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                               present: jax.Array) -> jax.Array:
    """Sum over real examples of the cross-entropy over the `present` classes."""
    z = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(z, axis=-1, where=jnp.broadcast_to(present, z.shape))
    ce = log_norm - jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(mask > 0, ce, 0.0))


def class_embeddings(heads: jax.Array, held: jax.Array) -> jax.Array:
    """(F, C) e_c: the mean of the embeddings of class c over the clients holding it
    (0 where none does)."""
    h = held.astype(heads.dtype)
    n = jnp.sum(h, axis=0)
    return jnp.einsum("kfc,kc->fc", heads, h) / jnp.maximum(n, 1.0)


def regulariser(heads: jax.Array, held: jax.Array) -> jax.Array:
    """PFLlib's Reg over the (K, F, C) heads of clients holding (K, C) classes; e_c
    is a constant."""
    e = jax.lax.stop_gradient(class_embeddings(heads, held))
    k, _, c = heads.shape
    n = jnp.sum(held, axis=0).astype(jnp.float32)
    ee = jnp.sum(e * e, axis=0)  # (C,)
    scores = jnp.einsum("kfj,fc->kjc", heads, e).reshape(k * c, c)  # W_{k,j} . e_c
    # Negatives of class c: the embeddings W_{k,j} of every client k not holding c.
    negative = (held[:, :, None] & ~held[:, None, :]).reshape(k * c, c)
    log_denominator = jax.nn.logsumexp(
        jnp.concatenate([ee[None], scores]), axis=0,
        where=jnp.concatenate([jnp.ones((1, c), bool), negative]))
    return jnp.sum(n * (log_denominator - ee))


def fedgc(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
          server_lr: float, server_tx: optax.GradientTransformation = optax.sgd(1.0)
          ) -> FederatedAlgorithm:
    """FedGC for `num_clients` clients of a flax `model` whose output layer `head` is a
    Dense (kernel (F, C)); `server_lr` is the regulariser's step (lam x the clients' lr);
    `server_tx` moves the body as FedAvg's."""
    if not 0.0 <= server_lr <= 1e4:
        raise ValueError(f"FedGC's server learning rate (lam x lr) must lie in [0, 1e4], "
                         f"got {server_lr}")

    def server_init(variables):
        flat = personal.split_params(variables["params"], lambda p: False)[0]
        if KERNEL not in flat or flat[KERNEL].ndim != 2:
            raise ValueError(f"FedGC needs a model whose output layer {personal.HEAD!r} is "
                             f"a dense layer with a (features, classes) kernel")
        kernel = flat[KERNEL]
        return GCServer(initial_server(server_tx, variables), per_client(kernel, num_clients),
                        jnp.zeros((num_clients, kernel.shape[1]), bool))

    def client_state_init(server):
        del server
        return {"id": jnp.asarray(-1, jnp.int32)}  # -1: never trained

    def _params(server, kernel):
        flat = personal.split_params(server.base.params, lambda p: False)[0]
        return {**flat, KERNEL: kernel}

    def client_init(server, client_state, ctx):
        del client_state
        flat = _params(server, server.heads[ctx.client_id])
        trainable = {k: v for k, v in flat.items() if k != BIAS}
        held = jnp.asarray(ctx.label_counts) > 0
        local = local_lib.init_local(client_tx, {"params": trainable,
                                                 **server.base.model_state}, server.base.round)
        # A client without examples trains on nothing: the softmax over every class
        # keeps its (masked) loss finite.
        return GCLocal(local, held | ~jnp.any(held), held,
                       jnp.asarray(ctx.client_id, jnp.int32))

    def client_step(local, batch, server):
        bias = personal.split_params(server.base.params, _is_bias)[1]

        def loss(logits, labels, mask):
            return held_softmax_cross_entropy(logits, labels, mask, local.present)
        train, metrics = local_lib.sgd_step(
            model, client_tx, local.train, batch, loss=loss,
            full_params=lambda t: personal.join_params(t, bias))
        return local._replace(train=train), metrics

    def client_output(local, server):
        old = personal.split_params(server.base.params, lambda p: False)[0]
        delta = {k: v - old[k] for k, v in local.train.params.items() if k != KERNEL}
        output = {"delta": delta, "model_state": local.train.model_state,
                  "kernel": local.train.params[KERNEL], "held": local.held}
        return output, {"id": local.client_id}

    def server_update(server, outputs, info):
        w = info.weights
        mean = tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1),
                        {"delta": outputs["delta"], "model_state": outputs["model_state"]})
        base = server.base
        flat = personal.split_params(base.params, lambda p: False)[0]
        grad = personal.join_params(
            {k: -mean["delta"][k] if k in mean["delta"] else jnp.zeros_like(v)
             for k, v in flat.items()}, {})
        updates, opt_state = server_tx.update(grad, base.opt_state, base.params)
        moved = personal.split_params(optax.apply_updates(base.params, updates),
                                      lambda p: p[0] == personal.HEAD)[0]
        # The head slot keeps the initial head whatever the server optimiser does.
        head = personal.split_params(base.params, lambda p: p[0] == personal.HEAD)[1]
        base = ServerState(personal.join_params(moved, head), mean["model_state"], opt_state,
                           base.round + 1)
        ids = info.client_ids
        arrived = w > 0  # a slot without an output changes nothing
        heads, held = set_rows((server.heads, server.held), ids,
                               (outputs["kernel"], outputs["held"]), arrived)
        heads = heads - server_lr * jax.grad(regulariser)(heads, held)
        return GCServer(base, heads, held)

    def eval_variables(server):
        flat = personal.split_params(server.base.params, lambda p: False)[0]
        known = jnp.any(server.held, axis=0)
        kernel = jnp.where(known, class_embeddings(server.heads, server.held), flat[KERNEL])
        return {"params": personal.join_params({**flat, KERNEL: kernel}, {}),
                **server.base.model_state}

    def personal_variables(server, client_state):
        # A client that never trained has the initial head (its row of `heads`, which
        # the regulariser leaves alone until it reports its classes) over every class.
        k = client_state["id"]
        i = jnp.maximum(k, 0)
        flat = personal.split_params(server.base.params, lambda p: False)[0]
        held = server.held[i] & (k >= 0)
        kernel = jnp.where(k >= 0, server.heads[i], flat[KERNEL])
        bias = jnp.where(jnp.any(held) & ~held, UNHELD_BIAS, flat[BIAS]).astype(flat[BIAS].dtype)
        return {"params": personal.join_params({**flat, KERNEL: kernel, BIAS: bias}, {}),
                **server.base.model_state}

    def upload_bytes(output, local):
        del local
        kernel = output["kernel"]
        held_columns = kernel.shape[0] * jnp.sum(output["held"]) * kernel.dtype.itemsize
        return tree_bytes((output["delta"], output["model_state"])) + held_columns

    def download_bytes(server, client_ids, round_index):
        del round_index
        flat = personal.split_params(server.base.params, lambda p: p[0] == personal.HEAD)[0]
        body = tree_bytes((flat, server.base.model_state))
        f = server.heads.shape[1]
        n = jnp.sum(server.held[client_ids], axis=1)
        return (body + f * n * server.heads.dtype.itemsize).astype(jnp.int32)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               eval_variables=eval_variables, aggregator=every_output,
                               upload_bytes=upload_bytes, personal_variables=personal_variables,
                               download_bytes=download_bytes)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    lam = cfg.fedgc.lam
    check_options(RULES, "fedgc", lam=lam)
    if cfg.aggregation.bn != "mean":
        raise ValueError(f"FedGC averages BatchNorm statistics (aggregation.bn='mean'), got "
                         f"aggregation.bn={cfg.aggregation.bn!r}")
    return fedgc(model, client_tx, cfg.partition.num_clients,
                 lam * cfg.optimizer.lr, server_tx)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)

__all__ = ["fedgc", "regulariser", "class_embeddings", "held_softmax_cross_entropy",
           "ENTRY", "OPTIONS", "RULES"]
