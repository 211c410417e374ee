"""Personalised FL: PFLlib's personalised algorithms and paper 001's, one module each in
this package. This module holds the simplest, personalisation by partial sharing, where
some parameters stay with each client, and the helpers the others share (`linear_head`).

One construction covers four algorithms of paper 001 (PFLlib); they differ only in which
parameters are personal (kept in the client's state, never sent) and which are shared
(trained from the global model and averaged as in FedAvg):

  local      every parameter personal: no communication at all (each client alone);
  fedper     the head personal, the body shared (Arivazhagan et al. 2019);
  lg_fedavg  the body personal, the head shared (Liang et al. 2020, LG-FedAvg);
  fedbn      the normalisation layers' parameters and statistics personal (Li et al. 2021).

A client starts each round from the global shared parameters and its own personal ones
(the global model's initial values on its first round), takes its local steps on all of
them, sends the change of the shared ones and keeps the personal ones. Evaluation on a
client's own test data uses this combined model (`personal_variables`); the global model
(`eval_variables`) is the shared parameters with the initial personal ones.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, sends)
from fedjax_pan.algorithms.fedavg_family.fedavg import ServerState, initial_server
from fedjax_pan.references import Reference, pfllib

PyTree = Any
Path = Tuple[str, ...]
HEAD = "head"  # the output layer's name in every model of `fedjax_pan.models`
NORM_SUFFIX = "_norm"  # normalisation layers are named <layer>_norm


def linear_head(params: PyTree, algorithm: str) -> PyTree:
    """The model's output layer `HEAD`, which `algorithm` needs to be one linear layer
    (kernel (D, C) and bias) on the sown 'features'; ValueError otherwise."""
    head = params.get(HEAD) if hasattr(params, "get") else None
    if head is None or set(head) != {"kernel", "bias"} or head["kernel"].ndim != 2:
        raise ValueError(f"{algorithm} needs a model whose output layer is one linear layer "
                         f"named {HEAD!r} (kernel and bias) on its features")
    return head


def _is_norm(path: Path) -> bool:
    return path[0].endswith(NORM_SUFFIX)


# Which parameters (by their path in the params tree) stay with the client.
PERSONAL: Dict[str, Callable[[Path], bool]] = {
    "local": lambda path: True,
    "fedper": lambda path: path[0] == HEAD,
    "lg_fedavg": lambda path: path[0] != HEAD,
    "fedbn": _is_norm,
}


_WEIGHTS = ("aggregation weights are uniform by default; PFLlib weights the uploads by "
            "training samples (aggregation.weights='num_examples')")
# Each entry's reference (`fedjax_pan.fidelity`).
REFERENCES: Dict[str, Reference] = {
    "local": Reference(
        "Local training alone, the baseline of the pFL literature (PFLlib's 'Local')",
        pfllib("servers/serverlocal.py", "clients/clientavg.py"), ()),
    "fedper": Reference(
        "Arivazhagan et al., 'Federated Learning with Personalization Layers', arXiv 2019 "
        "(FedPer: base layers averaged, personalization layers kept)",
        pfllib("servers/serverper.py", "clients/clientper.py"),
        ("the personalization layers are the output layer alone (the paper's K_P = 1, "
         "PFLlib's model.head)", _WEIGHTS)),
    "lg_fedavg": Reference(
        "Liang et al., 'Think Locally, Act Globally: Federated Learning with Local and "
        "Global Representations', arXiv 2020 (LG-FedAvg: local representation, global "
        "head averaged)",
        pfllib("servers/serverlg.py", "clients/clientlg.py"),
        ("the global part is the output layer alone (PFLlib's model.head), every other "
         "layer is local", _WEIGHTS)),
    "fedbn": Reference(
        "Li et al., 'FedBN: Federated Learning on Non-IID Features via Local Batch "
        "Normalization', ICLR 2021 (Alg. 1: BN parameters and statistics stay local)",
        pfllib("servers/serverbn.py", "clients/clientbn.py"),
        ("every normalisation layer named '<layer>_norm' stays local (a GroupNorm or "
         "LayerNorm too, where a model has one); the paper and PFLlib keep BatchNorm layers",
         _WEIGHTS)),
}


def split_params(params: PyTree, personal: Callable[[Path], bool]) -> Tuple[dict, dict]:
    """(shared, personal) flat dicts 'layer/name' -> leaf (string keys: checkpointable)."""
    flat = traverse_util.flatten_dict(params, sep="/")
    return ({k: v for k, v in flat.items() if not personal(tuple(k.split("/")))},
            {k: v for k, v in flat.items() if personal(tuple(k.split("/")))})


def join_params(shared: dict, own: dict) -> PyTree:
    return traverse_util.unflatten_dict({**shared, **own}, sep="/")


def partial_sharing(model: nn.Module, client_tx: optax.GradientTransformation,
                    personal: Callable[[Path], bool],
                    server_tx: optax.GradientTransformation = optax.sgd(1.0)
                    ) -> FederatedAlgorithm:
    """FedAvg over the parameters `personal(path)` rejects; the rest stay per client;
    the learning rate follows `client_tx`'s warm-up.

    Non-trainable state (BatchNorm statistics) of a personal normalisation layer stays
    with the client too; the rest of it is averaged as FedAvg does.
    """

    def server_init(variables):
        return initial_server(server_tx, variables)

    def client_state_init(server):
        own = split_params(server.params, personal)[1]
        stats = {c: split_params(s, personal)[1] for c, s in server.model_state.items()}
        state = {"params": own, "model_state": stats}
        return state if jax.tree_util.tree_leaves(state) else None  # nothing personal

    def combined(server, client_state) -> Tuple[PyTree, Dict[str, PyTree]]:
        if client_state is None:
            return server.params, server.model_state
        params = join_params(split_params(server.params, personal)[0], client_state["params"])
        model_state = {c: join_params(split_params(s, personal)[0], client_state["model_state"][c])
                       for c, s in server.model_state.items()}
        return params, model_state

    def client_init(server, client_state, ctx):
        del ctx
        params, model_state = combined(server, client_state)
        return local_lib.init_local(client_tx, {"params": params, **model_state},
                                    server.round)

    def client_step(local, batch, server):
        del server
        return local_lib.sgd_step(model, client_tx, local, batch)

    def client_output(local, server):
        shared, own = split_params(local.params, personal)
        old = split_params(server.params, personal)[0]
        delta = {k: shared[k] - old[k] for k in shared}
        stats = {c: split_params(s, personal) for c, s in local.model_state.items()}
        output = {"delta": delta, "model_state": {c: s[0] for c, s in stats.items()}}
        state = {"params": own, "model_state": {c: s[1] for c, s in stats.items()}}
        return output, state if jax.tree_util.tree_leaves(state) else None

    def server_update(server, mean_output, info):
        del info
        shared, own = split_params(server.params, personal)
        grad = {k: -mean_output["delta"][k] for k in shared}
        zeros = {k: jnp.zeros_like(v) for k, v in own.items()}
        updates, opt_state = server_tx.update(join_params(grad, zeros), server.opt_state,
                                              server.params)
        params = optax.apply_updates(server.params, updates)
        model_state = {c: join_params(mean_output["model_state"][c], split_params(s, personal)[1])
                       for c, s in server.model_state.items()}
        return ServerState(params, model_state, opt_state, server.round + 1)

    def personal_variables(server, client_state):
        params, model_state = combined(server, client_state)
        return {"params": params, **model_state}

    def shared_part(server):
        # Only the shared parameters and statistics are sent.
        return (split_params(server.params, personal)[0],
                {c: split_params(s, personal)[0] for c, s in server.model_state.items()})

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               personal_variables=personal_variables,
                               download_bytes=sends(shared_part))


def _entry(name: str) -> AlgorithmEntry:
    return AlgorithmEntry(
        lambda model, cfg, client_tx, server_tx: partial_sharing(
            model, client_tx, PERSONAL[name], server_tx), {}, {}, personal=True,
        reference=REFERENCES[name])


ENTRIES = {name: _entry(name) for name in PERSONAL}
