"""FedNTD (Lee et al., NeurIPS 2022, "Preservation of the Global Knowledge by Not-True
Distillation in Federated Learning"): FedAvg whose clients distil the broadcast global
model's predictions on the classes other than the true one.

For an example (x, y) with local logits z and global logits g, over the not-true classes
c != y only:

    q_l(c) = softmax_{c != y}(z_c / tau),   q_g(c) = softmax_{c != y}(g_c / tau)
    L_NTD  = tau^2 * KL(q_g || q_l) = tau^2 * sum_{c != y} q_g(c) log(q_g(c) / q_l(c))
    local loss = CE(z, y) + beta * mean_batch L_NTD

The global model is the round's broadcast, fixed (no gradient through it) and run in
evaluation mode (PFLlib's `global_model.eval()`: BatchNorm on its running statistics).
Everything else is FedAvg's; nothing is personal. The term is logged as `train_ntd`.

Choices: as PFLlib's clientntd.py (after the authors' criterion.py), the KL is averaged
over the batch's examples (`KLDivLoss(reduction='batchmean')`, here over its real ones)
and scaled by tau^2. tau = 1.0 is PFLlib's default (`--tau`). Deviation: beta defaults to
1.0, the paper's value, not PFLlib's `--beta` 0.0 (an argument pFedMe and others share;
at 0 FedNTD is FedAvg).
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
from fedjax_pan.rules import between, check_options

PyTree = Any
OPTIONS = {"beta": 1.0, "tau": 1.0}
RULES = {"beta": between(0, 1e4), "tau": between(0, 1e3, lo_open=True)}


REFERENCE = Reference(
    "Lee et al., 'Preservation of the Global Knowledge by Not-True Distillation in "
    "Federated Learning', NeurIPS 2022 (FedNTD: CE + beta tau^2 KL(q_g || q_l) over the "
    "not-true classes)",
    pfllib("servers/serverntd.py", "clients/clientntd.py"),
    ("beta defaults to 1.0, the paper's value; PFLlib's --beta defaults to 0.0 (an "
     "argument other methods share; at 0 FedNTD is FedAvg)",))


def _not_true_log_softmax(logits: jax.Array, not_true: jax.Array, tau: float) -> jax.Array:
    z = logits.astype(jnp.float32) / tau
    return z - jax.nn.logsumexp(z, axis=-1, where=not_true, keepdims=True)


def not_true_kl(local_logits: jax.Array, global_logits: jax.Array, labels: jax.Array,
                tau: float) -> jax.Array:
    """Each example's tau^2 KL(q_g || q_l) over its not-true classes, (B,)."""
    not_true = jax.nn.one_hot(labels, local_logits.shape[-1]) == 0
    log_l = _not_true_log_softmax(local_logits, not_true, tau)
    log_g = _not_true_log_softmax(jax.lax.stop_gradient(global_logits), not_true, tau)
    # The true class is masked out (where, not a product: its log-terms are meaningless).
    kl = jnp.where(not_true, jnp.exp(log_g) * (log_g - log_l), 0.0)
    return tau ** 2 * jnp.sum(kl, axis=-1)


def fedntd(model: nn.Module, client_tx: optax.GradientTransformation,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *, beta: float = 1.0,
           tau: float = 1.0, bn: str = "mean") -> FederatedAlgorithm:
    """FedNTD for a flax `model`; beta = 0 is FedAvg exactly."""
    check_options(RULES, "fedntd", beta=beta, tau=tau)
    base = fedavg(model, client_tx, server_tx, bn=bn)

    def client_step(local, batch, server):
        def ntd(params, local, batch, logits) -> Tuple[jax.Array, Dict[str, jax.Array]]:
            global_logits, _ = local_lib.forward(model, server.params, server.model_state,
                                                 batch, train=False)
            real = jnp.sum(batch["mask"])
            per_example = not_true_kl(logits, global_logits, batch["y"], tau)
            term = beta * jnp.sum(per_example * batch["mask"]) / jnp.maximum(real, 1.0)
            return term, {"ntd_sum": term * real}
        return local_lib.sgd_step(model, client_tx, local, batch,
                                  extra_loss=None if beta == 0 else ntd)

    return base._replace(client_step=client_step)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedntd(model, client_tx, server_tx, beta=cfg.fedntd.beta, tau=cfg.fedntd.tau,
                  bn=cfg.aggregation.bn)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, reference=REFERENCE)

__all__ = ["fedntd", "not_true_kl", "ENTRY", "OPTIONS", "RULES"]
