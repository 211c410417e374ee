"""Aggregation rules that weigh outputs by their staleness: FedAsync and SageFlow.

Both are stacked, model-space `Aggregator`s: `finalize(models, weights, arrivals)` sees
each arrived client's model (its broadcast plus its update, taken against the broadcast
it trained from), the round's weights (0: an empty slot), and `arrivals.staleness`, the
rounds since that broadcast (all 0 without stragglers). A staleness group is the
arrivals trained from one broadcast. Each returns the server's next model.

- `fedasync(a, kind, ...)` (Xie et al. 2019): x <- (1 - a_t) x + a_t x_new with
  a_t = a s(t - tau), s polynomial (t - tau + 1)^-p or hinge (1 for t - tau <= b, else
  1 / (a_h (t - tau - b) + 1)). Arrivals of one round are simultaneous here: each
  staleness group's weighted mean is mixed in, the stalest first, so the freshest is
  applied last, as an asynchronous server receiving them in order of age would.
- `sageflow(e_th, delta, lam, gamma_period, score)` (Park et al., NeurIPS 2021), as the
  authors' code (`Eflow`, `Sag`): within each staleness group, models whose mean softmax
  entropy on the server's public data is >= E_th are dropped and the rest averaged with
  beta_k proportional to m_k / loss_k^delta (loss on the public data); groups are then
  averaged with alpha_i proportional to their accepted m / (staleness + 1)^lambda, and
  x <- (1 - gamma) x + gamma sum_i alpha_i v_i with gamma = 0.5^(t // gamma_period)
  (their schedule: 20 rounds on Fashion-MNIST, 15 on MNIST, 300 on CIFAR-10; 0: gamma = 1,
  their synchronous script, which applies Eflow alone). m_k is the round's weight: with
  `aggregation.weights = uniform` each accepted client counts 1, as in the authors' code
  (which drops m_k); `num_examples` gives the paper's sample counts. A group whose
  clients are all dropped gets alpha 0, and so does one whose accepted clients' raw loss
  weights sum_k 1 / loss_k^delta are at most `min_weight` (the authors' `Eflow` returns
  None when `sum_alpha <= 0.001`: with delta 5 a group of high public loss is dropped);
  if every arrival is dropped the model stays (the authors' `Sag` would divide by 0).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import jax
import jax.numpy as jnp

from fedjax_pan.engine.protocol import Aggregator, PyTree

tree_map = jax.tree_util.tree_map
FEDASYNC_KINDS = ("polynomial", "hinge", "constant")


def _groups(arrivals: Any, n: int) -> jax.Array:
    """(N,) staleness group of each slot (a staleness never reaches N slots)."""
    return jnp.clip(arrivals.staleness.astype(jnp.int32), 0, n - 1)


def _mix(current: PyTree, models: PyTree, keep: jax.Array, coef: jax.Array) -> PyTree:
    """keep * current + sum_k coef_k * models_k."""
    return tree_map(lambda x, m: (keep * x + jnp.tensordot(coef.astype(m.dtype), m, axes=1)
                                  ).astype(x.dtype), current, models)


def staleness_weight(kind: str, staleness: jax.Array, a: float = 0.5, b: float = 4.0
                     ) -> jax.Array:
    """FedAsync's s(t - tau): 'polynomial' (t - tau + 1)^-a; 'hinge' 1 up to b, then
    1 / (a (t - tau - b) + 1); 'constant' 1."""
    s = staleness.astype(jnp.float32)
    if kind == "polynomial":
        return (s + 1.0) ** (-a)
    if kind == "hinge":
        return jnp.where(s <= b, 1.0, 1.0 / (a * (s - b) + 1.0))
    if kind == "constant":
        return jnp.ones_like(s)
    raise ValueError(f"unknown FedAsync staleness function {kind!r}; expected one of "
                     f"{FEDASYNC_KINDS}")


def fedasync(mixing: float = 0.6, kind: str = "polynomial", a: float = 0.5,
             b: float = 4.0) -> Aggregator:
    """FedAsync's mixing (module docstring) with mixing weight a = `mixing`."""
    if not 0.0 < mixing <= 1.0:
        raise ValueError(f"fedasync needs a mixing weight in (0, 1], got {mixing}")
    staleness_weight(kind, jnp.zeros(1), a, b)  # checks the kind now, not when traced

    def finalize(models, weights, arrivals):
        n = weights.shape[0]
        group = _groups(arrivals, n)
        total = jax.ops.segment_sum(weights, group, num_segments=n)  # W_g
        a_g = jnp.where(total > 0, mixing * staleness_weight(kind, jnp.arange(n), a, b), 0.0)
        # Group g is mixed in before every fresher group h < g: what survives of it is
        # a_g * prod_{h < g} (1 - a_h); of the current model, prod_g (1 - a_g).
        survive = jnp.cumprod(1.0 - a_g)
        later = jnp.concatenate([jnp.ones(1), survive[:-1]])
        coef_g = a_g * later / jnp.where(total > 0, total, 1.0)
        return _mix(arrivals.current, models, survive[-1], coef_g[group] * weights)
    return Aggregator(finalize, stacked=True, space="model")


def sageflow(e_th: float, delta: float, lam: float, gamma_period: int,
             score: Callable[[PyTree], Dict[str, jax.Array]],
             min_weight: float = 1e-3) -> Aggregator:
    """SageFlow's entropy filter, loss-weighted averaging and staleness-aware grouping
    (module docstring); `score` gives each model's public 'loss' and 'entropy'; a group
    whose raw loss weights sum to at most `min_weight` is dropped (the authors' 0.001)."""
    if e_th <= 0 or delta < 0 or lam < 0 or gamma_period < 0 or min_weight < 0:
        raise ValueError(f"sageflow needs E_th > 0, delta >= 0, lambda >= 0, a gamma "
                         f"period >= 0 and min_weight >= 0, got {e_th}, {delta}, {lam}, "
                         f"{gamma_period}, {min_weight}")

    def finalize(models, weights, arrivals):
        n = weights.shape[0]
        group = _groups(arrivals, n)
        accepted = (weights > 0) & (arrivals.scores["entropy"] < e_th)
        loss = jnp.maximum(arrivals.scores["loss"], 1e-12)
        raw = jax.ops.segment_sum(jnp.where(accepted, 1.0 / loss ** delta, 0.0), group,
                                  num_segments=n)
        accepted = accepted & (raw > min_weight)[group]
        beta = jnp.where(accepted, weights / loss ** delta, 0.0)
        beta_sum = jax.ops.segment_sum(beta, group, num_segments=n)
        count = jax.ops.segment_sum(jnp.where(accepted, weights, 0.0), group, num_segments=n)
        alpha = jnp.where(beta_sum > 0,
                          count * (jnp.arange(n, dtype=jnp.float32) + 1.0) ** (-lam), 0.0)
        alpha_sum = jnp.sum(alpha)
        coef = (alpha / jnp.where(alpha_sum > 0, alpha_sum, 1.0) /
                jnp.where(beta_sum > 0, beta_sum, 1.0))[group] * beta
        gamma = (jnp.float32(1.0) if gamma_period == 0 else
                 0.5 ** (arrivals.round // gamma_period).astype(jnp.float32))
        gamma = jnp.where(alpha_sum > 0, gamma, 0.0)  # all dropped: the model stays
        return _mix(arrivals.current, models, 1.0 - gamma, gamma * coef)
    return Aggregator(finalize, stacked=True, space="model", score=score)


__all__ = ["fedasync", "sageflow", "staleness_weight", "FEDASYNC_KINDS"]
