"""APPLE (Luo & Wu, IJCAI 2022, "Adapt to Adaptation: Learning Personalization for
Cross-Silo Federated Learning"): each client learns how much of every client's core model
to mix into its own personalised model.

Every client j has a core model c_j (the server keeps all K, the initial model at first)
and a directed-relationship (DR) vector p_j (K,). Client i's personalised model is

    theta_i = sum_j p_ij c_j,

recomputed at every local step from the K core models it downloaded (its own c_i moving,
the others fixed for the round). With g the gradient of the batch's mean loss at theta_i,
a step moves only its own core model and its DR vector:

    c_i  <- c_i  - lr' * p_ii * g
    p_ij <- p_ij - dr_lr * (<g, c_j> + lam(r) * mu * (p_ij - p0_j))
    lam(r) = (1 + cos(pi r / L)) / 2 for rounds r < L = int(l_share x rounds), else 0,

p0 being the clients' data shares (the paper's proximal term lam mu / 2 ||p_i - p0||^2
keeps p_i near them early on). The client then uploads c_i; the server stores it.

As PFLlib's serverapple.py / clientapple.py (the paper leaves these open):
- lr' = `optimizer.lr` x K (PFLlib: `self.learning_rate * self.num_clients`, which keeps
  the step on the personalised model near lr while p_ii is near 1/K), with the client
  optimiser's learning-rate warm-up; the step is plain SGD taken by hand (no momentum,
  weight decay or clipping from `config.optimizer`). dr_lr steps p plainly.
- <g, c_j> is PFLlib's sum_l mean(g_l * c_j,l) / n_leaves: each parameter tensor's mean of
  the elementwise product, averaged over tensors (not the full inner product); c_i there
  is the core model after this step's own update, as PFLlib updates it first.
- p_i starts at 1/K for every client.
- The mix runs over the parameters; BatchNorm statistics stay each client's own (client
  state), as PFLlib's mix over `parameters()` leaves the model's buffers.

Deviations, each for a reason:
- PFLlib trains all K clients every round; here the engine samples clients and only they
  train (the others' cores and DR vectors wait). Every sampled client downloads all K
  core models as they stood at the round's start (PFLlib's sequential clients see earlier
  clients' in-place updates), counted in `download_bytes`.
- PFLlib ends a client's round with `model_c = deepcopy(self.model)`: its core becomes its
  last personalised mix, and the trained core is dropped. The paper uploads the trained
  core, as here.
- lam(r) follows the paper at the round being trained; PFLlib updates it at the end of
  each round, so its round r uses lam(r - 1) (lam = 1 in rounds 0 and 1).
- p0: the server does not know the clients' sizes before they report them, so each
  sampled client reports its size with its core, and p0 is the shares of the sizes known
  (a client's own included), each unknown size taken as the mean of the known ones: the
  data shares once every client has taken part (PFLlib computes them at the start). It
  matters only where mu > 0.
- Defaults: PFLlib's `dr_learning_rate` is 0, which freezes every p_i at 1/K: every
  client's personalised model is then the same mean of the cores, and nothing personal is
  learned (synthetic 8x8 images, 10 clients of two classes each, an MLP, lr 0.01, half
  the clients a round, 20 rounds: 10% accuracy on their own data, the loss still 2.29).
  `apple.dr_lr` defaults to 1.0 instead: there, p_ii grows to 0.5-1.2 and the
  personalised models reach 86% (dr_lr 10: 94%, p further off the simplex; 100
  diverges). PFLlib's per-tensor means keep this scale largely independent of the
  model's size. mu = 0 and l_share = 1 are PFLlib's. p is not constrained (PFLlib's and
  the paper's steps are plain gradient steps): entries can turn negative or exceed 1.
- A client's personal model is its mix of the current core models (the server's) with its
  DR vector; PFLlib evaluates the mix of its last local step. The global evaluation shows
  the uniform mean of the core models (the personalised model of p = 1/K).
"""

from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, per_client, sends, set_rows)
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"dr_lr": 1.0, "mu": 0.0, "l_share": 1.0}
RULES = {"dr_lr": between(0, 1e4), "mu": between(0, 1e4), "l_share": between(0, 1)}

REFERENCE = Reference(
    "Luo & Wu, 'Adapt to Adaptation: Learning Personalization for Cross-Silo Federated "
    "Learning', IJCAI 2022 (APPLE, Alg. 1: core models and DR vectors, the proximal term "
    "lam mu / 2 ||p_i - p0||^2 with its cosine schedule)",
    pfllib("servers/serverapple.py", "clients/clientapple.py"),
    ("only the sampled clients train each round (PFLlib trains all K); each downloads all K "
     "cores as they stood at the round's start (PFLlib's sequential clients see earlier "
     "clients' in-place updates)",
     "the trained core is uploaded, as the paper; PFLlib's client replaces its core with "
     "its last personalised mix",
     "lam(r) is the paper's at the round being trained; PFLlib's round r uses lam(r - 1)",
     "p0 is the data shares of the client sizes known so far (unknown ones: their mean); "
     "PFLlib computes the shares at the start",
     "dr_lr defaults to 1.0; PFLlib's dr_learning_rate 0 freezes every p_i at 1/K",
     "a client's personal model is its DR mix of the server's current cores; PFLlib "
     "evaluates the mix of its last local step"))


class AppleServer(NamedTuple):
    cores: PyTree  # (K, ...) every client's core model's parameters
    model_state: Dict[str, PyTree]  # the initial non-trainable state (global evaluation)
    sizes: jax.Array  # (K,) the clients' reported sizes (0: not yet reported)
    round: jax.Array


class AppleLocal(NamedTuple):
    core: PyTree  # c_i
    p: jax.Array  # (K,) p_i
    model_state: Dict[str, PyTree]
    p0: jax.Array  # (K,)
    reg: jax.Array  # lam(r) * mu
    client: jax.Array  # i
    size: jax.Array
    schedule: PyTree  # the client optimiser's warm-up, for lr'


def regularizer_weight(round_index: Any, last: int) -> jax.Array:
    """lam(r) = (1 + cos(pi r / L)) / 2 for r < L, else 0."""
    r = jnp.asarray(round_index, jnp.float32)
    if last <= 0:
        return jnp.zeros((), jnp.float32)
    return jnp.where(r < last, 0.5 * (1.0 + jnp.cos(math.pi * r / last)), 0.0)


def data_shares(sizes: jax.Array) -> jax.Array:
    """sizes / their sum, each unknown (0) size taken as the mean of the known ones
    (uniform where none is known)."""
    known = sizes > 0
    count = jnp.sum(known)
    fill = jnp.where(count > 0, jnp.sum(sizes) / jnp.maximum(count, 1), 1.0)
    full = jnp.where(known, sizes, fill)
    return full / jnp.sum(full)


def mix(p: jax.Array, cores: PyTree, own: PyTree, client: jax.Array) -> PyTree:
    """sum_j p_j c_j with c_client replaced by `own` (the stack is left as broadcast)."""
    return tree_map(lambda c, o: jnp.tensordot(p.astype(c.dtype), c, axes=1)
                    + p[client].astype(c.dtype) * (o - c[client]), cores, own)


def dr_gradient(g: PyTree, cores: PyTree, own: PyTree, client: jax.Array) -> jax.Array:
    """(K,) PFLlib's d loss / d p_j: sum over tensors l of mean(g_l * c_j,l), over the
    number of tensors; c_client is `own`."""
    g_leaves = jax.tree_util.tree_leaves(g)
    c_leaves = jax.tree_util.tree_leaves(cores)
    o_leaves = jax.tree_util.tree_leaves(own)
    total = 0.0
    for gl, cl, ol in zip(g_leaves, c_leaves, o_leaves):
        k = cl.shape[0]
        means = cl.reshape(k, -1).astype(jnp.float32) @ gl.reshape(-1).astype(jnp.float32)
        means = means / gl.size
        total = total + means.at[client].set(jnp.mean((gl * ol).astype(jnp.float32)))
    return total / len(g_leaves)


def apple(model: nn.Module, client_tx: optax.GradientTransformation, learning_rate: float,
          num_clients: int, server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
          dr_lr: float = 1.0, mu: float = 0.0, schedule_rounds: int = 0,
          loss: local_lib.LossSum = local_lib.masked_cross_entropy) -> FederatedAlgorithm:
    """APPLE over `num_clients` clients: core steps of learning_rate x K (warming up as
    `client_tx` does), DR steps of `dr_lr`, the proximal weight mu x lam(r) over the first
    `schedule_rounds` rounds (L)."""
    del server_tx  # nothing is averaged
    if learning_rate <= 0:
        raise ValueError(f"APPLE needs learning_rate > 0, got {learning_rate}")
    check_options(RULES, "apple", dr_lr=dr_lr, mu=mu)
    core_lr = learning_rate * num_clients  # PFLlib's

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        return AppleServer(per_client(params, num_clients), model_state,
                           jnp.zeros((num_clients,), jnp.float32), jnp.zeros((), jnp.int32))

    def client_state_init(server):
        return {"p": jnp.full((num_clients,), 1.0 / num_clients, jnp.float32),
                "model_state": server.model_state}

    def client_init(server, client_state, ctx):
        client = jnp.asarray(ctx.client_id, jnp.int32)
        size = jnp.asarray(ctx.num_examples, jnp.float32)
        core = tree_map(lambda c: c[client], server.cores)
        return AppleLocal(core, client_state["p"], client_state["model_state"],
                          data_shares(server.sizes.at[client].set(size)),
                          mu * regularizer_weight(ctx.round, schedule_rounds), client, size,
                          local_lib.schedule(client_tx, ctx.round))

    def client_step(local, batch, server):
        personal = mix(local.p, server.cores, local.core, local.client)

        def objective(params):
            mean, (loss_sum, new_state, _) = local_lib.mean_loss(model, params,
                                                                 local.model_state, batch, loss)
            return mean, (loss_sum, new_state)
        g, (loss_sum, new_state) = jax.grad(objective, has_aux=True)(personal)
        rate = core_lr * local_lib.warmup_factor(local.schedule) * local.p[local.client]
        core = tree_map(lambda c, gl: c - rate.astype(c.dtype) * gl, local.core, g)
        grad_p = dr_gradient(g, server.cores, core, local.client)
        p = local.p - dr_lr * (grad_p + local.reg * (local.p - local.p0))
        return (local._replace(core=core, p=p, model_state=new_state,
                               schedule=local_lib.tick(local.schedule)),
                {"loss_sum": loss_sum, "num_examples": jnp.sum(batch["mask"])})

    def client_output(local, server):
        del server
        return ({"core": local.core, "size": local.size},
                {"p": local.p, "model_state": local.model_state})

    def server_update(server, outputs, info):
        ids = info.client_ids
        return server._replace(cores=set_rows(server.cores, ids, outputs["core"]),
                               sizes=server.sizes.at[ids].set(outputs["size"]),
                               round=server.round + 1)

    def eval_variables(server):
        return {"params": tree_map(lambda c: jnp.mean(c, axis=0), server.cores),
                **server.model_state}

    def personal_variables(server, client_state):
        params = tree_map(lambda c: jnp.tensordot(client_state["p"].astype(c.dtype), c, axes=1),
                          server.cores)
        return {"params": params, **client_state["model_state"]}

    # Each client downloads all K core models (its DR vector stays with it).
    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               eval_variables=eval_variables, aggregator=every_output,
                               personal_variables=personal_variables,
                               download_bytes=sends("cores"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    o = cfg.apple
    return apple(model, client_tx, cfg.optimizer.lr, cfg.partition.num_clients, server_tx,
                 dr_lr=o.dr_lr, mu=o.mu, schedule_rounds=int(o.l_share * cfg.rounds))


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)

__all__ = ["apple", "mix", "dr_gradient", "regularizer_weight", "data_shares", "AppleServer",
           "AppleLocal", "OPTIONS", "RULES", "ENTRY"]
