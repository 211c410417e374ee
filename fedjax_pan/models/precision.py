"""Mixed precision: any model computed in bfloat16 on float32 master weights
(`execution.precision`), and the precision of float32 matrix products
(`execution.matmul_precision`).

`policy(model, 'bfloat16')` wraps a model so that each `apply` casts the float32 parameters
and float32 inputs to bfloat16, runs the model, and returns its outputs (logits, sown
features, updated statistics) in float32: jmp's policy of float32 parameters, bfloat16
compute and float32 outputs. Gradients taken through it arrive in float32 with respect to
the float32 parameters, so losses, optimiser states, aggregation and an algorithm's own
arithmetic on parameters all stay float32, and no algorithm changes. Normalisation
statistics stay float32: the 'batch_stats' collection is not cast, and flax reduces in
float32. `policy(model, 'float32')` is `model` itself.

`matmul_precision(name)`: a context in which the float32 matrix products and convolutions
traced take XLA's 'high' or 'highest' precision ('default' leaves JAX's setting alone).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from fedjax_pan import models
    >>> net = models.build("mlp", 10, hidden=(8,))
    >>> variables = models.init(net, jax.random.PRNGKey(0), (4, 4, 1))
    >>> policy(net, "bfloat16").apply(variables, jnp.ones((2, 4, 4, 1))).dtype
    dtype('float32')
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

PRECISIONS = ("float32", "bfloat16")
MATMUL_PRECISIONS = ("default", "high", "highest")
# Collections a model keeps statistics in, never cast: running means are not weights.
KEPT_FLOAT32 = ("batch_stats",)

PyTree = Any


def _cast(tree: PyTree, source: Any, target: Any) -> PyTree:
    """`tree` with its leaves of dtype `source` cast to `target` (others as they are)."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(target) if getattr(x, "dtype", None) == source else x, tree)


class MixedPrecision(NamedTuple):
    """`model` computed in `compute` (a float dtype's name) on float32 variables and
    inputs, its outputs returned in float32; every other attribute is `model`'s."""

    model: nn.Module
    compute: str = "bfloat16"

    def apply(self, variables, *args, **kwargs):
        low = jnp.dtype(self.compute)
        variables = {name: tree if name in KEPT_FLOAT32 else _cast(tree, jnp.float32, low)
                     for name, tree in variables.items()}
        # Keyword arguments (`train`, `mask`, `mutable`) are flags and masks: not cast.
        args = tuple(_cast(a, jnp.float32, low) for a in args)
        return _cast(self.model.apply(variables, *args, **kwargs), low, jnp.float32)

    def __getattr__(self, name: str) -> Any:
        # The model's layers, sizes and methods (`weight_layers`, `grouped`, `init`):
        # permutation specs, layer orders and initialisation read the model they wrap.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.model, name)


def policy(model: nn.Module, precision: str = "float32") -> Any:
    """`model` computed in `precision` (`PRECISIONS`): itself for 'float32', else a
    `MixedPrecision` wrapper with the same `apply` signature."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of "
                         f"{', '.join(PRECISIONS)}")
    return model if precision == "float32" else MixedPrecision(model, precision)


def matmul_precision(name: str = "default") -> ContextManager[None]:
    """A context in which float32 matrix products and convolutions traced take XLA's
    precision `name` (`MATMUL_PRECISIONS`); restored on exit. 'default' changes nothing."""
    if name not in MATMUL_PRECISIONS:
        raise ValueError(f"unknown matmul precision {name!r}; expected one of "
                         f"{', '.join(MATMUL_PRECISIONS)}")
    return contextlib.nullcontext() if name == "default" else jax.default_matmul_precision(name)


__all__ = ["PRECISIONS", "MATMUL_PRECISIONS", "MixedPrecision", "policy", "matmul_precision"]
