"""FedCross (Hu et al., ICDE 2024, "FedCross: Towards Accurate
Federated Learning via Multi-Model Cross-Aggregation"): the server keeps several
middleware models instead of one global model; each is trained by a client and then
mixed with one collaborative model chosen among the others.

A round: each of the M clients trains a middleware model w_j; the server then forms,
for every j,

    w_j <- alpha w_j + (1 - alpha) w_c(j)

c(j) the collaborative model, by `strategy`: 'cyclic' c(j) = (j + t mod (M - 1) + 1) mod M
(t the round), 'least_similar' the model least similar to w_j, 'most_similar' the most
similar one, where the similarity of two models is the sum over layers of the cosine
similarity of the layer's parameters. The global model, deployed and evaluated as the
"global" one, is the weighted mean of the round's trained models (FedAvg's). During the
first `first_stage_bound` rounds every middleware model is instead replaced by the global
model (a warm-up of FedAvg).

As PFLlib's servercross.py / clientcross.py (the paper leaves these open):
- alpha = `fedcross.alpha` (PFLlib's -ca, 0.99), strategy 'least_similar' (PFLlib's
  -cmss 1), first_stage_bound 0 (-fsb);
- similarities are those of the trained models; PFLlib sums the cosine over consecutive
  pairs of `state_dict` entries (a layer's weight and bias) and adds the last pair once
  more: here over each layer's parameters (a top-level parameter scope, in the model's
  call order), the last layer counted twice; a model's similarity to itself is 0, so
  'most_similar' picks the model itself where every other is negatively similar;
- ties go as PFLlib's loop sends them: 'most_similar' to the lowest index,
  'least_similar' to (j + 1) mod M, then the lowest index;
- only parameters are mixed (a middleware model keeps its own BatchNorm statistics), and
  the first stage's reset replaces parameters only;
- a client evaluates its model as it last trained it (PFLlib's evaluate() scores the
  clients' own models; the initial model before it has trained).

Deviation, for a reason: PFLlib keeps M middleware models (M the clients a round) and
hands the j-th to the round's j-th sampled client, so a middleware model visits a random
client each round. Here a client learns only its own id, not its place in the round, so
the server keeps one middleware model per client (K of them) and a sampled client trains
its own; the M models trained in a round are cross-aggregated among themselves exactly as
PFLlib's and stored back, the others unchanged. Under full participation this is PFLlib's
with a fixed dispatch; mixing between clients comes from the cross-aggregation alone.
With one client a round there is no other model: it keeps its own.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan import models as models_lib
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, own_model, per_client,
                                        server_model, set_rows)
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options, one_of

PyTree = Any
tree_map = jax.tree_util.tree_map
STRATEGIES = ("cyclic", "least_similar", "most_similar")  # PFLlib's -cmss 0, 1, 2
OPTIONS = {"alpha": 0.99, "strategy": "least_similar", "first_stage_bound": 0}
RULES = {"alpha": between(0, 1), "strategy": one_of(STRATEGIES),
         "first_stage_bound": between(0, 1e6, integer=True)}
EPS = 1e-8  # PyTorch's cosine_similarity clamps each norm at eps


REFERENCE = Reference(
    "Hu et al., 'FedCross: Towards Accurate Federated "
    "Learning via Multi-Model Cross-Aggregation', ICDE 2024 (Algorithm 1: middleware models "
    "trained by clients, then w_j <- alpha w_j + (1 - alpha) w_c(j) by the collaborative "
    "model selection strategy)",
    pfllib("servers/servercross.py", "clients/clientcross.py"),
    ("the server keeps one middleware model per client and a sampled client trains its "
     "own; PFLlib keeps M (the clients a round) and hands the j-th to the round's j-th "
     "sampled client, so a middleware model visits a random client each round (equal under "
     "full participation up to the dispatch)",
     "with one client a round it keeps its own model (PFLlib's cyclic offset divides by "
     "M - 1 = 0)",
     "similarities are summed over each layer's parameters (the last layer twice); PFLlib "
     "pairs consecutive state_dict entries, which with BatchNorm buffers do not align with "
     "layers",
     "the global model (the round's weighted mean, BatchNorm statistics averaged) is "
     "evaluated as the 'global' one; PFLlib computes it (with the first uploaded client's "
     "statistics) but scores only the clients' own models"))


class CrossServer(NamedTuple):
    params: PyTree  # the global model (the round's weighted mean)
    model_state: Dict[str, PyTree]
    middleware: PyTree  # (K, ...) every client's middleware model's variables
    round: jax.Array


def _flat(tree: PyTree) -> jax.Array:
    """(M, n): each of the stacked (M, ...) leaves flattened and joined."""
    return jnp.concatenate([x.reshape(x.shape[0], -1).astype(jnp.float32)
                            for x in jax.tree_util.tree_leaves(tree)], axis=1)


def similarities(params: PyTree, order: List[str]) -> jax.Array:
    """(M, M) sum over layers `order` (the last twice) of the cosine similarity of the
    stacked models' layer parameters; the diagonal 0 (PFLlib's)."""
    total = 0.0
    for name in order + order[-1:]:
        v = _flat(params[name])
        norms = jnp.maximum(jnp.linalg.norm(v, axis=1), EPS)
        total = total + (v @ v.T) / (norms[:, None] * norms[None, :])
    m = total.shape[0]
    return jnp.where(jnp.eye(m, dtype=bool), 0.0, total)


def collaborators(sim: jax.Array, round_index: jax.Array, strategy: str) -> jax.Array:
    """(M,) c(j) for every j, as PFLlib's cross_aggregation picks it."""
    m = sim.shape[0]
    j = jnp.arange(m)
    if m == 1:
        return j
    if strategy == "cyclic":
        offset = jnp.asarray(round_index, jnp.int32) % (m - 1) + 1
        return (j + offset) % m
    if strategy == "most_similar":
        return jnp.argmax(sim, axis=1)  # the first maximum, the diagonal's 0 included
    off = jnp.where(jnp.eye(m, dtype=bool), jnp.inf, sim)
    lowest = off == jnp.min(off, axis=1, keepdims=True)
    start = (j + 1) % m
    return jnp.where(lowest[j, start], start, jnp.argmax(lowest, axis=1))


def fedcross(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
             server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
             alpha: float = 0.99, strategy: str = "least_similar",
             first_stage_bound: int = 0,
             loss: local_lib.LossSum = local_lib.masked_cross_entropy
             ) -> FederatedAlgorithm:
    """FedCross over `num_clients` clients, each with a middleware model."""
    del server_tx  # the global model is the weighted mean itself (PFLlib's)
    check_options(RULES, "fedcross", alpha=alpha, strategy=strategy,
                  first_stage_bound=first_stage_bound)

    def order(params):
        if hasattr(model, "weight_layers"):
            return models_lib.layer_order(model, params)
        return sorted(params)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        return CrossServer(params, model_state, per_client(variables, num_clients),
                           jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        del client_state
        mine = tree_map(lambda s: jnp.asarray(s)[ctx.client_id], server.middleware)
        return local_lib.init_local(client_tx, mine, server.round)

    def client_step(local, batch, server):
        del server
        return local_lib.sgd_step(model, client_tx, local, batch, loss=loss)

    def client_output(local, server):
        del server
        variables = {"params": local.params, **local.model_state}
        return variables, variables

    def server_update(server, outs, info):
        w, ids = info.weights, info.client_ids
        present = w > 0
        mean = tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1), outs)
        params, model_state = local_lib.split_variables(mean)
        trained = outs["params"]
        sim = similarities(trained, order(server.params))
        pick = collaborators(sim, info.round, strategy)
        pick = jnp.where(present[pick], pick, jnp.arange(pick.shape[0]))
        crossed = tree_map(lambda x: alpha * x + (1.0 - alpha) * x[pick], trained)
        middleware = set_rows(server.middleware, ids, {**outs, "params": crossed}, present)
        # The first stage: every middleware model takes the global model's parameters.
        first = server.round < first_stage_bound
        reset = tree_map(lambda s, g: jnp.where(first, jnp.broadcast_to(g, s.shape), s),
                         middleware["params"], params)
        return CrossServer(params, model_state, {**middleware, "params": reset},
                           server.round + 1)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               aggregator=every_output, personal_variables=own_model)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    o = cfg.fedcross
    return fedcross(model, client_tx, cfg.partition.num_clients, server_tx, alpha=o.alpha,
                    strategy=o.strategy, first_stage_bound=o.first_stage_bound)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)

__all__ = ["fedcross", "similarities", "collaborators", "CrossServer", "STRATEGIES",
           "OPTIONS", "RULES", "ENTRY"]
