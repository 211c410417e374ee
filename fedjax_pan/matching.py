"""Neuron alignment: permute one model's hidden neurons into another's order.

Two models trained from different initialisations compute similar features in different
neuron orders. `align(model, a, b)` returns b with every hidden layer's neurons permuted
(through the architecture's `PermutationSpec`, so b's function is unchanged) to best match a,
by one of two similarities:

  weights      neuron j of a and neuron i of b compare by the inner product of everything
               the spec attaches to them (incoming and outgoing weights, biases, norm
               parameters and statistics), with the other layers' permutations applied to b;
  activations  by the Pearson correlation of their outputs on a batch of `inputs`.

Each layer's matching is exact optimal transport between its neurons: with uniform marginals
and equal widths the optimal plan is a permutation, found by the Hungarian algorithm
(`scipy.optimize.linear_sum_assignment`). A layer whose GroupNorm groups constrain its
permutation is matched group by group.

Weight matching first goes layer by layer, input to output, each layer compared only through
leaves whose other permuted axes are already matched (its incoming weights: the choice of
OT fusion, Singh & Jaggi 2020), then refines by coordinate ascent over all leaves until no
permutation changes (weight matching of Ainsworth et al. 2023). Neither step can lower the
total similarity sum_leaves <a, P(b)>, which a permuted copy of a maximises, so aligning a
with a permuted copy of itself returns a exactly. Activation matching needs no iteration:
b's activations do not depend on b's own permutations.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np
from scipy.optimize import linear_sum_assignment

from fedjax_pan import permutation as perm_lib
from fedjax_pan.permutation import Flat, InGroup, PermutationSpec

PyTree = Any
Path = Tuple[str, ...]
BY = ("weights", "activations")


def assignment(similarity: np.ndarray, groups: int = 1) -> np.ndarray:
    """perm maximising sum_j similarity[j, perm[j]] (perm[j]: b's neuron placed at j), within
    `groups` contiguous blocks when a GroupNorm constrains the layer."""
    n = similarity.shape[0]
    if similarity.shape != (n, n) or n % groups:
        raise ValueError(f"need a square similarity with rows divisible by {groups} groups, "
                         f"got {similarity.shape}")
    if not np.all(np.isfinite(similarity)):
        raise ValueError("similarity has non-finite entries")
    size = n // groups
    perm = np.empty(n, np.int64)
    for g in range(groups):
        block = slice(g * size, (g + 1) * size)
        rows, cols = linear_sum_assignment(similarity[block, block], maximize=True)
        perm[g * size + rows] = g * size + cols
    return perm


def _check_spec(spec: PermutationSpec) -> None:
    for path, axes in spec.axes.items():
        if any(isinstance(a, InGroup) for a in axes):
            raise ValueError(f"alignment of grouped (Fed2) models is not supported (leaf "
                             f"{'/'.join(path)}): their groups are aligned by construction")


def _rows(leaf: np.ndarray, axis: int, entry: Any, n: int) -> np.ndarray:
    """The leaf as (n, -1): one row per neuron of the permutation on `axis`."""
    x = np.asarray(leaf, np.float64)
    if isinstance(entry, Flat):  # (..., H*W*C, ...) with channels fastest
        shape = x.shape[:axis] + (x.shape[axis] // n, n) + x.shape[axis + 1:]
        x, axis = x.reshape(shape), axis + 1
    return np.moveaxis(x, axis, 0).reshape(n, -1)


def _name(entry: Any) -> Optional[str]:
    return entry.name if isinstance(entry, Flat) else entry


def _weight_similarity(spec: PermutationSpec, perms: Dict[str, np.ndarray],
                       a: Mapping[Path, Any], b_variables: PyTree, name: str,
                       decided: Optional[set]) -> np.ndarray:
    """sum over leaves carrying `name` of a_rows @ b_rows.T, b permuted on its other axes.

    `decided`: use only leaves whose other permuted axes are in it (None: every leaf)."""
    n = spec.sizes[name]
    b = perm_lib._leaves(perm_lib.apply_permutation(
        spec, {**perms, name: np.arange(n)}, b_variables))
    sim = np.zeros((n, n))
    for path, axes in spec.axes.items():
        others = {_name(e) for e in axes if e is not None and _name(e) != name}
        if decided is not None and not others <= decided:
            continue
        for axis, entry in enumerate(axes):
            if _name(entry) == name:
                sim += _rows(a[path], axis, entry, n) @ _rows(b[path], axis, entry, n).T
    return sim


def weight_matching(spec: PermutationSpec, reference: PyTree, other: PyTree, *,
                    max_sweeps: int = 100, seed: int = 0) -> Dict[str, np.ndarray]:
    """Permutations taking `other` into `reference`'s neuron order, by weights."""
    _check_spec(spec)
    a = perm_lib._leaves(jax.tree_util.tree_map(np.asarray, dict(reference)))
    b = jax.tree_util.tree_map(np.asarray, dict(other))
    perms = perm_lib.identity(spec)
    decided: set = set()
    for name in spec.names:  # input to output: incoming weights only
        sim = _weight_similarity(spec, perms, a, b, name, decided)
        perms[name] = assignment(sim, spec.groups[name])
        decided.add(name)
    rng = np.random.default_rng(seed)
    for _ in range(max_sweeps):  # coordinate ascent over every leaf
        changed = False
        for name in rng.permutation(np.array(spec.names, dtype=object)):
            sim = _weight_similarity(spec, perms, a, b, name, None)
            new = assignment(sim, spec.groups[name])
            n = np.arange(len(new))
            if sim[n, new].sum() > sim[n, perms[name]].sum() + 1e-9 * np.abs(sim).sum():
                perms[name], changed = new, True
        if not changed:
            break
    return perms


def _producers(spec: PermutationSpec, name: str) -> Sequence[str]:
    """Modules whose kernel's output axis is permutation `name`."""
    return [path[1] for path, axes in spec.axes.items()
            if path[0] == "params" and path[-1] == "kernel" and len(path) == 3 and
            axes and _name(axes[-1]) == name and not isinstance(axes[-1], Flat)]


def _activations(model: Any, variables: PyTree, inputs: np.ndarray,
                 modules: set) -> Dict[str, np.ndarray]:
    _, state = model.apply(
        variables, inputs, capture_intermediates=lambda mdl, method: (
            method == "__call__" and mdl.name in modules and len(mdl.scope.path) == 1),
        mutable=["intermediates"])
    return {k: np.asarray(v["__call__"][0], np.float64)
            for k, v in state["intermediates"].items() if k in modules}


def activation_matching(model: Any, spec: PermutationSpec, reference: PyTree, other: PyTree,
                        inputs: Any) -> Dict[str, np.ndarray]:
    """Permutations taking `other` into `reference`'s neuron order, by the correlation of
    each neuron's outputs (pre-normalisation) over `inputs` (and spatial positions)."""
    _check_spec(spec)
    producers = {name: _producers(spec, name) for name in spec.names}
    modules = {m for ms in producers.values() for m in ms}
    acts = [_activations(model, v, inputs, modules) for v in (reference, other)]
    perms = {}
    for name, mods in producers.items():
        if not mods:
            raise ValueError(f"no layer produces permutation {name!r}")
        n = spec.sizes[name]
        za, zb = (np.concatenate([act[m].reshape(-1, n) for m in mods]) for act in acts)
        za, zb = ((z - z.mean(0)) / np.maximum(z.std(0), 1e-12) for z in (za, zb))
        perms[name] = assignment(za.T @ zb / len(za), spec.groups[name])
    return perms


def match(model: Any, reference_variables: PyTree, other_variables: PyTree, *,
          by: str = "weights", inputs: Any = None, spec: Optional[PermutationSpec] = None
          ) -> Dict[str, np.ndarray]:
    """The permutations (one per hidden layer, `permutation.apply_permutation`'s convention)
    taking `other_variables` into `reference_variables`' neuron order."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(map(repr, BY))}, got {by!r}")
    spec = spec or perm_lib.spec_for(model, reference_variables)
    if by == "weights":
        return weight_matching(spec, reference_variables, other_variables)
    if inputs is None:
        raise ValueError("by='activations' needs `inputs`, a batch of model inputs")
    return activation_matching(model, spec, reference_variables, other_variables, inputs)


def align(model: Any, reference_variables: PyTree, other_variables: PyTree, *,
          by: str = "weights", inputs: Any = None, spec: Optional[PermutationSpec] = None
          ) -> PyTree:
    """`other_variables` with its hidden neurons permuted into `reference_variables`' order
    (the same function of its inputs when PANs are off); see the module docstring for `by`."""
    spec = spec or perm_lib.spec_for(model, reference_variables)
    perms = match(model, reference_variables, other_variables, by=by, inputs=inputs, spec=spec)
    return perm_lib.apply_permutation(spec, perms, other_variables)


__all__ = ["align", "match", "assignment", "weight_matching", "activation_matching", "BY"]
