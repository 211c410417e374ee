"""Byzantine-robust aggregation rules over the round's stacked client outputs.

Each is an `Aggregator` with `stacked=True`: `finalize(outputs, weights)` sees every
client's output (a pytree with a leading client axis M) and the round's weights (M,),
and returns one output; jit-able, so any algorithm whose output is a model or an update
can use it (`config.aggregation.rule`). Distances are Euclidean over the whole output
(every leaf), computed leaf by leaf so no client's output is flattened into a copy.

- `multi_krum(f, m)` (Blanchard et al. 2017; El Mhamdi et al. 2018): client i's score is
  the sum of squared distances to its n - f - 2 nearest other clients; the m lowest-scored
  clients are averaged with the round's weights, renormalised (m = 1 is Krum; m = n - f
  by default).
- `geometric_median()` (RFA, Pillutla et al. 2022): the smoothed Weiszfeld iteration of
  the authors' code, weights = the round's (sample counts under
  `aggregation.weights = num_examples`): start at the weighted mean, then up to `maxiter`
  times v <- sum_i b_i x_i / sum_i b_i with b_i = a_i / max(eps, |v - x_i|), stopping once
  the objective sum_i a_i |v - x_i| changes by less than ftol times itself.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from fedjax_pan.engine.protocol import Aggregator, PyTree

tree_map = jax.tree_util.tree_map


def pairwise_sq_distances(outputs: PyTree) -> jax.Array:
    """(M, M) squared Euclidean distances between the clients' outputs (all leaves)."""
    def leaf(x):
        x = x.reshape(x.shape[0], -1).astype(jnp.float32)
        # |a - b|^2 by differences, not the Gram identity (no cancellation when updates
        # are close, the case that matters), one row at a time: memory M x P, not M^2 x P.
        return jax.lax.map(lambda row: jnp.sum((x - row) ** 2, axis=1), x)
    return sum(leaf(x) for x in jax.tree_util.tree_leaves(outputs))


def krum_kept(clients: int, byzantine: int, keep: Optional[int] = None) -> int:
    """How many of a round's `clients` Multi-Krum averages (`keep`; None: clients - f).
    ValueError unless clients > f + 2 (each is scored on its clients - f - 2 nearest) and
    1 <= m <= clients."""
    if clients <= byzantine + 2:
        raise ValueError(f"Krum needs more than f + 2 clients a round: {clients} clients, "
                         f"f = {byzantine}")
    kept = clients - byzantine if keep is None else keep
    if not 1 <= kept <= clients:
        raise ValueError(f"Multi-Krum averages m of the {clients} clients a round, "
                         f"1 <= m <= {clients}: got m = {kept}")
    return kept


def krum_scores(outputs: PyTree, byzantine: int) -> jax.Array:
    """(M,) Krum scores: each client's summed squared distance to its M - f - 2 nearest
    other clients."""
    m = jax.tree_util.tree_leaves(outputs)[0].shape[0]
    krum_kept(m, byzantine)
    d = pairwise_sq_distances(outputs)
    d = jnp.where(jnp.eye(m, dtype=bool), jnp.inf, d)  # a client is not its own neighbour
    return jnp.sum(jnp.sort(d, axis=1)[:, :m - byzantine - 2], axis=1)


def _weighted_mean(outputs: PyTree, weights: jax.Array) -> PyTree:
    w = weights / jnp.sum(weights)
    return tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1), outputs)


def multi_krum(byzantine: int, keep: Optional[int] = None) -> Aggregator:
    """Multi-Krum tolerating `byzantine` (f) clients a round, averaging the `keep` (m)
    best-scored (None: M - f; 1: Krum)."""
    if byzantine < 0 or (keep is not None and keep < 1):
        raise ValueError(f"multi_krum needs f >= 0 and m >= 1, got f = {byzantine}, "
                         f"m = {keep}")

    def finalize(outputs, weights):
        k = krum_kept(jax.tree_util.tree_leaves(outputs)[0].shape[0], byzantine, keep)
        chosen = jnp.argsort(krum_scores(outputs, byzantine))[:k]
        return _weighted_mean(tree_map(lambda x: x[chosen], outputs), weights[chosen])
    return Aggregator(finalize, stacked=True)


def _distances(v: PyTree, outputs: PyTree) -> jax.Array:
    """(M,) Euclidean distances from `v` to each client's output."""
    sq = sum(jnp.sum((x - y[None]).reshape(x.shape[0], -1).astype(jnp.float32) ** 2, axis=1)
             for x, y in zip(jax.tree_util.tree_leaves(outputs), jax.tree_util.tree_leaves(v)))
    return jnp.sqrt(sq)


def geometric_median(maxiter: int = 4, eps: float = 1e-5, ftol: float = 1e-6) -> Aggregator:
    """RFA's smoothed Weiszfeld geometric median (module docstring); the authors' defaults."""
    if maxiter < 1 or eps <= 0 or ftol < 0:
        raise ValueError(f"geometric_median needs maxiter >= 1, eps > 0, ftol >= 0, got "
                         f"{maxiter}, {eps}, {ftol}")

    def finalize(outputs, weights):
        alpha = weights / jnp.sum(weights)
        v = _weighted_mean(outputs, alpha)
        d = _distances(v, outputs)  # one pass over the outputs per iteration: reused below
        obj = jnp.sum(alpha * d)
        done = jnp.zeros((), bool)
        for _ in range(maxiter):  # a handful: unrolled; converged iterations change nothing
            new_v = _weighted_mean(outputs, alpha / jnp.maximum(eps, d))
            new_d = _distances(new_v, outputs)
            new_obj = jnp.sum(alpha * new_d)
            keep_old = lambda a, b: jnp.where(done, a, b)  # noqa: E731
            v, d = tree_map(keep_old, v, new_v), keep_old(d, new_d)
            converged = jnp.abs(obj - new_obj) < ftol * new_obj
            obj = keep_old(obj, new_obj)
            done = done | converged
        return v
    return Aggregator(finalize, stacked=True)


__all__ = ["multi_krum", "geometric_median", "krum_kept", "krum_scores",
           "pairwise_sq_distances"]
