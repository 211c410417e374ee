"""Neuron matching via optimal assignment (PAN paper, Sect. 5.2 "II. Matching via Optimal
Assignment", Fig. 7, App. E).

Each neuron of a layer is represented by its activations on m test samples (h_l in R^{J x m};
conv channels by their spatial maximum). The assignment Q in {0,1}^{J x J} minimising
sum_ij Q_ij ||h_{l,i} - h^(k)_{l,j}||_2 is solved with the Hungarian method; the share of ones
on Q's diagonal measures how well neurons at the same coordinates agree.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import flax.linen as nn
import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist

from fedjax_pan import models


def neuron_representations(model: nn.Module, variables: Mapping[str, Any], x: Any,
                           layer: str, batch_size: Optional[int] = None,
                           pre_relu: bool = True) -> np.ndarray:
    """Outputs of `layer` on inputs x as a (J, N) float64 array (one row per neuron).

    pre_relu: post-PAN, pre-ReLU outputs (the PAN authors' representation; `layer` may
    also be 'head', the logits: Fig. 22's FC4), else post-ReLU activations. Conv outputs
    (N, H, W, C) are reduced to their spatial max per channel (SPEC 5). `batch_size`
    bounds memory; None feeds all of x at once. Eval mode (train=False).
    """
    x = np.asarray(x)
    if not len(x):
        raise ValueError("neuron_representations needs at least one input")
    step = len(x) if not batch_size else int(batch_size)
    chunks = []
    for start in range(0, len(x), max(step, 1)):
        _, inter = models.apply_with_intermediates(model, variables, x[start:start + step],
                                                   pre_relu=pre_relu)
        if layer not in inter:
            raise KeyError(f"layer {layer!r} not sown; available: {sorted(inter)}")
        act = np.asarray(inter[layer], np.float64)
        if act.ndim > 2:
            act = act.reshape(act.shape[0], -1, act.shape[-1]).max(axis=1)
        chunks.append(act)
    return np.concatenate(chunks, axis=0).T


def optimal_assignment(reps_a: np.ndarray, reps_b: np.ndarray) -> np.ndarray:
    """perm with neuron i of A matched to neuron perm[i] of B (Hungarian, PAN paper App. E).

    Minimises sum_i ||reps_a[i] - reps_b[perm[i]]||_2 over permutations; reps are (J, m).
    """
    a = np.asarray(reps_a, np.float64)
    b = np.asarray(reps_b, np.float64)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"representations must be equal-shape (J, m) arrays, got "
                         f"{a.shape} and {b.shape}")
    # cdist differences coordinates directly, avoiding the cancellation of the
    # |a|^2 + |b|^2 - 2ab expansion when neurons are nearly identical.
    cost = cdist(a, b, metric="euclidean")
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(a), dtype=np.int64)
    perm[rows] = cols
    return perm


def _as_perm(perm_or_matrix: Any) -> np.ndarray:
    arr = np.asarray(perm_or_matrix)
    if arr.ndim == 2:
        if arr.shape[0] != arr.shape[1] or not np.all((arr.sum(0) == 1) & (arr.sum(1) == 1)):
            raise ValueError("an assignment matrix must be a square 0/1 permutation matrix")
        return np.argmax(arr, axis=1).astype(np.int64)
    perm = arr.astype(np.int64).ravel()
    if not np.array_equal(np.sort(perm), np.arange(len(perm))):
        raise ValueError("perm must be a permutation of 0..J-1")
    return perm


def assignment_matrix(perm: Any) -> np.ndarray:
    """The (J, J) 0/1 matrix Q with Q[i, perm[i]] = 1 (the paper's Fig. 7 heat map)."""
    perm = _as_perm(perm)
    q = np.zeros((len(perm), len(perm)), dtype=np.int64)
    q[np.arange(len(perm)), perm] = 1
    return q


def diagonal_ratio(perm: Any) -> float:
    """Fraction of neurons matched to their own coordinate (the "[]" number of Fig. 7)."""
    perm = _as_perm(perm)
    return float(np.mean(perm == np.arange(len(perm)))) if len(perm) else float("nan")


def match_layer(model: nn.Module, variables_a: Mapping[str, Any],
                variables_b: Mapping[str, Any], x: Any, layer: str,
                batch_size: Optional[int] = None, pre_relu: bool = True
                ) -> Tuple[np.ndarray, float]:
    """(perm, diagonal_ratio) matching `layer`'s neurons of model A (e.g. global) to B
    (local), represented as `neuron_representations` says."""
    reps = [neuron_representations(model, v, x, layer, batch_size, pre_relu)
            for v in (variables_a, variables_b)]
    perm = optimal_assignment(*reps)
    return perm, diagonal_ratio(perm)


__all__ = ["neuron_representations", "optimal_assignment", "assignment_matrix",
           "diagonal_ratio", "match_layer"]
