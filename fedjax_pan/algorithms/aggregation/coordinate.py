"""Coordinate-wise robust aggregation rules (Yin et al., ICML 2018): the median and the
trimmed mean of each coordinate over the round's clients.

Both are `Aggregator`s with `stacked=True`: `finalize(outputs, weights, arrivals)` sees
every client's output (a pytree with a leading client axis N) and the round's weights
(N,); the weights are ignored except that a weight of 0 marks an empty slot (an output
not arrived), which neither rule counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_pan.engine.protocol import Aggregator

tree_map = jax.tree_util.tree_map


def _present_sorted(x: jax.Array, present: jax.Array) -> jax.Array:
    """`x` sorted along the client axis with absent slots (+inf) last."""
    mask = present.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.sort(jnp.where(mask, x, jnp.inf), axis=0)


def median() -> Aggregator:
    """Coordinate-wise median over the round's clients (weights ignored, except that a
    weight of 0 marks an absent slot; robust). Interpolates the two middle values as
    `jnp.median` does, to the bit."""
    def finalize(outs, weights, arrivals=None):
        present = weights > 0
        q = 0.5 * (jnp.sum(present).astype(jnp.float32) - 1.0)
        low, high = jnp.floor(q), jnp.ceil(q)
        w_high = q - low

        def one(x):
            s = _present_sorted(x, present)
            lo, hi = s[low.astype(jnp.int32)], s[high.astype(jnp.int32)]
            return (lo * (1.0 - w_high) + hi * w_high).astype(x.dtype)
        return tree_map(one, outs)
    return Aggregator(finalize, stacked=True)


def trimmed_mean(trim: float) -> Aggregator:
    """Coordinate-wise mean after dropping the floor(trim * n) largest and smallest of the
    n present values (Yin et al. 2018); weights are ignored; trim in [0, 0.5)."""
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trimmed_mean needs trim in [0, 0.5), got {trim}")

    def finalize(outs, weights, arrivals=None):
        present = weights > 0
        n = jnp.sum(present)
        # floor(trim * n) for every n, in float64 on the host: no float32 rounding at
        # multiples (0.1 * 10).
        cut = jnp.asarray([int(trim * k) for k in range(len(present) + 1)], jnp.int32)[n]
        index = jnp.arange(len(present))
        kept = (index >= cut) & (index < n - cut)

        def one(x):
            s = _present_sorted(x, present)
            mask = kept.reshape((-1,) + (1,) * (x.ndim - 1))
            return (jnp.sum(jnp.where(mask, s, 0), axis=0) / (n - 2 * cut)).astype(x.dtype)
        return tree_map(one, outs)
    return Aggregator(finalize, stacked=True)


__all__ = ["median", "trimmed_mean"]
