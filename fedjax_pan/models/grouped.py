"""Fed2 / Psi-Net structure adaptation (papers 003 Sect. 4, 004 Sect. 3): grouped layers.

The first layers stay shared (dense); the last `depth` weight layers are split into G
groups, and the classifier into G decoupled heads:

  * the first grouped layer is an ordinary layer whose outputs are cut into G contiguous
    blocks (its inputs are the shared features every group may use);
  * later grouped convs are G-group convs (`feature_group_count=G` semantics; `conv_impl`
    picks how they compute, `grouped_conv`) and grouped FC layers use a (G, in/G, out/G)
    block-diagonal kernel, so group g only ever sees group g's channels;
  * head g maps group g's features to the logits of its own classes only (a (G, F/G, C)
    kernel masked by the class-to-group map).

So the loss on class c's logit has zero gradient on every other group's parameters
(gradient isolation, 003 Eq. 16). Grouped widths are rounded up to a multiple of G (VGG9's
128/256/512 become 130/260/520 for G = 10). After each grouped conv a GroupNorm whose
groups nest in the conv groups (`norm_per_group` GN groups per conv group) replaces the
model's norm (003 Sect. 4.2).

Which parameter belongs to which group is data: `group_owners` lists, per grouped leaf,
the axis that runs over the groups and the owning group of every index along it. Feature
paired averaging and trimming (`fedjax_pan.algorithms.fedavg_family.fed2`) and upload accounting read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.models import layers
from fedjax_pan.pan import PANConfig, apply_pan

Path = Tuple[str, ...]
# Ways to compute a grouped conv; all share one parameter layout and give the same numbers
# (`grouped_conv`); 'auto' picks one per backend and shape (`pick_conv_impl`).
CONV_IMPLS = ("auto", "feature_group_count", "split", "block_diagonal")
# Leaf path -> (axis over groups, owner[i] = the group of index i along that axis).
Owners = Dict[Path, Tuple[int, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """G groups over the last `depth` weight layers (head included); the paper: G = 10, 6.

    `class_groups[c]` is class c's group (None: contiguous blocks, class c -> c * G // C);
    `norm`: 'group' (GroupNorm after grouped convs, `norm_per_group` groups per conv group)
    or 'none'.
    """

    groups: int = 10
    depth: int = 6
    class_groups: Optional[Tuple[int, ...]] = None
    norm: str = "group"
    norm_per_group: int = 1
    conv_impl: str = "auto"  # how grouped convs compute (`CONV_IMPLS`)

    def __post_init__(self):
        if int(self.groups) < 1:
            raise ValueError(f"grouped models need groups >= 1, got {self.groups!r}")
        if int(self.depth) < 2:
            raise ValueError(f"grouped depth must be >= 2 (the head and at least one grouped "
                             f"hidden layer), got {self.depth!r}")
        if self.norm not in ("group", "none"):
            raise ValueError(f"grouped norm must be 'group' or 'none', got {self.norm!r}")
        if int(self.norm_per_group) < 1:
            raise ValueError(f"norm_per_group must be >= 1, got {self.norm_per_group!r}")
        if self.conv_impl not in CONV_IMPLS:
            raise ValueError(f"unknown grouped conv_impl {self.conv_impl!r}; expected one of "
                             f"{CONV_IMPLS}")

    def class_map(self, num_classes: int) -> np.ndarray:
        """(C,) int: the group of each class; every group must own at least one class."""
        g = int(self.groups)
        if self.class_groups is None:
            if g > num_classes:
                raise ValueError(f"{g} groups cannot each own one of {num_classes} classes")
            return (np.arange(num_classes) * g) // num_classes
        cmap = np.asarray(self.class_groups, np.int64)
        if cmap.shape != (num_classes,):
            raise ValueError(f"class_groups must give one group per class ({num_classes}), "
                             f"got {len(cmap)} entries")
        if cmap.min() < 0 or cmap.max() >= g:
            raise ValueError(f"class_groups entries must lie in [0, {g - 1}], got "
                             f"{sorted(set(cmap.tolist()))}")
        missing = sorted(set(range(g)) - set(cmap.tolist()))
        if missing:
            raise ValueError(f"groups {missing} own no class in class_groups")
        return cmap

    def width(self, features: int) -> int:
        """A grouped layer's width: `features` rounded up to a multiple of G (of G times
        `norm_per_group` under GroupNorm)."""
        unit = int(self.groups) * (int(self.norm_per_group) if self.norm == "group" else 1)
        return -(-int(features) // unit) * unit


GroupedLike = Union[None, GroupedConfig, Mapping[str, Any]]


def as_grouped(value: GroupedLike) -> Optional[GroupedConfig]:
    """None, a GroupedConfig, or a mapping of its fields (e.g. from a config)."""
    if value is None or isinstance(value, GroupedConfig):
        return value
    fields = dict(value)
    if fields.get("class_groups") is not None:
        fields["class_groups"] = tuple(int(c) for c in fields["class_groups"])
    unknown = set(fields) - {f.name for f in dataclasses.fields(GroupedConfig)}
    if unknown:
        raise ValueError(f"unknown grouped option(s) {sorted(unknown)}; accepted: "
                         f"{[f.name for f in dataclasses.fields(GroupedConfig)]}")
    return GroupedConfig(**fields)


def pick_conv_impl(groups: int, in_features: int, backend: Optional[str] = None) -> str:
    """The fastest measured `CONV_IMPLS` entry for a G-group conv with `in_features` input
    channels on `backend` (default: jax's).

    CPU, 2 cores, forward + input and kernel gradients of a 3x3 conv at B=64 (`python -m
    benchmarks.run --only grouped_conv`): feature_group_count is never the fastest for
    G > 1. 8x8, 260 channels, G=10: feature_group_count 1012 ms, split 17, block_diagonal
    78 (the dense G=1 conv: 77); G=2: 304, 37, 62; a grouped VGG9 local step (28x28x1,
    G=10): 1276, 300, 393. Same timing, other shapes: `split` wins from 4 input channels
    per group up (G=64 of 256 channels: split 50 ms, block_diagonal 88; G=16 of 64: 8.9
    and 10.2), `block_diagonal` below (G=32 of 64: 11.2 against split 16.8; depthwise,
    G=256 of 256: 93 against feature_group_count 98). Above G=64 block_diagonal too: split's compile time grows
    with G (6 s at G=64; 85 s at G=256 on a busy machine). Other backends keep XLA's
    native grouped conv (feature_group_count): not measured here; the grouped_conv
    section measures it there.
    """
    backend = backend or jax.default_backend()
    g = int(groups)
    if g == 1:
        return "feature_group_count"  # a plain dense conv
    if backend != "cpu":
        return "feature_group_count"
    return "split" if int(in_features) // g >= 4 and g <= 64 else "block_diagonal"


def block_diagonal_kernel(kernel: jnp.ndarray, groups: int) -> jnp.ndarray:
    """(k, k, in/G, out) grouped kernel -> (k, k, in, out) dense kernel, zero off the G
    diagonal blocks. The zeros are constants: no gradient reaches them."""
    _, _, cin, out = kernel.shape
    mask = np.kron(np.eye(groups, dtype=bool), np.ones((cin, out // groups), bool))
    return jnp.where(mask, jnp.tile(kernel, (1, 1, groups, 1)), jnp.zeros((), kernel.dtype))


def grouped_conv(x: jnp.ndarray, kernel: jnp.ndarray, groups: int, stride: int = 1,
                 impl: str = "auto") -> jnp.ndarray:
    """'Same'-padded NHWC conv with `feature_group_count` semantics (kernel (k, k, in/G,
    out), output channels in G contiguous blocks), computed the `impl` way."""
    if impl not in CONV_IMPLS:
        raise ValueError(f"unknown grouped conv_impl {impl!r}; expected one of {CONV_IMPLS}")
    g, k = int(groups), kernel.shape[0]
    if impl == "auto":
        impl = pick_conv_impl(g, x.shape[-1])

    def conv(x, kernel, count):
        return jax.lax.conv_general_dilated(x, kernel, (stride, stride), [(k // 2, k // 2)] * 2,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            feature_group_count=count)
    if impl == "feature_group_count" or g == 1:
        return conv(x, kernel, g)
    if impl == "block_diagonal":
        return conv(x, block_diagonal_kernel(kernel, g), 1)
    cin, cout = x.shape[-1] // g, kernel.shape[-1] // g  # split: G dense convs
    return jnp.concatenate([conv(x[..., i * cin:(i + 1) * cin],
                                 kernel[..., i * cout:(i + 1) * cout], 1) for i in range(g)],
                           axis=-1)


class GroupedConv(nn.Module):
    """A 'same'-padded conv whose G groups each see only their own input channels.

    Parameters as flax's `nn.Conv(feature_group_count=G)`: kernel (k, k, in/G, out), output
    channels in G contiguous blocks, bias (out,); `impl` (`CONV_IMPLS`) changes only how
    it is computed.
    """

    features: int
    groups: int
    kernel_size: int = 3
    stride: int = 1
    impl: str = "auto"

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        k, g = self.kernel_size, self.groups
        kernel = self.param("kernel", layers.conv_init, (k, k, x.shape[-1] // g, self.features))
        bias = self.param("bias", layers.zeros_init, (self.features,))
        return grouped_conv(x, kernel, g, self.stride, self.impl) + bias


class GroupedDense(nn.Module):
    """Block-diagonal dense layer: (B, G, in) -> (B, G, out), group g's own kernel."""

    features: int  # per group

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        g, fan_in = x.shape[-2], x.shape[-1]
        kernel = self.param("kernel", layers.dense_init, (g, fan_in, self.features))
        bias = self.param("bias", layers.zeros_init, (g, self.features))
        return jnp.einsum("bgi,gio->bgo", x, kernel) + bias


class DecoupledHead(nn.Module):
    """G heads: head g maps group g's features (B, G, F) to the logits of its classes."""

    class_groups: Tuple[int, ...]

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        g, fan_in = x.shape[-2], x.shape[-1]
        mask = jnp.asarray(np.arange(g)[:, None] == np.asarray(self.class_groups)[None, :],
                           x.dtype)  # (G, C) constant
        c = len(self.class_groups)
        kernel = self.param("kernel", lambda k, s: layers.dense_init(k, s) * mask[:, None, :],
                            (g, fan_in, c))
        bias = self.param("bias", layers.zeros_init, (c,))
        return jnp.einsum("bgf,gfc->bc", x, kernel * mask[:, None, :]) + bias


def split_groups(x: jnp.ndarray, groups: int) -> jnp.ndarray:
    """(B, ..., G*c) channels-last -> (B, G, prod(...) * c): each group's features together."""
    b, c = x.shape[0], x.shape[-1]
    x = x.reshape(b, -1, groups, c // groups)  # (B, S, G, c/G)
    return jnp.swapaxes(x, 1, 2).reshape(b, groups, -1)


def grouped_unit(module: nn.Module, x: jnp.ndarray, features: int, name: str, *,
                 conv: bool, first: bool, grouped: GroupedConfig,
                 pan: Optional[PANConfig], kernel: int = 3, stride: int = 1) -> jnp.ndarray:
    """relu(pan(norm(grouped affine(x)))), sown as `name`; `features` already a multiple of G.

    Convs map (B, H, W, C) -> (B, H', W', features); FCs map (B, G, in) (or (B, in) when
    `first`) -> (B, features), group-major. The first grouped layer sees every input channel.
    """
    g = int(grouped.groups)
    if conv:
        x = GroupedConv(features, 1 if first else g, kernel, stride,
                        "feature_group_count" if first else grouped.conv_impl, name=name)(x)
    elif first:
        x = nn.Dense(features, kernel_init=layers.dense_init, bias_init=layers.zeros_init,
                     name=name)(x)
    else:
        x = GroupedDense(features // g, name=name)(x).reshape(x.shape[0], features)
    if grouped.norm == "group" and conv:
        x = nn.GroupNorm(num_groups=g * int(grouped.norm_per_group), epsilon=layers.NORM_EPS,
                         name=f"{name}_norm")(x)
    return layers.relu_sown(module, name, apply_pan(x, pan))


# How each grouped layer's leaves map onto groups: 'blocks' = output channels in G
# contiguous blocks (kernel's last axis, bias, norm); 'stacked' = leading axis is the group
# (GroupedDense); 'head' = DecoupledHead (kernel's leading axis; bias by the class map).
LayerKinds = Dict[str, str]


def layout(weight_layers: Sequence[str], grouped: Optional[GroupedConfig]) -> LayerKinds:
    """Grouped layer name -> kind, for a model whose weight layers are `weight_layers` in
    order (convs `conv*`, FCs `fc*`, the last one `head`); empty when not grouped."""
    if grouped is None:
        return {}
    first = len(weight_layers) - int(grouped.depth)
    if first < 0:
        raise ValueError(f"grouped depth {grouped.depth} exceeds the model's "
                         f"{len(weight_layers)} weight layers")
    return {name: ("head" if name == "head" else
                   "stacked" if name.startswith("fc") and i > first else "blocks")
            for i, name in enumerate(weight_layers) if i >= first}


def decoupled_head(features: jnp.ndarray, grouped: GroupedConfig,
                   num_classes: int) -> jnp.ndarray:
    """The grouped classifier on group-major features (B, G * F)."""
    cmap = tuple(int(c) for c in grouped.class_map(num_classes))
    x = features.reshape(features.shape[0], int(grouped.groups), -1)
    return DecoupledHead(cmap, name="head")(x)


def group_owners(params_tree: Mapping[str, Any], kinds: LayerKinds, groups: int,
                 class_map: Sequence[int]) -> Owners:
    """Per grouped leaf of a variables tree: (axis, owner group of each index on it)."""
    flat = jax.tree_util.tree_flatten_with_path(dict(params_tree))[0]
    out: Owners = {}
    for path, leaf in flat:
        keys = tuple(k.key for k in path)
        layer = keys[1] if len(keys) > 2 else None
        base = layer[:-len("_norm")] if layer and layer.endswith("_norm") else layer
        kind = kinds.get(base)
        if kind is None:
            continue
        shape = np.shape(leaf)
        if kind == "stacked" or (kind == "head" and keys[-1] == "kernel"):
            out[keys] = (0, np.arange(groups))
        elif kind == "head":
            out[keys] = (0, np.asarray(class_map))
        else:  # 'blocks': output channels are the last axis
            n = shape[-1]
            out[keys] = (len(shape) - 1, np.repeat(np.arange(groups), n // groups))
    return out
