"""Position-Aware Neurons (PANs): constant sinusoidal position encodings on pre-activations.

For a layer of width J and neuron (or channel) index j:

    s_j = sin(2 * pi * T * j / J)
    PAN+ ("add"): e_j = A * s_j          h = relu(z + e)
    PANx ("mul"): e_j = 1 + A * s_j      h = relu(z * e)

where z is the pre-activation after bias and normalisation. Encodings are compile-time
constants: never parameters, never optimiser state, never communicated, never permuted.
With A = 0 (or T = 0) a PAN is the identity and the network is bit-for-bit the baseline.

Example:
    >>> encoding(4, "add", period=1.0, amplitude=0.5).round(6).tolist()
    [0.0, 0.5, 0.0, -0.5]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

import jax.numpy as jnp
import numpy as np

KINDS = ("add", "mul")


@dataclasses.dataclass(frozen=True)
class PANConfig:
    """PAN hyper-parameters. The paper's default "on" setting is PANx, T=1, A=0.1.

    `ratio` (the released code's `pe_ratio`) encodes only the first floor(ratio * J)
    neurons; the rest get the neutral value (0 for "add", 1 for "mul").
    """

    kind: str = "mul"
    period: float = 1.0
    amplitude: float = 0.1
    ratio: float = 1.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"PAN kind must be one of {KINDS}, got {self.kind!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"PAN ratio must lie in [0, 1], got {self.ratio!r}")
        if not np.isfinite(self.amplitude) or not np.isfinite(self.period):
            raise ValueError(
                f"PAN amplitude and period must be finite, got A={self.amplitude!r}, "
                f"T={self.period!r}")

    @property
    def enabled(self) -> bool:
        """False when the encoding is constant across neurons (A = 0, T = 0 or ratio = 0)."""
        return self.amplitude != 0.0 and self.period != 0.0 and self.ratio != 0.0


PANLike = Union[None, PANConfig, Mapping[str, Any]]


def as_config(pan: PANLike) -> Optional[PANConfig]:
    """Normalises None / PANConfig / mapping (e.g. an ml_collections ConfigDict) to a config."""
    if pan is None or isinstance(pan, PANConfig):
        return pan
    if isinstance(pan, Mapping) or hasattr(pan, "to_dict"):
        items = dict(pan.to_dict() if hasattr(pan, "to_dict") else pan)
        unknown = set(items) - {f.name for f in dataclasses.fields(PANConfig)}
        if unknown:
            raise ValueError(f"unknown PAN option(s) {sorted(unknown)}; "
                             "expected kind, period, amplitude, ratio")
        return PANConfig(**items)
    raise TypeError(f"pan must be None, a PANConfig or a mapping, got {type(pan).__name__}")


def encoding(width: int, kind: str, period: float, amplitude: float,
             ratio: float = 1.0) -> np.ndarray:
    """The constant float32 encoding e of shape (width,) (SPEC 1, paper Eq. 4-5)."""
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    if kind not in KINDS:
        raise ValueError(f"PAN kind must be one of {KINDS}, got {kind!r}")
    j = np.arange(width, dtype=np.float64)
    s = amplitude * np.sin(2.0 * np.pi * period * j / width)
    s[int(np.floor(ratio * width)):] = 0.0
    e = s if kind == "add" else 1.0 + s
    return e.astype(np.float32)


def apply_encoding(x: jnp.ndarray, enc: np.ndarray, kind: str) -> jnp.ndarray:
    """Applies `enc` over the last axis (neurons, or channels of NHWC maps)."""
    enc = jnp.asarray(enc, dtype=x.dtype)
    return x + enc if kind == "add" else x * enc


def apply_pan(x: jnp.ndarray, config: Optional[PANConfig]) -> jnp.ndarray:
    """Applies the PAN of `config` over the last axis of `x`; the identity when disabled."""
    # Skipping the op entirely (rather than adding 0 / multiplying by 1) is what makes
    # "PANs off" bit-for-bit the baseline, including signed zeros.
    if config is None or not config.enabled:
        return x
    enc = encoding(x.shape[-1], config.kind, config.period, config.amplitude, config.ratio)
    return apply_encoding(x, enc, config.kind)
