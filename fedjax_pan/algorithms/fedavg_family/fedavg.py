"""FedAvg (McMahan et al.) with a server optimiser (FedOpt, Reddi et al.).

Each sampled client starts from the global model with a fresh local optimiser, trains on
its own data, and sends its model delta. The server treats minus the mean delta as a
pseudo-gradient for `server_tx`: `optax.sgd(1.0)` is plain FedAvg, SGD with momentum is
FedAvgM, `optax.adam` / `optax.yogi` are FedAdam / FedYogi.

Non-trainable model state (BatchNorm statistics) is averaged with the deltas ("BN-Y"), or,
with bn='local' ("BN-N"), kept per client; the global model's statistics are then the
mean of the sampled clients' and are used only to evaluate it.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

import flax.linen as nn
import jax
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import FederatedAlgorithm, federated_algorithm
from fedjax_pan.engine.protocol import ModelView
from fedjax_pan.references import Reference, pfllib

PyTree = Any
BN_MODES = ("mean", "local")

REFERENCE = Reference(
    "McMahan et al., 'Communication-Efficient Learning of Deep Networks from Decentralized "
    "Data', AISTATS 2017 (FederatedAveraging, Alg. 1); server optimisers as Reddi et al., "
    "'Adaptive Federated Optimization', ICLR 2021 (FedOpt, Alg. 1; FedAdam / FedYogi, "
    "Alg. 2; FedAvgM: server SGD with momentum)",
    pfllib("servers/serveravg.py", "clients/clientavg.py"),
    ("aggregation weights are uniform by default (config.aggregation.weights='uniform'); "
     "'num_examples' gives Alg. 1's n_k / n, which PFLlib uses",
     "the default client optimiser (config.optimizer) is SGD with momentum 0.9, weight decay "
     "1e-5, gradient-norm clipping at 100 and a 10-round warm-up (the PAN authors' "
     "settings), not Alg. 1's plain SGD (momentum=0, weight_decay=0, warmup='none' and a "
     "large grad_clip give it)",
     "FedAdam / FedYogi are optax.adam / optax.yogi: their moments are bias-corrected, which "
     "Reddi et al.'s Alg. 2 does not do, and optax.yogi starts both moments at 1e-6 (the "
     "paper: m = 0, v >= tau^2); tau is optax's eps (default 1e-3, beta1 0.9, beta2 0.99)",
     "BatchNorm statistics are averaged with the deltas (bn='mean') or kept per client "
     "(bn='local', FedBN-style); the paper's models have none"))


class ServerState(NamedTuple):
    params: PyTree
    model_state: Dict[str, PyTree]
    opt_state: PyTree
    round: jax.Array


def fedavg(model: nn.Module, client_tx: optax.GradientTransformation,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
           bn: str = "mean", loss: local_lib.LossSum = local_lib.masked_cross_entropy
           ) -> FederatedAlgorithm:
    """FedAvg / FedOpt for a flax `model` trained locally with `client_tx` on `loss`; the
    learning-rate warm-up, if any, is part of `client_tx` (`client_optimizer`)."""
    if bn not in BN_MODES:
        raise ValueError(f"unknown bn mode {bn!r}; expected one of {BN_MODES}")

    def server_init(variables):
        return initial_server(server_tx, variables)

    def client_state_init(server):
        return server.model_state if bn == "local" and server.model_state else None

    def client_init(server, client_state, ctx):
        del ctx  # local training is deterministic given the batches
        model_state = server.model_state if client_state is None else client_state
        return local_lib.init_local(client_tx, {"params": server.params, **model_state},
                                    server.round)

    def client_step(local, batch, server):
        del server  # FedAvg's local objective does not involve the global model
        return local_lib.sgd_step(model, client_tx, local, batch, loss=loss)

    def client_output(local, server):
        delta = jax.tree_util.tree_map(lambda a, b: a - b, local.params, server.params)
        new_client_state = local.model_state if bn == "local" and local.model_state else None
        return {"delta": delta, "model_state": local.model_state}, new_client_state

    def server_update(server, mean_output, info):
        del info
        params, opt_state = server_step(server_tx, server.params, server.opt_state,
                                        mean_output["delta"])
        return ServerState(params, mean_output["model_state"], opt_state, server.round + 1)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               model_view=DELTA_VIEW)


def initial_server(server_tx: optax.GradientTransformation, variables: PyTree) -> ServerState:
    """FedAvg's server state for the initial model `variables`, at round 0."""
    params, model_state = local_lib.split_variables(variables)
    return ServerState(params, model_state, server_tx.init(params),
                       jax.numpy.zeros((), jax.numpy.int32))


def server_step(server_tx: optax.GradientTransformation, params: PyTree, opt_state: PyTree,
                mean_delta: PyTree) -> Tuple[PyTree, PyTree]:
    """FedOpt's server step: (params, opt_state) after `server_tx` on minus the clients'
    mean delta, the pseudo-gradient."""
    pseudo_grad = jax.tree_util.tree_map(lambda d: -d, mean_delta)
    updates, opt_state = server_tx.update(pseudo_grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _delta_model(server: ServerState, output: Dict[str, Any]) -> PyTree:
    # An algorithm built on FedAvg that sends more than its delta (or keeps another server
    # state) has no such model: refused here, when the view is traced.
    if not isinstance(server, ServerState) or set(output) != {"delta", "model_state"}:
        raise TypeError("the output is not FedAvg's {'delta', 'model_state'} against its "
                        "server state")
    params = jax.tree_util.tree_map(lambda w, d: w + d, server.params, output["delta"])
    return {"params": params, **output["model_state"]}


def _delta_output(server: ServerState, variables: PyTree) -> Dict[str, Any]:
    params, model_state = local_lib.split_variables(variables)
    delta = jax.tree_util.tree_map(lambda a, b: a - b, params, server.params)
    return {"delta": delta, "model_state": model_state}


def _delta(server: ServerState, output: Dict[str, Any]) -> PyTree:
    _delta_model(server, output)  # the same check, traced only
    return output["delta"]


def _with_delta(server: ServerState, output: Dict[str, Any], delta: PyTree) -> Dict[str, Any]:
    return {**output, "delta": delta}


# FedAvg's output {delta, model_state} is the model server.params + delta with its state.
DELTA_VIEW = ModelView(_delta_model, _delta_output, _delta, _with_delta)
