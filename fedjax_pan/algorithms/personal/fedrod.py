"""FedRoD (Chen & Chao, ICLR 2022): one model, two heads.

The shared model (body and generic head) is trained with the balanced softmax loss,
cross-entropy of logits + log n_c (n_c the client's count of class c), so that what is
averaged is a class-balanced generic model. On the same forward pass a personal head
h_p (a linear layer on the body's features, kept by the client) is trained on
cross-entropy of the detached generic logits plus its own: g(x) + h_p(f(x)), f(x)
detached. A client's personal model is g + h_p; both heads being linear on the same
features, that is the model with head (W_g + W_p, b_g + b_p), so it evaluates as the
architecture itself. The personal head starts as a copy of the initial global head
(PFLlib's). The loss reported is the balanced softmax one.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.references import Reference, pfllib

PyTree = Any
NO_CLASS = -1e9  # log n_c of a class the client lacks: its logit never wins


REFERENCE = Reference(
    "Chen & Chao, 'On Bridging Generic and Personalized Federated Learning for Image "
    "Classification', ICLR 2022 (FedRoD: generic model on the balanced softmax loss, a "
    "personal linear head on the detached features added to the generic logits)",
    pfllib("servers/serverrod.py", "clients/clientrod.py"),
    ("log n_c of a class the client lacks is -1e9 (its logit never wins); PFLlib's log 0 "
     "is -inf",
     "the personal model is evaluated as one head (W_g + W_p, b_g + b_p), equal to PFLlib's "
     "g(x) + h_p(f(x)) for linear heads",
     "aggregation weights are uniform by default; PFLlib weights by training samples "
     "(aggregation.weights='num_examples')"))


def balanced_softmax_sum(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                         counts: jax.Array) -> jax.Array:
    """Sum over real examples of cross-entropy of logits + log n_c (Ren et al. 2020)."""
    log_prior = jnp.where(counts > 0, jnp.log(jnp.maximum(counts, 1.0)), NO_CLASS)
    return local_lib.masked_cross_entropy(logits + log_prior, labels, mask)


def fedrod(model: nn.Module, client_tx: optax.GradientTransformation,
           server_tx: optax.GradientTransformation = optax.sgd(1.0)
           ) -> FederatedAlgorithm:
    """FedRoD with both heads trained by `client_tx` (separate states per parameter),
    warmed up as `client_tx` says."""
    base = fedavg(model, client_tx, server_tx)
    net = local_lib.WithFeatures(model)

    def client_state_init(server):
        linear_head(server.params, "FedRoD")
        return {"head": server.params[HEAD]}

    def client_init(server, client_state, ctx):
        local = base.client_init(server, None, ctx)
        trained = {"model": local.params, "personal_head": client_state["head"]}
        return (local._replace(params=trained, opt_state=client_tx.init(trained)),
                ctx.label_counts)

    def client_step(local_and_counts, batch, server):
        del server
        local, counts = local_and_counts

        def generic_loss(outputs, labels, mask):
            return balanced_softmax_sum(outputs[0], labels, mask, counts)

        def personal_loss(params, local, batch, outputs):
            del local
            logits, features = jax.lax.stop_gradient(outputs)
            head = params["personal_head"]
            mixed = logits + features @ head["kernel"] + head["bias"]
            loss_sum = local_lib.masked_cross_entropy(mixed, batch["y"], batch["mask"])
            return loss_sum / jnp.maximum(jnp.sum(batch["mask"]), 1.0), {
                "personal_loss_sum": loss_sum}

        local, metrics = local_lib.sgd_step(net, client_tx, local, batch, extra_loss=personal_loss,
                                            loss=generic_loss,
                                            full_params=lambda p: p["model"])
        return (local, counts), metrics

    def client_output(local_and_counts, server):
        local, _ = local_and_counts
        output, _ = base.client_output(local._replace(params=local.params["model"]), server)
        return output, {"head": local.params["personal_head"]}

    def personal_variables(server, client_state):
        params = dict(server.params)
        params[HEAD] = jax.tree_util.tree_map(lambda g, p: g + p, server.params[HEAD],
                                              client_state["head"])
        return {"params": params, **server.model_state}

    return base._replace(client_state_init=client_state_init, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_variables=personal_variables)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedrod(model, client_tx, server_tx)


ENTRY = AlgorithmEntry(from_config, {}, {}, personal=True, reference=REFERENCE)
