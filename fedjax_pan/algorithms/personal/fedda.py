"""FedDA: PFL-DA (Shi & Kontar, Technometrics 2023, "Personalized Federated Learning via
Domain Adaptation with an Application to Distributed 3D Printing"), as PFLlib implements
it (clientda.py / serverda.py).

Each client keeps its whole model (feature extractor f_i and head h_i: never sent); the
server keeps only a global head g, the weighted mean of the clients' copies. Client i's
round, from the received g:

  1. its head alone (f_i frozen):  CE(h_i(f_i(x)), y) + lam ||h_i - g||_2
     (the L2 norm, not squared, over the head's kernel and bias together);
  2. its extractor with the global head (h_i frozen):  CE(g'(f_i(x)), y), training f_i
     and its copy g' of the global head, which it sends back (deltas through
     `server_tx`: sgd(1) is the mean).

The extractor thus adapts to the shared head (the domain-adaptation step: a
representation on which one classifier serves every client) while the personal head
stays near it. A client is scored with its own (f_i, h_i).

Choices as PFLlib: lam = 1 (its `-lam` default); both heads start as the initial head;
every client starts from the initial model. As PFLlib trains E epochs of each phase, the
first `head_fraction` (0.5) of the round's local steps are phase 1 and the rest phase 2:
`local.epochs` = 2E gives PFLlib's E + E (experiments/personalized.py sets it).
Deviations: PFLlib builds the penalty from `.data` (detached) tensors, so in PFLlib it
has no gradient and phase 1 is plain CE (that is lam = 0 here); here it has its gradient
(h_i - g) / ||h_i - g|| (0 where h_i = g, e.g. a client's first round), which is what the
term is for. Frozen parts do not move (their updates are masked out); one optimiser
(`client_tx`) serves all three parts (PFLlib: a second SGD for g at the same rate). The
global evaluation shows the initial extractor with the global head (there is no global
extractor).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, own_model, sends, server_model)
from fedjax_pan.algorithms.fedavg_family.fedavg import server_step
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.rules import between, check_options
from fedjax_pan.references import Reference, pfllib

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"lam": 1.0, "head_fraction": 0.5}
RULES = {"lam": between(0, 1e4), "head_fraction": between(0, 1, lo_open=True, hi_open=True)}


REFERENCE = Reference(
    "Shi & Kontar, 'Personalized Federated Learning via Domain Adaptation with an "
    "Application to Distributed 3D Printing', Technometrics 2023 (FedDA)",
    pfllib("servers/serverda.py", "clients/clientda.py"),
    ("the head penalty's gradient is taken; PFLlib builds it from `.data`, so it has none "
     "(lam = 0 reproduces PFLlib's training)",
     "one client optimiser serves both heads and the extractor (PFLlib: a second SGD for "
     "the global head)",
     "the head average follows `aggregation.weights` (PFLlib: by training-set size)"))


class DaServer(NamedTuple):
    params: PyTree  # the initial model, its head slot holding the global head g
    model_state: PyTree
    opt_state: PyTree
    round: jax.Array


class DaLocal(NamedTuple):
    train: local_lib.LocalState  # params {"model": (f_i, h_i), "ghead": g'}
    head_steps: jax.Array


def head_distance(head: PyTree, anchor: PyTree) -> jax.Array:
    """||head - anchor||_2 over all its leaves, with gradient 0 where they are equal."""
    s = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree_util.tree_leaves(head),
                                                  jax.tree_util.tree_leaves(anchor)))
    safe = jnp.where(s > 0, s, 1.0)
    return jnp.where(s > 0, jnp.sqrt(safe), 0.0)


def fedda(model: nn.Module, client_tx: optax.GradientTransformation,
          server_tx: optax.GradientTransformation = optax.sgd(1.0), *, lam: float = 1.0,
          head_fraction: float = 0.5) -> FederatedAlgorithm:
    """PFL-DA for a flax `model` that sows 'features' under a linear `head`."""
    check_options(RULES, "fedda", lam=lam, head_fraction=head_fraction)
    net = local_lib.WithFeatures(model)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        linear_head(params, "FedDA")
        return DaServer(params, model_state, server_tx.init(params[HEAD]),
                        jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        params, model_state = local_lib.split_variables(client_state)
        trained = {"model": params, "ghead": server.params[HEAD]}
        train = local_lib.init_local(client_tx, {"params": trained, **model_state},
                                     server.round)
        return DaLocal(train, local_lib.phase_steps(head_fraction, ctx.num_steps))

    def client_step(local, batch, server):
        train, mask = local.train, batch["mask"]
        n = jnp.maximum(jnp.sum(mask), 1.0)
        in_head = train.step < local.head_steps
        g = server.params[HEAD]

        def loss_fn(params):
            (logits, f), new_state = local_lib.forward(net, params["model"], train.model_state,
                                                       batch, train=True)
            f = f.reshape(f.shape[0], -1)
            gh = params["ghead"]
            shared_logits = f @ gh["kernel"] + gh["bias"]
            ce_own = local_lib.masked_cross_entropy(logits, batch["y"], mask)
            ce_shared = local_lib.masked_cross_entropy(shared_logits, batch["y"], mask)
            dist = head_distance(params["model"][HEAD], g)
            objective = jnp.where(in_head, ce_own / n + lam * dist, ce_shared / n)
            return objective, (jnp.where(in_head, ce_own, ce_shared), new_state, dist)

        grads, (ce_sum, new_state, dist) = jax.grad(loss_fn, has_aux=True)(train.params)
        updates, opt_state = client_tx.update(grads, train.opt_state, train.params)
        # Phase 1 moves the personal head only; phase 2 the extractor and g'.
        moves = {"model": {k: jnp.where(k == HEAD, in_head, ~in_head)
                           for k in train.params["model"]}, "ghead": ~in_head}
        updates = {"model": {k: tree_map(lambda u: jnp.where(moves["model"][k], u, 0.0), u_k)
                             for k, u_k in updates["model"].items()},
                   "ghead": tree_map(lambda u: jnp.where(moves["ghead"], u, 0.0),
                                     updates["ghead"])}
        params = optax.apply_updates(train.params, updates)
        # Phase 2 keeps the model's statistics (BatchNorm) from its own forward pass too.
        train = local_lib.LocalState(params, new_state, opt_state, train.step + 1)
        real = jnp.sum(mask)
        return local._replace(train=train), {
            "loss_sum": ce_sum, "num_examples": real,
            "head_distance_sum": jnp.where(in_head, dist, 0.0) * real}

    def client_output(local, server):
        p = local.train.params
        delta = tree_map(jnp.subtract, p["ghead"], server.params[HEAD])
        return {"delta": delta}, {"params": p["model"], **local.train.model_state}

    def server_update(server, mean_output, info):
        del info
        head, opt_state = server_step(server_tx, server.params[HEAD], server.opt_state,
                                      mean_output["delta"])
        return DaServer({**server.params, HEAD: head}, server.model_state, opt_state,
                        server.round + 1)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               personal_variables=own_model,
                               download_bytes=sends(lambda server: server.params[HEAD]))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedda(model, client_tx, server_tx, lam=cfg.fedda.lam,
                 head_fraction=cfg.fedda.head_fraction)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
