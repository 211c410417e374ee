"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective keeps clients near the
broadcast model.

    local loss = CE(w) + mu/2 * ||w - w_global||^2                (distance 'l2', the paper)
    local loss = CE(w) + mu * sum_i huber(w_i - w_global_i)       (distance 'huber')

'huber' is the PAN authors' code's variant: PyTorch's smooth-L1 (0.5 x^2 for |x| < 1,
|x| - 0.5 beyond), which grows linearly for far-off weights. The term is logged as
`train_prox`. Everything else (server optimiser, warm-up, BN handling) is FedAvg's.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options, one_of

PyTree = Any
DISTANCES = ("l2", "huber")
OPTIONS = {"mu": 0.01, "distance": "l2"}
RULES = {"mu": between(0, 1e4), "distance": one_of(DISTANCES)}

REFERENCE = Reference(
    "Li et al., 'Federated Optimization in Heterogeneous Networks', MLSys 2020 (FedProx, "
    "Alg. 2: local objective F_k(w) + mu/2 ||w - w^t||^2)",
    pfllib("servers/serverprox.py", "clients/clientprox.py"),
    ("the proximal gradient passes through the configured client optimiser (momentum, "
     "weight decay, clipping, warm-up); PFLlib's PerturbedGradientDescent adds mu (w - w^t) "
     "to plain SGD's gradient",
     "distance='huber' (mu * sum smooth-L1(w - w^t)) is the PAN authors' code's variant, "
     "which this module's docstring follows (that code is not pinned here); the default "
     "'l2' is the paper's",
     "every client runs its full local work (no stragglers' partial solutions, the "
     "paper's gamma-inexactness)"))


def proximal_term(params: PyTree, anchor: PyTree, mu: float, distance: str) -> jax.Array:
    """mu/2 ||params - anchor||^2 ('l2') or mu * sum huber(params - anchor) ('huber')."""
    diffs = [(p - a).astype(jnp.float32) for p, a in
             zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(anchor))]
    if distance == "l2":
        return 0.5 * mu * sum(jnp.sum(d * d) for d in diffs)
    return mu * sum(jnp.sum(optax.huber_loss(d, delta=1.0)) for d in diffs)


def fedprox(model: nn.Module, client_tx: optax.GradientTransformation,
            server_tx: optax.GradientTransformation = optax.sgd(1.0), *, mu: float = 0.01,
            distance: str = "l2",
            bn: str = "mean") -> FederatedAlgorithm:
    """FedProx for a flax `model`; mu = 0 is FedAvg exactly."""
    check_options(RULES, "fedprox", mu=mu, distance=distance)
    base = fedavg(model, client_tx, server_tx,
                  bn=bn)

    def client_step(local, batch, server):
        def prox(params, local, batch, logits) -> Tuple[jax.Array, Dict[str, jax.Array]]:
            term = proximal_term(params, server.params, mu, distance)
            return term, {"prox_sum": term * jnp.sum(batch["mask"])}
        return local_lib.sgd_step(model, client_tx, local, batch,
                                  extra_loss=prox)

    return base._replace(client_step=client_step)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedprox(model, client_tx, server_tx, mu=cfg.fedprox.mu,
                   distance=cfg.fedprox.distance, bn=cfg.aggregation.bn)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, reference=REFERENCE)
