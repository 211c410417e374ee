"""Local training shared by algorithms: masked loss, one optax step, learning-rate warm-up.

Warm-up (SPEC 3): the paper warms the learning rate over the first `length` local steps
of every round ('steps'); the authors' code warms it over the first `length` rounds
('rounds', lr_r = min((r + 1) / length, 1) * lr with r counted from 0). Scaling the final
update by the factor equals PyTorch's SGD with a changed lr, momentum buffer included.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

PyTree = Any
WARMUPS = ("none", "steps", "rounds")


class LocalState(NamedTuple):
    """A client's working copy during a round."""

    params: PyTree
    model_state: Dict[str, PyTree]  # non-trainable collections, e.g. batch_stats
    opt_state: PyTree
    step: jax.Array  # local steps taken this round
    lr_scale: jax.Array  # round-level warm-up factor


def client_optimizer(learning_rate: float, momentum: float = 0.9, weight_decay: float = 0.0,
                     grad_clip: Optional[float] = None) -> optax.GradientTransformation:
    """PyTorch-style SGD: clip the gradient norm, add weight decay, then momentum SGD."""
    parts = []
    if grad_clip:
        parts.append(optax.clip_by_global_norm(grad_clip))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.sgd(learning_rate, momentum=momentum or None))
    return optax.chain(*parts)


def round_lr_scale(round_index: jax.Array, warmup: str, length: int) -> jax.Array:
    """Warm-up factor of a whole round (1 unless warmup == 'rounds')."""
    if warmup != "rounds" or length <= 0:
        return jnp.ones((), jnp.float32)
    return jnp.minimum((round_index + 1) / length, 1.0).astype(jnp.float32)


def split_variables(variables: Dict[str, PyTree]) -> Tuple[PyTree, Dict[str, PyTree]]:
    """{'params': p, **rest} -> (p, rest)."""
    rest = {k: v for k, v in variables.items() if k != "params"}
    return variables["params"], rest


def init_local(tx: optax.GradientTransformation, variables: Dict[str, PyTree],
               lr_scale: jax.Array) -> LocalState:
    """A fresh local state: the broadcast model and a fresh optimiser."""
    params, model_state = split_variables(variables)
    return LocalState(params, model_state, tx.init(params), jnp.zeros((), jnp.int32),
                      jnp.asarray(lr_scale, jnp.float32))


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
             batch: Dict[str, jax.Array], warmup: str = "none", warmup_length: int = 0,
             extra_loss: Optional[ExtraLoss] = None,
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
    updates, opt_state = tx.update(grads, local.opt_state, local.params)
    if warmup != "none":  # without warm-up the factor is 1: skip a pass over all parameters
        updates = scale_updates(updates, step_scale(local.step, local.lr_scale, warmup,
                                                    warmup_length))
    params = optax.apply_updates(local.params, updates)
    new_local = LocalState(params, new_state, opt_state, local.step + 1, local.lr_scale)
    return new_local, {"loss_sum": loss_sum, "num_examples": jnp.sum(batch["mask"]),
                       **extra_metrics}


def step_scale(step: jax.Array, lr_scale: jax.Array, warmup: str, length: int) -> jax.Array:
    """The learning-rate factor of local step `step` (0-based) in a round whose factor is
    `lr_scale`: the round's, times min((step + 1) / length, 1) when warmup == 'steps'."""
    if warmup == "steps" and length > 0:
        return lr_scale * jnp.minimum((step + 1) / length, 1.0)
    return lr_scale


def scale_updates(updates: PyTree, scale: jax.Array) -> PyTree:
    """updates x scale; after warm-up the factor is 1 and `cond` skips the pass over the
    parameters (a select when vmapped)."""
    return jax.lax.cond(
        scale == 1.0, lambda u: u,
        lambda u: jax.tree_util.tree_map(lambda x: x * scale.astype(x.dtype), u), updates)
