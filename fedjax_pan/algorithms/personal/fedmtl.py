"""FedMTL (MOCHA: Smith et al., "Federated Multi-Task Learning", NeurIPS 2017), as PFLlib's
FedMTL implements it (servers/servermtl.py, clients/clientmtl.py).

Every client k keeps its own model w_k; nothing is averaged. The models are the columns of
W = [w_1 ... w_K] (d, K), and the paper couples them through

    min_W  sum_k f_k(w_k) + R(W),   R(W) = lambda tr(W Omega W^T),
    Omega = (I - 1/K 1 1^T)^2   (mean-regularised multi-task learning),

so tr(W Omega W^T) = ||W||_F^2 - ||W 1||^2 / K = sum_k ||w_k - mean_j w_j||^2.

PFLlib's code minimises another R (`regularizer = "pfllib"`, the default here):

    R(W) = 10^-f (||W||_F^2 + omega^2 ||W 1||^2),   omega = 1 - 1/K,
    f = int(log10(d) + 1) + 1   (d's number of digits plus one),

because its `I` is `torch.ones`, not the identity: its Omega = ((1 - 1/K) 1 1^T)^2
(elementwise) has every entry (1 - 1/K)^2, the client keeps the scalar
omega = sqrt(Omega[0][0]), and `sum((W * omega), 1) ** 2` summed is omega^2 ||W 1||^2.
`lamba = 1e-4` is set and never used; the 10^-f factor is the scale. `-itk` (4000) only
sizes a chunked loop that is commented out: no option here. `regularizer = "paper"` is the
paper's lambda tr(W Omega W^T) with the identity's Omega. `lam` replaces the scale of
either (None: PFLlib's 10^-f).

A round: each sampled client receives the stack of every client's latest model, trains
its own column w_k with the others held fixed, on f_k(w_k) (mean cross-entropy) + R(W)
at every local step (as clientmtl.py, which writes its current model into its copy of W
before each step), and uploads w_k; the server writes it into column k. Its own model is
what a client evaluates. Gradients: d/dw_k of ||W||^2 + c ||W 1||^2 is
2 w_k + 2 c W 1; the other columns enter only through their sum and sum of squares,
computed once a round (`other_columns`).

Deviations from PFLlib, and why:
- PFLlib's regulariser has no gradient: `flatten` reads `model.state_dict()`, whose
  tensors are detached, so R(W) enters its loss as a constant and its clients train
  exactly as Local training does. Here R is differentiated in w_k, as the paper and
  the code's intent have it; `lam = 0` reproduces PFLlib's training exactly.
- W holds all K clients' latest models (clients never sampled: the initial model), and
  K in omega is the number of clients. PFLlib's W holds only the round's M sampled
  clients' models (as they stood before the round) and uses K = M; a client here cannot
  know who else is sampled. Under full participation the two coincide.
- d counts the parameters and the non-trainable state (BatchNorm statistics), as
  PFLlib's flattened state_dict does less its `num_batches_tracked` counters; W itself
  holds the parameters only (PFLlib's buffers in W are constants: they change R's value,
  not its gradient).
- There is no global model: the global evaluation shows the initial one (as KT-pFL's).
Not reproduced: PFLlib's slow clients (`train_slow`) and learning-rate decay.
"""

from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from ml_collections.config_dict import placeholder

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, own_model, per_client, sends,
                                        server_model, set_rows)
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options, one_of

PyTree = Any
tree_map = jax.tree_util.tree_map
REGULARIZERS = ("pfllib", "paper")
OPTIONS = {"lam": placeholder(float), "regularizer": "pfllib"}
RULES = {"lam": between(0, 1e4, optional=True), "regularizer": one_of(REGULARIZERS)}


REFERENCE = Reference(
    "Smith, Chiang, Sanjabi and Talwalkar, 'Federated Multi-Task Learning', NeurIPS 2017 "
    "(MOCHA: min_W sum_k f_k(w_k) + lambda tr(W Omega W^T), mean-regularised Omega), as "
    "PFLlib's FedMTL implements it",
    pfllib("servers/servermtl.py", "clients/clientmtl.py"),
    ("the regulariser is differentiated in w_k (the paper's and the code's intent); "
     "PFLlib's reads detached state_dict tensors, so R enters its loss as a constant and "
     "its clients train as Local does (lam = 0 reproduces that)",
     "W holds all K clients' latest models (never sampled: the initial model) and omega "
     "uses K clients; PFLlib's W holds the round's M sampled clients' models and uses M "
     "(equal under full participation)",
     "d omits BatchNorm's num_batches_tracked counters and W holds the parameters only "
     "(PFLlib's buffers in W are constants: they change R's value, not its gradient)",
     "the default regularizer='pfllib' is PFLlib's R (torch.ones for I, scale 10^-f); "
     "'paper' is lambda tr(W Omega W^T); MOCHA's primal-dual solver and its learned Omega "
     "are not reproduced (SGD on the primal with a fixed Omega, as PFLlib)",
     "there is no global model: the global evaluation shows the initial one"))


class MtlServer(NamedTuple):
    params: PyTree  # the initial model (evaluated as the "global" one)
    model_state: Dict[str, PyTree]
    stack: PyTree  # W: every client's latest parameters, leaves (K, ...)
    round: jax.Array


class MtlLocal(NamedTuple):
    train: local_lib.LocalState
    others_sum: PyTree  # sum_{j != k} w_j
    others_sq: jax.Array  # sum_{j != k} ||w_j||^2


def pfllib_scale(d: int) -> float:
    """PFLlib's factor 10^-f, f = int(log10(d) + 1) + 1, for a model of d numbers."""
    return 10.0 ** -(int(math.log10(d) + 1) + 1)


def coefficients(regularizer: str, num_clients: int) -> Tuple[float, float]:
    """(a, c) with R(W) = scale (a ||W||_F^2 + c ||W 1||^2): PFLlib's (1, (1 - 1/K)^2),
    the paper's tr(W (I - 11^T/K)^2 W^T) = (1, -1/K)."""
    if regularizer not in REGULARIZERS:
        raise ValueError(f"unknown FedMTL regularizer {regularizer!r}; expected one of "
                         f"{REGULARIZERS}")
    if regularizer == "pfllib":
        return 1.0, (1.0 - 1.0 / num_clients) ** 2
    return 1.0, -1.0 / num_clients


def other_columns(stack: PyTree, k: Any) -> Tuple[PyTree, jax.Array]:
    """(sum_{j != k} w_j, sum_{j != k} ||w_j||^2) of the stack's columns (leaves (K, ...))."""
    def masked(x):
        keep = (jnp.arange(x.shape[0]) != k).reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, x, 0)
    others = tree_map(masked, stack)
    return (tree_map(lambda x: jnp.sum(x, 0), others),
            sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(others)))


def regularizer_value(params: PyTree, others_sum: PyTree, others_sq: jax.Array,
                      scale: float, coef: Tuple[float, float]) -> jax.Array:
    """R(W) with client k's column `params`, the others given by their sum and sum of
    squares: scale (a (||w_k||^2 + others_sq) + c ||w_k + others_sum||^2)."""
    a, c = coef
    own_sq = sum(jnp.sum(jnp.square(p)) for p in jax.tree_util.tree_leaves(params))
    col_sq = sum(jnp.sum(jnp.square(p + s)) for p, s in
                 zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(others_sum)))
    return scale * (a * (own_sq + others_sq) + c * col_sq)


def fedmtl(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
           lam: Optional[float] = None, regularizer: str = "pfllib") -> FederatedAlgorithm:
    """FedMTL over `num_clients` clients; `lam` None: PFLlib's scale 10^-f (module doc).
    `server_tx` is unused: nothing is averaged."""
    del server_tx
    check_options(RULES, "fedmtl", lam=lam, regularizer=regularizer)
    coef = coefficients(regularizer, num_clients)
    if num_clients < 1:
        raise ValueError(f"FedMTL needs num_clients >= 1, got {num_clients}")

    def scale_of(params, model_state):
        if lam is not None:
            return float(lam)
        d = sum(int(x.size) for x in jax.tree_util.tree_leaves((params, model_state)))
        return pfllib_scale(d)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        return MtlServer(params, model_state, per_client(params, num_clients),
                         jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        train = local_lib.init_local(client_tx, client_state, server.round)
        others_sum, others_sq = other_columns(server.stack, ctx.client_id)
        return MtlLocal(train, others_sum, others_sq)

    def client_step(local, batch, server):
        scale = scale_of(server.params, server.model_state)

        def reg(params, train, batch, logits):
            del train, logits
            term = regularizer_value(params, local.others_sum, local.others_sq, scale, coef)
            return term, {"reg_sum": term * jnp.sum(batch["mask"])}
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch,
                                            extra_loss=reg)
        return local._replace(train=train), metrics

    def client_output(local, server):
        del server
        return local.train.params, local_lib.model_variables(local.train)

    def server_update(server, outputs, info):
        stack = set_rows(server.stack, info.client_ids, outputs)
        return server._replace(stack=stack, round=server.round + 1)

    # Every client's model starts as the initial one (PFLlib deep-copies args.model); each
    # sampled client receives W, all K columns (PFLlib deep-copies W_glob).
    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               aggregator=every_output, personal_variables=own_model,
                               download_bytes=sends("stack"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedmtl(model, client_tx, cfg.partition.num_clients, server_tx,
                  lam=cfg.fedmtl.lam, regularizer=cfg.fedmtl.regularizer)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
