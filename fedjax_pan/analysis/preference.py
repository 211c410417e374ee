"""Neuron class-preference vectors and their layer-wise total variance.

Preference (Fed2 Eq. 9; PAN paper Sect. 5.2 "III", Fig. 8): neuron i's preference for class c
is p[i, c] = sum_b Acti_i(x_{c,b}) * dZ_c / dActi_i(x_{c,b}) over the class-c samples, Z_c the
class-c logit; for a conv channel the product is also summed over spatial positions (the
channel is one neuron, Fed2 footnote 4). argmax_c p[i, c] is the neuron's class.

Total variance (Fed2 Eq. 17 = Psi-Net Eq. 5, same authors, legible there):
TV_l = sum_{i=1}^{J} (1/J) ||P_i - E_i(P_i)||_2 with P_i = p[i, :] / sum_c p[i, c], i.e. the
mean Euclidean distance of the sum-normalised preference vectors from their mean over the
layer's J neurons. The signed sum can be near zero for neurons with mixed-sign preferences,
which then dominate TV; normalize='l1' is offered as a robust variant (not the paper's).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan import models

Normalize = Union[bool, str, None]


def _normalize_rows(pref: np.ndarray, normalize: Normalize) -> Tuple[np.ndarray, np.ndarray]:
    """(normalised rows, mask of rows whose normaliser is non-zero and finite)."""
    pref = np.asarray(pref, np.float64)
    if normalize in (None, False):
        return pref, np.ones(len(pref), dtype=bool)
    kind = "sum" if normalize is True else str(normalize)
    if kind == "sum":
        # Eq. 17 divides by the plain (signed) sum over classes, as printed.
        denom = pref.sum(axis=1)
    elif kind == "l1":
        denom = np.abs(pref).sum(axis=1)
    else:
        raise ValueError(f"normalize must be False, True, 'sum' or 'l1', got {normalize!r}")
    valid = np.isfinite(denom) & (denom != 0)
    out = np.zeros_like(pref)
    out[valid] = pref[valid] / denom[valid, None]
    return out, valid


@functools.partial(jax.jit, static_argnums=(0, 1))
def _contributions(model: nn.Module, layers: Tuple[str, ...], variables: Mapping[str, Any],
                   xb: jnp.ndarray, weight: jnp.ndarray,
                   onehot: jnp.ndarray) -> Dict[str, jnp.ndarray]:
    """sum over batch (and space) of Acti * d(sum_b weight_b Z_c(x_b))/dActi, per layer."""
    # Padding rows get weight 0, hence zero gradient and zero contribution; since
    # eval-mode examples are independent, d(sum_b Z_c(x_b))/dActi(x_b) = dZ_c/dActi(x_b).
    # The class enters as a one-hot vector so that all classes share one compilation.
    output_fn = lambda z: jnp.sum((z @ onehot) * weight)  # noqa: E731
    acts, grads = models.activation_gradients(model, variables, xb, output_fn)
    missing = [name for name in layers if name not in acts]
    if missing:
        raise KeyError(f"layer(s) {missing} not sown; available: {sorted(acts)}")
    return {name: (acts[name] * grads[name]).reshape(-1, acts[name].shape[-1]).sum(0)
            for name in layers}


def _preferences(model: nn.Module, variables: Mapping[str, Any], images: Any, labels: Any,
                 layers: Sequence[str], num_classes: int, batch_size: int,
                 reduce: str) -> Dict[str, np.ndarray]:
    """Raw (J, C) preference matrices for several layers from one pass over the data."""
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
    images = np.asarray(images, np.float32)
    labels = np.asarray(labels).astype(np.int64).ravel()
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    names = tuple(layers)
    counts = np.bincount(labels, minlength=num_classes)
    # One padded batch shape keeps the jitted function to a single compilation.
    size = int(max(1, min(int(batch_size), counts.max(initial=1))))

    out: Dict[str, np.ndarray] = {}
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        onehot = jnp.asarray(np.eye(num_classes, dtype=np.float32)[c])
        for start in range(0, len(idx), size):
            chunk = idx[start:start + size]
            xb = np.zeros((size, *images.shape[1:]), images.dtype)
            xb[:len(chunk)] = images[chunk]
            weight = np.zeros(size, np.float32)
            weight[:len(chunk)] = 1.0
            contrib = _contributions(model, names, variables, jnp.asarray(xb),
                                     jnp.asarray(weight), onehot)
            for name in names:
                vec = np.asarray(contrib[name], np.float64)
                if name not in out:
                    out[name] = np.zeros((len(vec), num_classes))
                out[name][:, c] += vec
    if not out:
        # No samples at all: the shapes still come from one (all-padding) pass.
        contrib = _contributions(model, names, variables,
                                 jnp.zeros((1, *images.shape[1:]), jnp.float32),
                                 jnp.zeros(1), jnp.zeros(num_classes))
        out = {name: np.zeros((len(contrib[name]), num_classes)) for name in names}
    if reduce == "mean":
        # Fed2's "averaged on batch trials"; classes without samples stay 0.
        for name in names:
            out[name] = out[name] / np.maximum(counts, 1)[None, :]
    return out


def preference_vectors(model: nn.Module, variables: Mapping[str, Any], images: Any,
                       labels: Any, layer: str, num_classes: int, batch_size: int = 256,
                       reduce: str = "sum", normalize: Normalize = False) -> np.ndarray:
    """(J, C) preference matrix p[i, c] = sum_b Acti_i(x_{c,b}) dZ_c/dActi_i(x_{c,b}) (Fed2 Eq. 9).

    reduce='sum' follows the PAN paper / Psi-Net Eq. 2 (sum over class-c samples); 'mean'
    divides by the class count (Fed2's "averaged on batch trials"). normalize: False (the
    paper's raw vectors), True/'sum' (Eq. 17's division by sum_c p[i, c]) or 'l1' (by
    sum_c |p[i, c]|); rows whose normaliser is zero are left as zeros.
    """
    pref = _preferences(model, variables, images, labels, [layer], num_classes,
                        batch_size, reduce)[layer]
    return _normalize_rows(pref, normalize)[0]


def neuron_classes(pref: np.ndarray) -> np.ndarray:
    """(J,) class each neuron prefers most: argmax_c p[i, c] (PAN paper Sect. 5.2 III)."""
    return np.argmax(np.asarray(pref), axis=1)


def class_agreement(pref_a: np.ndarray, pref_b: np.ndarray) -> float:
    """Fraction of coordinates whose preferred class agrees between two models (Fig. 8 "[]")."""
    a, b = neuron_classes(pref_a), neuron_classes(pref_b)
    if a.shape != b.shape:
        raise ValueError(f"preference matrices differ in neuron count: {a.shape} vs {b.shape}")
    return float(np.mean(a == b)) if a.size else float("nan")


def total_variance(pref: np.ndarray, normalize: Normalize = "sum") -> float:
    """Layer total variance TV = (1/J) sum_i ||P_i - mean_i P_i||_2 (Fed2 Eq. 17, Psi-Net Eq. 5).

    P_i = p[i] / sum_c p[i, c] as printed (normalize='sum'); 'l1' or False are alternatives.
    Neurons whose normaliser is zero (e.g. dead ReLUs, p = 0) are left out; NaN if none remain.
    """
    normed, valid = _normalize_rows(pref, normalize)
    normed = normed[valid]
    if not len(normed):
        return float("nan")
    return float(np.linalg.norm(normed - normed.mean(axis=0), axis=1).mean())


def layerwise_total_variance(model: nn.Module, variables: Mapping[str, Any], images: Any,
                             labels: Any, layers: Sequence[str], num_classes: int,
                             batch_size: int = 256, reduce: str = "sum",
                             normalize: Normalize = "sum") -> Dict[str, float]:
    """{layer: TV} of Fed2 Eq. 17 for each of `layers`, from one pass over the data.

    Used to choose the sharing depth (Fed2 Sect. 5.1): TV stays low in shallow layers.
    """
    prefs = _preferences(model, variables, images, labels, layers, num_classes,
                         batch_size, reduce)
    return {name: total_variance(prefs[name], normalize) for name in layers}


def sharing_depth(tv: Mapping[str, float], threshold: Optional[float] = None,
                  relative: float = 0.5) -> Tuple[int, float]:
    """(layers to share, threshold) from layer-wise TV in network order (Fed2 Sect. 5.1).

    The shared part is every layer before the first whose TV exceeds the threshold (all of
    them when none does); `threshold` defaults to min + relative * (max - min) of the TVs.
    NaN TVs (layers without live neurons) never end the shared part.
    """
    values = np.asarray([tv[name] for name in tv], np.float64)
    finite = values[np.isfinite(values)]
    if not len(finite):
        raise ValueError("no layer has a finite total variance")
    if threshold is None:
        threshold = float(finite.min() + relative * (finite.max() - finite.min()))
    over = np.flatnonzero(np.isfinite(values) & (values > threshold))
    return (int(over[0]) if len(over) else len(values)), float(threshold)


def grouped_depth(weight_layers: Sequence[str], shared: int) -> int:
    """The `GroupedConfig.depth` that shares the first `shared` hidden layers (>= 2: the
    head and at least one grouped hidden layer)."""
    return int(min(max(len(weight_layers) - shared, 2), len(weight_layers)))


__all__ = ["preference_vectors", "neuron_classes", "class_agreement", "total_variance",
           "layerwise_total_variance", "sharing_depth", "grouped_depth"]
