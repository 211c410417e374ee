"""FML, Federated Mutual Learning (Shen, Wang, Kuang, Wu et al., arXiv 2006.16765, 2020).

Every client keeps a private model w_p (its own network, possibly of another architecture
than other clients') and trains it together with its copy w_m of the shared "meme" model
(one architecture for every client) by deep mutual learning on each batch:

    L_p = alpha * CE(p_p, y) + (1 - alpha) * KL(p_m || p_p)
    L_m = beta  * CE(p_m, y) + (1 - beta)  * KL(p_p || p_m)

p_p, p_m the two networks' softmax outputs. The server averages the memes (FedAvg on the
meme: a client sends its meme's delta, the server steps `server_tx` on minus their
weighted mean; sgd(1.0) is the plain average). A client is scored on its private model.

Choices that follow PFLlib's clientfml.py / serverfml.py:
- defaults alpha = 1.0, beta = 0.0 (PFLlib's `-al` / `-bt`; the paper uses 0.5 / 0.5):
  the private model learns from the labels, the meme from the private model;
- KL is PyTorch's `nn.KLDivLoss()`, whose 'mean' reduction divides the sum by the
  elements, B x C (`kl_mean='elements'`); 'examples' divides by B, the paper's per-example
  KL;
- the targets are not detached (`detach=False`): PFLlib backpropagates L_p and L_m into
  both networks, so each step follows the gradient of L_p + L_m in (w_p, w_m);
  `detach=True` is the paper's (DML's) step, each loss seeing the other network's output
  as a constant;
- each network's gradient is clipped to norm `clip` (PFLlib's `clip_grad_norm_(..., 10)`,
  PyTorch's formula; 0: no clipping) before its optimiser; both train with the client
  optimiser, each with its own state, fresh every round (PFLlib's plain SGD keeps
  none).
Deviations: the meme's architecture is the option `fml.meme`, a model spec, default
'mlp(hidden=(200,))' (PFLlib's meme is a copy of the global model, which under
heterogeneous clients has no single architecture); the server averages with the
configured aggregation weights (PFLlib: uniform, `aggregation.weights='uniform'`).

The meme starts from `models.init` with the key PRNGKey(seed) folded with MEME_KEY, the
same in every network's group; private models start from their network's initial model
(round 0: a client that never trained evaluates that). The global evaluation shows this
network's initial model (the meme is another network); each client downloads the meme.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan import models
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, own_model, sends, server_model)
from fedjax_pan.algorithms.fedavg_family.fedavg import server_step
from fedjax_pan.algorithms.personal import HEAD
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import Rule, between, boolean, check_options, one_of

PyTree = Any
KL_MEANS = ("elements", "examples")
DEFAULT_SPEC = "mlp(hidden=(200,))"
OPTIONS = {"meme": DEFAULT_SPEC, "alpha": 1.0, "beta": 0.0, "detach": False,
           "kl_mean": "elements", "clip": 10.0}
MEME_KEY = 0x3E3E  # folded into the seed: the meme's initial key


REFERENCE = Reference(
    "Shen et al., 'Federated Mutual Learning', arXiv:2006.16765, 2020 (deep mutual "
    "learning of the private and meme models, L_p and L_m, and FedAvg on the meme)",
    pfllib("servers/serverfml.py", "clients/clientfml.py"),
    ("the meme's architecture is the option fml.meme (default mlp(hidden=(200,))) "
     "initialised from the seed's folded key; PFLlib's meme is a copy of the global model, "
     "which under heterogeneous clients has no single architecture",
     "the server averages the memes with the configured aggregation weights (PFLlib's "
     "uniform 1/M is aggregation.weights='uniform', the default)",
     "the meme's BatchNorm statistics are averaged with it; PFLlib's aggregate keeps the "
     "first uploaded meme's",
     "defaults alpha = 1, beta = 0, KL 'elements' and undetached targets are PFLlib's; "
     "the paper's are alpha = beta = 0.5 with per-example KL and detached targets "
     "(fml.kl_mean='examples', fml.detach=True)"))


def spec_error(value: Any) -> Optional[str]:
    """None for one model spec that builds, else what it must be (a config rule)."""
    if not isinstance(value, str) or len(models.spec_texts(value)) != 1:
        return "one model spec, e.g. 'mlp(hidden=(200,))'"
    try:
        models.from_spec(value, 10)
    except (TypeError, ValueError) as e:
        return f"one model spec that builds ({e})"
    return None


RULES = {"meme": Rule(spec_error), "alpha": between(0, 1), "beta": between(0, 1),
         "detach": Rule(boolean), "kl_mean": one_of(KL_MEANS), "clip": between(0, 1e6)}


@functools.lru_cache(maxsize=None)
def shared_network(spec: str, num_classes: int) -> nn.Module:
    """The shared model's network (built once per spec and class count)."""
    return models.from_spec(spec, num_classes)


def head_classes(params: PyTree, who: str) -> int:
    """The classes of a model whose output layer is the linear layer `HEAD`."""
    head = params.get(HEAD) if hasattr(params, "get") else None
    if head is None or "kernel" not in head or head["kernel"].ndim != 2:
        raise ValueError(f"{who} needs a model whose output layer is one linear layer "
                         f"named {HEAD!r}")
    return int(head["kernel"].shape[-1])


def kl_divergence(target_logits: jax.Array, logits: jax.Array, mask: jax.Array,
                  kl_mean: str) -> Tuple[jax.Array, jax.Array]:
    """(KL(softmax(target) || softmax(logits)) over the real rows, reduced as PyTorch's
    KLDivLoss 'mean' (by rows x classes, 'elements') or per example ('examples'); its sum
    over the rows)."""
    log_p = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    rows = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1) * mask
    total = jnp.sum(rows)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    return total / (n * (logits.shape[-1] if kl_mean == "elements" else 1)), total


def clip_grad_norm(grads: PyTree, max_norm: float) -> PyTree:
    """PyTorch's clip_grad_norm_: scale by min(1, max_norm / (||g|| + 1e-6)); 0: off."""
    if not max_norm:
        return grads
    norm = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2)
                        for g in jax.tree_util.tree_leaves(grads)))
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), grads)


def clipped_step(tx: optax.GradientTransformation, train: local_lib.LocalState,
                 grads: PyTree, model_state: Dict[str, PyTree], clip: float
                 ) -> local_lib.LocalState:
    """`train` one step of `tx` on `grads` clipped to norm `clip` (`clip_grad_norm`)."""
    return local_lib.apply_gradients(tx, train, clip_grad_norm(grads, clip), model_state)


class FmlServer(NamedTuple):
    params: PyTree  # this network's initial model (the global evaluation's)
    model_state: PyTree
    meme: PyTree  # the meme's parameters
    meme_state: Dict[str, PyTree]  # its non-trainable collections (BatchNorm)
    opt_state: PyTree  # server_tx's, on the meme
    round: jax.Array


class FmlLocal(NamedTuple):
    own: local_lib.LocalState  # the private model
    meme: local_lib.LocalState


def fml(model: nn.Module, client_tx: optax.GradientTransformation,
        server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
        input_shape: Tuple[int, ...], meme: str = DEFAULT_SPEC, alpha: float = 1.0,
        beta: float = 0.0, detach: bool = False, kl_mean: str = "elements",
        clip: float = 10.0, seed: int = 0) -> FederatedAlgorithm:
    """FML for a client network `model` and the meme network the spec `meme` describes,
    initialised for inputs of `input_shape` (H, W, C) from `seed`."""
    check_options(RULES, "fml", meme=meme, alpha=alpha, beta=beta, detach=detach,
                  kl_mean=kl_mean, clip=clip)
    input_shape = tuple(input_shape)
    other = jax.lax.stop_gradient if detach else (lambda x: x)

    def meme_net(params):
        return shared_network(meme, head_classes(params, "FML's meme"))

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        net = shared_network(meme, head_classes(params, "FML"))
        key = jax.random.fold_in(jax.random.PRNGKey(seed), MEME_KEY)
        meme_params, meme_state = local_lib.split_variables(models.init(net, key, input_shape))
        return FmlServer(params, model_state, meme_params, meme_state,
                         server_tx.init(meme_params), jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        return FmlLocal(local_lib.init_local(client_tx, client_state, ctx.round),
                        local_lib.init_local(client_tx, {"params": server.meme,
                                                         **server.meme_state}, ctx.round))

    def client_step(local, batch, server):
        del server  # the broadcast meme is in the local state
        net = meme_net(local.meme.params)
        mask = batch["mask"]
        n = jnp.maximum(jnp.sum(mask), 1.0)

        def objective(both):
            own_params, meme_params = both
            out_p, state_p = local_lib.forward(model, own_params, local.own.model_state,
                                               batch, train=True)
            out_m, state_m = local_lib.forward(net, meme_params, local.meme.model_state,
                                               batch, train=True)
            ce_p = local_lib.masked_cross_entropy(out_p, batch["y"], mask)
            ce_m = local_lib.masked_cross_entropy(out_m, batch["y"], mask)
            kl_p, kl_sum = kl_divergence(other(out_m), out_p, mask, kl_mean)
            kl_m, _ = kl_divergence(other(out_p), out_m, mask, kl_mean)
            loss_p = alpha * ce_p / n + (1 - alpha) * kl_p
            loss_m = beta * ce_m / n + (1 - beta) * kl_m
            return loss_p + loss_m, (state_p, state_m, ce_p, ce_m, kl_sum)

        grads, (state_p, state_m, ce_p, ce_m, kl_sum) = jax.grad(objective, has_aux=True)(
            (local.own.params, local.meme.params))

        return (FmlLocal(clipped_step(client_tx, local.own, grads[0], state_p, clip),
                         clipped_step(client_tx, local.meme, grads[1], state_m, clip)),
                {"loss_sum": ce_p, "num_examples": jnp.sum(mask), "meme_loss_sum": ce_m,
                 "kl_sum": kl_sum})

    def client_output(local, server):
        delta = jax.tree_util.tree_map(jnp.subtract, local.meme.params, server.meme)
        return ({"delta": delta, "model_state": local.meme.model_state},
                local_lib.model_variables(local.own))

    def server_update(server, mean, info):
        del info
        meme, opt_state = server_step(server_tx, server.meme, server.opt_state, mean["delta"])
        return server._replace(meme=meme, meme_state=mean["model_state"], opt_state=opt_state,
                               round=server.round + 1)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               personal_variables=own_model,
                               download_bytes=sends("meme", "meme_state"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation, *, input_shape: Tuple[int, ...]
                ) -> FederatedAlgorithm:
    o = cfg.fml
    return fml(model, client_tx, server_tx, input_shape=input_shape, meme=o.meme,
               alpha=o.alpha, beta=o.beta, detach=o.detach, kl_mean=o.kl_mean, clip=o.clip,
               seed=cfg.seed)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, heterogeneous=True,
                       input_shape=True, reference=REFERENCE)
