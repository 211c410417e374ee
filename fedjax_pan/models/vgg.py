"""VGG networks of the PAN paper (App. B).

VGG9 (the FL literature's "moderate CNN") has convs 32,64,M,128,128,M,256,256,M and three
FC layers 512-512-C; VGG11/13/16 follow Simonyan & Zisserman's conv stacks with a single
FC(512, C) classifier. No normalisation by default. PANs follow every conv; on VGG9's FC
hidden layers only when `pan_fc=True` (the released code leaves them off).

With `grouped` (Fed2 / Psi-Net, `fedjax_pan.models.grouped`) the last `depth` weight
layers (convs, FC hidden layers and the head, counted from the end) are split into groups
and the head into decoupled per-group heads.

Pooling is 2x2/2 with 'SAME' padding (ceil mode): identical to PyTorch's floor mode on
the paper's 32x32 inputs, and it also admits 28x28 inputs (VGG9 then still flattens
4x4x256 = 4096 features).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax.numpy as jnp

from fedjax_pan.models import grouped as grouped_lib
from fedjax_pan.models import layers
from fedjax_pan.pan import PANConfig

Plan = Tuple[Union[int, str], ...]

CONV_PLANS = {
    "vgg9": (32, 64, "M", 128, 128, "M", 256, 256, "M"),
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"),
}
FC_HIDDEN = {"vgg9": (512, 512), "vgg11": (), "vgg13": (), "vgg16": ()}


class VGG(nn.Module):
    """Convs `conv1..convN` (PAN'd), hidden FCs `fc1..` (PAN'd iff pan_fc), then `head`.

    `width` scales every conv and FC hidden width (1.0 = the paper's widths).
    Sown intermediates: every conv/fc by name and `features` (the classifier's input).
    """

    num_classes: int
    plan: Plan = CONV_PLANS["vgg9"]
    fc_hidden: Sequence[int] = FC_HIDDEN["vgg9"]
    pan: Optional[PANConfig] = None
    pan_fc: bool = False
    norm: str = "none"
    groups: int = layers.DEFAULT_GROUPS
    width: float = 1.0
    grouped: Optional[grouped_lib.GroupedConfig] = None
    kernel: int = 3  # every conv's square kernel ('same' padding)

    def weight_layers(self) -> Tuple[str, ...]:
        """Names of the weight layers in order: conv1.., fc1.., head."""
        n_conv = sum(1 for item in self.plan if item != "M")
        return (tuple(f"conv{i}" for i in range(1, n_conv + 1))
                + tuple(f"fc{i}" for i in range(1, len(self.fc_hidden) + 1)) + ("head",))

    def group_layout(self) -> grouped_lib.LayerKinds:
        """Grouped layer name -> how its leaves map onto groups (empty when not grouped)."""
        return grouped_lib.layout(self.weight_layers(), self.grouped)

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False,
                 mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
        layout, gc = self.group_layout(), self.grouped
        first = next(iter(layout), None)
        n = 0
        for item in self.plan:
            if item == "M":
                x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="SAME")
                continue
            n += 1
            name, width = f"conv{n}", scaled(item, self.width)
            if name in layout:
                x = grouped_lib.grouped_unit(self, x, gc.width(width), name, conv=True,
                                             first=name == first, grouped=gc, pan=self.pan,
                                             kernel=self.kernel)
            else:
                x = layers.hidden_unit(self, x, width, name, conv=True, norm=self.norm,
                                       groups=self.groups, pan=self.pan, train=train,
                                       mask=mask, kernel=self.kernel)
        # Grouped feature maps flatten group by group, so each group's features stay apart.
        x = (grouped_lib.split_groups(x, gc.groups).reshape(x.shape[0], -1)
             if f"conv{n}" in layout else x.reshape((x.shape[0], -1)))
        for i, h in enumerate(self.fc_hidden, start=1):
            name, pan = f"fc{i}", self.pan if self.pan_fc else None
            if name in layout:
                x = x if name == first else x.reshape(x.shape[0], gc.groups, -1)
                x = grouped_lib.grouped_unit(self, x, gc.width(scaled(h, self.width)), name,
                                             conv=False, first=name == first, grouped=gc,
                                             pan=pan)
            else:
                # The released code normalises convs only; FC hidden layers stay plain.
                x = layers.hidden_unit(self, x, scaled(h, self.width), name, conv=False,
                                       norm="none", groups=self.groups, pan=pan, train=train)
        x = layers.sow(self, "features", x)
        logits = (layers.classifier(x, self.num_classes) if gc is None else
                  grouped_lib.decoupled_head(x, gc, self.num_classes))
        return layers.sow(self, "head", layers.sow_pre(self, "head", logits))


def scaled(width: int, factor: float) -> int:
    """`width` scaled by `factor`, at least 1."""
    return max(1, int(round(width * factor)))
