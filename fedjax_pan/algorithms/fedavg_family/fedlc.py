"""FedLC (Zhang et al., ICML 2022, "Federated Learning with Label Distribution Skew via
Logits Calibration"): FedAvg whose clients train on logits calibrated by their label
counts.

Client c with n_{c,y} training examples of label y shifts each logit down by a margin that
grows as its class is rarer locally,

    z'_y(x) = z_y(x) - tau * n_{c,y}^(-1/4),
    local loss = -log( exp(z'_y(x)) / sum_{y'} exp(z'_{y'}(x)) )   (cross-entropy on z')

and everything else is FedAvg's (server optimiser, warm-up, BN handling). Evaluation uses
the raw logits z of the global model; nothing is personal.

Choices: tau = 1.0 is PFLlib's default (`--tau`). The denominator runs over every class,
y included, as PFLlib's clientlc.py (`CrossEntropyLoss(output - calibration, y)`) and the
common implementations do; the paper prints sum_{y' != y}, a loss unbounded below. A class
the client holds no example of (n_{c,y} = 0) has an infinite margin in the formula: its
logit drops out of the softmax (no term, no gradient); a client with no examples at all
(nothing to calibrate by) trains on plain cross-entropy, and so does tau = 0 (FedAvg,
every class kept: the limit of the formula as tau -> 0).

Deviation from PFLlib: serverlc.py calibrates every client by the label counts summed over
ALL clients (one shared margin tau * N_y^(-1/4), in effect global logit adjustment); here,
as in the paper, each client uses its own counts (`ClientContext.label_counts`), which is
the point of calibrating for label skew and needs no count to leave a client.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
OPTIONS = {"tau": 1.0}
RULES = {"tau": between(0, 1e4)}


REFERENCE = Reference(
    "Zhang et al., 'Federated Learning with Label Distribution Skew via Logits "
    "Calibration', ICML 2022 (the calibrated loss: logits shifted by tau n_{c,y}^(-1/4) "
    "before the cross-entropy, each client by its own label counts)",
    pfllib("servers/serverlc.py", "clients/clientlc.py"),
    ("each client calibrates by its own label counts, as the paper; PFLlib's serverlc.py "
     "calibrates every client by the counts summed over all clients (one shared margin, in "
     "effect global logit adjustment)",
     "the softmax denominator runs over every class, y included, as PFLlib's "
     "CrossEntropyLoss(output - calibration, y); the paper prints sum over y' != y, a "
     "loss unbounded below",
     "a client with no examples, and tau = 0, train on plain cross-entropy over every "
     "class (the formula has no margin to apply)"))


class LCLocal(NamedTuple):
    train: local_lib.LocalState
    margin: jax.Array  # (C,) tau * n_y^(-1/4), 0 where n_y = 0
    present: jax.Array  # (C,) bool: the classes the softmax runs over


def calibration(label_counts: jax.Array, tau: float):
    """(margin (C,), present (C,)) for a client's label counts: margin_y =
    tau * n_y^(-1/4) for the classes it holds, which alone stay in the softmax (every
    class, with margin 0, when it holds none or tau = 0: no calibration)."""
    counts = jnp.asarray(label_counts, jnp.float32)
    held = counts > 0
    margin = jnp.where(held, tau * jnp.where(held, counts, 1.0) ** -0.25, 0.0)
    return margin, held | ~jnp.any(held) | (tau == 0)


def calibrated_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                             margin: jax.Array, present: jax.Array) -> jax.Array:
    """Sum over real examples of the cross-entropy of logits - margin over the present
    classes (the finite margins keep padded rows of absent labels finite)."""
    z = logits.astype(jnp.float32) - margin
    log_norm = jax.nn.logsumexp(z, axis=-1, where=jnp.broadcast_to(present, z.shape))
    ce = log_norm - jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(mask > 0, ce, 0.0))


def fedlc(model: nn.Module, client_tx: optax.GradientTransformation,
          server_tx: optax.GradientTransformation = optax.sgd(1.0), *, tau: float = 1.0,
          bn: str = "mean") -> FederatedAlgorithm:
    """FedLC for a flax `model`; tau = 0 is FedAvg exactly."""
    check_options(RULES, "fedlc", tau=tau)
    base = fedavg(model, client_tx, server_tx, bn=bn)

    def client_init(server, client_state, ctx):
        margin, present = calibration(ctx.label_counts, tau)
        return LCLocal(base.client_init(server, client_state, ctx), margin, present)

    def client_step(local, batch, server):
        del server

        def loss(logits, labels, mask):
            return calibrated_cross_entropy(logits, labels, mask, local.margin, local.present)
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch, loss=loss)
        return local._replace(train=train), metrics

    def client_output(local, server):
        return base.client_output(local.train, server)

    return base._replace(client_init=client_init, client_step=client_step,
                         client_output=client_output)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedlc(model, client_tx, server_tx, tau=cfg.fedlc.tau, bn=cfg.aggregation.bn)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, reference=REFERENCE)

__all__ = ["fedlc", "calibration", "calibrated_cross_entropy", "ENTRY", "OPTIONS", "RULES"]
