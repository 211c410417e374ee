"""FedDBE (Zhang et al., NeurIPS 2023, "Eliminating Domain Bias for Federated
Learning in Representation Space"): FedAvg with a personalised representation bias (PRBM)
and a mean regularisation (MR) of the representation towards a global mean.

A client's model is a feature extractor f and a head h (here: the model's sown 'features'
and its linear output layer `head`). Client i keeps a vector c_i (PRBM, zeros at first)
added to its representation before the head, and, over its local steps t, a running mean
of its representations

    rbar_t = (1 - m) rbar_{t-1} + m mean_batch f(x)          (rbar_0 = 0; m: momentum)
    loss   = CE(h(f(x) + c_i), y) + kappa * mean_d 0.5 (rbar_t - rbar_g)_d^2

rbar_{t-1} held fixed (detached), rbar_g the global mean representation; f, h and c_i are
trained together, and f, h are averaged as FedAvg's. The client's personal model is
h(f(x) + c_i); with h linear it is the architecture with head bias b + c_i W, so it
evaluates as the model itself.

The global mean (the paper's consensus): the server averages the clients' rbar during an
initialisation period and sends it to them. As PFLlib's serverdbe.py / clientdbe.py (the
paper leaves these open):
- rbar restarts at 0 every round and moves once a local step (a step on a batch without
  real examples leaves it), with m = `feddbe.momentum` (PFLlib's -mo, 0.1); the reported
  rbar is its value after the round's last step, and the server weighs clients as FedAvg
  does (PFLlib: by their examples);
- kappa = `feddbe.kl_weight` (PFLlib's -klw, default 0.0: MR off); the MR term is logged
  as `train_mean_reg`;
- until a global mean exists, clients train as FedAvg's (neither c_i nor MR applies:
  PFLlib's `global_mean is None`), so c_i stays 0 and a client that has not trained since
  evaluates the global model;
- the global mean is formed once and then frozen.

Deviations, each for a reason:
- PFLlib's initialisation period trains every client once (its training then discarded)
  before round 0 to form the global mean. The engine runs sampled rounds only, so here the
  global mean is estimated over the first `feddbe.mean_rounds` rounds (1: round 0 alone)
  from the clients those rounds sample; round 0's clients train as FedAvg's and their
  training is kept. The mean after round r < mean_rounds is the average over rounds 0..r
  of each round's weighted mean of its clients' rbar; it is then frozen (PFLlib's), a
  larger `mean_rounds` refining it over more clients.
- c_i is stepped by `client_tx` together with the model (one optimiser, as FedRoD's
  personal head); PFLlib gives it a plain SGD at the same learning rate, the same step
  where `client_tx` is plain SGD without weight decay.
- BatchNorm statistics are averaged as FedAvg's default (bn='mean'); the model needs a
  linear output layer `head` fed by the sown 'features'.
Communication: a client uploads rbar (D floats) in the estimation rounds only, and every
client receives the global mean with the model from round 1 on (`download_bytes`).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, tree_bytes)
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
OPTIONS = {"momentum": 0.1, "kl_weight": 0.0, "mean_rounds": 1}
RULES = {"momentum": between(0, 1), "kl_weight": between(0, 1e4),
         "mean_rounds": between(1, 1e6, integer=True)}


REFERENCE = Reference(
    "Zhang et al., 'Eliminating Domain Bias for Federated "
    "Learning in Representation Space', NeurIPS 2023 (FedDBE: the personalised "
    "representation bias PRBM and the mean regularisation MR towards the consensus mean, "
    "Algorithm 1)",
    pfllib("servers/serverdbe.py", "clients/clientdbe.py"),
    ("the global mean is estimated over the first feddbe.mean_rounds sampled rounds (their "
     "clients' training kept) and then frozen; PFLlib trains every client once before round "
     "0 (that training discarded) to form it from all clients",
     "the PRBM c_i is stepped by client_tx together with the model; PFLlib gives it a plain "
     "SGD at the same learning rate (the same step where client_tx is plain SGD without "
     "weight decay)",
     "BatchNorm statistics are averaged as FedAvg's default (bn='mean'); PFLlib aggregates "
     "parameters only"))


class DbeServer(NamedTuple):
    base: Any  # FedAvg's ServerState
    global_mean: jax.Array  # (D,) rbar_g (zeros until round 0 closes)


class DbeLocal(NamedTuple):
    train: local_lib.LocalState  # params {'model': ..., 'client_mean': c_i (D,)}
    running: jax.Array  # (D,) rbar_t
    on: jax.Array  # 1.0 once a global mean exists: PRBM and MR apply
    round: jax.Array  # the round's index (rbar is uploaded while < mean_rounds)


def dbe_objective(logits: jax.Array, features: jax.Array, kernel: jax.Array,
                  client_mean: jax.Array, running: jax.Array, global_mean: jax.Array,
                  batch: Dict[str, jax.Array], momentum: float, kl_weight: float,
                  on: jax.Array) -> Tuple[jax.Array, Tuple[jax.Array, jax.Array, jax.Array]]:
    """(mean CE of h(f(x) + on c) + on kappa MR, (CE sum, MR, the new running mean)) for a
    batch whose model gave `logits` = h(f(x)) and `features` f(x); h's kernel `kernel`
    (D, C). A batch without real examples leaves the running mean as it was."""
    mask = batch["mask"]
    n = jnp.sum(mask)
    feats = features.reshape(features.shape[0], -1).astype(jnp.float32)
    shifted = logits + (on * client_mean) @ kernel  # h(f + c) = h(f) + c W for linear h
    ce_sum = local_lib.masked_cross_entropy(shifted, batch["y"], mask)
    batch_mean = jnp.sum(feats * mask[:, None], axis=0) / jnp.maximum(n, 1.0)
    new_running = (1.0 - momentum) * jax.lax.stop_gradient(running) + momentum * batch_mean
    new_running = jnp.where(n > 0, new_running, running)
    reg = jnp.mean(0.5 * (new_running - global_mean) ** 2)
    objective = ce_sum / jnp.maximum(n, 1.0) + on * kl_weight * reg
    return objective, (ce_sum, reg, new_running)


def feddbe(model: nn.Module, client_tx: optax.GradientTransformation,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
           momentum: float = 0.1, kl_weight: float = 0.0, mean_rounds: int = 1
           ) -> FederatedAlgorithm:
    """FedDBE for a flax `model` that sows 'features' into a linear `head`; the global mean
    is estimated over the first `mean_rounds` rounds."""
    check_options(RULES, "feddbe", momentum=momentum, kl_weight=kl_weight,
                  mean_rounds=mean_rounds)
    base = fedavg(model, client_tx, server_tx)
    net = local_lib.WithFeatures(model)

    def width(params):
        linear_head(params, "FedDBE")
        return params[HEAD]["kernel"].shape[0]

    def server_init(variables):
        b = base.server_init(variables)
        return DbeServer(b, jnp.zeros((width(b.params),), jnp.float32))

    def client_state_init(server):
        return {"client_mean": jnp.zeros_like(server.global_mean)}

    def client_init(server, client_state, ctx):
        local = base.client_init(server.base, None, ctx)
        trained = {"model": local.params, "client_mean": client_state["client_mean"]}
        train = local._replace(params=trained,
                               opt_state=local_lib.start_round(client_tx.init(trained),
                                                               server.base.round))
        on = (server.base.round > 0).astype(jnp.float32)
        return DbeLocal(train, jnp.zeros_like(server.global_mean), on, server.base.round)

    def client_step(local, batch, server):
        train = local.train

        def loss_fn(params):
            (logits, features), new_state = local_lib.forward(
                net, params["model"], train.model_state, batch, train=True)
            objective, aux = dbe_objective(
                logits, features, params["model"][HEAD]["kernel"], params["client_mean"],
                local.running, server.global_mean, batch, momentum, kl_weight, local.on)
            return objective, (aux, new_state)

        grads, ((ce_sum, reg, running), new_state) = jax.grad(loss_fn, has_aux=True)(
            train.params)
        new_train = local_lib.apply_gradients(client_tx, train, grads, new_state)
        n = jnp.sum(batch["mask"])
        return (local._replace(train=new_train, running=running),
                {"loss_sum": ce_sum, "num_examples": n, "mean_reg_sum": local.on * reg * n})

    def client_output(local, server):
        model_local = local.train._replace(params=local.train.params["model"])
        output, _ = base.client_output(model_local, server.base)
        return ({**output, "mean": local.running},
                {"client_mean": local.train.params["client_mean"]})

    def server_update(server, mean_output, info):
        b = base.server_update(server.base, {"delta": mean_output["delta"],
                                             "model_state": mean_output["model_state"]}, info)
        r = server.base.round.astype(jnp.float32)
        # The average over estimation rounds 0..r of each round's weighted mean.
        estimate = (r * server.global_mean + mean_output["mean"]) / (r + 1.0)
        global_mean = jnp.where(server.base.round < mean_rounds, estimate, server.global_mean)
        return DbeServer(b, global_mean)

    def eval_variables(server):
        return base.eval_variables(server.base)

    def personal_variables(server, client_state):
        params = dict(server.base.params)
        head = params[HEAD]
        params[HEAD] = {**head,
                        "bias": head["bias"] + client_state["client_mean"] @ head["kernel"]}
        return {"params": params, **server.base.model_state}

    def upload_bytes(output, local):
        # rbar travels only while the server still estimates the global mean.
        extra = jnp.where(local.round < mean_rounds, 0, tree_bytes(output["mean"]))
        return tree_bytes(output) - extra

    def download_bytes(server, client_ids, round_index):
        del client_ids
        model = tree_bytes(eval_variables(server))
        mean = tree_bytes(server.global_mean)
        return jnp.where(jnp.asarray(round_index) > 0, model + mean, model).astype(jnp.int32)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               eval_variables=eval_variables, upload_bytes=upload_bytes,
                               personal_variables=personal_variables,
                               download_bytes=download_bytes)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    o = cfg.feddbe
    return feddbe(model, client_tx, server_tx, momentum=o.momentum, kl_weight=o.kl_weight,
                  mean_rounds=o.mean_rounds)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)

__all__ = ["feddbe", "dbe_objective", "DbeServer", "DbeLocal", "OPTIONS", "RULES", "ENTRY"]
