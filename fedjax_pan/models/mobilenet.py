"""MobileNetV1 (Howard et al., 2017) for CIFAR-size inputs, the Fed2 papers' third network.

Plan (the common CIFAR variant): the ImageNet network with the stem's stride 2 set to 1,
so 32x32 inputs keep full resolution there and reach 2x2 before the global average pool
(ImageNet's 224x224 reaches 7x7 after five stride-2 layers; CIFAR keeps four):

    stem   conv3x3, 32, stride 1
    block  1   2   3   4   5   6   7..11   12    13
    width  64  128 128 256 256 512 512     1024  1024
    stride 1   2   1   2   1   2   1       2     1

then global average pool and a linear `head`. A depthwise-separable block is

    h   = relu(norm(dwconv3x3(x)))            `block{i}_dw` (feature_group_count = channels)
    out = relu(pan(norm(conv1x1(h))))         `block{i}_pw`

and the stem is `relu(pan(norm(conv3x3(x))))`. PANs sit on the stem and every pointwise
conv but not on the depthwise convs: a depthwise channel is tied to its input channel, so
the depthwise layer has no neuron order of its own to encode (permuting the previous layer
permutes it too), and a second encoding would modulate the same channel twice. Convs have
no bias and BatchNorm by default; with norm='none' every conv gets a bias instead.
Initialisation as the released code (`layers`): kaiming-normal fan-out convs (for a
depthwise kernel fan-out = 9 * C, as PyTorch computes it), N(0, 0.01) head.

With `grouped` (Fed2, `fedjax_pan.models.grouped`) the weight layers are `stem`, one per
block `block{i}`, and `head` (15 in all), so the paper's depth 6 groups blocks 9-13 and
the head. The first grouped block's depthwise conv still reads the shared features, so it
stays shared (the model's norm); its pointwise conv sees every channel and cuts its
(rounded up) outputs into G contiguous blocks. In later grouped blocks the depthwise conv
is per channel, hence already within a group, followed by a GroupNorm whose groups nest in
the conv groups (as after grouped convs; no norm, and a bias instead, with the grouped
norm 'none'), and the pointwise conv is a grouped 1x1 conv (`grouped_unit`, with its bias).
With depth 15 the stem is the first grouped layer and every block is grouped. Average
pooling keeps the channel order, so the head gets group-major features.
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from fedjax_pan.models import grouped as grouped_lib
from fedjax_pan.models import layers
from fedjax_pan.pan import PANConfig

STEM = 32
# (width, stride) of the 13 depthwise-separable blocks.
BLOCKS: Tuple[Tuple[int, int], ...] = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1))


class MobileNetV1(nn.Module):
    """`stem`, `block{i}_dw` / `block{i}_pw` (i = 1..13), pooled `features`, `head`.

    `width` scales every width (at least one channel; grouped widths round up to G).
    Sown intermediates: `stem`, every `block{i}_dw` and `block{i}_pw`, and `features`.
    """

    num_classes: int
    pan: Optional[PANConfig] = None
    norm: str = "batch"
    groups: int = layers.DEFAULT_GROUPS
    width: float = 1.0
    grouped: Optional[grouped_lib.GroupedConfig] = None

    def weight_layers(self) -> Tuple[str, ...]:
        """Names of the weight layers in order: stem, block1..block13, head."""
        return ("stem",) + tuple(f"block{i}" for i in range(1, len(BLOCKS) + 1)) + ("head",)

    def _grouped_layers(self) -> grouped_lib.LayerKinds:
        return grouped_lib.layout(self.weight_layers(), self.grouped)

    def group_layout(self) -> grouped_lib.LayerKinds:
        """Grouped parameter scope -> kind (empty when not grouped).

        A grouped block contributes its pointwise conv and, unless it is the first grouped
        layer (whose depthwise conv is shared), its depthwise conv: both 'blocks', the
        channels being the kernels' last axis.
        """
        kinds = self._grouped_layers()
        first = next(iter(kinds), None)
        out: grouped_lib.LayerKinds = {}
        for name, kind in kinds.items():
            if name.startswith("block"):
                if name != first:
                    out[f"{name}_dw"] = kind
                out[f"{name}_pw"] = kind
            else:
                out[name] = kind
        return out

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False,
                 mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
        grouped_layers, gc = self._grouped_layers(), self.grouped
        first = next(iter(grouped_layers), None)
        bias = self.norm == "none"
        common = dict(conv=True, norm=self.norm, groups=self.groups, train=train, mask=mask,
                      use_bias=bias, pan=self.pan)
        if "stem" in grouped_layers:
            x = grouped_lib.grouped_unit(self, x, gc.width(_scaled(STEM, self.width)), "stem",
                                         conv=True, first=True, grouped=gc, pan=self.pan)
        else:
            x = layers.hidden_unit(self, x, _scaled(STEM, self.width), "stem", **common)
        for i, (width, stride) in enumerate(BLOCKS, start=1):
            name = f"block{i}"
            if name not in grouped_layers:
                x = self._depthwise(x, f"{name}_dw", stride, train, mask)
                x = layers.hidden_unit(self, x, _scaled(width, self.width), f"{name}_pw",
                                       kernel=1, **common)
                continue
            is_first = name == first
            # The first grouped block's depthwise conv reads shared features: a shared layer.
            x = (self._depthwise(x, f"{name}_dw", stride, train, mask) if is_first
                 else self._grouped_depthwise(x, f"{name}_dw", stride))
            x = grouped_lib.grouped_unit(self, x, gc.width(_scaled(width, self.width)),
                                         f"{name}_pw", conv=True, kernel=1, first=is_first,
                                         grouped=gc, pan=self.pan)
        # Group g's channels stay contiguous through the pool: group-major features.
        x = layers.sow(self, "features", jnp.mean(x, axis=(1, 2)))
        logits = (layers.classifier(x, self.num_classes) if gc is None else
                  grouped_lib.decoupled_head(x, gc, self.num_classes))
        return layers.sow(self, "head", layers.sow_pre(self, "head", logits))

    def _depthwise(self, x: jnp.ndarray, name: str, stride: int, train: bool,
                   mask: Optional[jnp.ndarray]) -> jnp.ndarray:
        """relu(norm(dwconv(x))) with the model's norm; no PAN."""
        x = _dwconv(x, name, stride, use_bias=self.norm == "none")
        x = layers.normalize(x, self.norm, self.groups, train, f"{name}_norm", mask)
        return layers.relu_sown(self, name, x)

    def _grouped_depthwise(self, x: jnp.ndarray, name: str, stride: int) -> jnp.ndarray:
        """relu(groupnorm(dwconv(x))) on group-major channels; GN groups nest in the G groups."""
        gc = self.grouped
        x = _dwconv(x, name, stride, use_bias=gc.norm == "none")
        if gc.norm == "group":
            x = nn.GroupNorm(num_groups=int(gc.groups) * int(gc.norm_per_group),
                             epsilon=layers.NORM_EPS, name=f"{name}_norm")(x)
        return layers.relu_sown(self, name, x)


def _dwconv(x: jnp.ndarray, name: str, stride: int, use_bias: bool) -> jnp.ndarray:
    """3x3 depthwise conv (kernel (3, 3, 1, C)), PyTorch-style padding 1."""
    c = x.shape[-1]
    return nn.Conv(c, (3, 3), (stride, stride), padding=[(1, 1)] * 2, feature_group_count=c,
                   use_bias=use_bias, kernel_init=layers.conv_init,
                   bias_init=layers.zeros_init, name=name)(x)


def _scaled(width: int, factor: float) -> int:
    return max(1, int(round(width * factor)))
