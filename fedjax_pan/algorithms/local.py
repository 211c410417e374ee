"""Local training shared by algorithms: masked loss, one optax step, learning-rate warm-up.

Warm-up (SPEC 3) is a transformation in the client optimiser (`scale_by_warmup`, added by
`client_optimizer`): the paper warms the learning rate over the first `length` local steps
of every round ('steps'); the authors' code warms it over the first `length` rounds
('rounds', lr_r = min((r + 1) / length, 1) * lr with r counted from 0). Scaling the final
update by the factor equals PyTorch's SGD with a changed lr, momentum buffer included.
A round's optimiser is started with `start_round`, which tells its warm-up the round.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_pan.models import layers

PyTree = Any
FEATURES = "features" + layers.SOW_SUFFIX  # the representation's key in 'intermediates'
# 'halving' is a decay, not a warm-up: the rate halves every `warmup_length` rounds (the
# SageFlow authors' `lrdecay`).
WARMUPS = ("none", "steps", "rounds", "halving")


class LocalState(NamedTuple):
    """A client's working copy during a round."""

    params: PyTree
    model_state: Dict[str, PyTree]  # non-trainable collections, e.g. batch_stats
    opt_state: PyTree
    step: jax.Array  # local steps taken this round


@struct.dataclass
class WarmupState:
    """The warm-up's part of an optimiser's state: updates made this round, and the round;
    the kind and length are static (part of the tree's structure)."""

    count: jax.Array
    round: jax.Array
    kind: str = struct.field(pytree_node=False)
    length: int = struct.field(pytree_node=False)

    def factor(self) -> jax.Array:
        """The learning-rate factor of the next update."""
        if self.kind == "halving":
            return (0.5 ** (self.round // self.length)).astype(jnp.float32)
        if self.kind == "rounds":
            return jnp.minimum((self.round + 1) / self.length, 1.0).astype(jnp.float32)
        return jnp.minimum((self.count + 1) / self.length, 1.0)


def scale_by_warmup(kind: str, length: int) -> optax.GradientTransformation:
    """Scale each update by the warm-up factor of its round and local step (module doc);
    kind 'none' or length 0 is the identity."""
    if kind not in WARMUPS:
        raise ValueError(f"unknown warmup {kind!r}; expected one of {WARMUPS}")
    if kind == "none" or length <= 0:
        return optax.identity()

    def init(params):
        del params
        return WarmupState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), kind,
                           int(length))

    def update(updates, state, params=None):
        del params
        return scale_updates(updates, state.factor()), state.replace(count=state.count + 1)

    return optax.GradientTransformation(init, update)


def client_optimizer(learning_rate: float, momentum: float = 0.9, weight_decay: float = 0.0,
                     grad_clip: Optional[float] = None, warmup: str = "none",
                     warmup_length: int = 0) -> optax.GradientTransformation:
    """PyTorch-style SGD: clip the gradient norm, add weight decay, then momentum SGD, its
    step scaled by the learning-rate warm-up (`scale_by_warmup`)."""
    parts = []
    if grad_clip:
        parts.append(optax.clip_by_global_norm(grad_clip))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.sgd(learning_rate, momentum=momentum or None))
    parts.append(scale_by_warmup(warmup, warmup_length))  # no warm-up: the identity
    return optax.chain(*parts)


def _is_warmup(x: Any) -> bool:
    return isinstance(x, WarmupState)


def _warmups(opt_state: PyTree, fn: Callable[[WarmupState], WarmupState]) -> PyTree:
    return jax.tree_util.tree_map(lambda s: fn(s) if _is_warmup(s) else s, opt_state,
                                  is_leaf=_is_warmup)


def start_round(opt_state: PyTree, round_index: jax.Array) -> PyTree:
    """A fresh optimiser's `opt_state` with its warm-up told the round."""
    r = jnp.asarray(round_index, jnp.int32)
    return _warmups(opt_state, lambda s: s.replace(round=r))


def warmup_factor(opt_state: PyTree) -> jax.Array:
    """The learning-rate factor of the optimiser's next update (1 without warm-up)."""
    factors = [s.factor() for s in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_warmup)
               if _is_warmup(s)]
    return factors[0] if factors else jnp.ones((), jnp.float32)


def schedule(tx: optax.GradientTransformation, round_index: jax.Array) -> PyTree:
    """`tx`'s learning-rate schedule alone, for steps an algorithm takes by hand: its state
    on no parameters, started at `round_index`; read with `warmup_factor`, advanced with
    `tick`."""
    return start_round(tx.init({}), round_index)


def tick(opt_state: PyTree) -> PyTree:
    """`opt_state` one update on, as far as its warm-up is concerned."""
    return _warmups(opt_state, lambda s: s.replace(count=s.count + 1))


def split_variables(variables: Dict[str, PyTree]) -> Tuple[PyTree, Dict[str, PyTree]]:
    """{'params': p, **rest} -> (p, rest)."""
    rest = {k: v for k, v in variables.items() if k != "params"}
    return variables["params"], rest


def init_local(tx: optax.GradientTransformation, variables: Dict[str, PyTree],
               round_index: jax.Array) -> LocalState:
    """A fresh local state for round `round_index`: the broadcast model and a fresh
    optimiser."""
    params, model_state = split_variables(variables)
    return LocalState(params, model_state, start_round(tx.init(params), round_index),
                      jnp.zeros((), jnp.int32))


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over real examples of the softmax cross-entropy."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * mask)


# loss(outputs, targets, mask) -> the sum over real examples (cross-entropy by default).
LossSum = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def forward(model: nn.Module, params: PyTree, model_state: Dict[str, PyTree],
            batch: Dict[str, jax.Array], train: bool) -> Tuple[jax.Array, Dict[str, PyTree]]:
    """Logits and the updated non-trainable collections."""
    variables = {"params": params, **model_state}
    if train and model_state:
        logits, new_state = model.apply(variables, batch["x"], train=True, mask=batch["mask"],
                                        mutable=list(model_state))
        return logits, dict(new_state)
    return model.apply(variables, batch["x"], train=train, mask=batch["mask"]), model_state


def mean_loss(model: nn.Module, params: PyTree, model_state: Dict[str, PyTree],
              batch: Dict[str, jax.Array], loss: "LossSum" = masked_cross_entropy
              ) -> Tuple[jax.Array, Tuple[jax.Array, Dict[str, PyTree], jax.Array]]:
    """(the mean of `loss` over the batch's real examples, (its sum, the updated
    non-trainable collections, the outputs)) of a training-mode forward pass: what local
    steps differentiate."""
    outputs, new_state = forward(model, params, model_state, batch, train=True)
    loss_sum = loss(outputs, batch["y"], batch["mask"])
    return loss_sum / jnp.maximum(jnp.sum(batch["mask"]), 1.0), (loss_sum, new_state, outputs)


def share_of_steps(part_epochs: float, epochs: float, option: str, what: str) -> float:
    """part_epochs / epochs for an algorithm whose round spends `option` (part_epochs) of
    its `local.epochs` on a phase of its own; ValueError unless 0 < part_epochs < epochs."""
    if not 0 < part_epochs < epochs:
        raise ValueError(f"{option} must lie strictly between 0 and local.epochs "
                         f"({epochs:g}): {what} part of the round's local work, got "
                         f"{part_epochs:g}")
    return part_epochs / epochs


def check_share(share: float, what: str) -> None:
    if not 0.0 < share < 1.0:
        raise ValueError(f"{what} must lie in (0, 1), got {share}")


def phase_steps(share: float, num_steps: jax.Array) -> jax.Array:
    """round(share x num_steps): the local steps a phase taking `share` of them gets."""
    return jnp.round(share * jnp.asarray(num_steps, jnp.float32)).astype(jnp.int32)


# extra_loss(params, local_state, batch, logits) -> (term added to the mean loss, metrics):
# the metrics are sums the algorithm reports (see algorithms.core).
ExtraLoss = Callable[[PyTree, LocalState, Dict[str, jax.Array], jax.Array],
                     Tuple[jax.Array, Dict[str, jax.Array]]]


def sgd_step(model: nn.Module, tx: optax.GradientTransformation, local: LocalState,
             batch: Dict[str, jax.Array], extra_loss: Optional[ExtraLoss] = None,
             grad_transform: Optional[Callable[[PyTree, LocalState], PyTree]] = None,
             loss: LossSum = masked_cross_entropy,
             full_params: Optional[Callable[[PyTree], PyTree]] = None,
             ) -> Tuple[LocalState, Dict[str, jax.Array]]:
    """One local step on the mean loss over the batch's real examples.

    `full_params(local.params)` -> the model's parameters, when `local` trains only part of
    them (the rest held fixed inside `full_params`).
    """
    def loss_fn(params):
        model_params = params if full_params is None else full_params(params)
        objective, (loss_sum, new_state, logits) = mean_loss(model, model_params,
                                                             local.model_state, batch, loss)
        extra_metrics = {}
        if extra_loss is not None:
            term, extra_metrics = extra_loss(params, local, batch, logits)
            objective = objective + term
        return objective, (loss_sum, new_state, extra_metrics)

    grads, (loss_sum, new_state, extra_metrics) = jax.grad(loss_fn, has_aux=True)(local.params)
    if grad_transform is not None:
        grads = grad_transform(grads, local)
    return apply_gradients(tx, local, grads, new_state), {
        "loss_sum": loss_sum, "num_examples": jnp.sum(batch["mask"]), **extra_metrics}


def apply_gradients(tx: optax.GradientTransformation, local: LocalState, grads: PyTree,
                    model_state: Dict[str, PyTree]) -> LocalState:
    """`local` one step of `tx` on `grads` on, its non-trainable collections now
    `model_state` (those of the step's forward pass)."""
    updates, opt_state = tx.update(grads, local.opt_state, local.params)
    return LocalState(optax.apply_updates(local.params, updates), model_state, opt_state,
                      local.step + 1)


def model_variables(local: LocalState) -> Dict[str, PyTree]:
    """The model `local` holds as flax variables: {'params': ..., **model_state}."""
    return {"params": local.params, **local.model_state}


class WithFeatures(NamedTuple):
    """`model` as `forward` / `sgd_step` call it, returning (logits, features): the
    representation the model sows as 'features' (`models.layers.sow`), read from the same
    forward pass that gives the logits (one pass for both; the step's warm-up, clipping
    and BatchNorm unchanged)."""

    model: nn.Module

    def apply(self, variables, x, train=False, mask=None, mutable=False):
        kept = list(mutable) if mutable else []
        logits, state = self.model.apply(variables, x, train=train, mask=mask,
                                         mutable=kept + ["intermediates"])
        if FEATURES not in state.get("intermediates", {}):
            raise ValueError(f"this algorithm reads the representation a model sows as "
                             f"'features' (see models.layers.sow); "
                             f"{type(self.model).__name__} sows none")
        outputs = (logits, state["intermediates"][FEATURES])
        if not mutable:
            return outputs
        return outputs, {k: v for k, v in state.items() if k != "intermediates"}


def epochs_share(section: str, option: str, what: str) -> Callable[[Any], float]:
    """cfg -> the share of its local steps an algorithm spends on a phase of its own,
    `config.<section>.<option>` of `local.epochs` (`share_of_steps`; ValueError where the
    phase does not fit): an entry's `check` and its builder's share."""
    def share(cfg: Any) -> float:
        return share_of_steps(cfg[section][option], cfg.local.epochs, f"{section}.{option}",
                              what)
    return share


def scale_updates(updates: PyTree, scale: jax.Array) -> PyTree:
    """updates x scale; after warm-up the factor is 1 and `cond` skips the pass over the
    parameters (a select when vmapped)."""
    return jax.lax.cond(
        scale == 1.0, lambda u: u,
        lambda u: jax.tree_util.tree_map(lambda x: x * scale.astype(x.dtype), u), updates)
