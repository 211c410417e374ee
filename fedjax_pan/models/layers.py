"""Shared building blocks: initialisers, normalisation choice, and the PAN'd hidden unit.

A hidden unit is always `relu(pan(norm(affine(x))))`: PANs sit after bias and norm and
before the activation (paper App. B, Fig. 13). Layers are created flat in the calling
module's scope (`fc1`, `fc1_norm`, ...), so parameter paths stay short and stable for
permutation specs. Activations are sown into the 'intermediates' collection under the
layer's name (and pre-activations into 'preactivations'); sowing is free unless that
collection is mutable.

The helpers here must be called inside a `@nn.compact` method.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from fedjax_pan.pan import PANConfig, apply_pan

# Initialisation of the authors' released code: kaiming-normal (fan_out, ReLU gain) convs,
# N(0, 0.01) linear weights, zero biases; norms start at scale 1, bias 0 (flax default).
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
dense_init = nn.initializers.normal(stddev=0.01)
zeros_init = nn.initializers.zeros

# PyTorch's BatchNorm defaults (momentum 0.1 there is 0.9 here; eps 1e-5).
BN_MOMENTUM = 0.9
NORM_EPS = 1e-5
DEFAULT_GROUPS = 32

_NORM_RE = re.compile(r"^(none|batch|group)(?:\((\d+)\))?$")


def parse_norm(norm: str, num_groups: Optional[int] = None) -> Tuple[str, int]:
    """'none' | 'batch' | 'group' | 'group(G)' -> (kind, groups)."""
    m = _NORM_RE.match(str(norm).strip().lower())
    if m is None or (m.group(2) and m.group(1) != "group"):
        raise ValueError(f"unknown norm {norm!r}; expected 'none', 'batch', 'group' or 'group(G)'")
    groups = int(m.group(2)) if m.group(2) else (num_groups or DEFAULT_GROUPS)
    if groups < 1:
        raise ValueError(f"group norm needs at least one group, got {groups}")
    return m.group(1), groups


def normalize(x: jnp.ndarray, kind: str, groups: int, train: bool, name: str,
              mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
    """BatchNorm, GroupNorm or identity over the last axis, created as `name`.

    `mask` (B,) marks real examples: padded ones are left out of batch statistics.
    """
    if kind == "batch":
        if mask is not None and train:
            mask = jnp.broadcast_to(mask.reshape((-1,) + (1,) * (x.ndim - 1)) > 0, x.shape)
        else:
            mask = None
        return nn.BatchNorm(use_running_average=not train, momentum=BN_MOMENTUM,
                            epsilon=NORM_EPS, name=name)(x, mask=mask)
    if kind == "group":
        if x.shape[-1] % groups:
            raise ValueError(f"group norm with {groups} groups cannot split the "
                             f"{x.shape[-1]} channels of layer {name!r}")
        return nn.GroupNorm(num_groups=groups, epsilon=NORM_EPS, name=name)(x)
    return x


def affine(x: jnp.ndarray, features: int, name: str, *, conv: bool, kernel: int = 3,
           stride: int = 1, use_bias: bool = True) -> jnp.ndarray:
    """A Dense layer, or a 'same'-padded square Conv, with the released code's init."""
    if not conv:
        return nn.Dense(features, use_bias=use_bias, kernel_init=dense_init,
                        bias_init=zeros_init, name=name)(x)
    pad = kernel // 2
    return nn.Conv(features, (kernel, kernel), (stride, stride), padding=[(pad, pad)] * 2,
                   use_bias=use_bias, kernel_init=conv_init, bias_init=zeros_init,
                   name=name)(x)


def hidden_unit(module: nn.Module, x: jnp.ndarray, features: int, name: str, *,
                conv: bool, norm: str, groups: int, pan: Optional[PANConfig], train: bool,
                mask: Optional[jnp.ndarray] = None, kernel: int = 3, stride: int = 1,
                use_bias: bool = True) -> jnp.ndarray:
    """relu(pan(norm(affine(x)))), sown as `name`."""
    x = affine(x, features, name, conv=conv, kernel=kernel, stride=stride, use_bias=use_bias)
    x = normalize(x, norm, groups, train, f"{name}_norm", mask)
    return relu_sown(module, name, apply_pan(x, pan))


def classifier(x: jnp.ndarray, num_classes: int, name: str = "head") -> jnp.ndarray:
    """The output layer: plain linear, never a PAN."""
    return nn.Dense(num_classes, kernel_init=dense_init, bias_init=zeros_init, name=name)(x)


SOW_SUFFIX = "_out"
PERTURBATIONS = "perturbations"
# Pre-activations: a hidden layer's post-PAN, pre-ReLU output (the PAN authors' neuron
# representation) and the head's logits, recorded only when this collection is mutable.
PREACTIVATIONS = "preactivations"
PRE_SUFFIX = "_pre"  # as SOW_SUFFIX: apart from the layer's parameter scope


def sow_pre(module: nn.Module, name: str, value: jnp.ndarray) -> jnp.ndarray:
    """Records `value` as layer `name`'s pre-activation and returns it."""
    module.sow(PREACTIVATIONS, name + PRE_SUFFIX, value, init_fn=lambda: None,
               reduce_fn=lambda _, new: new)
    return value


def relu_sown(module: nn.Module, name: str, pre: jnp.ndarray) -> jnp.ndarray:
    """relu(pre), with `pre` recorded as the pre-activation and the result sown as `name`."""
    return sow(module, name, nn.relu(sow_pre(module, name, pre)))


def sow(module: nn.Module, name: str, value: jnp.ndarray) -> jnp.ndarray:
    """Records an activation as `name + SOW_SUFFIX` and returns it, perturbable.

    The suffix keeps the key apart from the layer's own parameter scope `name`. The
    perturbation (a no-op unless a 'perturbations' collection is passed) lets analyses take
    gradients with respect to this activation (preference vectors).
    """
    key = name + SOW_SUFFIX
    value = module.perturb(key, value, collection=PERTURBATIONS)
    module.sow("intermediates", key, value, init_fn=lambda: None,
               reduce_fn=lambda _, new: new)
    return value
