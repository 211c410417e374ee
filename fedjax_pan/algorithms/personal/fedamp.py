"""FedAMP (Huang et al., AAAI 2021): attentive message passing between personal models.

Every client i keeps its own model w_i; the server keeps the latest model each client
uploaded. For a client it takes part in a round, the server forms its personalised cloud
model from the others' models, weighted by how close they are:

    u_i = xi_ii w_i + sum_{j != i} xi_ij w_j,
    xi_ij = alpha_k A'(||w_i - w_j||^2)  (j != i),   xi_ii = 1 - sum_{j != i} xi_ij,
    A'(x) = exp(-x / sigma) / sigma      (the derivative of A(x) = 1 - exp(-x / sigma)),

one gradient step of size alpha_k on lambda sum_{i<j} A(||w_i - w_j||^2) from W. The client
then trains on its own data

    F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2

and uploads w_i. As in PFLlib's clientamp.py the client starts its local steps from its
own model w_i (the paper leaves the start open). Before anyone uploads, u_i = w_i.
Distances and weights are over the trainable parameters; BatchNorm statistics stay with
the client. There is no global model: the global evaluation shows the initial one. Each
client downloads one model, u_i.

Deviations from PFLlib, and why:
- PFLlib's proximal term has no gradient: clientamp.py builds it from `.data` (detached)
  tensors, 0.5 lam / alpha_k ||w - u_i||, so it enters the loss as a constant, u_i never
  reaches the client's model (`set_parameters` writes only `client_u`), and its clients
  train exactly as Local training does. Here the term is differentiated in w, as the
  paper has it; `lam = 0` reproduces PFLlib's training exactly (the attention weights do
  not depend on lam).
- The term is the paper's squared norm lam / (2 alpha_k) ||w - u_i||^2; PFLlib scales the
  plain norm (which, having no gradient, changes only the logged loss).
- The others are every client that has uploaded once, the server keeping each one's
  latest model; PFLlib's are the clients that uploaded in the last round.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, own_model, per_client, sends,
                                        server_model, set_rows)
from fedjax_pan.rules import between, check_options
from fedjax_pan.references import Reference, pfllib

PyTree = Any
tree_map = jax.tree_util.tree_map
# PFLlib's defaults (system/main.py: -alk 1.0, -lam 1.0, -sg 1.0).
OPTIONS = {"alpha": 1.0, "lam": 1.0, "sigma": 1.0}
RULES = {"alpha": between(0, 1e4, lo_open=True), "lam": between(0, 1e4),
         "sigma": between(1e-6, 1e6)}


REFERENCE = Reference(
    "Huang et al., 'Personalized Cross-Silo Federated Learning on Non-IID Data', AAAI 2021 "
    "(FedAMP: attentive message passing, Eq. 3-6)",
    pfllib("servers/serveramp.py", "clients/clientamp.py"),
    ("the proximal term's gradient is taken, as the paper's objective; PFLlib builds it from "
     "`.data`, so it has none and PFLlib's clients train as Local does (lam = 0 reproduces "
     "that)",
     "the squared norm, as the paper (PFLlib's plain norm changes only its logged loss)",
     "the attention runs over every client that has uploaded so far (PFLlib: the last "
     "round's uploaders), so a client's cloud model sees every peer's latest model"))


class AmpServer(NamedTuple):
    params: PyTree  # the initial model (the global evaluation's)
    model_state: PyTree
    models: PyTree  # (K, ...) each client's latest uploaded parameters
    uploaded: jax.Array  # (K,) 1.0 once the client has uploaded
    round: jax.Array


class AmpLocal(NamedTuple):
    train: local_lib.LocalState
    cloud: PyTree  # u_i


def squared_distances(own: PyTree, models: PyTree) -> jax.Array:
    """(K,) ||own - models[j]||^2 over every leaf, one model at a time (a client's K
    differences are never held at once)."""
    def one(model):
        return sum(jnp.sum(jnp.square(a - b)) for a, b in
                   zip(jax.tree_util.tree_leaves(own), jax.tree_util.tree_leaves(model)))
    return jax.lax.map(one, models)


def attention(distances: jax.Array, uploaded: jax.Array, me: jax.Array, alpha: float,
              sigma: float) -> jax.Array:
    """(K,) xi_i: alpha exp(-d_j / sigma) / sigma for the others that have uploaded,
    1 minus their sum for client `me` itself."""
    others = (jnp.arange(distances.shape[0]) != me) & (uploaded > 0)
    xi = jnp.where(others, alpha * jnp.exp(-distances / sigma) / sigma, 0.0)
    return xi.at[me].set(1.0 - jnp.sum(xi))


def cloud_model(own: PyTree, models: PyTree, xi: jax.Array, me: jax.Array) -> PyTree:
    """u_i = xi_ii own + sum_{j != i} xi_ij models[j] (own in client i's place)."""
    others = xi.at[me].set(0.0)
    return tree_map(lambda w, m: xi[me] * w + jnp.tensordot(others, m, axes=1), own, models)


def fedamp(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int, *,
           alpha: float = 1.0, lam: float = 1.0, sigma: float = 1.0) -> FederatedAlgorithm:
    """FedAMP for `num_clients` clients with attention step alpha_k = `alpha`, proximal
    weight `lam` and attention scale `sigma`."""
    check_options(RULES, "fedamp", alpha=alpha, lam=lam, sigma=sigma)
    prox = lam / (2.0 * alpha)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        return AmpServer(params, model_state, per_client(params, num_clients),
                         jnp.zeros((num_clients,), jnp.float32), jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        own = client_state["params"]
        me = jnp.asarray(ctx.client_id, jnp.int32)
        xi = attention(squared_distances(own, server.models), server.uploaded, me, alpha,
                       sigma)
        return AmpLocal(local_lib.init_local(client_tx, client_state, ctx.round),
                        cloud_model(own, server.models, xi, me))

    def client_step(local, batch, server):
        del server

        def proximal(params, train, batch, logits):
            del train, logits
            term = prox * sum(jnp.sum(jnp.square(w - u)) for w, u in zip(
                jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(local.cloud)))
            return term, {"prox_sum": term * jnp.sum(batch["mask"])}
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch,
                                            extra_loss=proximal)
        return local._replace(train=train), metrics

    def client_output(local, server):
        del server
        return local.train.params, local_lib.model_variables(local.train)

    def server_update(server, uploads, info):
        ids = info.client_ids
        return server._replace(models=set_rows(server.models, ids, uploads),
                               uploaded=server.uploaded.at[ids].set(1.0),
                               round=server.round + 1)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               aggregator=every_output, personal_variables=own_model,
                               download_bytes=sends("params"))  # u_i: one model


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # nothing is averaged
    o = cfg.fedamp
    return fedamp(model, client_tx, cfg.partition.num_clients, alpha=o.alpha, lam=o.lam,
                  sigma=o.sigma)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
