"""FedCAC (Wu et al., ICCV 2023, "Bold but Cautious: Unlocking the Potential of
Personalized Federated Learning through Cautiously Aggregating Collaborative Knowledge"):
each client keeps its critical parameters from a customised global model of the clients
whose critical parameters lie where its own do, and takes the rest from the global model.

After its local training from w_i^0 to w_i, client i scores every parameter by its
sensitivity (a first-order estimate of the loss change if it were zeroed)

    s_i = | (w_i - w_i^0) * w_i |

and marks the top tau share of each layer's parameters (each parameter tensor) critical:
its mask c_i (1 critical, 0 not). The server averages the uploaded models into the global
model w_g (weighted as FedAvg's) and, among the round's M clients, measures how far two
clients' critical parameters overlap,

    o_ij = 1 - sum |c_i - c_j| / (2 sum c_i),

with the threshold  T = mean_{i!=j} o_ij + (t + 1) / beta * (max_{i!=j} o_ij - mean), t
the round from 0. Client i's customised global model u_i is the plain mean of w_i and
every w_j with o_ij >= T; collaboration narrows as rounds pass (beta rounds in, only the
most-overlapping clients remain). A client's model, which it evaluates and starts its next
round from, is

    w_i <- c_i * u_i + (1 - c_i) * w_g          (the global model, until it has trained).

As PFLlib's servercac.py / clientcac.py (the paper leaves these open):
- a tensor's threshold is its floor(tau x n)-th largest score (none critical where
  floor(tau x n) = 0); where it is <= 1e-10 it becomes the smallest score above 1e-20
  (all critical where every score is 0); ties at the threshold are all critical;
- o_ij and T are over the round's clients only; the customised mean is unweighted;
- every client, sampled or not, takes the current global model for its non-critical
  parameters (PFLlib sends the global model to every client each round) with its last
  customised model and mask for the critical ones.

Deviations, each for a reason:
- Defaults: PFLlib's defaults (tau = 1.0, MOON's; beta = 0, which fails its own
  `assert beta >= 1`) do not run FedCAC; the defaults here are the authors' released
  configuration (Fling: tau = 0.5, beta = 100).
- Non-trainable state (BatchNorm statistics) is the global model's, averaged as FedAvg's
  (PFLlib mixes parameters only and its clients keep their own running statistics): a
  client's model is then the global model's state plus its parameters, stored once.
- PFLlib builds no customised model in round 0 (its `epoch != 0` test), so after round 0
  the critical parameters take the values of the customised-model copy made at client
  creation (the initial model): a side effect, not the paper's method. Here round 0
  builds them as every round does.
- With one client a round there is no pair to compare: its customised model is its own.
- A mask is a threshold on scores: where a parameter's gradient is rounding noise alone
  (a bias in front of BatchNorm) its mask can differ between two executions that agree
  to rounding.
The server keeps every client's latest customised model ((K, ...) parameters); a client
keeps its mask (one byte a parameter). Communication: a client uploads its model and its
mask and receives the global model, plus its customised model once it has one
(`download_bytes`).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, per_client, server_model,
                                        set_rows, tree_bytes)
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"tau": 0.5, "beta": 100}
RULES = {"tau": between(0, 1), "beta": between(1, 1e6, integer=True)}
TINY, NONZERO = 1e-10, 1e-20  # PFLlib's thresholds


REFERENCE = Reference(
    "Wu et al., 'Bold but Cautious: Unlocking the Potential of Personalized "
    "Federated Learning through Cautiously Aggregating Collaborative Knowledge', ICCV 2023 "
    "(FedCAC: the sensitivity |dw * w|, the per-layer top-tau critical mask, the overlap "
    "o_ij, the threshold T and the customised global model, Algorithm 1)",
    pfllib("servers/servercac.py", "clients/clientcac.py"),
    ("defaults tau = 0.5, beta = 100 are the authors' released configuration (Fling); "
     "PFLlib's defaults (tau = 1.0, beta = 0, which fails its own assert beta >= 1) do not "
     "run FedCAC",
     "BatchNorm statistics are the global model's, averaged as FedAvg's; PFLlib mixes "
     "parameters only and its clients keep their own running statistics",
     "round 0 builds customised models as every round does; PFLlib builds none in round 0 "
     "(its epoch != 0 test), so after round 0 its critical parameters take the initial "
     "model's values",
     "with one client in a round its customised model is its own (PFLlib's threshold "
     "over no pairs is undefined)"))


class CacServer(NamedTuple):
    params: PyTree  # the global model w_g
    model_state: Dict[str, PyTree]
    customized: PyTree  # (K, ...) each client's latest customised model u_i
    built: jax.Array  # (K,) bool: u_i exists
    round: jax.Array


class CacLocal(NamedTuple):
    train: local_lib.LocalState
    start: PyTree  # w_i^0, the parameters training started from
    client_id: jax.Array


def critical_mask(start: PyTree, trained: PyTree, tau: float) -> PyTree:
    """Per parameter tensor: True where |(trained - start) * trained| reaches the tensor's
    threshold (the module docstring's rule)."""
    def one(w0, w):
        score = jnp.abs((w - w0) * w).astype(jnp.float32)
        flat = score.reshape(-1)
        k = int(tau * flat.size)
        thresh = jnp.sort(flat)[::-1][k - 1] if k > 0 else jnp.float32(jnp.inf)
        positive = flat > NONZERO
        smallest = jnp.min(jnp.where(positive, flat, jnp.inf))
        thresh = jnp.where((thresh <= TINY) & jnp.any(positive), smallest, thresh)
        return score >= thresh
    return tree_map(one, start, trained)


def overlaps(masks: PyTree) -> jax.Array:
    """(M, M) o_ij = 1 - sum |c_i - c_j| / (2 sum c_i) of stacked (M, ...) masks: for 0/1
    vectors sum |c_i - c_j| = s_i + s_j - 2 c_i.c_j."""
    flat = [m.reshape(m.shape[0], -1).astype(jnp.float32)
            for m in jax.tree_util.tree_leaves(masks)]
    gram = sum(f @ f.T for f in flat)
    sums = jnp.diagonal(gram)
    apart = sums[:, None] + sums[None, :] - 2.0 * gram
    return 1.0 - apart / (2.0 * jnp.maximum(sums, 1.0)[:, None])


def collaborators(overlap: jax.Array, round_index: jax.Array, beta: float) -> jax.Array:
    """(M, M) 0/1: client j joins i's customised model (i itself always)."""
    m = overlap.shape[0]
    eye = jnp.eye(m, dtype=bool)
    if m == 1:
        return eye.astype(jnp.float32)
    off = jnp.where(eye, 0.0, overlap)
    avg = jnp.sum(off) / (m * (m - 1))
    top = jnp.max(jnp.where(eye, -jnp.inf, overlap))
    thresh = avg + (jnp.asarray(round_index, jnp.float32) + 1.0) / beta * (top - avg)
    return (eye | (overlap >= thresh)).astype(jnp.float32)


def fedcac(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *, tau: float = 0.5,
           beta: int = 100, loss: local_lib.LossSum = local_lib.masked_cross_entropy
           ) -> FederatedAlgorithm:
    """FedCAC over `num_clients` clients, critical share `tau`, collaboration horizon
    `beta` rounds; the global model is the plain weighted mean (no server optimiser)."""
    del server_tx  # PFLlib's global model is the weighted mean itself
    check_options(RULES, "fedcac", tau=tau, beta=beta)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        return CacServer(params, model_state, per_client(params, num_clients),
                         jnp.zeros((num_clients,), bool), jnp.zeros((), jnp.int32))

    def client_state_init(server):
        return {"critical": tree_map(lambda p: jnp.zeros(p.shape, bool), server.params),
                "trained": jnp.zeros((), bool), "id": jnp.zeros((), jnp.int32)}

    def own_model(server, client_state, client_id):
        """c_i * u_i + (1 - c_i) * w_g, or w_g before the client has trained."""
        custom = tree_map(lambda s: jnp.asarray(s)[client_id], server.customized)
        return tree_map(lambda c, u, g: jnp.where(c & client_state["trained"], u, g),
                        client_state["critical"], custom, server.params)

    def client_init(server, client_state, ctx):
        start = own_model(server, client_state, ctx.client_id)
        train = local_lib.init_local(client_tx, {"params": start, **server.model_state},
                                     server.round)
        return CacLocal(train, start, jnp.asarray(ctx.client_id, jnp.int32))

    def client_step(local, batch, server):
        del server
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch, loss=loss)
        return local._replace(train=train), metrics

    def client_output(local, server):
        del server
        mask = critical_mask(local.start, local.train.params, tau)
        output = {"params": local.train.params, "model_state": local.train.model_state,
                  "critical": mask}
        return output, {"critical": mask, "trained": jnp.ones((), bool), "id": local.client_id}

    def server_update(server, outs, info):
        w = info.weights
        mean = lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1)  # noqa: E731
        params = tree_map(mean, outs["params"])
        model_state = tree_map(mean, outs["model_state"])
        together = collaborators(overlaps(outs["critical"]), info.round, float(beta))
        # Slots without an output (weight 0) join no one's model.
        together = together * (w > 0).astype(jnp.float32)[None, :]
        share = together / jnp.sum(together, axis=1, keepdims=True)
        custom = tree_map(lambda x: jnp.tensordot(share.astype(x.dtype), x, axes=1),
                          outs["params"])
        ids, present = info.client_ids, w > 0
        return CacServer(params, model_state, set_rows(server.customized, ids, custom, present),
                         server.built.at[ids].set(server.built[ids] | present),
                         server.round + 1)

    def personal_variables(server, client_state):
        return {"params": own_model(server, client_state, client_state["id"]),
                **server.model_state}

    def download_bytes(server, client_ids, round_index):
        del round_index
        glob = tree_bytes(server_model(server))
        custom = tree_bytes(server.params)
        return jnp.where(jnp.asarray(server.built)[jnp.asarray(client_ids)], glob + custom,
                         glob).astype(jnp.int32)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               aggregator=every_output, personal_variables=personal_variables,
                               download_bytes=download_bytes)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedcac(model, client_tx, cfg.partition.num_clients, server_tx,
                  tau=cfg.fedcac.tau, beta=cfg.fedcac.beta)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)

__all__ = ["fedcac", "critical_mask", "overlaps", "collaborators", "CacServer", "CacLocal",
           "OPTIONS", "RULES", "ENTRY"]
