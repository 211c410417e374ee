"""CIFAR-style ResNet20 of the PAN paper (App. B): basic blocks, 3 per stage.

Widths default to the paper's code (stem 64, stages 64/128/256), not the classic
16/32/64. Convs have no bias and BatchNorm precedes ReLU. In a block:

    h   = relu(pan1(bn1(conv1 x)))
    out = relu(pan2(bn2(conv2 h)) + shortcut(x))

A projection shortcut (1x1 conv, stride 2, + norm) carries its own encoding; an identity
shortcut and the stem carry none. With norm='none' the convs get biases instead.

`explicit_shortcuts=True` writes every identity shortcut as a 1x1 conv `..._identity` whose
kernel starts as the identity matrix (no bias, norm or PAN): the same function, but each
block's output channels can then be permuted on their own, the shortcut's kernel becoming a
permutation matrix (the PAN authors' per-block shuffle). `explicit_shortcuts(model,
variables)` converts a model trained without them.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from fedjax_pan.models import layers
from fedjax_pan.pan import PANConfig, apply_pan


class ResNet(nn.Module):
    """Stem `stem`, blocks `stage{s}_block{b}_{conv1,conv2,shortcut}`, pooled `features`, `head`."""

    num_classes: int
    widths: Sequence[int] = (64, 128, 256)
    stem_width: int = 64
    blocks_per_stage: int = 3
    pan: Optional[PANConfig] = None
    norm: str = "batch"
    groups: int = layers.DEFAULT_GROUPS
    explicit_shortcuts: bool = False

    def weight_layers(self) -> Tuple[str, ...]:
        """Names of the weight layers in call order: stem, each block's conv1, conv2 and
        shortcut (a projection, or with `explicit_shortcuts` an identity conv, where it
        has one), head."""
        names, width_in = ["stem"], self.stem_width
        for s, width in enumerate(self.widths, start=1):
            for b in range(1, self.blocks_per_stage + 1):
                name = f"stage{s}_block{b}"
                names += [f"{name}_conv1", f"{name}_conv2"]
                if (b == 1 and s > 1) or width_in != width:
                    names.append(f"{name}_shortcut")
                elif self.explicit_shortcuts:
                    names.append(f"{name}_identity")
                width_in = width
        return tuple(names) + ("head",)

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False,
                 mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
        bias = self.norm == "none"
        common = dict(conv=True, norm=self.norm, groups=self.groups, train=train,
                      mask=mask, use_bias=bias)
        x = layers.hidden_unit(self, x, self.stem_width, "stem", pan=None, **common)
        for s, width in enumerate(self.widths, start=1):
            for b in range(1, self.blocks_per_stage + 1):
                name = f"stage{s}_block{b}"
                stride = 2 if (b == 1 and s > 1) else 1
                h = layers.hidden_unit(self, x, width, f"{name}_conv1", stride=stride,
                                       pan=self.pan, **common)
                h = layers.affine(h, width, f"{name}_conv2", conv=True, use_bias=bias)
                h = apply_pan(layers.normalize(h, self.norm, self.groups, train,
                                               f"{name}_conv2_norm", mask), self.pan)
                if stride != 1 or x.shape[-1] != width:
                    x = layers.affine(x, width, f"{name}_shortcut", conv=True, kernel=1,
                                      stride=stride, use_bias=bias)
                    x = apply_pan(layers.normalize(x, self.norm, self.groups, train,
                                                   f"{name}_shortcut_norm", mask), self.pan)
                elif self.explicit_shortcuts:
                    x = nn.Conv(width, (1, 1), use_bias=False, kernel_init=_identity_init,
                                name=f"{name}_identity")(x)
                x = layers.relu_sown(self, name, h + x)
        x = jnp.mean(x, axis=(1, 2))
        x = layers.sow(self, "features", x)
        return layers.sow(self, "head", layers.sow_pre(self, "head", layers.classifier(
            x, self.num_classes)))


def _identity_init(key: Any, shape: Sequence[int], dtype: Any = jnp.float32) -> jnp.ndarray:
    del key
    return jnp.eye(shape[-2], shape[-1], dtype=dtype).reshape(shape)


def explicit_shortcuts(model: ResNet, variables: Mapping[str, Any]
                       ) -> Tuple[ResNet, Dict[str, Any]]:
    """(model, variables) computing the same function with every identity shortcut an
    explicit identity 1x1 conv `stage{s}_block{b}_identity`."""
    params = dict(variables["params"])
    for key in list(params):
        if key.endswith("_conv2"):
            name = key[:-len("_conv2")]
            if f"{name}_shortcut" not in params:
                width = int(params[key]["kernel"].shape[-1])
                params[f"{name}_identity"] = {
                    "kernel": np.eye(width, dtype=np.float32).reshape(1, 1, width, width)}
    return model.clone(explicit_shortcuts=True, parent=None), {**variables, "params": params}
