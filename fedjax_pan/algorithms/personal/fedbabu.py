"""FedBABU (Oh, Kim and Yun, ICLR 2022): Federated Averaging with the Body only, then
fine-tuning.

The model is a body (every layer but the output layer `head`) and a head. During federated
training the head stays at its (shared, random) initialisation: every client trains only
the body,

    body_k <- body_k - lr * grad_body CE(head_0(body_k(x)), y)      (head_0 never trained)

and the server averages the bodies as FedAvg does (body <- body + sum_k w_k delta_k); the
global model is (averaged body, head_0). Personalisation is fine-tuning: each client
trains its copy of the global model on its own data before it is scored.

How the personal model is produced: PFLlib's serverbabu.py, after the last round, has every
client fine-tune the whole model (clientbabu.py's `fine_tune` defaults to body and head;
`fine_tuning_epochs` = 10, plain CE, the client's optimiser: plain SGD at its rate) from
the global model it last received, and scores it on its own test data. The engine's
evaluation service `eval.finetune_epochs` (algorithms/fedavg_family/finetune.py,
`engine.Tuning`) does exactly that, from the current global model, before every evaluation,
so FedBABU defines no `personal_variables` of its own: run it with
`eval.finetune_epochs=10` and `partition.test_fraction > 0` for PFLlib's personalised
numbers (the service tunes with the clients' optimiser, from a fresh state each time).
Without it, clients are scored on
the global model, as PFLlib's "Evaluate global model" during training. PFLlib tunes
each client's own copy as it stands after the last round (the global model sent at that
round's start, plus, for a client sampled in it, its own E epochs of body training with
the head frozen); the service here tunes the global model after the round's
aggregation, and does so before every evaluation, not once at the end. Keeping a
fine-tuned model per client instead (in the client state, tuned when a client is
sampled) would cost K models of memory, take the tuning steps out of the round's
training, and score models tuned from a global model many rounds old.

Other choices: the head is frozen by training only the body's parameters (its own
optimiser state; weight decay or momentum never touch the head) and by the server keeping
the head as it was whatever the aggregate holds (an attack, compression or DP noise on
the head's zero delta is dropped). Clients upload and download the body and the model
state only (PFLlib's receive_models/send_models move `model.base`; every client holds the
initial head from the start). The output keeps FedAvg's {delta, model_state} form (the
head's delta zero) so FedAvg's model view, attacks and defences apply. BatchNorm
statistics follow FedAvg's `bn` mode.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms import personal
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm, sends, tree_bytes
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference, pfllib

PyTree = Any
OPTIONS: dict = {}
RULES: dict = {}
_IS_HEAD = personal.PERSONAL["fedper"]  # the output layer `personal.HEAD`


REFERENCE = Reference(
    "Oh, Kim & Yun, 'FedBABU: Toward Enhanced Representation for Federated Image "
    "Classification', ICLR 2022 (body trained and averaged, head frozen, fine-tuned to "
    "evaluate)", pfllib("servers/serverbabu.py", "clients/clientbabu.py"),
    ("fine-tuning (`eval.finetune_epochs`, PFLlib's 10 in the personalised experiment) runs "
     "before every evaluation from the aggregated global model; PFLlib tunes once at the "
     "end, from each client's own copy",
     "the body average follows `aggregation.weights` (PFLlib: by training-set size)"))


def _body_head(params: PyTree):
    return personal.split_params(params, _IS_HEAD)


def fedbabu(model: nn.Module, client_tx: optax.GradientTransformation,
            server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
            bn: str = "mean") -> FederatedAlgorithm:
    """FedBABU for a flax `model` whose output layer is named `head`: FedAvg on the body,
    the head frozen at its initial values."""
    base = fedavg(model, client_tx, server_tx, bn=bn)

    def server_init(variables):
        if not _body_head(variables["params"])[1]:
            raise ValueError(f"FedBABU needs a model with an output layer named "
                             f"{personal.HEAD!r} to freeze")
        return base.server_init(variables)

    def client_init(server, client_state, ctx):
        full = base.client_init(server, client_state, ctx)
        body = _body_head(full.params)[0]
        # The optimiser sees the body alone: the head has no state to move it.
        return local_lib.init_local(client_tx, {"params": body, **full.model_state},
                                    server.round)

    def client_step(local, batch, server):
        head = _body_head(server.params)[1]
        return local_lib.sgd_step(model, client_tx, local, batch,
                                  full_params=lambda b: personal.join_params(b, head))

    def client_output(local, server):
        params = personal.join_params(local.params, _body_head(server.params)[1])
        return base.client_output(local._replace(params=params), server)

    def server_update(server, mean_output, info):
        new = base.server_update(server, mean_output, info)
        body = _body_head(new.params)[0]
        return new._replace(params=personal.join_params(body, _body_head(server.params)[1]))

    def upload_bytes(output, local):
        del local
        return tree_bytes(output) - tree_bytes(output["delta"][personal.HEAD])

    return base._replace(server_init=server_init, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         server_update=server_update, upload_bytes=upload_bytes,
                         download_bytes=sends(lambda server: _body_head(server.params)[0],
                                              "model_state"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedbabu(model, client_tx, server_tx, bn=cfg.aggregation.bn)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, reference=REFERENCE)

__all__ = ["fedbabu", "ENTRY", "OPTIONS", "RULES"]
