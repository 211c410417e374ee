"""FedPCL (Tan et al., NeurIPS 2022, "Federated Learning from Pre-Trained Models: A
Contrastive Learning Approach"): clients learn representations against shared class
prototypes, contrastively.

Every client keeps its own model and reports its local prototypes: the class means of its
normalised representation r = f(x) / ||f(x)|| (f: the head's input). The server keeps the
global prototypes G (the class means of the prototypes the round's clients report, over
those holding the class) and the set S of every client's latest prototypes, each padded
with G where it has none (PFLlib's `prototype_padding`), and sends both to every client.
A client trains its representation on

    L = CE(r . G^T / tau, y) + (1 / K) sum_{s = 1..K} CE(r . P_s^T / tau, y),

P_s client s's padded prototypes, K the number of clients (its own among them), each term
over the classes its prototypes hold (a class missing from a set is no candidate there,
and a row whose label a set lacks adds 0 to that term: PFLlib assumes every class is
present), then reports its new prototypes from one pass over its data with the trained
model. It is scored by its own prototypes padded with the current G: the class j
maximising r . p_j, which is its network with the head replaced by those prototypes.

As PFLlib's clientpcl.py / serverpcl.py: a client that has never reported prototypes
only collects them in its first round (it does not train); G is the mean over the
previous round's reporting clients; S holds all K clients, a client's prototypes kept
until it reports again (stale) and the sum divided by K; a client that has never
reported is padded with G whole, and a class a client lacks with G's prototype of it,
once: an entry padded stays as it was padded until its client reports again (PFLlib pads
only what is still missing); prototypes are not renormalised after averaging; the head
(unused by the loss) is never trained. PFLlib's pass collecting prototypes (eval mode,
no gradient, after training) is the last round(share x steps) local steps here
(`fedpcl.collect_epochs` out of `local.epochs`, 1.0: one pass); its gradient clipping
(norm 10) is the clients' optimiser's (`optimizer.grad_clip`). Each client downloads G
and the K padded prototypes, (1 + K) x (C x D + C) numbers (the presence masks
included), and uploads its prototypes.

Departures from PFLlib, and why:
- PFLlib stacks a set's prototypes in its dict's order (the order the classes first
  appear in a shuffled loader), so column j of its similarities is class j only by
  chance; here column j is class j, as the paper's loss has it.
- A client's own padded prototypes (what PFLlib scores it with) are padded here with the
  current G when it is scored; PFLlib pads them once, with G of the round it reported.
  The two coincide for a client that reported in the last round (every client under
  full participation).
- PFLlib's backbones are frozen pre-trained networks with a trained projection; here
  the whole network trains from its initialisation. Outputs are (C, D) prototypes
  whatever the network, so clients may run several of one representation width
  (`model.architectures`).
- A client that has never reported is scored by its own (initial) head; PFLlib leaves it
  out of the aggregate (it counts 0 of 1e-5 examples).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, sends, set_rows)
from fedjax_pan.algorithms.personal.fedproto import (NEVER, class_means, swap_head,
                                            train_then_collect)
from fedjax_pan.algorithms.personal import linear_head
from fedjax_pan.rules import between, check_options
from fedjax_pan.references import Reference, pfllib

PyTree = Any
OPTIONS = {"tau": 1.0, "collect_epochs": 1.0}
RULES = {"tau": between(0.01, 100), "collect_epochs": between(0, 1000, lo_open=True)}


REFERENCE = Reference(
    "Tan et al., 'Federated Learning from Pre-Trained Models: A Contrastive Learning "
    "Approach', NeurIPS 2022 (FedPCL: global and personalised prototype contrast)",
    pfllib("servers/serverpcl.py", "clients/clientpcl.py"),
    ("prototype column j is class j, as the paper's loss has it (PFLlib stacks them in the "
     "order classes first appear in a shuffled loader)",
     "own-prototype padding at scoring uses the current global prototypes, not those of "
     "the round the client reported (equal under full participation)",
     "the whole network trains from initialisation: no pre-trained frozen backbone here",
     "a class missing from a prototype set is masked out (PFLlib's torch.stack fails on it)",
     "a never-reported client is scored by its own initial head (PFLlib counts it as 0 "
     "correct)"))


class PclServer(NamedTuple):
    params: PyTree  # this network's initial model (the global evaluation's)
    model_state: PyTree
    protos: jax.Array  # (K, C, D) the set S: each client's latest prototypes, padded
    present: jax.Array  # (K, C) 1.0 where S's entry holds a prototype
    global_protos: jax.Array  # (C, D) G: the last round's reporters' class means
    global_present: jax.Array  # (C,) 1.0 where some reporter held the class
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


def global_prototypes(protos: jax.Array, has: jax.Array):
    """((C, D) the class means of prototypes (N, C, D) over the clients holding each
    class (`has` (N, C), 0 for a slot without a report), (C,) present)."""
    total = jnp.sum(has, axis=0)
    mean = jnp.einsum("kc,kcd->cd", has, protos) / jnp.maximum(total, 1.0)[:, None]
    return mean, (total > 0).astype(jnp.float32)


def pad_with_global(protos: jax.Array, present: jax.Array, g: jax.Array,
                    g_present: jax.Array):
    """PFLlib's `prototype_padding`: every entry of the set (K, C, D) still without a
    prototype takes G's (where G has one); entries that hold one keep it."""
    fill = (present == 0) & (g_present[None, :] > 0)
    return (jnp.where(fill[..., None], g[None], protos),
            jnp.maximum(present, g_present[None, :]))


def contrastive_loss(r: jax.Array, labels: jax.Array, mask: jax.Array, g: jax.Array,
                     g_present: jax.Array, protos: jax.Array, present: jax.Array,
                     tau: float) -> jax.Array:
    """The sum over real rows of the term against G plus the terms against each of the K
    entries of the set S over K (module docstring); r normalised (B, D). A class missing
    from a set is no candidate there, and a row whose label it lacks adds 0 to its term."""
    def term(p, there):
        logits = jnp.where(there[None, :] > 0, r @ p.T / tau, NEVER)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.where(there[labels] > 0, ce, 0.0)
    per_client = jax.vmap(term)(protos, present)  # (K, B)
    rows = term(g, g_present) + jnp.sum(per_client, axis=0) / protos.shape[0]
    return jnp.sum(rows * mask)


def fedpcl(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
           collect_share: float, *, tau: float = 1.0) -> FederatedAlgorithm:
    """FedPCL for `num_clients` clients of a `model` that sows 'features' and ends in one
    linear head; the last round(collect_share x steps) local steps collect prototypes."""
    check_options(RULES, "fedpcl", tau=tau)
    local_lib.check_share(collect_share, "FedPCL's share of local steps collecting "
                                         "prototypes")
    net = local_lib.WithFeatures(model)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        d, c = linear_head(params, "FedPCL")["kernel"].shape
        return PclServer(params, model_state, jnp.zeros((num_clients, c, d), jnp.float32),
                         jnp.zeros((num_clients, c), jnp.float32),
                         jnp.zeros((c, d), jnp.float32), jnp.zeros((c,), jnp.float32),
                         jnp.zeros((), jnp.int32))

    def client_state_init(server):
        c, d = server.global_protos.shape
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
            return contrastive_loss(normalised(outputs[1]), labels, mask,
                                    server.global_protos, server.global_present,
                                    server.protos, server.present, tau)
        train, metrics = local_lib.sgd_step(net, client_tx, local.train, batch, loss=loss)
        # A client without prototypes of its own only collects them (PFLlib).
        train = jax.tree_util.tree_map(lambda new, old: jnp.where(local.active > 0, new, old),
                                       train, local.train)._replace(step=train.step)
        metrics = jax.tree_util.tree_map(lambda x: x * local.active, metrics)
        return local._replace(train=train), metrics

    client_step = train_then_collect(train_step, net, normalised)

    def client_output(local, server):
        del server
        protos, has = class_means(local.sums, local.counts)
        state = {"variables": local_lib.model_variables(local.train), "protos": protos,
                 "has": has}
        return {"protos": protos, "has": has}, state

    def server_update(server, outputs, info):
        ids = info.client_ids
        # A slot of weight 0 holds no report: its client's entry stays as it was.
        sent = info.weights > 0
        has = outputs["has"] * sent[:, None]
        g, g_present = global_prototypes(outputs["protos"], has)
        protos, present = set_rows((server.protos, server.present), ids,
                                   (outputs["protos"], has), sent)
        protos, present = pad_with_global(protos, present, g, g_present)
        return server._replace(protos=protos, present=present, global_protos=g,
                               global_present=g_present, round=server.round + 1)

    def personal_variables(server, client_state):
        has = client_state["has"]
        # Its own prototypes, padded with G (PFLlib scores the padded set).
        protos, present = pad_with_global(client_state["protos"][None], has[None],
                                          server.global_protos, server.global_present)
        protos, present = protos[0], present[0]
        head = {"kernel": protos.T, "bias": jnp.where(present > 0, 0.0, NEVER)}
        # Before its first report: its own head.
        return swap_head(client_state["variables"], head, jnp.sum(has) > 0)

    # G and the whole padded set S (K entries), each (C, D) + its (C,) mask.
    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               aggregator=every_output, personal_variables=personal_variables,
                               download_bytes=sends("global_protos", "global_present",
                                                    "protos", "present"))


_collect_share = local_lib.epochs_share("fedpcl", "collect_epochs", "the prototype pass is")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # no model is averaged
    return fedpcl(model, client_tx, cfg.partition.num_clients, _collect_share(cfg),
                  tau=cfg.fedpcl.tau)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_collect_share,
                       heterogeneous=True, reference=REFERENCE)
