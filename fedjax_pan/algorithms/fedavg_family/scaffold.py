"""SCAFFOLD (Karimireddy et al., ICML 2020), option II of Algorithm 1: control variates
correct each client's drift towards its own optimum.

Client k holds c_k, the server x and c (all zeros at first). A sampled client, from
y_k = x, takes its local steps on the corrected gradient              (Alg. 1, line 10)

    y_k <- y_k - lr (g_k(y_k) + c - c_k),

then, after its steps (option II, line 12),

    c_k+ = c_k - c + (x - y_k) / (steps * lr)

and sends delta_y = y_k - x and delta_c = c_k+ - c_k (line 13). The server (lines 16-17):

    x <- x + lr_g * mean_S(delta_y),    c <- c + |S|/K * mean_S(delta_c).

`steps * lr` is the total step size the round's gradients were applied with. We use its
exact value for the local optimiser FedAvg's clients use: A = sum_t lr_t (1 - b^(t+1)) /
(1 - b), with lr_t the step's learning rate (warm-up included: 'rounds' scales every step
by the round's factor, 'steps' ramps the first steps) and b the heavy-ball
momentum (the momentum buffer starts at zero each round, so gradient s moves y_k by
sum_{t>=s} lr_t b^(t-s)). Then x - y_k = A * (a weighted mean of the corrected
gradients), and c_k+ is that mean of the raw gradients, as in the paper; without momentum
and warm-up A = steps * lr exactly. (Dividing by steps * lr under momentum b would
inflate c_k by up to 1/(1 - b), 10x for b = 0.9, which makes the control variates
oscillate and diverge.) Weight decay enters c_k as part of the gradient; gradient
clipping acts on the corrected gradient and is not accounted for.

Aggregation: `mean_S` is the engine's weighted mean. With uniform weights c stays the
mean of all K clients' c_k; with example-count weights and full participation it is
their n_k-weighted mean, the gradient of the objective FedAvg's weighted x-update
follows. Everything else (warm-up, BN statistics averaged or kept per client) is FedAvg's.
Memory: one parameter-sized c_k per client.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, sends)
from fedjax_pan.algorithms.fedavg_family.fedavg import ServerState, fedavg
from fedjax_pan.references import Reference
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"server_lr": 1.0}
RULES = {"server_lr": between(0, 100, lo_open=True)}

REFERENCE = Reference(
    "Karimireddy et al., 'SCAFFOLD: Stochastic Controlled Averaging for Federated "
    "Learning', ICML 2020 (Alg. 1, option II for c_i+)", None,
    ("the divisor K * eta_l of option II is the exact total step size A of the configured "
     "client optimiser (heavy-ball momentum and warm-up accounted for); it equals K * eta_l "
     "for the paper's plain SGD",
     "weight decay enters c_i as part of the gradient; gradient clipping acts on the "
     "corrected gradient g + c - c_i and is not accounted for in A",
     "mean_S is the engine's weighted mean: the paper's plain mean under the default "
     "uniform weights, the n_k-weighted mean with aggregation.weights='num_examples'"))


class ScaffoldServer(NamedTuple):
    base: ServerState  # x (params), the BN statistics, the round
    c: PyTree  # the server control variate


class ClientState(NamedTuple):
    """What a client keeps between its rounds."""

    c: PyTree  # c_k
    model_state: Optional[Dict[str, PyTree]]  # its own BN statistics (bn='local'), else None


class ScaffoldLocal(NamedTuple):
    """A client's working state during a round."""

    train: local_lib.LocalState  # y_k and its optimiser
    correction: PyTree  # c - c_k, added to every local gradient of the round
    lr_sum: jax.Array  # A: the total step size of the steps taken so far


def step_size(train: local_lib.LocalState, lr: float, momentum: float) -> jax.Array:
    """Step t's share of A: lr_t (1 - b^(t+1)) / (1 - b), lr_t as `client_tx`'s warm-up
    scales it."""
    t = train.step.astype(jnp.float32)
    carried = (1.0 - momentum ** (t + 1.0)) / (1.0 - momentum) if momentum else 1.0
    return lr * local_lib.warmup_factor(train.opt_state) * carried


def scaffold(model: nn.Module, client_tx: optax.GradientTransformation, lr: float, *,
             momentum: float = 0.0, server_lr: float = 1.0, bn: str = "mean",
             loss: local_lib.LossSum = local_lib.masked_cross_entropy) -> FederatedAlgorithm:
    """SCAFFOLD (option II) for a flax `model`; `lr` and `momentum` must be `client_tx`'s.

    Round 1 (c = c_k = 0) is FedAvg's round exactly when server_lr = 1.
    """
    if not lr > 0:
        raise ValueError(f"SCAFFOLD needs the client learning rate lr > 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"SCAFFOLD needs momentum in [0, 1), got {momentum}")
    check_options(RULES, "scaffold", server_lr=server_lr)
    # x <- x - lr_g * (-mean delta_y): FedAvg's server step with sgd(lr_g).
    base = fedavg(model, client_tx, optax.sgd(server_lr), bn=bn, loss=loss)

    def server_init(variables):
        server = base.server_init(variables)
        return ScaffoldServer(server, tree_map(jnp.zeros_like, server.params))

    def client_state_init(server):
        return ClientState(tree_map(jnp.zeros_like, server.base.params),
                           base.client_state_init(server.base))

    def client_init(server, client_state, ctx):
        train = base.client_init(server.base, client_state.model_state, ctx)  # y_k <- x
        correction = tree_map(jnp.subtract, server.c, client_state.c)
        return ScaffoldLocal(train, correction, jnp.zeros((), jnp.float32))

    def client_step(local, batch, server):
        del server  # c enters through the correction, fixed at client_init
        corrected = lambda grads, _: tree_map(jnp.add, grads, local.correction)  # noqa: E731
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch,
                                            grad_transform=corrected,
                                            loss=loss)
        lr_sum = local.lr_sum + step_size(local.train, lr, momentum)
        return ScaffoldLocal(train, local.correction, lr_sum), metrics

    def client_output(local, server):
        output, bn_state = base.client_output(local.train, server.base)  # delta = y_k - x
        # A = 0 only for a client that took no steps (a vmap filler): then y_k = x.
        lr_sum = jnp.where(local.lr_sum > 0, local.lr_sum, 1.0)
        mean_grad = tree_map(lambda d: -d / lr_sum, output["delta"])  # (x - y_k) / A
        c_new = tree_map(jnp.subtract, mean_grad, local.correction)  # c_k - c + (x - y_k)/A
        delta_c = tree_map(jnp.subtract, mean_grad, server.c)  # c_k+ - c_k
        return {**output, "delta_c": delta_c}, ClientState(c_new, bn_state)

    def server_update(server, mean_output, info):
        fraction = info.client_ids.shape[0] / info.num_clients  # |S| / K
        c = tree_map(lambda c, d: c + fraction * d, server.c, mean_output["delta_c"])
        x = base.server_update(server.base, {"delta": mean_output["delta"],
                                             "model_state": mean_output["model_state"]}, info)
        return ScaffoldServer(x, c)

    def eval_variables(server):
        return base.eval_variables(server.base)

    # A client receives the model and the server control variate c.
    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               eval_variables=eval_variables,
                               download_bytes=sends(eval_variables, "c"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # SCAFFOLD's server step is its own (config.scaffold.server_lr)
    server = cfg.server
    if (server.optimizer, server.lr, server.momentum) != ("sgd", 1.0, 0.0):
        raise ValueError("SCAFFOLD has its own server step: leave config.server at sgd, "
                         "lr 1, momentum 0 and set config.scaffold.server_lr")
    if cfg.aggregation.rule != "mean":
        raise ValueError(f"SCAFFOLD needs aggregation.rule 'mean' (c must stay the clients' "
                         f"mean control variate), got {cfg.aggregation.rule!r}")
    opt = cfg.optimizer
    return scaffold(model, client_tx, opt.lr, momentum=opt.momentum,
                    server_lr=cfg.scaffold.server_lr, bn=cfg.aggregation.bn)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, reference=REFERENCE)

__all__ = ["scaffold", "step_size", "ScaffoldServer", "ClientState", "ScaffoldLocal",
           "OPTIONS", "RULES", "ENTRY"]
