"""FedRep (Collins et al., ICML 2021): a shared representation, a personal head, trained
in alternation.

Each round a sampled client takes the global body and its own head, trains the head
alone with the body frozen for its first `head_share` of local steps, then the body alone
with the head frozen for the rest (PFLlib's FedRep: one head epoch, then the local
epochs; here both within the round's local work, so E = 2 with head_share = 0.5 is
PFLlib's default). Each phase has its own optimiser state, fresh every round, so a
momentum buffer never carries from one phase's parameters to the other's. The body's
change is averaged as in FedAvg; the head stays with the client (as in FedPer).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms import personal
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between

PyTree = Any
OPTIONS = {"head_epochs": 1.0}
RULES = {"head_epochs": between(0, 1000, lo_open=True)}

REFERENCE = Reference(
    "Collins et al., 'Exploiting Shared Representations for Personalized Federated "
    "Learning', ICML 2021 (FedRep, Alg. 1: head updates with the body fixed, then body "
    "updates with the head fixed; the body averaged)",
    pfllib("servers/serverrep.py", "clients/clientrep.py"),
    ("both phases come out of the round's local work (head_epochs of local.epochs); "
     "PFLlib runs plocal_epochs of head training on top of local_epochs of body training "
     "(E = 2, head_epochs = 1 is PFLlib's default 1 + 1)",
     "each phase's optimiser state is fresh every round (PFLlib keeps its two optimisers, "
     "plain SGD without state, across rounds)",
     "aggregation weights are uniform by default; PFLlib weights the bodies by training "
     "samples (aggregation.weights='num_examples')"))


class RepLocal(NamedTuple):
    body: local_lib.LocalState  # shared parameters (flat dict) and all model state
    head: local_lib.LocalState  # personal parameters (flat dict); its model_state unused
    head_steps: jax.Array  # the first head_steps steps train the head


def fedrep(model: nn.Module, client_tx: optax.GradientTransformation, head_share: float,
           server_tx: optax.GradientTransformation = optax.sgd(1.0)
           ) -> FederatedAlgorithm:
    """FedRep with the head trained for round(head_share x local steps) steps, then the
    body; the learning rate follows `client_tx`'s warm-up in each phase."""
    local_lib.check_share(head_share, "FedRep's head share of the local steps")
    is_head = personal.PERSONAL["fedper"]
    base = personal.partial_sharing(model, client_tx, is_head, server_tx)

    def client_init(server, client_state, ctx):
        full = base.client_init(server, client_state, ctx)
        body, head = personal.split_params(full.params, is_head)
        return RepLocal(
            local_lib.init_local(client_tx, {"params": body, **full.model_state}, server.round),
            local_lib.init_local(client_tx, {"params": head}, server.round),
            local_lib.phase_steps(head_share, ctx.num_steps))

    def head_step(local, batch):
        trained = local.head._replace(model_state=local.body.model_state)
        head, metrics = local_lib.sgd_step(
            model, client_tx, trained, batch,
            full_params=lambda h: personal.join_params(local.body.params, h))
        body = local.body._replace(model_state=head.model_state)
        return local._replace(body=body, head=head._replace(model_state={})), metrics

    def body_step(local, batch):
        body, metrics = local_lib.sgd_step(
            model, client_tx, local.body, batch,
            full_params=lambda b: personal.join_params(b, local.head.params))
        return local._replace(body=body), metrics

    def client_step(local, batch, server):
        del server
        return jax.lax.cond(local.head.step < local.head_steps, head_step, body_step,
                            local, batch)

    def client_output(local, server):
        params = personal.join_params(local.body.params, local.head.params)
        full = local.body._replace(params=params)
        return base.client_output(full, server)

    return base._replace(client_init=client_init, client_step=client_step,
                         client_output=client_output)


_head_share = local_lib.epochs_share("fedrep", "head_epochs", "the head's epochs are")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedrep(model, client_tx, _head_share(cfg), server_tx)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_head_share,
                      reference=REFERENCE)
