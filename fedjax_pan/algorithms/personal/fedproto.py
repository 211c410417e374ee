"""FedProto (Tan et al., AAAI 2022): clients share class prototypes, not models.

Every client keeps its own model; the server keeps one prototype per class, the mean
over clients of their class means of the representation f(x) (the input of the head):

    C_j = (1 / |N_j|) sum_{i in N_j} c_j^i,   c_j^i = mean_{(x, y) in D_i, y = j} f_i(x),

N_j the clients that hold class j. A client trains on

    CE(w) + lam * MSE(f_w(x), C_y)

(the mean over the batch's real rows and the D features, PFLlib's `nn.MSELoss`; rows of a
class without a global prototype contribute 0, as PFLlib's `proto_new[i] = rep[i]`), then
reports its class means. As PFLlib's serverproto.py, the global prototypes are those the
round's clients report (a class nobody reports drops out), averaged over the clients that
hold the class (weighted by `aggregation.weights`: 'uniform' is PFLlib's plain mean over
them, 'num_examples' weights them by their sizes). As PFLlib's clientproto.py, the class
means are collected while the client trains: f(x) of the training forward pass (train
mode, the parameters before that batch's step), over every batch of every local epoch of
the round, a mean over all of them (an example seen in E epochs counts E times), with no
separate pass. A client is scored by its nearest global prototype (PFLlib's test:
argmin_j MSE(f(x), C_j)), which is the client's network with its head replaced by kernel
2 C^T and bias -||C_j||^2 (classes without a prototype never chosen); before any
prototype exists, by its own head.

Outputs depend only on the classes and the representation's width, so clients may run
networks of several architectures (`model.architectures`, `engine.groups.Groups`) whose
representations are equally wide. The global evaluation shows this network's initial
model; each client downloads the prototypes.

Departures from PFLlib: its training loader drops each epoch's last partial batch
(`drop_last=True`), whose examples then neither train nor count in the class means; here
every example does (the engine's batches are masked, never dropped).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, sends, server_model,
                                        weighted_sum)
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.rules import between, check_options
from fedjax_pan.references import Reference, pfllib

PyTree = Any
OPTIONS = {"lam": 1.0}
RULES = {"lam": between(0, 1e4)}
NEVER = -1e9  # a prototype-less class's logit: never the nearest
SUMS, COUNTS = "class_sums", "class_counts"  # carried out of a step, not logged


REFERENCE = Reference(
    "Tan et al., 'FedProto: Federated Prototype Learning across Heterogeneous Clients', "
    "AAAI 2022 (Alg. 1, Eq. 4-8)", pfllib("servers/serverproto.py", "clients/clientproto.py"),
    ("the last partial batch of an epoch is masked, not dropped (PFLlib's drop_last=True): "
     "every example trains and counts in its class mean",
     "prototypes are averaged by `aggregation.weights`: uniform (the default) is PFLlib's "
     "plain mean, num_examples is the paper's |D_i|-weighted one"))


class ProtoServer(NamedTuple):
    params: PyTree  # this network's initial model (the global evaluation's)
    model_state: PyTree
    protos: jax.Array  # (C, D) global prototypes
    present: jax.Array  # (C,) 1.0 where some client reported the class last round
    round: jax.Array


class ProtoLocal(NamedTuple):
    """A client's round that collects class sums: FedProto's of f(x), FD's of the logits."""

    train: local_lib.LocalState
    sums: jax.Array  # (C, D) sums by class over the round's training batches
    counts: jax.Array  # (C,)


def proto_loss(features: jax.Array, labels: jax.Array, mask: jax.Array, protos: jax.Array,
               present: jax.Array) -> jax.Array:
    """MSE(f(x), C_y) over the real rows and the features; 0 where y has no prototype."""
    target = protos[labels]
    use = mask * present[labels]
    diff = jnp.where(use[:, None] > 0, features - target, 0.0)
    rows = jnp.maximum(jnp.sum(mask), 1.0)
    return jnp.sum(diff * diff) / (rows * features.shape[-1])


def class_sums(features: jax.Array, labels: jax.Array, mask: jax.Array, num_classes: int):
    """((C, D) sums of the real rows' features by class, (C,) their counts)."""
    onehot = jax.nn.one_hot(labels, num_classes, dtype=features.dtype) * mask[:, None]
    return onehot.T @ features, jnp.sum(onehot, axis=0)


def class_means(sums: jax.Array, counts: jax.Array):
    """((C, D) the class means of collected `sums` and `counts`, 0 for a class without
    rows; (C,) 1.0 where it has rows): what a client reports."""
    has = (counts > 0).astype(jnp.float32)
    return sums / jnp.maximum(counts, 1.0)[:, None] * has[:, None], has


def reported_means(sums: jax.Array, has: jax.Array):
    """((C, D) each class's mean over the clients that report it, 0 for a class nobody
    reports; (C,) 1.0 where somebody does) from the weighted sums of the reports
    (`class_means`) and of their `has`."""
    present = (has > 0).astype(jnp.float32)
    return sums / jnp.maximum(has, 1e-12)[:, None] * present[:, None], present


def collecting_sgd_step(net: Any, tx: optax.GradientTransformation, local: Any, batch: Any,
                        extra_loss: local_lib.ExtraLoss, collected: Callable[[Any], jax.Array],
                        loss: local_lib.LossSum = local_lib.masked_cross_entropy) -> tuple:
    """`local_lib.sgd_step` of `local.train` with `extra_loss`, whose `local.sums` and
    `counts` take the class sums of `collected(outputs)`, the step's training-mode outputs
    (the parameters before the step; no gradient), carried out of the gradient pass beside
    its metrics."""
    def collecting(params, train, batch, outputs):
        term, metrics = extra_loss(params, train, batch, outputs)
        z = jax.lax.stop_gradient(collected(outputs)).astype(jnp.float32)
        sums, counts = class_sums(z, batch["y"], batch["mask"], local.sums.shape[0])
        return term, {**metrics, SUMS: sums, COUNTS: counts}
    train, metrics = local_lib.sgd_step(net, tx, local.train, batch, extra_loss=collecting,
                                        loss=loss)
    sums, counts = metrics.pop(SUMS), metrics.pop(COUNTS)
    return (local._replace(train=train, sums=local.sums + sums, counts=local.counts + counts),
            metrics)


def collecting_step(net: Any, local: Any, batch: Any, transform: Any = None,
                    metrics: Any = ("loss_sum", "num_examples")) -> tuple:
    """A step of a pass collecting class means (FedGH, FedPCL): `local`'s
    `sums` and `counts` take the batch's features under its model (through `transform`),
    nothing trains, its step is counted; the step's `metrics` are 0 (the pass adds no
    training loss)."""
    (_, z), _ = local_lib.forward(net, local.train.params, local.train.model_state, batch,
                                  train=False)
    z = z.reshape(z.shape[0], -1)
    z = (z if transform is None else transform(z)).astype(jnp.float32)
    sums, counts = class_sums(z, batch["y"], batch["mask"], local.sums.shape[0])
    zero = jnp.zeros((), jnp.float32)
    return (local._replace(sums=local.sums + sums, counts=local.counts + counts,
                           train=local.train._replace(step=local.train.step + 1)),
            {name: zero for name in metrics})


def train_then_collect(train_step: Callable, net: Any, transform: Any = None) -> Callable:
    """`client_step` of a round whose steps before `local.collect_from` are `train_step`'s
    and the rest a pass collecting class means (`collecting_step`, through `transform`)."""
    def collect_step(local, batch, server):
        del server
        return collecting_step(net, local, batch, transform)

    def client_step(local, batch, server):
        return jax.lax.cond(local.train.step < local.collect_from, train_step, collect_step,
                            local, batch, server)
    return client_step


def nearest_prototype_head(protos: jax.Array, present: jax.Array) -> dict:
    """The head whose argmax is the nearest prototype: logits 2 f.C_j - ||C_j||^2 (the
    squared distance less ||f||^2, equal for every class)."""
    bias = jnp.where(present > 0, -jnp.sum(protos * protos, axis=1), NEVER)
    return {"kernel": 2.0 * protos.T, "bias": bias}


def swap_head(variables: dict, head: dict, use: jax.Array) -> dict:
    """`variables` with the linear head `head` in place of their own where `use` (a scalar
    bool: a client scored by prototypes once it has some, by its own head before)."""
    params = dict(variables["params"])
    params[HEAD] = jax.tree_util.tree_map(lambda p, own: jnp.where(use, p, own), head,
                                          params[HEAD])
    return {**variables, "params": params}


def fedproto(model: nn.Module, client_tx: optax.GradientTransformation, *,
             lam: float = 1.0) -> FederatedAlgorithm:
    """FedProto for a `model` that sows its 'features' and ends in one linear head; its
    training steps collect the class means."""
    check_options(RULES, "fedproto", lam=lam)
    net = local_lib.WithFeatures(model)

    def ce(outputs, labels, mask):
        return local_lib.masked_cross_entropy(outputs[0], labels, mask)

    def features(outputs):
        return outputs[1].reshape(outputs[1].shape[0], -1)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        d, c = linear_head(params, "FedProto")["kernel"].shape
        return ProtoServer(params, model_state, jnp.zeros((c, d), jnp.float32),
                           jnp.zeros((c,), jnp.float32), jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        return ProtoLocal(local_lib.init_local(client_tx, client_state, ctx.round),
                          jnp.zeros_like(server.protos), jnp.zeros_like(server.present))

    def client_step(local, batch, server):
        def regulariser(params, train, batch, outputs):
            del params, train
            term = proto_loss(features(outputs), batch["y"], batch["mask"], server.protos,
                              server.present)
            return lam * term, {"proto_sum": term * jnp.sum(batch["mask"])}
        # The batch's features by class, as PFLlib's clientproto.py records them in its
        # training loop.
        return collecting_sgd_step(net, client_tx, local, batch, regulariser, features, ce)

    def client_output(local, server):
        del server
        protos, has = class_means(local.sums, local.counts)
        return {"protos": protos, "has": has}, local_lib.model_variables(local.train)

    def server_update(server, sums, info):
        del info
        protos, present = reported_means(sums["protos"], sums["has"])
        return server._replace(protos=protos, present=present, round=server.round + 1)

    def personal_variables(server, client_state):
        return swap_head(client_state, nearest_prototype_head(server.protos, server.present),
                         jnp.any(server.present > 0))

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               aggregator=weighted_sum, personal_variables=personal_variables,
                               download_bytes=sends("protos", "present"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # no model is averaged
    return fedproto(model, client_tx, lam=cfg.fedproto.lam)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, heterogeneous=True,
                       reference=REFERENCE)
