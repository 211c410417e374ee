"""FedGH (Yi et al., ACM MM 2023, "FedGH: Heterogeneous Federated Learning with
Generalized Global Header"): clients of any network share one linear head, which the
server trains on their class prototypes.

Every client keeps its own model. At the start of a round its head is replaced by the
global head; it trains its whole model on its own data (cross-entropy), then computes
its class prototypes, the mean representation f(x) (the head's input) of each class it
holds, with the trained model in one pass over its data. The server trains the global
head on the reported (prototype, class) pairs, one epoch of minibatches of the clients'
batch size in a shuffled order, by SGD at `server_lr`.

As PFLlib's servergh.py / clientgh.py: every reported pair is one training example (no
weighting by the clients' sizes), the pass uses `local.batch_size` and keeps a last
partial batch, the server's rate is PFLlib's `server_learning_rate` (1.0), and a client is
scored with its own body and the current global head (PFLlib evaluates after handing out
the head). The global head starts as a draw from the seed, the same for every network
(PFLlib's is the first client's head module itself, not a copy, so that client's local
training moves the global head too; here only the server's pass does). The prototype
pass is the last round(share x steps) local steps of the round (`fedgh.collect_epochs` out
of `local.epochs`, 1.0: one pass). The order of the server's pass is drawn from (seed,
round). Outputs are (C, D) prototypes whatever the client's network, so clients may run
several whose representations
are equally wide (`model.architectures`). Each client downloads the head and uploads its
prototypes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, sends, server_model)
from fedjax_pan.algorithms.personal.fedproto import class_means, train_then_collect
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
OPTIONS = {"server_lr": 1.0, "collect_epochs": 1.0}
RULES = {"server_lr": between(0, 100, lo_open=True),
         "collect_epochs": between(0, 1000, lo_open=True)}
HEAD_STREAM = 0x6768  # the global head's key, folded into the seed's


REFERENCE = Reference(
    "Yi et al., 'FedGH: Heterogeneous Federated Learning with Generalized Global Header', "
    "ACM MM 2023 (the global head trained by the server on the clients' class prototypes, "
    "Algorithm 1)",
    pfllib("servers/servergh.py", "clients/clientgh.py"),
    ("the prototype pass (eval mode) is the last round(collect_epochs x steps) local steps "
     "of the round; PFLlib adds one pass over the data after the local epochs",
     "the global head starts as a draw from the seed, the same for every network; PFLlib's "
     "is the first client's head module itself, so that client's local training also moves "
     "the global head (here only the server's pass does)",
     "the order of the server's pass is drawn from (seed, round), not PyTorch's generator"))


class GhServer(NamedTuple):
    params: PyTree  # this network's initial model (the global evaluation's body)
    model_state: PyTree
    head: PyTree  # {'kernel': (D, C), 'bias': (C,)} the global head
    round: jax.Array


class GhLocal(NamedTuple):
    train: local_lib.LocalState
    collect_from: jax.Array
    sums: jax.Array  # (C, D)
    counts: jax.Array  # (C,)


def train_head(head: PyTree, protos: jax.Array, has: jax.Array, lr: float, batch_size: int,
               key: jax.Array) -> PyTree:
    """One epoch of SGD on the mean cross-entropy of `head` over the reported pairs
    (protos (M, C, D), has (M, C)): minibatches of `batch_size` in a random order of the
    pairs, the last one partial."""
    m, c, d = protos.shape
    x, y = protos.reshape(m * c, d), jnp.tile(jnp.arange(c), m)
    valid = has.reshape(m * c) > 0
    # Valid pairs first, shuffled; the rest after them, in no batch of a valid pair.
    order = jnp.argsort(jnp.where(valid, jax.random.uniform(key, (m * c,)), 2.0))
    x, y, mask = x[order], y[order], valid[order].astype(jnp.float32)
    batches = -(-m * c // batch_size)
    pad = batches * batch_size - m * c
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(batches, batch_size, d)
    y = jnp.pad(y, (0, pad)).reshape(batches, batch_size)
    mask = jnp.pad(mask, (0, pad)).reshape(batches, batch_size)

    def step(h, batch):
        bx, by, bm = batch

        def loss(h):
            logits = bx @ h["kernel"] + h["bias"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, by)
            return jnp.sum(ce * bm) / jnp.maximum(jnp.sum(bm), 1.0)
        g = jax.grad(loss)(h)
        return jax.tree_util.tree_map(lambda p, gp: p - lr * gp, h, g), None
    head, _ = jax.lax.scan(step, head, (x, y, mask))
    return head


def fedgh(model: nn.Module, client_tx: optax.GradientTransformation, collect_share: float,
          *, server_lr: float = 1.0, batch_size: int = 64, seed: int = 0
          ) -> FederatedAlgorithm:
    """FedGH for a `model` that sows 'features' and ends in one linear head; the server
    trains the head at `server_lr` in minibatches of `batch_size`."""
    check_options(RULES, "fedgh", server_lr=server_lr)
    if batch_size < 1:
        raise ValueError(f"FedGH needs batch_size >= 1, got {batch_size}")
    local_lib.check_share(collect_share, "FedGH's share of local steps collecting "
                                         "prototypes")

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        d, c = linear_head(params, "FedGH")["kernel"].shape
        # One global head for every network: drawn from the seed (as flax's Dense draws
        # its kernel), not from any one network's initialisation.
        kernel = nn.initializers.lecun_normal()(
            jax.random.fold_in(jax.random.PRNGKey(seed), HEAD_STREAM), (d, c), jnp.float32)
        return GhServer(params, model_state, {"kernel": kernel, "bias": jnp.zeros(c)},
                        jnp.zeros((), jnp.int32))

    def with_head(variables, head):
        return {**variables, "params": {**variables["params"], HEAD: head}}

    def client_init(server, client_state, ctx):
        steps = jnp.asarray(ctx.num_steps, jnp.int32)
        d, c = server.head["kernel"].shape
        return GhLocal(local_lib.init_local(client_tx, with_head(client_state, server.head),
                                            ctx.round),
                       steps - local_lib.phase_steps(collect_share, ctx.num_steps),
                       jnp.zeros((c, d), jnp.float32), jnp.zeros((c,), jnp.float32))

    def train_step(local, batch, server):
        del server
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch)
        return local._replace(train=train), metrics

    client_step = train_then_collect(train_step, local_lib.WithFeatures(model))

    def client_output(local, server):
        del server
        protos, has = class_means(local.sums, local.counts)
        return {"protos": protos, "has": has}, local_lib.model_variables(local.train)

    def server_update(server, outputs, info):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), info.round)
        # A slot of weight 0 holds no report.
        has = outputs["has"] * (info.weights > 0)[:, None]
        head = train_head(server.head, outputs["protos"], has, server_lr, batch_size, key)
        return server._replace(head=head, round=server.round + 1)

    def eval_variables(server):
        return {"params": {**server.params, HEAD: server.head}, **server.model_state}

    def personal_variables(server, client_state):
        return with_head(client_state, server.head)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               eval_variables=eval_variables, aggregator=every_output,
                               personal_variables=personal_variables,
                               download_bytes=sends("head"))


_collect_share = local_lib.epochs_share("fedgh", "collect_epochs", "the prototype pass is")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # the head is trained on the server, not averaged
    return fedgh(model, client_tx, _collect_share(cfg), server_lr=cfg.fedgh.server_lr,
                 batch_size=cfg.local.batch_size, seed=cfg.seed)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_collect_share,
                       heterogeneous=True, reference=REFERENCE)
