"""Personalised masked aggregation, as paper 001's efficiency slides write it (the table's
pFedEff rows):

    Theta_i <- l2 Theta_i + (1 - l2) M_i^p * sum_j k_j (Theta_g - eta grad_j^u)

Each client keeps its own pruned model Theta_i (its state; the `keep` share of each
layer's weights by magnitude, M_i^p its support: the slides' post-training mask). The
server keeps the global model Theta_g, moved by the clients' masked updates:
Theta_g <- sum_j k_j (Theta_g - eta grad_j^u) = Theta_g + sum_j k_j u_j (FedAvg's step; the
upload mask grad^u = grad * M^u is the config's `compression.upload`, e.g. `top_k`).
A sampled client first takes its personalised aggregate (the equation above, with the
latest Theta_g), trains from it, sends its update u_i against that start, and keeps its
trained model pruned to `keep` as its new Theta_i. Clients evaluate Theta_i.

The download is Theta_g at M_i^p's positions only (the download mask): `keep` of each
layer's values and their positions (int32 indices or a bitmap, whichever is smaller), a
client's mask being the support of the pruned model it reported. On a client's first
round its model is the initial one, unpruned (M^p all ones): it receives the whole
model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms.uploads import compression as comp
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.fedavg_family.fedavg import DELTA_VIEW, ServerState, fedavg
from fedjax_pan.engine.protocol import ModelView
from fedjax_pan.references import Reference
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"keep": 0.5, "lam": 0.5}
RULES = {"keep": between(0, 1, lo_open=True), "lam": between(0, 1, hi_open=True)}

REFERENCE = Reference(
    "The pFedEff rows of paper 001's efficiency slides (PFLlib platform slides: "
    "personalised model aggregation Theta_i <- l2 Theta_i + (1 - l2) M_i^p * sum_j k_j "
    "(Theta_g - eta grad_j^u), upload mask grad^u = grad * M^u, download mask M^d); no "
    "paper or code is cited there", None,
    ("M_i^p is the support of the client's trained model pruned to `keep` of each layer by "
     "magnitude: the slides name a post-training mask without saying how it is chosen",
     "sum_j k_j (Theta_g - eta grad_j^u) is the server's model after FedAvg's step on the "
     "masked updates, k_j the engine's aggregation weights; the update is the change over "
     "the local steps, not one gradient step",
     "the upload mask M^u is the configured compression.upload (e.g. top_k); a client's "
     "first round uses the initial model unpruned (M^p all ones)"))


def prune(params: PyTree, keep: float) -> PyTree:
    """Each leaf with all but its ceil(keep * d) largest magnitudes set to 0."""
    return tree_map(lambda w: jnp.where(comp.top_k_mask(jnp.abs(w), comp.kept(keep, w.size)),
                                        w, 0).astype(w.dtype), params)


def personalised(own: PyTree, global_params: PyTree, lam: float) -> PyTree:
    """l2 Theta_i + (1 - l2) M_i^p * Theta_g, M_i^p the support of Theta_i (all ones
    before a client's first round: its model is then dense)."""
    return tree_map(lambda w, g: lam * w + (1.0 - lam) * jnp.where(w != 0, g, 0),
                    own, global_params)


class PfedeffServer(NamedTuple):
    base: ServerState  # Theta_g and FedAvg's server state
    pruned: jax.Array  # (K,) bool: the client holds a pruned model (it has trained)


def pfedeff(model: nn.Module, client_tx: optax.GradientTransformation,
            server_tx: optax.GradientTransformation = optax.sgd(1.0), *, num_clients: int,
            keep: float = 0.5, lam: float = 0.5) -> FederatedAlgorithm:
    """The personalised masked aggregation for a flax `model` over `num_clients` clients
    (BatchNorm statistics, if any, are averaged as FedAvg's)."""
    check_options(RULES, "pfedeff", keep=keep, lam=lam)
    base = fedavg(model, client_tx, server_tx)

    def server_init(variables):
        return PfedeffServer(base.server_init(variables), jnp.zeros(num_clients, bool))

    def client_state_init(server):
        return {"params": server.base.params}  # the initial model, dense

    def client_init(server, client_state, ctx):
        del ctx
        start = personalised(client_state["params"], server.base.params, lam)
        return local_lib.init_local(client_tx, {"params": start, **server.base.model_state},
                                    server.base.round), start

    def client_step(local, batch, server):
        train, start = local
        train, metrics = base.client_step(train, batch, server.base)
        return (train, start), metrics

    def client_output(local, server):
        del server
        train, start = local
        delta = tree_map(jnp.subtract, train.params, start)
        return ({"delta": delta, "model_state": train.model_state},
                {"params": prune(train.params, keep)})

    def server_update(server, mean_output, info):
        return PfedeffServer(base.server_update(server.base, mean_output, info),
                             server.pruned.at[info.client_ids].set(True))

    def personal_variables(server, client_state):
        return {"params": client_state["params"], **server.base.model_state}

    def download_bytes(server, client_ids, round_index):
        # Theta_g at the client's mask: `keep` of each layer with their positions; a
        # client that never trained holds the dense initial model: all of Theta_g.
        del round_index
        params = server.base.params
        sparse = comp.message_bytes(comp.top_k(keep), params)
        dense = comp.message_bytes(comp.identity(), params)
        return jnp.where(server.pruned[client_ids], sparse, dense).astype(jnp.int32)

    view = ModelView(lambda server, output: DELTA_VIEW.to_model(server.base, output),
                     lambda server, variables: DELTA_VIEW.to_output(server.base, variables),
                     lambda server, output: DELTA_VIEW.update(server.base, output),
                     lambda server, output, delta: DELTA_VIEW.with_update(server.base, output,
                                                                          delta))
    return base._replace(server_init=server_init, client_state_init=client_state_init,
                         client_init=client_init, client_step=client_step,
                         client_output=client_output, server_update=server_update,
                         eval_variables=lambda server: base.eval_variables(server.base),
                         personal_variables=personal_variables,
                         download_bytes=download_bytes, model_view=view)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return pfedeff(model, client_tx, server_tx, num_clients=cfg.partition.num_clients,
                   keep=cfg.pfedeff.keep, lam=cfg.pfedeff.lam)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)

__all__ = ["pfedeff", "prune", "personalised", "PfedeffServer", "OPTIONS", "RULES", "ENTRY"]
