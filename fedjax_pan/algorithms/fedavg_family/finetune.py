"""Local fine-tuning before evaluation (paper 001's FedAvg-C and FedProx-C).

Each client takes the model it would be evaluated on (the global model, or its own
personal model where the algorithm defines one), trains it on its own training data with
the clients' optimiser for `eval.finetune_epochs` epochs (cross-entropy, a fresh
optimiser state), and is scored on its own test part with the result. Nothing it
trains is sent or kept: every evaluation fine-tunes afresh from the model of that round.

As a `FederatedAlgorithm` the engine runs through its executors (`engine.Tuning`): the
model to tune is the client state, the tuned model the new client state, the output
empty.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import FederatedAlgorithm, weighted_sum

PyTree = Any


def fine_tuning(model: nn.Module, client_tx: optax.GradientTransformation
                ) -> FederatedAlgorithm:
    """Local training of the model each client holds as its state (its variables); the
    server state is a placeholder scalar, the output nothing."""

    def server_init(variables):
        del variables
        return jnp.zeros((), jnp.int32)

    def client_state_init(server):
        raise TypeError("fine-tuning is handed each client's model as its state")

    def client_init(server, client_state, ctx):
        del server  # the warm-up, if any, follows the evaluated round
        return local_lib.init_local(client_tx, client_state, ctx.round)

    def client_step(local, batch, server):
        del server
        return local_lib.sgd_step(model, client_tx, local, batch)

    def client_output(local, server):
        del server
        return (), local_lib.model_variables(local)

    def server_update(server, aggregate, info):
        del aggregate, info
        return server

    def eval_variables(server):
        raise TypeError("fine-tuning has no global model")

    return FederatedAlgorithm(server_init, client_state_init, client_init, client_step,
                              client_output, server_update, eval_variables,
                              aggregator=weighted_sum,
                              upload_bytes=lambda output, local: jnp.zeros((), jnp.float32))


__all__ = ["fine_tuning"]
