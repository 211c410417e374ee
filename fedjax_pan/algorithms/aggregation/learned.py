"""Aggregation whose weights the server learns on its labelled public set: FAIR's part 3.

`auto_weights(steps, lr, score)` (Deng et al., FAIR, INFOCOM 2021 / TPDS 2022,
auto-weighted model aggregation) is a stacked, model-space `Aggregator`: the round's
weights a_i become logits theta = log a_i over the present models (a slot of weight 0
stays at alpha 0), and `steps` steps of plain gradient descent with rate `lr` lower

    L(alpha) = mean cross-entropy on the public set of sum_i alpha_i m_i,
    alpha = softmax(theta),

every leaf of the models (BatchNorm statistics too) mixed with the same alpha; the server
takes the model mixed with the final alpha. The papers' text is not at hand: the loss,
the set it is taken on, the softmax, the start and the optimiser are this library's
choices (its `RuleEntry` lists them).
"""

from __future__ import annotations

from typing import Callable, Dict

import jax
import jax.numpy as jnp

from fedjax_pan.engine.protocol import Aggregator, PyTree

tree_map = jax.tree_util.tree_map


def mix(models: PyTree, alpha: jax.Array) -> PyTree:
    """sum_i alpha_i models_i, leaf by leaf (`models` stacked on a leading axis)."""
    return tree_map(lambda x: jnp.tensordot(alpha.astype(x.dtype), x, axes=1), models)


def learn_weights(models: PyTree, weights: jax.Array, loss_fn: Callable[[PyTree], jax.Array],
                  steps: int, lr: float) -> jax.Array:
    """(N,) alpha = softmax(theta) after `steps` steps theta <- theta - lr dL/dtheta of
    L = loss_fn(mix(models, alpha)), from theta = log(weights); a slot of weight 0 is
    absent: its alpha is exactly 0 throughout. Jit-able (`steps` a Python int)."""
    present = weights > 0

    def alpha_of(theta):
        # -inf outside: softmax gives those slots 0 exactly, and `where` passes them no
        # gradient even where an absent slot holds values whose product overflows.
        return jax.nn.softmax(jnp.where(present, theta, -jnp.inf))

    grad = jax.grad(lambda theta: loss_fn(mix(models, alpha_of(theta))))
    theta = jnp.where(present, jnp.log(jnp.where(present, weights, 1.0)), 0.0)

    def step(_, t):
        g = grad(t)
        # A step whose gradient is not finite (a mixed model's loss overflowed) is skipped:
        # the weights stay where they were rather than turning NaN.
        return jnp.where(jnp.all(jnp.isfinite(g)), t - lr * g, t)

    theta = jax.lax.fori_loop(0, steps, step, theta.astype(jnp.float32))
    return alpha_of(theta)


def auto_weights(steps: int, lr: float,
                 score: Callable[[PyTree], Dict[str, jax.Array]],
                 apply: bool = True) -> Aggregator:
    """The models mixed with the weights `learn_weights` learns in `steps` steps of rate
    `lr` on the public 'loss' that `score` gives (`robust.public_scorer`); its `report`
    adds {'weights': alpha}, what FAIR reads each client's quality from, learned once.
    `apply=False` learns and reports the weights but mixes with the round's own (FAIR's
    quality estimate without its aggregation)."""
    if steps < 1 or not lr > 0:
        raise ValueError(f"auto_weights needs steps >= 1 and lr > 0, got steps = {steps}, "
                         f"lr = {lr}")

    def loss_fn(variables):
        return score(variables)["loss"]

    def report(models, weights, arrivals=None):
        del arrivals  # only the arrived models and their weights enter
        alpha = learn_weights(models, weights, loss_fn, steps, lr)
        return mix(models, alpha if apply else weights), {"weights": alpha}

    def finalize(models, weights, arrivals=None):
        return report(models, weights, arrivals)[0]
    # No `score` on the Aggregator: the clients' own public losses are not needed, only
    # the mixed model's, inside `finalize`.
    return Aggregator(finalize, stacked=True, space="model", report=report)


__all__ = ["auto_weights", "learn_weights", "mix"]
