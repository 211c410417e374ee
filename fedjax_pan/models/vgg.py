"""VGG networks of the PAN paper (App. B).

VGG9 (the FL literature's "moderate CNN") has convs 32,64,M,128,128,M,256,256,M and three
FC layers 512-512-C; VGG11/13/16 follow Simonyan & Zisserman's conv stacks with a single
FC(512, C) classifier. No normalisation by default. PANs follow every conv; on VGG9's FC
hidden layers only when `pan_fc=True` (the released code leaves them off).

Pooling is 2x2/2 with 'SAME' padding (ceil mode): identical to PyTorch's floor mode on
the paper's 32x32 inputs, and it also admits 28x28 inputs (VGG9 then still flattens
4x4x256 = 4096 features).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax.numpy as jnp

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

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False,
                 mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
        n = 0
        for item in self.plan:
            if item == "M":
                x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="SAME")
                continue
            n += 1
            x = layers.hidden_unit(self, x, _scaled(item, self.width), f"conv{n}", conv=True,
                                   norm=self.norm, groups=self.groups, pan=self.pan,
                                   train=train, mask=mask)
        x = x.reshape((x.shape[0], -1))
        for i, h in enumerate(self.fc_hidden, start=1):
            # The released code normalises convs only; FC hidden layers stay plain.
            x = layers.hidden_unit(self, x, _scaled(h, self.width), f"fc{i}", conv=False,
                                   norm="none", groups=self.groups,
                                   pan=self.pan if self.pan_fc else None, train=train)
        x = layers.sow(self, "features", x)
        return layers.classifier(x, self.num_classes)


def _scaled(width: int, factor: float) -> int:
    return max(1, int(round(width * factor)))
