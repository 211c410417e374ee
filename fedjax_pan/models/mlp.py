"""MLP of the PAN paper (App. B): FC(784,1024)-ReLU-FC(1024,1024)-ReLU-FC(1024,1024)-ReLU-FC(1024,C)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp

from fedjax_pan.models import grouped as grouped_lib
from fedjax_pan.models import layers
from fedjax_pan.pan import PANConfig


class MLP(nn.Module):
    """Flattens the input; hidden layers `fc1..fcL` carry PANs, the `head` does not.

    Sown intermediates: `fc1..fcL` (post-ReLU) and `features` (the classifier's input).
    """

    num_classes: int
    hidden: Sequence[int] = (1024, 1024, 1024)
    pan: Optional[PANConfig] = None
    norm: str = "none"
    groups: int = layers.DEFAULT_GROUPS
    grouped: Optional[grouped_lib.GroupedConfig] = None  # Fed2 groups on the last layers

    def weight_layers(self) -> Tuple[str, ...]:
        return tuple(f"fc{i}" for i in range(1, len(self.hidden) + 1)) + ("head",)

    def group_layout(self) -> grouped_lib.LayerKinds:
        return grouped_lib.layout(self.weight_layers(), self.grouped)

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False,
                 mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
        layout, gc = self.group_layout(), self.grouped
        first = next(iter(layout), None)
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.hidden, start=1):
            name = f"fc{i}"
            if name in layout:
                x = x if name == first else x.reshape(x.shape[0], gc.groups, -1)
                x = grouped_lib.grouped_unit(self, x, gc.width(width), name, conv=False,
                                             first=name == first, grouped=gc, pan=self.pan)
            else:
                x = layers.hidden_unit(self, x, width, name, conv=False, norm=self.norm,
                                       groups=self.groups, pan=self.pan, train=train,
                                       mask=mask)
        x = layers.sow(self, "features", x)
        logits = (layers.classifier(x, self.num_classes) if gc is None else
                  grouped_lib.decoupled_head(x, gc, self.num_classes))
        return layers.sow(self, "head", layers.sow_pre(self, "head", logits))
