"""FedPHP (Li et al., ECML PKDD 2021): FedAvg plus an inherited private model per client.

Each client keeps a personalised model w_p (the "HPM"), a moving average of the models it
has trained. In round r (of R) a sampled client starts from the global model w, trains it
on

    (1 - lambda) CE(w) + lambda MMD(f_w(x), f_{w_p}(x)),

pulling its features towards the HPM's on the same batch (f: the representation before
the head; MMD with PFLlib's sum of RBF kernels, bandwidths 10, 15, 20 and 50, over the
batch's real examples), sends w as FedAvg does, and updates

    w_p <- (1 - mu_r) w + mu_r w_p,    mu_r = mu r / R,

so the HPM inherits more of its past as training goes on. As PFLlib's clientphp.py the
kernel is PFLlib's RBF mixture and the HPM starts as the initial global model; the
average covers every variable (BatchNorm statistics too; PFLlib's only the parameters).
A client is evaluated on its HPM (the paper's inference model; PFLlib scores the model
it has just trained). PFLlib's defaults (mu = 0, lambda = 1) would make the HPM a copy of
the trained model and drop the supervised term, so the defaults here are mu = 0.9 and
lambda = 0.5. The logged training loss is the cross-entropy, the MMD `train_mmd`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, own_model,
                                        server_model)
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"mu": 0.9, "lam": 0.5}
RULES = {"mu": between(0, 1), "lam": between(0, 1)}
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # PFLlib's RBF mixture


REFERENCE = Reference(
    "Li et al., 'FedPHP: Federated Personalization with Inherited Private Models', ECML "
    "PKDD 2021 (the HPM moving average w_p <- (1 - mu_r) w + mu_r w_p, mu_r = mu r / R, "
    "and the (1 - lambda) CE + lambda MMD local loss)",
    pfllib("servers/serverphp.py", "clients/clientphp.py"),
    ("a client is evaluated on its HPM (the paper's inference model); PFLlib scores the "
     "model it has just trained (the global model for a client not sampled)",
     "the HPM average covers every variable, BatchNorm statistics too; PFLlib's covers "
     "the parameters only",
     "defaults mu = 0.9, lambda = 0.5; PFLlib's (mu = 0, lambda = 1) make the HPM a copy "
     "of the trained model and drop the supervised term"))


class PhpLocal(NamedTuple):
    train: local_lib.LocalState
    private: PyTree  # w_p, the HPM's variables
    round: jax.Array


def mmd(x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """The empirical MMD of PFLlib's FedPHP between the rows of `x` and `y` (B, D): the
    mean over pairs of real rows (mask 1) of K(x, x') + K(y, y') - 2 K(x, y'), K the sum
    of exp(-||a - b||^2 / (2 h)) over the bandwidths h."""
    x, y = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)

    def kernel(a, b):
        d = (jnp.sum(a * a, 1)[:, None] + jnp.sum(b * b, 1)[None, :] - 2.0 * a @ b.T)
        return sum(jnp.exp(-0.5 * d / h) for h in BANDWIDTHS)
    pairs = mask[:, None] * mask[None, :]
    total = kernel(x, x) + kernel(y, y) - 2.0 * kernel(x, y)
    return jnp.sum(total * pairs) / jnp.maximum(jnp.sum(pairs), 1.0)


def moving_average(trained: PyTree, private: PyTree, round_index: jax.Array, mu: float,
                   rounds: int) -> PyTree:
    """(1 - mu_r) trained + mu_r private, mu_r = mu r / R."""
    m = mu * jnp.asarray(round_index, jnp.float32) / rounds
    return tree_map(lambda w, p: ((1.0 - m) * w + m * p).astype(w.dtype), trained, private)


def fedphp(model: nn.Module, client_tx: optax.GradientTransformation, rounds: int,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *, mu: float = 0.9,
           lam: float = 0.5) -> FederatedAlgorithm:
    """FedPHP over a run of `rounds` rounds (mu_r's denominator) for a `model` that sows
    its 'features'."""
    check_options(RULES, "fedphp", mu=mu, lam=lam)
    if rounds < 1:
        raise ValueError(f"FedPHP needs rounds >= 1, got {rounds}")
    base = fedavg(model, client_tx, server_tx)
    net = local_lib.WithFeatures(model)

    def ce(outputs, labels, mask):
        return local_lib.masked_cross_entropy(outputs[0], labels, mask)

    def client_init(server, client_state, ctx):
        return PhpLocal(base.client_init(server, None, ctx), client_state,
                        jnp.asarray(ctx.round, jnp.int32))

    def client_step(local, batch, server):
        del server
        private_params, private_state = local_lib.split_variables(local.private)
        (_, z_private), _ = local_lib.forward(net, private_params, private_state, batch,
                                              train=False)
        z_private = jax.lax.stop_gradient(z_private)

        def transfer(params, train, batch, outputs):
            del params, train
            m = batch["mask"]
            count = jnp.maximum(jnp.sum(m), 1.0)
            d = mmd(outputs[1], z_private, m)
            # (1 - lam) CE + lam MMD, the CE (the loss sgd_step logs) being added already.
            term = lam * (d - ce(outputs, batch["y"], m) / count)
            return term, {"mmd_sum": d * jnp.sum(m)}
        train, metrics = local_lib.sgd_step(net, client_tx, local.train, batch,
                                            extra_loss=transfer, loss=ce)
        return local._replace(train=train), metrics

    def client_output(local, server):
        output, _ = base.client_output(local.train, server)
        return output, moving_average(local_lib.model_variables(local.train), local.private,
                                      local.round, mu, rounds)

    return base._replace(client_state_init=server_model, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_variables=own_model)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedphp(model, client_tx, cfg.rounds, server_tx, mu=cfg.fedphp.mu,
                  lam=cfg.fedphp.lam)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
