"""FedCP (Zhang et al., KDD 2023, "FedCP: Separating Feature Information for Personalized
Federated Learning via Conditional Policy").

The model is a feature extractor W^fe (every layer below the head; its output h, the sown
'features') and a linear head. Client i keeps a personal head W^hd_i; the server keeps the
global extractor, a global head W^hd and the Conditional Policy Network theta (CPN). For a
sample x, with the client's context v_i (the column sums of its personal head's kernel,
v_i = sum_c W^hd_i[:, c], L2-normalised):

    h          = W^fe(x)
    [a_p, a_g] = ReLU(LayerNorm(Linear_theta(h * v_i)))        two halves of width D
    s_i, 1-s_i = gumbel_softmax over {a_p, a_g} (temperature tau), element-wise
    y_hat      = W^hd_i(h * s_i) + W^hd(h * (1 - s_i))          (W^hd frozen locally)
    loss       = CE(y_hat, y) + lam * MMD_rbf(h, W^fe_global(x))   (W^fe_global frozen)

MMD_rbf is PFLlib's: mean over pairs of K(x,x') + K(y,y') - 2K(x,y') with
K = sum_{a in (10, 15, 20, 50)} exp(-|u - u'|^2 / (2a)), here over the batch's real rows.
The client trains W^fe, W^hd_i and theta with `client_tx`; it sends its extractor, theta,
and (as PFLlib's `generate_upload_head`) the head 0.5 W^hd_i + 0.5 W^hd; the server
averages all three (deltas through `server_tx`: sgd(1) is the mean).

Choices follow PFLlib's clientcp.py / servercp.py: the CPN is Linear(D, 2D) -> LayerNorm
-> ReLU with PyTorch's default initialisation (here drawn from the config seed's key);
the context is recomputed from the personal head after each of the client's rounds (so a
round trains with the context of the head it started from); a client that has never
trained uses a uniform-[0, 1) random context, as PFLlib's `torch.rand` (here one draw from
the seed shared by all clients, not one per client); the frozen global extractor runs in
training mode on the batch (its statistics updates discarded). BatchNorm statistics are
averaged as FedAvg's.
Deviations: (1) clients receive the latest global head and CPN at the start of the round
they are sampled in (the paper's Algorithm 1); PFLlib hands the aggregates only to the
round's clients at its end, so a client trains with those of its own last round. (2) The
personal model is evaluated with the noise-free policy softmax([a_p, a_g] / tau) (PFLlib
keeps sampling Gumbel noise at test time: a random prediction); evaluation is thereby
deterministic. (3) As the evaluated model is not the bare architecture, a configured run
goes through a one-group `engine.groups.Groups` driver evaluating `CPNet`; settings that
need the compiled `Simulation` (stragglers, attacks, shuffling, fine-tuning) are refused
there, and `model.architectures` is not supported.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan import models
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, sends)
from fedjax_pan.algorithms.fedavg_family.fedavg import server_step
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.engine import Groups
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"lam": 1.0, "tau": 1.0}
# Policy logits are divided by tau in float32: >= 0.01 keeps them far from overflow.
RULES = {"lam": between(0, 1e4), "tau": between(0.01, 100)}
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # PFLlib's MMD(kernel='rbf')
COLLECTION = "fedcp"  # the personal model's extra variables (CPNet reads them)
LN_EPS = 1e-5  # PyTorch's LayerNorm


REFERENCE = Reference(
    "Zhang et al., 'FedCP: Separating Feature Information for "
    "Personalized Federated Learning via Conditional Policy', KDD 2023 (Algorithm 1: the "
    "conditional policy s_i over h * v_i, the ensemble of personal and global heads, the "
    "CE + lambda MMD loss)",
    pfllib("servers/servercp.py", "clients/clientcp.py"),
    ("clients receive the latest global head and CPN at the start of the round they are "
     "sampled in (the paper's Algorithm 1); PFLlib hands them only to the round's clients "
     "at its end, so a client trains with those of its own last round",
     "the personal model is evaluated with the noise-free policy softmax([a_p, a_g] / tau); "
     "PFLlib samples Gumbel noise at test time too (a random prediction)",
     "a client that has never trained uses one uniform-[0, 1) context drawn from the config "
     "seed and shared by all clients; PFLlib draws one per client (torch.rand)",
     "BatchNorm statistics are averaged with the extractor; PFLlib aggregates and sends "
     "parameters only (each client keeps its own running statistics)",
     "runs through a one-group Groups driver evaluating CPNet: stragglers, attacks, "
     "shuffling, fine-tuning and model.architectures are refused"))


class CPServer(NamedTuple):
    params: PyTree  # global extractor, and the global head in the head's slot
    model_state: Dict[str, PyTree]
    cs: PyTree  # the CPN theta
    context0: jax.Array  # (D,) the context of clients that have never trained
    opt_state: PyTree
    round: jax.Array


class CPLocal(NamedTuple):
    train: local_lib.LocalState  # params {"model": ..., "cs": ...}
    context: jax.Array  # (D,)
    key: jax.Array


def init_cs(key: jax.Array, dim: int) -> Dict[str, jax.Array]:
    """Linear(D, 2D) as PyTorch initialises it (U(+-1/sqrt(D))) and LayerNorm(2D)."""
    k1, k2 = jax.random.split(key)
    bound = 1.0 / np.sqrt(dim)
    return {"kernel": jax.random.uniform(k1, (dim, 2 * dim), jnp.float32, -bound, bound),
            "bias": jax.random.uniform(k2, (2 * dim,), jnp.float32, -bound, bound),
            "scale": jnp.ones((2 * dim,), jnp.float32),
            "shift": jnp.zeros((2 * dim,), jnp.float32)}


def policy_logits(cs: Dict[str, jax.Array], gate_in: jax.Array) -> jax.Array:
    """ReLU(LayerNorm(gate_in @ W + b)) as (B, 2, D): [:, 0] personal, [:, 1] global."""
    z = gate_in @ cs["kernel"] + cs["bias"]
    mean = jnp.mean(z, axis=-1, keepdims=True)
    var = jnp.mean((z - mean) ** 2, axis=-1, keepdims=True)
    z = (z - mean) / jnp.sqrt(var + LN_EPS) * cs["scale"] + cs["shift"]
    z = jax.nn.relu(z)
    return z.reshape(z.shape[0], 2, -1)


def context_of(head: Dict[str, jax.Array]) -> jax.Array:
    """A client's context: its head kernel (D, C) summed over classes (PFLlib's
    `set_head_g`: the (C, D) weight summed over dim 0)."""
    return jnp.sum(head["kernel"], axis=1)


def normalize(v: jax.Array, eps: float = 1e-12) -> jax.Array:
    """v / max(|v|, eps) (PyTorch's F.normalize)."""
    return v / jnp.maximum(jnp.linalg.norm(v), eps)


def ensemble_logits(features: jax.Array, head_p: PyTree, head_g: PyTree, cs: PyTree,
                    context: jax.Array, tau: float, noise: Any = None) -> jax.Array:
    """W^hd_i(h s) + W^hd(h (1 - s)), s the policy's first channel: gumbel-softmax with
    `noise` (B, 2, D) Gumbel draws, or the noise-free softmax when None."""
    h = features.reshape(features.shape[0], -1)
    z = policy_logits(cs, h * normalize(context))
    if noise is not None:
        z = z + noise
    policy = jax.nn.softmax(z / tau, axis=1)
    rep_p, rep_g = h * policy[:, 0], h * policy[:, 1]
    return (rep_p @ head_p["kernel"] + head_p["bias"]) + (rep_g @ head_g["kernel"] +
                                                         head_g["bias"])


def mmd_rbf(x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """PFLlib's MMD(x, y, 'rbf') over the rows with mask 1: the mean over real pairs of
    XX + YY - 2 XY, each a sum of exp(-d / (2a)) over the bandwidths a."""
    x = x.reshape(x.shape[0], -1).astype(jnp.float32)
    y = y.reshape(y.shape[0], -1).astype(jnp.float32)
    xx, yy, zz = x @ x.T, y @ y.T, x @ y.T
    rx, ry = jnp.diag(xx), jnp.diag(yy)
    dxx = rx[:, None] + rx[None, :] - 2.0 * xx
    dyy = ry[:, None] + ry[None, :] - 2.0 * yy
    dxy = rx[:, None] + ry[None, :] - 2.0 * zz
    k = sum(jnp.exp(-0.5 * dxx / a) + jnp.exp(-0.5 * dyy / a) - 2.0 * jnp.exp(-0.5 * dxy / a)
            for a in BANDWIDTHS)
    pairs = mask[:, None] * mask[None, :]
    return jnp.sum(k * pairs) / jnp.maximum(jnp.sum(pairs), 1.0)


class CPNet(NamedTuple):
    """The network a FedCP client is scored with: `model`'s features through the
    ensemble of its personal head and the global head (`ensemble_logits`, noise-free)
    when `variables` hold the 'fedcp' collection, else `model` itself (the global
    model)."""

    model: nn.Module
    tau: float = 1.0

    def apply(self, variables, x, train=False, mask=None, mutable=False):
        if COLLECTION not in variables:
            return self.model.apply(variables, x, train=train, mask=mask, mutable=mutable)
        extra = variables[COLLECTION]
        rest = {k: v for k, v in variables.items() if k != COLLECTION}
        _, h = local_lib.WithFeatures(self.model).apply(rest, x, train=False, mask=mask)
        return ensemble_logits(h, rest["params"][HEAD], extra["head_g"], extra["cs"],
                               extra["context"], self.tau)


def fedcp(model: nn.Module, client_tx: optax.GradientTransformation,
          server_tx: optax.GradientTransformation = optax.sgd(1.0), *, lam: float = 1.0,
          tau: float = 1.0, seed: int = 0) -> FederatedAlgorithm:
    """FedCP for a flax `model` that sows 'features' under a linear `head`; the CPN and
    the untrained clients' context are drawn from `seed`."""
    check_options(RULES, "fedcp", lam=lam, tau=tau)
    net = local_lib.WithFeatures(model)
    key0 = jax.random.fold_in(jax.random.PRNGKey(seed), 0xFC)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        linear_head(params, "FedCP")
        dim = params[HEAD]["kernel"].shape[0]
        cs = init_cs(jax.random.fold_in(key0, 0), dim)
        context0 = jax.random.uniform(jax.random.fold_in(key0, 1), (dim,), jnp.float32)
        shared = {"params": params, "cs": cs}
        return CPServer(params, model_state, cs, context0, server_tx.init(shared),
                        jnp.zeros((), jnp.int32))

    def client_state_init(server):
        # The personal head starts as the initial head (PFLlib's deep copy of the model).
        return {"head": server.params[HEAD], "trained": jnp.zeros((), jnp.float32)}

    def context(server, client_state):
        return jnp.where(client_state["trained"] > 0, context_of(client_state["head"]),
                         server.context0)

    def client_init(server, client_state, ctx):
        trained = {"model": {**server.params, HEAD: client_state["head"]}, "cs": server.cs}
        train = local_lib.init_local(client_tx, {"params": trained, **server.model_state},
                                     server.round)
        return CPLocal(train, context(server, client_state), jax.random.fold_in(ctx.rng, 0xC9))

    def client_step(local, batch, server):
        train = local.train
        noise_key = jax.random.fold_in(local.key, train.step)
        mask = batch["mask"]
        n = jnp.maximum(jnp.sum(mask), 1.0)
        # The frozen global extractor (PFLlib's Ensemble.base), in training mode.
        (_, h_glob), _ = local_lib.forward(net, server.params, server.model_state, batch,
                                           train=True)
        h_glob = jax.lax.stop_gradient(h_glob)
        head_g = jax.lax.stop_gradient(server.params[HEAD])

        def loss_fn(params):
            (_, h), new_state = local_lib.forward(net, params["model"], train.model_state,
                                                  batch, train=True)
            h2 = h.reshape(h.shape[0], -1)
            noise = jax.random.gumbel(noise_key, (h2.shape[0], 2, h2.shape[1]), jnp.float32)
            logits = ensemble_logits(h2, params["model"][HEAD], head_g, params["cs"],
                                     local.context, tau, noise)
            ce_sum = local_lib.masked_cross_entropy(logits, batch["y"], mask)
            mmd = mmd_rbf(h2, h_glob, mask)
            return ce_sum / n + lam * mmd, (ce_sum, new_state, mmd)

        grads, (ce_sum, new_state, mmd) = jax.grad(loss_fn, has_aux=True)(train.params)
        train = local_lib.apply_gradients(client_tx, train, grads, new_state)
        return local._replace(train=train), {"loss_sum": ce_sum, "num_examples": jnp.sum(mask),
                                             "mmd_sum": mmd * jnp.sum(mask)}

    def client_output(local, server):
        model_params = local.train.params["model"]
        head_p = model_params[HEAD]
        # PFLlib's generate_upload_head: 0.5 W^hd_i + 0.5 W^hd (the global head unchanged).
        upload = {**model_params,
                  HEAD: tree_map(lambda p, g: 0.5 * p + 0.5 * g, head_p, server.params[HEAD])}
        sent = {"params": upload, "cs": local.train.params["cs"]}
        delta = tree_map(jnp.subtract, sent, {"params": server.params, "cs": server.cs})
        return ({"delta": delta, "model_state": local.train.model_state},
                {"head": head_p, "trained": jnp.ones((), jnp.float32)})

    def server_update(server, mean_output, info):
        del info
        shared, opt_state = server_step(server_tx, {"params": server.params, "cs": server.cs},
                                        server.opt_state, mean_output["delta"])
        return server._replace(params=shared["params"], cs=shared["cs"],
                               model_state=mean_output["model_state"], opt_state=opt_state,
                               round=server.round + 1)

    def personal_variables(server, client_state):
        params = {**server.params, HEAD: client_state["head"]}
        extra = {"cs": server.cs, "head_g": server.params[HEAD],
                 "context": context(server, client_state)}
        return {"params": params, COLLECTION: extra, **server.model_state}

    # The global model is the global extractor with the global head (the bare
    # architecture); a client downloads them, their statistics, and the CPN.
    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               personal_variables=personal_variables,
                               download_bytes=sends("params", "model_state", "cs"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedcp(model, client_tx, server_tx, lam=cfg.fedcp.lam, tau=cfg.fedcp.tau,
                 seed=cfg.seed)


def one_group(name: str, network: Any, model: nn.Module, cfg: Any,
              client_tx: optax.GradientTransformation, services: Any, build: Any) -> Any:
    """One group over every client (`engine.groups.Groups`: Simulation's numbers) whose
    network is `network`, so that clients are scored on their own models; the model
    starts from the seed's key as the config's model does."""
    if cfg.model.architectures:
        raise ValueError(f"{name} runs one architecture: model.architectures must be ''")
    if cfg.aggregation.rule != "mean":
        raise ValueError(f"{name} averages its outputs: aggregation.rule must be 'mean', got "
                         f"{cfg.aggregation.rule!r}")
    data = services.data
    variables = models.init(model, jax.random.PRNGKey(cfg.seed), tuple(data.images.shape[1:]))
    return Groups([network], [variables], np.zeros(data.num_clients, np.int64),
                  [build(model, cfg, client_tx, services.server_tx)], services,
                  cfg.aggregation.weights)


def driver(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
           services: Any) -> Any:
    """FedCP's round as `one_group` over `CPNet`."""
    return one_group("FedCP", CPNet(model, cfg.fedcp.tau), model, cfg, client_tx, services,
                     from_config)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, driver=driver, personal=True,
                       reference=REFERENCE)
