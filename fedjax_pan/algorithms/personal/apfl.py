"""APFL (Deng et al. 2020, Adaptive Personalized FL, Alg. 1): each client mixes a personal
model v with the global model w, m = alpha v + (1 - alpha) w, and learns alpha.

A sampled client trains its copy of w by FedAvg's local steps (its delta is sent) and, on
the same batches, its personal model and mixing weight on the mixed model's loss:

    v     <- v - lr * alpha * g_m                    (g_m = grad of f_k at m)
    alpha <- clip(alpha - lr_alpha * (<v - w, g_m> + 0.02 alpha), 0, 1)   (adaptive)

(the 0.02 alpha term is the authors' released code's). alpha = 0, not adaptive, leaves
the mixed model equal to the global one: FedAvg. The mixed model a client evaluates on its
own data uses the current global model; normalisation statistics are the global model's.
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
from fedjax_pan.references import Reference
from fedjax_pan.rules import Rule, between, boolean, check_options

PyTree = Any
OPTIONS = {"alpha": 0.5, "adaptive": True, "alpha_lr": 0.05}
RULES = {"alpha": between(0, 1), "adaptive": Rule(boolean), "alpha_lr": between(0, 100)}
ALPHA_DECAY = 0.02  # the released code's regulariser on alpha

REFERENCE = Reference(
    "Deng, Kamani, Mahdavi, 'Adaptive Personalized Federated Learning', arXiv 2020 (APFL, "
    "Alg. 1: v and alpha updated with the gradient at the mixed model m = alpha v + "
    "(1 - alpha) w)", None,
    ("alpha's gradient carries the + 0.02 alpha regulariser of the authors' released code "
     "(FedTorch, as the module docstring says; not pinned here), which the paper does not "
     "have",
     "the personal step is plain SGD with the configured rate (no warm-up); the global copy "
     "uses the configured client optimiser",
     "not PFLlib's clientapfl.py, which trains v on its own loss, takes alpha's gradient "
     "from the two models' separate gradients and overwrites v with the mixture after the "
     "round: the paper's gradient at the mixed model is used here",
     "the mixed model uses the global model's normalisation statistics"))


class ApflLocal(NamedTuple):
    shared: local_lib.LocalState  # the client's copy of the global model
    personal: PyTree  # v
    alpha: jax.Array


def _mix(alpha, v, w):
    return jax.tree_util.tree_map(lambda a, b: alpha * a + (1.0 - alpha) * b, v, w)


def apfl(model: nn.Module, client_tx: optax.GradientTransformation, learning_rate: float,
         server_tx: optax.GradientTransformation = optax.sgd(1.0), *, alpha: float = 0.5,
         adaptive: bool = True, alpha_lr: float = 0.05) -> FederatedAlgorithm:
    """APFL; `learning_rate` is the personal model's step size (plain SGD, as the paper);
    the global copy warms up as `client_tx` does (the personal step does not)."""
    check_options(RULES, "apfl", alpha=alpha, adaptive=adaptive, alpha_lr=alpha_lr)
    base = fedavg(model, client_tx, server_tx)

    def client_state_init(server):
        return {"params": server.params, "alpha": jnp.asarray(alpha, jnp.float32)}

    def client_init(server, client_state, ctx):
        return ApflLocal(base.client_init(server, None, ctx), client_state["params"],
                         client_state["alpha"])

    def client_step(local, batch, server):
        w = local.shared.params

        def mixed_loss(m):
            return local_lib.mean_loss(model, m, local.shared.model_state, batch)[0]
        g = jax.grad(mixed_loss)(_mix(local.alpha, local.personal, w))
        personal = jax.tree_util.tree_map(lambda v, gm: v - learning_rate * local.alpha * gm,
                                          local.personal, g)
        new_alpha = local.alpha
        if adaptive:
            inner = sum(jnp.sum((v - b) * gm) for v, b, gm in zip(
                jax.tree_util.tree_leaves(local.personal), jax.tree_util.tree_leaves(w),
                jax.tree_util.tree_leaves(g)))
            new_alpha = jnp.clip(local.alpha - alpha_lr * (inner + ALPHA_DECAY * local.alpha),
                                 0.0, 1.0)
        shared, metrics = base.client_step(local.shared, batch, server)
        return ApflLocal(shared, personal, new_alpha), metrics

    def client_output(local, server):
        output, _ = base.client_output(local.shared, server)
        return output, {"params": local.personal, "alpha": local.alpha}

    def personal_variables(server, client_state):
        return {"params": _mix(client_state["alpha"], client_state["params"], server.params),
                **server.model_state}

    return base._replace(client_state_init=client_state_init, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_variables=personal_variables)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return apfl(model, client_tx, cfg.optimizer.lr, server_tx, alpha=cfg.apfl.alpha,
                adaptive=cfg.apfl.adaptive, alpha_lr=cfg.apfl.alpha_lr)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
