"""MLP of the PAN paper (App. B): FC(784,1024)-ReLU-FC(1024,1024)-ReLU-FC(1024,1024)-ReLU-FC(1024,C)."""

from __future__ import annotations

from typing import Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

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

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False,
                 mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.hidden, start=1):
            x = layers.hidden_unit(self, x, width, f"fc{i}", conv=False, norm=self.norm,
                                   groups=self.groups, pan=self.pan, train=train, mask=mask)
        x = layers.sow(self, "features", x)
        return layers.classifier(x, self.num_classes)
