"""Per-FedAvg (Fallah et al., NeurIPS 2020): FedAvg of a model meant to be adapted by one
local gradient step (MAML's objective).

Each local step splits its batch into two parts D, D' (three, D'' too, for the Hessian-
free variant), as PFLlib loads 2B examples and halves them (so `local.batch_size` is
PFLlib's 2B; a short last batch splits its real examples the same way):

    w_tmp = w - alpha grad f(w; D)
    FO:  w <- w - beta grad f(w_tmp; D')
    HF:  w <- w - beta (I - alpha H f(w; D'')) grad f(w_tmp; D')

with the Hessian-vector product taken exactly (forward-over-reverse), where the paper
approximates it by finite differences. alpha is `optimizer.lr`; beta defaults to it
(PFLlib sets beta = the learning rate). Steps are plain SGD, as PFLlib's PerAvgOptimizer.
A client's personal model is the current global model after one step of size alpha on
one batch of its own training data (`personal_adapt`); the engine draws that batch.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from ml_collections.config_dict import placeholder

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm, no_client_state
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import Rule, between, boolean, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"beta": placeholder(float), "hessian_free": False}
RULES = {"beta": between(0, 100, lo_open=True, optional=True), "hessian_free": Rule(boolean)}

REFERENCE = Reference(
    "Fallah, Mokhtari, Ozdaglar, 'Personalized Federated Learning with Theoretical "
    "Guarantees: A Model-Agnostic Meta-Learning Approach', NeurIPS 2020 (Per-FedAvg, Alg. 1, "
    "first-order (FO) and Hessian-free (HF) variants)",
    pfllib("servers/serverperavg.py", "clients/clientperavg.py"),
    ("HF's Hessian-vector product is taken exactly (forward-over-reverse); the paper "
     "approximates it by finite differences (PFLlib has the FO variant only)",
     "D, D' (and D'') are the parts of one loaded batch of local.batch_size examples, "
     "PFLlib's 2B split in halves; the paper draws them independently",
     "aggregation weights are uniform by default; PFLlib weights by training samples "
     "(aggregation.weights='num_examples')"))


class PerAvgLocal(NamedTuple):
    params: PyTree
    model_state: Dict[str, PyTree]
    schedule: PyTree  # the learning-rate warm-up's state (`local.schedule`)


def _parts(batch: Dict[str, jax.Array], n: int) -> list:
    """The batch's real examples (a prefix, mask 1) cut into n consecutive parts of
    floor-divided sizes, each on ceil(rows / n) rows, masked past its end. Cut by the real
    count, not the rows, so a padded short batch splits as the same batch unpadded."""
    rows = batch["y"].shape[0]
    size = -(-rows // n)
    count = jnp.sum(batch["mask"]).astype(jnp.int32)
    bounds = [(i * count) // n for i in range(n + 1)]
    parts = []
    for i in range(n):
        pos = bounds[i] + jnp.arange(size)
        idx = jnp.minimum(pos, rows - 1)
        part = {k: v[idx] for k, v in batch.items()}
        part["mask"] = (pos < bounds[i + 1]).astype(batch["mask"].dtype)
        parts.append(part)
    return parts


def perfedavg(model: nn.Module, alpha: float,
              server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
              beta: Optional[float] = None, hessian_free: bool = False,
              lr_schedule: optax.GradientTransformation = optax.identity(),
              loss: local_lib.LossSum = local_lib.masked_cross_entropy) -> FederatedAlgorithm:
    """Per-FedAvg (FO, or HF with `hessian_free`) on `loss`; beta None: beta = alpha. The
    learning rates warm up as the optimiser `lr_schedule` does (from a config: the client
    optimiser)."""
    check_options(RULES, "perfedavg", beta=beta, hessian_free=hessian_free)
    if alpha <= 0:
        raise ValueError(f"Per-FedAvg needs alpha > 0, got {alpha}")
    beta = alpha if beta is None else beta
    parts = 3 if hessian_free else 2
    base = fedavg(model, optax.sgd(alpha), server_tx)

    def grad(params, model_state, batch):
        """(grad of the mean loss, (its sum, the updated non-trainable state))."""
        g, (loss_sum, new_state, _) = jax.grad(local_lib.mean_loss, argnums=1, has_aux=True)(
            model, params, model_state, batch, loss)
        return g, (loss_sum, new_state)

    def client_init(server, client_state, ctx):
        del client_state, ctx
        return PerAvgLocal(server.params, server.model_state,
                           local_lib.schedule(lr_schedule, server.round))

    def client_step(local, batch, server):
        del server
        scale = local_lib.warmup_factor(local.schedule)
        cut = _parts(batch, parts)
        w = local.params
        g1, (loss_sum, state) = grad(w, local.model_state, cut[0])
        w_tmp = tree_map(lambda p, g: p - scale * alpha * g, w, g1)
        g2, (_, state) = grad(w_tmp, state, cut[1])
        if hessian_free:
            def g3(p):
                g, (_, new_state) = grad(p, state, cut[2])
                return g, new_state
            _, hv, state = jax.jvp(g3, (w,), (g2,), has_aux=True)  # H f(w; D'') g2
            g2 = tree_map(lambda g, h: g - scale * alpha * h, g2, hv)
        params = tree_map(lambda p, g: p - scale * beta * g, w, g2)
        return (PerAvgLocal(params, state, local_lib.tick(local.schedule)),
                {"loss_sum": loss_sum, "num_examples": jnp.sum(cut[0]["mask"])})

    def client_output(local, server):
        delta = tree_map(lambda a, b: a - b, local.params, server.params)
        return {"delta": delta, "model_state": local.model_state}, None

    def personal_adapt(server, client_state, batch):
        del client_state
        g, _ = grad(server.params, server.model_state, batch)
        params = tree_map(lambda p, gp: p - alpha * gp, server.params, g)
        return {"params": params, **server.model_state}

    return base._replace(client_state_init=no_client_state, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_adapt=personal_adapt)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    # Per-FedAvg's steps are its own (plain SGD, alpha and beta) on client_tx's warm-up
    parts = 3 if cfg.perfedavg.hessian_free else 2
    if cfg.local.batch_size < parts:
        raise ValueError(f"Per-FedAvg cuts each batch into {parts} parts; local.batch_size "
                         f"{cfg.local.batch_size} is too small")
    return perfedavg(model, cfg.optimizer.lr, server_tx, beta=cfg.perfedavg.beta,
                     hessian_free=cfg.perfedavg.hessian_free, lr_schedule=client_tx)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
