"""FD, federated distillation (Jeong et al., "Communication-Efficient On-Device Machine
Learning: Federated Distillation and Augmentation under Non-IID Private Data", 2018):
clients share per-class average logits, not models.

Every client keeps its own model. While it trains it records, for each class j, the mean
of its model's logits on its examples of class j; the server averages each class's
logits over the clients that report it (the global average logits G_j). A client trains on

    CE(f(x), y) + lam * CE(softmax(G_y), softmax(f(x)))

(rows of a class without global logits add no distillation term; PFLlib's target for such
a row is its own detached logits, a term with a gradient). As PFLlib's
clientfd.py / serverfd.py: the means run over every local step's outputs of the round (all
epochs, the model as it trains), the server's over the round's reporting clients (a class
nobody reports drops out; PFLlib's mean is unweighted, as here under the default
`aggregation.weights` 'uniform'; 'num_examples' weighs them by their sizes), and the
distillation target comes from the global logits of the example's label. PFLlib passes
the raw logits G_y as the cross-entropy's target "probabilities" (unnormalised, possibly
negative); here the target is the distribution softmax(G_y), the paper's teacher output.
Clients evaluate their own models; each downloads the (C, C) global logits. Outputs are
(C, C) whatever the client's network, so clients may run several
(`model.architectures`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, own_model, sends, server_model,
                                        weighted_sum)
from fedjax_pan.algorithms.personal.fedproto import (ProtoLocal, class_means, collecting_sgd_step,
                                            reported_means)
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between, check_options

PyTree = Any
OPTIONS = {"lam": 1.0}
RULES = {"lam": between(0, 1e4)}


REFERENCE = Reference(
    "Jeong et al., 'Communication-Efficient On-Device Machine Learning: Federated "
    "Distillation and Augmentation under Non-IID Private Data', 2018, arXiv:1811.11479 "
    "(FD: per-class average logits, averaged by the server, distilled "
    "as the teacher's output)",
    pfllib("servers/serverfd.py", "clients/clientfd.py"),
    ("the distillation target is the distribution softmax(G_y), the paper's teacher "
     "output; PFLlib passes the raw logits G_y as CrossEntropyLoss's target "
     "probabilities (unnormalised, possibly negative)",
     "a row whose label has no global logits adds no distillation term; PFLlib's target "
     "for it is the row's own detached logits, a term with a gradient",
     "the server's mean over the clients reporting a class follows aggregation.weights "
     "(the default 'uniform' is PFLlib's unweighted mean; 'num_examples' weighs by size)"))


class FdServer(NamedTuple):
    params: PyTree  # this network's initial model (the global evaluation's)
    model_state: PyTree
    logits: jax.Array  # (C, C) global average logits by class
    present: jax.Array  # (C,) 1.0 where some client reported the class last round
    round: jax.Array


def distillation(logits: jax.Array, labels: jax.Array, mask: jax.Array, teacher: jax.Array,
                 present: jax.Array) -> jax.Array:
    """Sum over real rows whose label has global logits of CE(softmax(G_y), softmax(f))."""
    target = jax.nn.softmax(teacher[labels], axis=-1)
    per_row = -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    return jnp.sum(per_row * mask * present[labels])


def fd(model: nn.Module, client_tx: optax.GradientTransformation, *, lam: float = 1.0
       ) -> FederatedAlgorithm:
    """FD with distillation weight `lam` (0: each client trains alone, as Local); a
    client's round collects its logits by class (`fedproto.ProtoLocal`)."""
    check_options(RULES, "fd", lam=lam)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        c = params["head"]["kernel"].shape[-1]  # the classes
        return FdServer(params, model_state, jnp.zeros((c, c), jnp.float32),
                        jnp.zeros((c,), jnp.float32), jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        c = server.present.shape[0]
        return ProtoLocal(local_lib.init_local(client_tx, client_state, ctx.round),
                          jnp.zeros((c, c), jnp.float32), jnp.zeros((c,), jnp.float32))

    def client_step(local, batch, server):
        def distil(params, train, batch, logits):
            del params, train
            term = distillation(logits, batch["y"], batch["mask"], server.logits,
                                server.present)
            count = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
            return lam * term / count, {"distill_sum": term}
        # The step's training-mode logits by class (PFLlib records `output`).
        return collecting_sgd_step(model, client_tx, local, batch, distil, lambda z: z)

    def client_output(local, server):
        del server
        logits, has = class_means(local.sums, local.counts)
        return {"logits": logits, "has": has}, local_lib.model_variables(local.train)

    def server_update(server, sums, info):
        del info
        logits, present = reported_means(sums["logits"], sums["has"])
        return server._replace(logits=logits, present=present, round=server.round + 1)

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               aggregator=weighted_sum, personal_variables=own_model,
                               download_bytes=sends("logits", "present"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    del server_tx  # no model is averaged
    return fd(model, client_tx, lam=cfg.fd.lam)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, heterogeneous=True,
                       reference=REFERENCE)
