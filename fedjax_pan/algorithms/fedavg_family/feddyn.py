"""FedDyn (Acar et al., ICLR 2021, Algorithm 1): each client's objective is corrected by a
linear term so that, at a fixed point, the clients' local optima agree with the global one.

Client k holds g_k, the gradient of its loss at its last local model (zeros at first).
Sampled in round t, it trains from the broadcast theta^{t-1} on

    L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2,

reaching theta_k^t, and then (first-order condition of that objective)

    g_k <- g_k - alpha (theta_k^t - theta^{t-1}).

The server holds theta and h (zeros at first):

    h^t     = h^{t-1} - alpha/K * sum_{k in S} (theta_k^t - theta^{t-1})
    theta^t = mean_{k in S} theta_k^t - h^t / alpha.

The clients send delta_k = theta_k^t - theta^{t-1}; the sum over S is |S| times the
engine's mean, which holds for uniform weights only: FedDyn assumes
aggregation.weights 'uniform' and rule 'mean' (`from_config` refuses others). Server
optimisers do not apply. Warm-up and BN handling (averaged, or per client) are FedAvg's.

The dynamic term's gradient, alpha (theta - theta^{t-1}) - g_k, is added in closed form:
elementwise, it fuses into the optimiser's pass over the parameters. Its value,
-<g_k, theta> + alpha/2 ||...||^2, costs two reductions over all parameters per step
(+14% round time on the MLP bench), so it is logged as `train_dyn` only with
`log_term=True`.

alpha -> 0 is *not* FedAvg: the clients' local models tend to FedAvg's, but
h^t / alpha = -(|S|/K) * sum_{r<=t} mean_S(delta^r) does not vanish, so the server adds
the running sum of all past mean updates to FedAvg's step, like heavy-ball momentum
without decay: round 1 (h = 0) moves theta by (1 + |S|/K) times the clients' mean delta,
where FedAvg moves it by 1 times.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm)
from fedjax_pan.algorithms.fedavg_family.fedavg import ServerState, fedavg
from fedjax_pan.algorithms.fedavg_family.fedprox import proximal_term
from fedjax_pan.references import Reference
from fedjax_pan.rules import Rule, between, boolean, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"alpha": 0.01, "log_term": False}
# The server divides h by alpha in float32: a tiny alpha rounds to 0 there (h / 0 = NaN).
RULES = {"alpha": between(1e-6, 100), "log_term": Rule(boolean)}

REFERENCE = Reference(
    "Acar et al., 'Federated Learning Based on Dynamic Regularization', ICLR 2021 "
    "(FedDyn, Alg. 1)", None,
    ("the local objective is minimised approximately, by the configured client optimiser's "
     "local steps (the paper's analysis assumes the exact minimiser)",
     "not PFLlib's clientdyn.py, which adds alpha/2 ||theta - theta^{t-1}|| (the norm, not "
     "its square) to the loss: the paper's squared norm is used here",
     "only uniform weights and the 'mean' rule (the sum over S is |S| times the mean)"))


class FedDynServer(NamedTuple):
    base: ServerState  # theta (params), the BN statistics, the round
    h: PyTree


class ClientState(NamedTuple):
    """What a client keeps between its rounds."""

    grad: PyTree  # g_k
    model_state: Optional[Dict[str, PyTree]]  # its own BN statistics (bn='local'), else None


class FedDynLocal(NamedTuple):
    """A client's working state during a round."""

    train: local_lib.LocalState
    grad: PyTree  # g_k, fixed during the round


def linear_term(grad: PyTree, params: PyTree) -> jax.Array:
    """<grad, params> over all leaves."""
    return sum(jnp.vdot(g, p) for g, p in zip(jax.tree_util.tree_leaves(grad),
                                             jax.tree_util.tree_leaves(params)))


def feddyn(model: nn.Module, client_tx: optax.GradientTransformation, *, alpha: float = 0.01,
           log_term: bool = False,
           bn: str = "mean", loss: local_lib.LossSum = local_lib.masked_cross_entropy
           ) -> FederatedAlgorithm:
    """FedDyn for a flax `model`, under uniform aggregation weights (see the module doc)."""
    check_options(RULES, "feddyn", alpha=alpha, log_term=log_term)
    # The server step theta + (mean delta - h/alpha) is FedAvg's with sgd(1).
    base = fedavg(model, client_tx, optax.sgd(1.0), bn=bn, loss=loss)

    def server_init(variables):
        server = base.server_init(variables)
        return FedDynServer(server, tree_map(jnp.zeros_like, server.params))

    def client_state_init(server):
        return ClientState(tree_map(jnp.zeros_like, server.base.params),
                           base.client_state_init(server.base))

    def client_init(server, client_state, ctx):
        train = base.client_init(server.base, client_state.model_state, ctx)
        return FedDynLocal(train, client_state.grad)

    def client_step(local, batch, server):
        theta = server.base.params

        def dynamic(grads, train):  # + alpha (params - theta) - g_k
            return tree_map(lambda d, p, t, g: d + alpha * (p - t) - g, grads, train.params,
                            theta, local.grad)
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch,
                                            grad_transform=dynamic, loss=loss)
        if log_term:  # at the parameters the step's gradient was taken at
            term = (proximal_term(local.train.params, theta, alpha, "l2")
                    - linear_term(local.grad, local.train.params))
            metrics = {**metrics, "dyn_sum": term * metrics["num_examples"]}
        return local._replace(train=train), metrics

    def client_output(local, server):
        output, bn_state = base.client_output(local.train, server.base)  # theta_k - theta
        grad = tree_map(lambda g, d: g - alpha * d, local.grad, output["delta"])
        return output, ClientState(grad, bn_state)

    def server_update(server, mean_output, info):
        fraction = info.client_ids.shape[0] / info.num_clients  # |S| / K: sum_S = |S| mean_S
        mean_delta = mean_output["delta"]
        h = tree_map(lambda h, d: h - alpha * fraction * d, server.h, mean_delta)
        step = tree_map(lambda d, h: d - h / alpha, mean_delta, h)  # theta^t - theta^{t-1}
        theta = base.server_update(server.base, {**mean_output, "delta": step}, info)
        return FedDynServer(theta, h)

    def eval_variables(server):
        return base.eval_variables(server.base)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               eval_variables=eval_variables)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # FedDyn's server update is its own
    server, agg = cfg.server, cfg.aggregation
    if (server.optimizer, server.lr, server.momentum) != ("sgd", 1.0, 0.0):
        raise ValueError("FedDyn has its own server update: leave config.server at sgd, "
                         "lr 1, momentum 0")
    if (agg.weights, agg.rule) != ("uniform", "mean"):
        raise ValueError(f"FedDyn sums over the sampled clients as |S| times their mean, "
                         f"so it needs aggregation.weights 'uniform' and rule 'mean', got "
                         f"{agg.weights!r} and {agg.rule!r}")
    return feddyn(model, client_tx, alpha=cfg.feddyn.alpha, log_term=cfg.feddyn.log_term,
                  bn=agg.bn)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, reference=REFERENCE)

__all__ = ["feddyn", "linear_term", "FedDynServer", "ClientState", "FedDynLocal",
           "OPTIONS", "RULES", "ENTRY"]
