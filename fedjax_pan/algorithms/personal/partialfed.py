"""PartialFed (Sun, Huo, Yang, Bai, "PartialFed: Cross-Domain Personalized Federated
Learning via Partial Initialization", NeurIPS 2021).

Every client keeps its local model theta^c_{t-1}. At the start of round t it initialises
each layer l either from the received global model or from its own:

    theta^c_t[l] = A^c_t[l] * theta^g_t[l] + (1 - A^c_t[l]) * theta^c_{t-1}[l],
    A^c_t[l] in {0, 1},

then trains from there as FedAvg does and uploads its model; the server averages (FedAvg,
with its server optimiser). Layers are the model's top-level parameter scopes in call
order (`models.layer_order`; a normalisation layer is a layer of its own, its statistics
following its parameters' choice).

PartialFed-Fix (`strategy = "fix"`): A loads the bottom `layers` layers from the global
model and keeps the rest local (None: all but the top one, the classifier: the paper
finds loading the bottom layers better than the top ones, and loading the classifier
harmful). `layers` = all is FedAvg; 0 is Local training.

PartialFed-Adaptive (`strategy = "adaptive"`, the default) learns A per client: a logit
alpha_l per layer (kept across rounds, starting at 0), and a binary Gumbel-softmax sample
with the straight-through estimator,

    s_l = 1[z_l > 0] (forward), ds_l / dalpha_l = sigmoid'(z_l) / tau (backward),
    z_l = (alpha_l + L_l) / tau,   L_l ~ Logistic(0, 1)  (the difference of two Gumbels),

on the layer mix s_l theta^g[l] + (1 - s_l) theta^c_{t-1}[l]; SGD with rate
`strategy_lr` on the training loss moves the logits, the weights held fixed. Here that
is the first round(share x steps) local steps of the round (`partialfed.strategy_epochs`
out of `local.epochs`, as FedALA's ALA pass); the model then starts from
A_l = 1[alpha_l >= 0] (ties load the global layer) and trains for the steps left.
The paper's method section could not be consulted here (its abstract: each client
"automatically selects [a] personalized loading strategy" on its data). The relaxation
above (a logit per layer, binary Gumbel-softmax, straight-through), the strategy steps
as a first phase of the round, the rate `strategy_lr`, the temperature and the logits'
start at 0 are this module's choices, not read from the paper; there is no reference
code (PFLlib has no PartialFed).

A client that has never trained takes the global model, and its strategy steps leave
its logits as they are (as FedALA's untrained clients skip ALA); its later rounds then
start from the global model for every layer with logit 0. A client evaluates the
initialisation it would start its next round from: the current global model and its
local model combined by its strategy (untrained: the global model) — the paper's
initialisation, with the latest global layers.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from ml_collections.config_dict import placeholder

from fedjax_pan import models
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference
from fedjax_pan.rules import between, check_options, one_of

PyTree = Any
tree_map = jax.tree_util.tree_map
STRATEGIES = ("adaptive", "fix")
OPTIONS = {"strategy": "adaptive", "layers": placeholder(int), "strategy_epochs": 0.5,
           "strategy_lr": 1.0, "temperature": 1.0}
RULES = {"strategy": one_of(STRATEGIES), "layers": between(0, 1000, integer=True,
                                                           optional=True),
         "strategy_epochs": between(0, 1000, lo_open=True),
         "strategy_lr": between(0, 100), "temperature": between(0.01, 100)}


REFERENCE = Reference(
    "Sun, Huo, Yang, Bai, 'PartialFed: Cross-Domain Personalized Federated Learning via "
    "Partial Initialization', NeurIPS 2021 (the layer-wise initialisation theta^c_t[l] = "
    "A[l] theta^g_t[l] + (1 - A[l]) theta^c_{t-1}[l]; PartialFed-Fix and -Adaptive)", None,
    ("the paper's method section was not consulted: PartialFed-Adaptive's relaxation (a "
     "logit per layer, binary Gumbel-softmax with the straight-through estimator), its "
     "rate, temperature and zero start are this module's choices; no reference code (PFLlib "
     "has no PartialFed)",
     "the strategy steps are the first share of the round's local work "
     "(strategy_epochs out of local.epochs)",
     "layers are the model's top-level parameter scopes in call order, a normalisation "
     "layer one of its own; Fix's default loads all but the classifier",
     "a client that has never trained takes the global model and leaves its logits as "
     "they are"))


class PartialLocal(NamedTuple):
    train: local_lib.LocalState  # the model: its partial initialisation, then trained
    own: PyTree  # the client's local model (all collections) before this round
    logits: Dict[str, jax.Array]  # alpha per layer
    strategy_steps: jax.Array  # strategy steps left this round
    trained: jax.Array  # 1 once the client has trained
    key: jax.Array


def partial_init(glob: PyTree, own: PyTree, take_global: Dict[str, Any]) -> PyTree:
    """Variables whose every top-level scope (in each collection) comes from `glob` where
    `take_global[scope]` holds, else from `own` (scopes not named: from `glob`)."""
    return {col: {scope: tree_map(lambda g, o, t=take_global.get(scope, True):
                                  jnp.where(t, g, o), sub, own[col][scope])
                  for scope, sub in tree.items()}
            for col, tree in glob.items()}


def strategy_noise(key: jax.Array, step: Any, num_layers: int) -> jax.Array:
    """The Logistic(0, 1) noise of strategy step `step` (one per layer, in call order)."""
    return jax.random.logistic(jax.random.fold_in(key, step), (num_layers,))


def relaxed_choice(logits: jax.Array, noise: jax.Array, temperature: float) -> jax.Array:
    """Straight-through binary Gumbel-softmax: 1[z > 0] forward, sigmoid(z)'s gradient
    backward, z = (logits + noise) / temperature."""
    soft = jax.nn.sigmoid((logits + noise) / temperature)
    hard = (logits + noise > 0).astype(soft.dtype)
    return hard + soft - jax.lax.stop_gradient(soft)


def partialfed(model: nn.Module, client_tx: optax.GradientTransformation,
               strategy_share: float = 0.5,
               server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
               strategy: str = "adaptive", layers: Optional[int] = None,
               strategy_lr: float = 1.0, temperature: float = 1.0) -> FederatedAlgorithm:
    """PartialFed-Adaptive (its strategy learned in the first round(strategy_share x
    steps) local steps) or PartialFed-Fix (the bottom `layers` layers loaded from the
    global model; None: all but the top one)."""
    check_options(RULES, "partialfed", strategy=strategy, layers=layers,
                  strategy_lr=strategy_lr, temperature=temperature)
    if strategy == "adaptive":
        local_lib.check_share(strategy_share, "PartialFed's share of local steps for "
                                              "learning its strategy")
    base = fedavg(model, client_tx, server_tx)

    def names_of(params) -> List[str]:
        names = models.layer_order(model, params)
        if strategy == "fix" and layers is not None and not 0 <= layers <= len(names):
            raise ValueError(f"partialfed.layers must lie in [0, {len(names)}] for this "
                             f"model (layers {names}), got {layers}")
        return names

    def take_global(params, logits, trained):
        """Layer -> load it from the global model (always, for an untrained client)."""
        names = names_of(params)
        if strategy == "fix":
            count = len(names) - 1 if layers is None else layers
            chosen = {n: jnp.asarray(i < count) for i, n in enumerate(names)}
        else:
            chosen = {n: logits[n] >= 0 for n in names}
        return {n: jnp.logical_or(c, trained <= 0) for n, c in chosen.items()}

    def start(server, own, logits, trained):
        glob = {"params": server.params, **server.model_state}
        return partial_init(glob, own, take_global(server.params, logits, trained))

    def client_state_init(server):
        names = names_of(server.params)
        return {"variables": {"params": server.params, **server.model_state},
                "logits": {n: jnp.zeros((), jnp.float32) for n in names},
                "trained": jnp.zeros((), jnp.float32)}

    def client_init(server, client_state, ctx):
        own, logits, trained = (client_state["variables"], client_state["logits"],
                                client_state["trained"])
        train = local_lib.init_local(client_tx, start(server, own, logits, trained),
                                     server.round)
        steps = (local_lib.phase_steps(strategy_share, ctx.num_steps)
                 if strategy == "adaptive" else jnp.zeros((), jnp.int32))
        return PartialLocal(train, own, logits, steps, trained,
                            jax.random.fold_in(ctx.rng, 0x50F))

    def strategy_step(local, batch, server):
        names = names_of(server.params)
        own_params, own_state = local_lib.split_variables(local.own)
        noise = strategy_noise(local.key, local.strategy_steps, len(names))
        # The statistics follow the layers' current choice (no gradient reaches them).
        model_state = local.train.model_state

        def loss(alpha):
            s = relaxed_choice(jnp.stack([alpha[n] for n in names]), noise, temperature)
            params = {**server.params,
                      **{n: tree_map(lambda g, o, w=s[i]: w * g + (1 - w) * o,
                                     server.params[n], own_params[n])
                         for i, n in enumerate(names)}}
            mean, (loss_sum, _, _) = local_lib.mean_loss(model, params, model_state, batch)
            return mean, loss_sum
        g, loss_sum = jax.grad(loss, has_aux=True)(local.logits)
        logits = {n: jnp.where(local.trained > 0, a - strategy_lr * g[n], a)
                  for n, a in local.logits.items()}
        init = start(server, local.own, logits, local.trained)
        params, model_state = local_lib.split_variables(init)
        train = local.train._replace(params=params, model_state=model_state)
        # Strategy steps are not training: the optimiser's steps count apart.
        return (local._replace(train=train, logits=logits,
                               strategy_steps=local.strategy_steps - 1),
                {"loss_sum": loss_sum, "num_examples": jnp.sum(batch["mask"])})

    def train_step(local, batch, server):
        train, metrics = base.client_step(local.train, batch, server)
        return local._replace(train=train), metrics

    def client_step(local, batch, server):
        if strategy == "fix":
            return train_step(local, batch, server)
        return jax.lax.cond(local.strategy_steps > 0, strategy_step, train_step, local,
                            batch, server)

    def client_output(local, server):
        output, _ = base.client_output(local.train, server)
        return output, {"variables": {"params": local.train.params,
                                      **local.train.model_state},
                        "logits": local.logits, "trained": jnp.ones((), jnp.float32)}

    def personal_variables(server, client_state):
        return start(server, client_state["variables"], client_state["logits"],
                     client_state["trained"])

    return base._replace(client_state_init=client_state_init, client_init=client_init,
                         client_step=client_step, client_output=client_output,
                         personal_variables=personal_variables)


def _strategy_share(cfg: Any) -> float:
    if cfg.partialfed.strategy != "adaptive":
        return 0.5  # unused
    return local_lib.share_of_steps(cfg.partialfed.strategy_epochs, cfg.local.epochs,
                                    "partialfed.strategy_epochs",
                                    "PartialFed-Adaptive's strategy steps are")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    o = cfg.partialfed
    return partialfed(model, client_tx, _strategy_share(cfg), server_tx,
                      strategy=o.strategy, layers=o.layers, strategy_lr=o.strategy_lr,
                      temperature=o.temperature)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, check=_strategy_share,
                      reference=REFERENCE)
