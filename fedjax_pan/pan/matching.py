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
(`scipy.optimize.linear_sum_assignment`). Under a permutation, the squared Euclidean ground
cost ||a_j - b_i||^2 and the inner product a_j . b_i give the same plan (the norms sum to a
constant), so the inner product is used. A layer whose GroupNorm groups constrain its
permutation is matched group by group.

`bbp_map` is the other kind of matching, FedMA's (PFNM, Yurochkin et al. 2019): J clients'
neurons of one layer matched to a global layer that may grow, by MAP under a Beta-Bernoulli
process prior.

Weight matching first goes layer by layer, input to output, each layer compared only through
leaves whose other permuted axes are already matched (its incoming weights: the choice of
OT fusion, Singh & Jaggi 2020), then refines by coordinate ascent over all leaves until no
permutation changes (weight matching of Ainsworth et al. 2023). Neither step can lower the
total similarity sum_leaves <a, P(b)>, which a permuted copy of a maximises, so aligning a
with a permuted copy of itself returns a exactly. Activation matching needs no iteration:
b's activations do not depend on b's own permutations.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np
from scipy.optimize import linear_sum_assignment

from fedjax_pan.pan import permutation as perm_lib
from fedjax_pan.pan.permutation import Flat, InGroup, PermutationSpec

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


def _activations(model: Any, modules: set) -> Callable[[PyTree, Any], Dict[str, np.ndarray]]:
    """(variables, inputs) -> the outputs of the top-level `modules`, float64; one compiled
    program for every variables of the model's shapes."""
    @jax.jit
    def run(variables, inputs):
        _, state = model.apply(
            variables, inputs, capture_intermediates=lambda mdl, method: (
                method == "__call__" and mdl.name in modules and len(mdl.scope.path) == 1),
            mutable=["intermediates"])
        return {k: v["__call__"][0] for k, v in state["intermediates"].items()
                if k in modules}
    return lambda variables, inputs: {k: np.asarray(v, np.float64)
                                      for k, v in run(variables, inputs).items()}


def activation_matching(model: Any, spec: PermutationSpec, reference: PyTree, other: PyTree,
                        inputs: Any) -> Dict[str, np.ndarray]:
    """Permutations taking `other` into `reference`'s neuron order, by the correlation of
    each neuron's outputs (pre-normalisation) over `inputs` (and spatial positions)."""
    _check_spec(spec)
    producers = {name: _producers(spec, name) for name in spec.names}
    modules = {m for ms in producers.values() for m in ms}
    activations = _activations(model, modules)
    acts = [activations(v, inputs) for v in (reference, other)]
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


class BBPMatch(NamedTuple):
    """A matched layer: `weights` (L, D) the global neurons' posterior means, `assignments[j]`
    (L_j,) the global neuron each of client j's neurons went to, `counts` (L,) how many
    clients' neurons each global neuron holds."""

    weights: np.ndarray
    assignments: List[np.ndarray]
    counts: np.ndarray


def new_neurons(local: int, width: int, cap: Optional[int]) -> int:
    """How many new global neurons a client of `local` neurons may open against a global
    layer of `width`: IBM's min(L_j, max(cap - L, 1)) (pfnm.py's `max_added`, cap 700),
    but never so few that some of its neurons could not be placed (L + added >= L_j); all
    L_j without a cap."""
    if cap is None:
        return local
    return min(local, max(cap - width, 1, local - width))


def _bbp_cost(w_j: np.ndarray, glob: np.ndarray, glob_prec: np.ndarray, counts: np.ndarray,
              prec_j: np.ndarray, prior_mean_prec: np.ndarray, prior_prec: np.ndarray,
              gamma: float, num_clients: int, added: Optional[int] = None) -> np.ndarray:
    """(L_j, L + added) log-posterior gains: client neuron l joining global neuron i (first
    L columns) or opening the k-th new one (the rest; `added` of them, default L_j)."""
    # sum_d (w + g)^2 / (prec_j + glob_prec) - g^2 / glob_prec, expanded into matmuls so
    # no (L_j, L, D) array is formed (1024-wide layers of 1025 inputs: 8 GiB otherwise).
    inv = 1.0 / (prec_j[None] + glob_prec)
    param = ((w_j ** 2) @ inv.T + 2.0 * w_j @ (glob * inv).T
             + ((glob ** 2) * inv - glob ** 2 / glob_prec).sum(-1)[None])
    capped = np.minimum(counts, 10.0)  # as IBM's code: popular neurons stop attracting more
    param = param + np.log(capped / (num_clients - capped))[None]
    new = (((w_j + prior_mean_prec) ** 2 / (prior_prec + prec_j)).sum(-1)
           - (prior_mean_prec ** 2 / prior_prec).sum())
    k = np.arange(1, (w_j.shape[0] if added is None else added) + 1)
    nonparam = new[:, None] - 2 * np.log(k)[None] + 2 * np.log(gamma / num_clients)
    return np.hstack([param, nonparam])


def bbp_map(weights: Sequence[np.ndarray], *, sigma: Any = 1.0, sigma0: Any = 1.0,
            mu0: Any = 0.0, gamma: float = 7.0, iterations: int = 5,
            rng: Optional[np.random.Generator] = None, cap: Optional[int] = 700) -> BBPMatch:
    """Matches J clients' neurons (weights[j]: (L_j, D), one row per neuron: its incoming
    weights and bias) by BBP-MAP: each client in turn is assigned by the Hungarian algorithm
    on `_bbp_cost` against the others' current global layer, first in decreasing L_j, then
    `iterations` sweeps in random order, each removing and re-matching one client. Gaussian
    neurons (variance sigma^2 around their global neuron, prior N(mu0, sigma0^2)), Indian
    buffet prior with mass gamma; IBM's FedMA defaults. A client matched against L global
    neurons opens at most `new_neurons(L_j, L, cap)` new ones (IBM's cap of 700 on the
    layer's growth; None: no cap). sigma, sigma0 and mu0 are scalars or (D,) arrays. IBM's
    `layer_wise_group_descent` sets mu0 = 0.1 on the bias column of the first layer only;
    on later layers its prior vector puts 0.1 on column 0, the first incoming weight (its
    neurons there are [weights, bias] as well, so the bias gets mu0 = 0). The returned
    weights are the posterior means sum(w) / sigma^2 + mu0 / sigma0^2 over n / sigma^2 +
    1 / sigma0^2: a neuron held by one client comes back shrunk towards mu0."""
    rng = rng if rng is not None else np.random.default_rng(0)
    ws = [np.asarray(w, np.float64) for w in weights]
    if not ws or any(w.ndim != 2 or w.shape[1] != ws[0].shape[1] for w in ws):
        raise ValueError("weights must be J >= 1 arrays (L_j, D) of one D, got shapes "
                         f"{[w.shape for w in ws]}")
    num, dim = len(ws), ws[0].shape[1]
    per_dim = lambda x: np.broadcast_to(np.asarray(x, np.float64), (dim,))  # noqa: E731
    prec = 1.0 / per_dim(sigma) ** 2
    prior_prec = 1.0 / per_dim(sigma0) ** 2
    prior_mean_prec = per_dim(mu0) * prior_prec
    normed = [w * prec for w in ws]
    order = sorted(range(num), key=lambda j: -ws[j].shape[0])
    first = order[0]
    glob = prior_mean_prec + normed[first]
    glob_prec = np.tile(prior_prec + prec, (len(glob), 1))
    counts = np.ones(len(glob))
    assign: List[np.ndarray] = [np.zeros(0, np.int64)] * num
    assign[first] = np.arange(len(glob))

    def add(j, glob, glob_prec, counts):
        cost = _bbp_cost(normed[j], glob, glob_prec, counts, prec, prior_mean_prec,
                         prior_prec, gamma, num, new_neurons(len(normed[j]), len(glob), cap))
        rows, cols = linear_sum_assignment(cost, maximize=True)
        out = np.empty(len(rows), np.int64)
        size = len(glob)
        new_rows = []
        for l, i in zip(rows, cols):
            if i < size:
                glob[i] += normed[j][l]
                glob_prec[i] += prec
                counts[i] += 1
                out[l] = i
            else:
                out[l] = size + len(new_rows)
                new_rows.append(l)
        if new_rows:
            glob = np.vstack([glob, prior_mean_prec + normed[j][new_rows]])
            glob_prec = np.vstack([glob_prec, np.tile(prior_prec + prec, (len(new_rows), 1))])
            counts = np.concatenate([counts, np.ones(len(new_rows))])
        return glob, glob_prec, counts, out

    for j in order[1:]:
        glob, glob_prec, counts, assign[j] = add(j, glob, glob_prec, counts)
    for _ in range(iterations):
        for j in rng.permutation(num):
            # Take client j out; global neurons only it held disappear.
            np.subtract.at(glob, assign[j], normed[j])
            np.subtract.at(glob_prec, assign[j], prec)
            np.subtract.at(counts, assign[j], 1.0)
            keep = counts > 0
            remap = np.cumsum(keep) - 1
            glob, glob_prec, counts = glob[keep], glob_prec[keep], counts[keep]
            assign = [a if k == j else remap[a] for k, a in enumerate(assign)]
            glob, glob_prec, counts, assign[j] = add(j, glob, glob_prec, counts)
    return BBPMatch(glob / glob_prec, assign, counts)


__all__ = ["align", "match", "assignment", "bbp_map", "BBPMatch", "weight_matching", "activation_matching", "BY"]
