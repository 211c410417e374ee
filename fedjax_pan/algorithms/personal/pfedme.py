"""pFedMe (Dinh et al., NeurIPS 2020): personalisation by Moreau envelopes.

Each client keeps a personal model theta near its copy w of the global model, solving

    min_theta f_k(theta) + lambda/2 ||theta - w||^2

approximately on every batch by `inner_steps` gradient steps of size `personal_lr`
(theta <- theta - personal_lr (grad f_k(theta) + lambda (theta - w) + mu theta), mu a
weight decay, PFLlib's pFedMeOptimizer), then moves w towards it:
w <- w - lr lambda (w - theta). theta starts each round at the received global model and
carries across the round's batches. The server moves the global model by beta times the
clients' mean change (beta = 1: their mean; pFedMe's beta > 1 extrapolates). A client
evaluates its theta of the last round it took part in.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

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
tree_map = jax.tree_util.tree_map
OPTIONS = {"lam": 15.0, "inner_steps": 5, "personal_lr": 0.09, "beta": 1.0, "mu": 0.0}
# The inner steps are unrolled into each compiled step: compiling takes 4 s at 100 steps
# but 3 minutes at 1000 for a tiny MLP on a CPU (the paper and PFLlib use 5).
RULES = {"lam": between(0, 1e4), "inner_steps": between(1, 100, integer=True),
         "personal_lr": between(0, 100, lo_open=True), "beta": between(0, 100, lo_open=True),
         "mu": between(0, 1e4)}


REFERENCE = Reference(
    "Dinh, Tran, Nguyen, 'Personalized Federated Learning with Moreau Envelopes', NeurIPS "
    "2020 (pFedMe, Alg. 1: K inner steps for theta, the local update of w, the server's "
    "beta step)",
    pfllib("servers/serverpFedMe.py", "clients/clientpFedMe.py"),
    ("mu (the inner steps' weight decay) defaults to 0; PFLlib's pFedMeOptimizer always "
     "uses its default mu = 0.001",
     "aggregation weights are uniform by default; PFLlib weights by training samples "
     "(aggregation.weights='num_examples')"))


class PFedMeLocal(NamedTuple):
    w: PyTree  # the client's copy of the global model
    theta: PyTree  # its personal model
    model_state: Dict[str, PyTree]
    schedule: PyTree  # the learning-rate warm-up's state (`local.schedule`)


def pfedme(model: nn.Module, learning_rate: float,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *, lam: float = 15.0,
           inner_steps: int = 5, personal_lr: float = 0.09, beta: float = 1.0,
           mu: float = 0.0, lr_schedule: optax.GradientTransformation = optax.identity(),
           loss: local_lib.LossSum = local_lib.masked_cross_entropy) -> FederatedAlgorithm:
    """pFedMe; `learning_rate` is the local model's (w's) step size, warmed up as the
    optimiser `lr_schedule` is (from a config: the client optimiser); the inner problem's
    steps use `personal_lr` as they are."""
    check_options(RULES, "pfedme", lam=lam, inner_steps=inner_steps, personal_lr=personal_lr,
                  beta=beta, mu=mu)
    base = fedavg(model, optax.sgd(learning_rate), server_tx)

    def client_state_init(server):
        return {"params": server.params}

    def client_init(server, client_state, ctx):
        del client_state, ctx  # theta restarts from the received model
        return PFedMeLocal(server.params, server.params, server.model_state,
                           local_lib.schedule(lr_schedule, server.round))

    def client_step(local, batch, server):
        del server
        count = jnp.sum(batch["mask"])

        theta, model_state, first_loss = local.theta, local.model_state, None
        for _ in range(inner_steps):  # a handful: unrolled
            g, (loss_sum, model_state, _) = jax.grad(local_lib.mean_loss, argnums=1,
                                                     has_aux=True)(model, theta, model_state,
                                                                   batch, loss)
            first_loss = loss_sum if first_loss is None else first_loss
            theta = tree_map(lambda t, gt, w: t - personal_lr * (gt + lam * (t - w) + mu * t),
                             theta, g, local.w)
        rate = learning_rate * lam * local_lib.warmup_factor(local.schedule)
        w = tree_map(lambda w, t: w - rate * (w - t), local.w, theta)
        return (PFedMeLocal(w, theta, model_state, local_lib.tick(local.schedule)),
                {"loss_sum": first_loss, "num_examples": count})

    def client_output(local, server):
        delta = tree_map(lambda a, b: beta * (a - b), local.w, server.params)
        return {"delta": delta, "model_state": local.model_state}, {"params": local.theta}

    def personal_variables(server, client_state):
        return {"params": client_state["params"], **server.model_state}

    return base._replace(client_state_init=client_state_init, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_variables=personal_variables)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    o = cfg.pfedme  # its steps are its own plain SGD, on client_tx's warm-up
    return pfedme(model, cfg.optimizer.lr, server_tx, lam=o.lam, inner_steps=o.inner_steps,
                  personal_lr=o.personal_lr, beta=o.beta, mu=o.mu, lr_schedule=client_tx)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
