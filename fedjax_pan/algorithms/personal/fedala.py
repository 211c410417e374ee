"""FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the global model.

A client keeps its local model. On receiving the global model it takes the lower layers
from it as they are and, for its top `layers` layers, learns element-wise weights W in
[0, 1] of the mix

    theta = local + (global - local) * W

on a random `rand_percent` share of its data (PFLlib's ALA: SGD on W with rate eta,
grad_W = grad_theta * (global - local), clipped to [0, 1]; W kept across rounds, starting
at ones). Then it trains theta as FedAvg does and sends it; the server averages.

Here the ALA pass is the first round(ala_share x steps) local steps of the round, so
`fedala.ala_epochs` (0.8: PFLlib's 80% sample) comes out of `local.epochs`: E = 1.8 is
ALA's pass plus one training epoch. Those steps see the first ala_epochs of the round's
first epoch order, a random sample of that share. Not reproduced: PFLlib's first ALA
round repeats its pass until the loss settles (std of the last 10 < 0.1); here every
round makes one pass. A client that has never trained (its local model is the initial
global one) skips ALA, as PFLlib's. A client evaluates its ALA mix of the current global
model with its local model and W (PFLlib re-learns W one pass before evaluating).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan import models
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"layers": 1, "eta": 1.0, "ala_epochs": 0.8}
RULES = {"layers": between(1, 1000, integer=True), "eta": between(0, 100, lo_open=True),
         "ala_epochs": between(0, 1000, lo_open=True)}

REFERENCE = Reference(
    "Zhang et al., 'FedALA: Adaptive Local Aggregation for Personalized Federated "
    "Learning', AAAI 2023 (ALA module, Eq. 4-6: element-wise weights W on the top layers, "
    "learned on a random share of the local data)",
    pfllib("servers/serverala.py", "clients/clientala.py") + ", system/utils/ALA.py",
    ("the ALA pass is the first round(ala_share x steps) local steps of the round's local "
     "work (ala_epochs out of local.epochs), on the first share of the round's first epoch "
     "order; PFLlib's pass is extra, on a contiguous slice of rand_percent% of the data "
     "starting at a random index",
     "every round makes one pass; PFLlib's first ALA round repeats its pass until the std "
     "of the last 10 losses is below 0.1",
     "`layers` counts layers (default 1: the head); PFLlib's layer_idx counts parameter "
     "tensors (its default 2: the head's weight and bias)",
     "a client evaluates its ALA mix with its stored W; PFLlib re-learns W one pass on the "
     "new global model before evaluating",
     "aggregation weights are uniform by default; PFLlib weights by training samples "
     "(aggregation.weights='num_examples')"))


class AlaLocal(NamedTuple):
    train: local_lib.LocalState  # theta: ALA-mixed, then trained
    own: PyTree  # the client's local model's top layers before this round
    glob: PyTree  # the received global model's top layers
    weights: PyTree  # W over the top layers
    ala_steps: jax.Array
    trained: jax.Array  # 1 once the client has trained: ALA applies


def _top(params: PyTree, names) -> dict:
    return {n: params[n] for n in names}


def fedala(model: nn.Module, client_tx: optax.GradientTransformation, ala_share: float,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *, layers: int = 1,
           eta: float = 1.0
           ) -> FederatedAlgorithm:
    """FedALA over the top `layers` layers (in the model's call order), its ALA
    pass the first round(ala_share x local steps) steps; training warms up as FedAvg's."""
    local_lib.check_share(ala_share, "FedALA's share of local steps for ALA")
    base = fedavg(model, client_tx, server_tx)

    def top_names(params):
        # The model's call order: params dicts are sorted by name, where on ResNet20 and
        # MobileNet `stem_norm` would come last and pass for the top layer.
        names = models.layer_order(model, params)
        if not 1 <= layers <= len(names):
            raise ValueError(f"fedala.layers must lie in [1, {len(names)}] for this model "
                             f"(layers {names}), got {layers}")
        return names[-layers:]

    def adapted(own, glob, weights, trained):
        """own + (glob - own) * W, or glob for a client that has never trained."""
        return tree_map(lambda o, g, w: jnp.where(trained > 0, o + (g - o) * w, g),
                        own, glob, weights)

    def client_state_init(server):
        top = _top(server.params, top_names(server.params))
        return {"params": server.params, "weights": tree_map(jnp.ones_like, top),
                "trained": jnp.zeros((), jnp.float32)}

    def client_init(server, client_state, ctx):
        names = top_names(server.params)
        own, glob = _top(client_state["params"], names), _top(server.params, names)
        trained = client_state["trained"]
        start = adapted(own, glob, client_state["weights"], trained)
        local = base.client_init(server, None, ctx)
        local = local._replace(params={**server.params, **start})
        return AlaLocal(local, own, glob, client_state["weights"],
                        local_lib.phase_steps(ala_share, ctx.num_steps), trained)

    def ala_step(local, batch, server):
        del server
        def loss(top):
            mean, (loss_sum, _, _) = local_lib.mean_loss(
                model, {**local.train.params, **top}, local.train.model_state, batch)
            return mean, loss_sum
        g, loss_sum = jax.grad(loss, has_aux=True)(_top(local.train.params, list(local.glob)))
        weights = tree_map(lambda w, gt, o, gl: jnp.clip(w - eta * gt * (gl - o), 0.0, 1.0),
                           local.weights, g, local.own, local.glob)
        weights = tree_map(lambda new, old: jnp.where(local.trained > 0, new, old), weights,
                           local.weights)
        theta = adapted(local.own, local.glob, weights, local.trained)
        train = local.train._replace(params={**local.train.params, **theta})
        # The ALA pass is not training: its steps count apart (warm-up counts from 0).
        return (local._replace(train=train, weights=weights, ala_steps=local.ala_steps - 1),
                {"loss_sum": loss_sum, "num_examples": jnp.sum(batch["mask"])})

    def train_step(local, batch, server):
        train, metrics = base.client_step(local.train, batch, server)
        return local._replace(train=train), metrics

    def client_step(local, batch, server):
        return jax.lax.cond(local.ala_steps > 0, ala_step, train_step, local, batch, server)

    def client_output(local, server):
        output, _ = base.client_output(local.train, server)
        return output, {"params": local.train.params, "weights": local.weights,
                        "trained": jnp.ones((), jnp.float32)}

    def personal_variables(server, client_state):
        names = top_names(server.params)
        own, glob = _top(client_state["params"], names), _top(server.params, names)
        top = adapted(own, glob, client_state["weights"], client_state["trained"])
        return {"params": {**server.params, **top}, **server.model_state}

    return base._replace(client_state_init=client_state_init, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_variables=personal_variables)


_ala_share = local_lib.epochs_share("fedala", "ala_epochs", "ALA's pass is")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedala(model, client_tx, _ala_share(cfg), server_tx, layers=cfg.fedala.layers,
                  eta=cfg.fedala.eta)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_ala_share,
                      reference=REFERENCE)
