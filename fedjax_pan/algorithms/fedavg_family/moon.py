"""MOON (Li, He, Song, CVPR 2021, "Model-Contrastive Federated Learning"): FedAvg whose
local objective pulls each client's representation towards the global model's and away
from its own previous local model's.

Algorithm 1, PartyLocalTraining(i, w^t), per batch (x, y):

    z      = R_{w_i}(x)          the local model being trained            (train mode)
    z_glob = R_{w^t}(x)          the broadcast global model, no gradient  (eval mode)
    z_prev = R_{w_i^{t-1}}(x)    this client's previous local model       (eval mode)
    l_con  = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}) )
                                                                          (Eq. 3)
    loss   = CE(F_{w_i}(x), y) + mu * l_con                               (Eq. 4)

sim is the cosine similarity; l_con is averaged over the batch's real examples (padded
rows, mask 0, count nowhere). R is the model's penultimate representation, the sown
'features' (the classifier's input): our models have no separate projection head, so the
paper's head is left out. Each client keeps its final local model as its persistent state
(w_i^{t-1} of the next round it is sampled in); before its first round it is the initial
global model, so l_con = log 2 with zero gradient until then. The term is logged as
`train_contrastive`.

BatchNorm: the global and previous models run in eval mode with the *server's*
`model_state` (running statistics), with both bn modes; the local model trains on its own
statistics as in FedAvg. Everything else (server optimiser, warm-up, BN averaging or
bn='local') is FedAvg's. Memory: one stored model per client (`state_bytes`).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
OPTIONS = {"mu": 1.0, "tau": 0.5}
# Similarities are divided by tau in float32: a tiny tau rounds to 0 there (NaN losses).
RULES = {"mu": between(0, 1e4), "tau": between(0.01, 100)}
REFERENCE = Reference(
    "Li, He, Song, 'Model-Contrastive Federated Learning', CVPR 2021 (MOON, Alg. 1; "
    "Eq. 3 model-contrastive loss, Eq. 4 local objective)",
    pfllib("servers/servermoon.py", "clients/clientmoon.py"),
    ("no projection head: R is the classifier's input (the sown 'features'), as PFLlib's "
     "model.base; the paper adds a 2-layer projection head",
     "the global and previous models run in eval mode with the server's BatchNorm "
     "statistics; PFLlib runs both copies in train mode (batch statistics)",
     "l_con is averaged over the batch's real examples only (padded rows masked)"))


class ClientState(NamedTuple):
    """What a client keeps between its rounds."""

    params: PyTree  # its previous local model w_i^{t-1} (at first: the initial global model)
    model_state: Optional[Dict[str, PyTree]]  # its own BN statistics (bn='local'), else None


class MoonLocal(NamedTuple):
    """A client's working state during a round: FedAvg's, plus the previous model."""

    train: local_lib.LocalState
    prev_params: PyTree


def cosine_similarity(a: jax.Array, b: jax.Array, eps: float = 1e-8) -> jax.Array:
    """Row-wise a.b / (max(|a|, eps) max(|b|, eps)) over the last axis (PyTorch's).

    The clamped norms keep all-zero rows (dead ReLUs, padding) finite, gradients included.
    """
    a = a.reshape(a.shape[0], -1).astype(jnp.float32)
    b = b.reshape(b.shape[0], -1).astype(jnp.float32)
    norm = lambda v: jnp.sqrt(jnp.maximum(jnp.sum(v * v, axis=-1), eps * eps))  # noqa: E731
    return jnp.sum(a * b, axis=-1) / (norm(a) * norm(b))


def contrastive_loss(z: jax.Array, z_glob: jax.Array, z_prev: jax.Array, mask: jax.Array,
                     tau: float) -> jax.Array:
    """Eq. 3 averaged over the real examples (mask 1) of a batch.

    -log(e^a / (e^a + e^b)) = softplus(b - a) with a = sim(z, z_glob)/tau,
    b = sim(z, z_prev)/tau: the same value, without overflow for small tau.
    """
    a = cosine_similarity(z, z_glob) / tau
    b = cosine_similarity(z, z_prev) / tau
    per_example = jax.nn.softplus(b - a)
    return jnp.sum(per_example * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def moon(model: nn.Module, client_tx: optax.GradientTransformation,
         server_tx: optax.GradientTransformation = optax.sgd(1.0), *, mu: float = 1.0,
         tau: float = 0.5,
         bn: str = "mean") -> FederatedAlgorithm:
    """MOON for a flax `model` that sows 'features'; mu = 0 is FedAvg exactly."""
    check_options(RULES, "moon", mu=mu, tau=tau)
    base = fedavg(model, client_tx, server_tx, bn=bn)
    net = local_lib.WithFeatures(model)

    def ce(outputs, labels, mask):  # the supervised part reads the logits only
        return local_lib.masked_cross_entropy(outputs[0], labels, mask)

    def representation(params, server, batch):
        (_, z), _ = local_lib.forward(net, params, server.model_state, batch, train=False)
        return jax.lax.stop_gradient(z)

    def client_state_init(server):
        # w_i^{-1}: the initial global model; FedAvg's per-client BN statistics if bn='local'.
        return ClientState(server.params, base.client_state_init(server))

    def client_init(server, client_state, ctx):
        train = base.client_init(server, client_state.model_state, ctx)  # w_i <- w^t
        return MoonLocal(train, client_state.params)

    def client_step(local, batch, server):
        # Three forward passes: the global and previous models here, the local one (with
        # its backward pass) inside sgd_step.
        z_glob = representation(server.params, server, batch)
        z_prev = representation(local.prev_params, server, batch)

        def model_contrastive(params, train, batch, outputs):
            del params, train
            l_con = contrastive_loss(outputs[1], z_glob, z_prev, batch["mask"], tau)
            return mu * l_con, {"contrastive_sum": l_con * jnp.sum(batch["mask"])}

        train, metrics = local_lib.sgd_step(net, client_tx, local.train, batch,
                                            extra_loss=model_contrastive,
                                            loss=ce)
        return local._replace(train=train), metrics

    def client_output(local, server):
        output, bn_state = base.client_output(local.train, server)
        return output, ClientState(local.train.params, bn_state)  # w_i^t becomes w_i^{t-1}

    return base._replace(client_state_init=client_state_init, client_init=client_init,
                         client_step=client_step, client_output=client_output)


def state_bytes(variables: Dict[str, PyTree], num_clients: int, bn: str = "mean") -> int:
    """Bytes of the K stored previous models (`ClientState`, stacked over all clients).

    One copy of the trainable parameters per client, plus the non-trainable collections
    when bn='local' keeps them per client (FedAvg with bn='local' stores those too).
    """
    stored = [variables["params"]]
    if bn == "local":
        stored += [v for k, v in variables.items() if k != "params"]
    per_client = sum(int(np.size(x)) * np.dtype(x.dtype).itemsize
                     for x in jax.tree_util.tree_leaves(stored))
    return int(num_clients) * per_client


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return moon(model, client_tx, server_tx, mu=cfg.moon.mu, tau=cfg.moon.tau,
                bn=cfg.aggregation.bn)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, reference=REFERENCE)

__all__ = ["moon", "contrastive_loss", "cosine_similarity", "state_bytes", "ClientState",
           "MoonLocal", "OPTIONS", "RULES", "ENTRY"]
