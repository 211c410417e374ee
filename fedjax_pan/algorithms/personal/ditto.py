"""Ditto (Li et al., ICML 2021): FedAvg for the global model, plus a personal model per
client pulled towards the global one.

A sampled client trains two models on the same batches: its copy of the global model w
(FedAvg's local steps; its delta is sent) and its personal model v on

    f_k(v) + lambda/2 ||v - w^t||^2,

w^t being the global model it received (PFLlib's Ditto: the personal step runs with the
received model as the anchor). The quadratic term is taken by its proximal step,
v <- (v_half + lr lambda w^t) / (1 + lr lambda) after the optimiser's step v_half on f_k,
which is exact and stable for any lambda: lambda = 0 is a Local model trained on the
client's own data, lambda -> infinity the received global model. Evaluation on the
client's own data uses v; the global model is FedAvg's exactly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, own_model,
                                        server_model)
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between

PyTree = Any
OPTIONS = {"lam": 0.1}
# lr * lam * w is formed in float32: 1e4 (x lr <= 100) stays far from its 3.4e38 overflow.
RULES = {"lam": between(0, 1e4)}

REFERENCE = Reference(
    "Li et al., 'Ditto: Fair and Robust Federated Learning Through Personalization', ICML "
    "2021 (Alg. 1: personal v on f_k(v) + lambda/2 ||v - w^t||^2, w by FedAvg)",
    pfllib("servers/serverditto.py", "clients/clientditto.py"),
    ("the quadratic term is taken by its exact proximal step after the optimiser's step on "
     "f_k; PFLlib's PerturbedGradientDescent takes an explicit gradient step on it (equal "
     "to first order in lr * lambda)",
     "the personal model trains on the same batches and number of steps as the global copy "
     "in the round's local work; PFLlib's ptrain runs plocal_epochs of its own first",
     "aggregation weights are uniform by default; PFLlib weights by training samples "
     "(aggregation.weights='num_examples')"))


class DittoLocal(NamedTuple):
    """A client's working state: its global copy and its personal model."""

    shared: local_lib.LocalState
    personal: local_lib.LocalState


def ditto(model: nn.Module, client_tx: optax.GradientTransformation, learning_rate: float,
          server_tx: optax.GradientTransformation = optax.sgd(1.0), *, lam: float = 0.1
          ) -> FederatedAlgorithm:
    """Ditto with proximal weight `lam`; `learning_rate` is `client_tx`'s (the proximal
    step's size); both models follow `client_tx`'s warm-up."""
    # Any lambda >= 0, past RULES' cap: that cap keeps lr * lam float32-safe at a config's
    # rates, while a tiny rate with a huge lambda (lambda -> infinity) is still Ditto.
    if lam < 0:
        raise ValueError(f"Ditto's lambda must be >= 0, got {lam}")
    base = fedavg(model, client_tx, server_tx)
    shrink = 1.0 / (1.0 + learning_rate * lam)

    def client_init(server, client_state, ctx):
        shared = base.client_init(server, None, ctx)
        personal = local_lib.init_local(client_tx, client_state, server.round)
        return DittoLocal(shared, personal)

    def client_step(local, batch, server):
        shared, metrics = base.client_step(local.shared, batch, server)
        personal, _ = local_lib.sgd_step(model, client_tx, local.personal, batch)
        params = jax.tree_util.tree_map(
            lambda v, w: (v + (learning_rate * lam) * w) * shrink, personal.params,
            server.params)
        return DittoLocal(shared, personal._replace(params=params)), metrics

    def client_output(local, server):
        output, _ = base.client_output(local.shared, server)
        return output, local_lib.model_variables(local.personal)

    # The personal model starts as the global model's initial value.
    return base._replace(client_state_init=server_model, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_variables=own_model)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return ditto(model, client_tx, cfg.optimizer.lr, server_tx, lam=cfg.ditto.lam)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
