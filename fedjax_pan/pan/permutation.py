"""Permutations of hidden neurons as data (git-re-basin style), and the PAN paper's shuffle test.

A `PermutationSpec` says, for every leaf of a model's variables, which permutation acts on
each axis (or none). One pure function, `apply_permutation`, applies any set of
permutations to any variables; architecture knowledge lives only in the spec builders.
A permutation `perm` of a layer with J neurons moves old neuron perm[j] to position j
(`jnp.take(x, perm, axis)`), on the layer's outputs (kernel out-axis, bias, norm scale/bias,
running statistics) and on the next layer's inputs. Input and output layers are never
permuted; PAN encodings are constants, not variables, so they are never permuted either:
that is exactly what breaks permutation invariance when PANs are on.

Architectures (parameter names of `fedjax_pan.models`):
  mlp      one permutation per hidden layer `fc{i}`;
  vgg*     one per conv `conv{i}` and per FC hidden layer; the conv-to-dense flatten maps the
           last conv's channel permutation onto the flattened (H, W, C) axis ('flat' axes);
  resnet   one permutation per stage for the residual stream (stem, every block's conv2 and
           projection shortcut of that stage, so residual sums stay consistent) and one for
           the inner channels of every block (its conv1); with explicit identity shortcuts
           (`models.explicit_shortcuts`, the PAN authors' way) one per block output instead,
           the identity kernels carrying the change between blocks;
  mobilenet  one per stem and pointwise conv; a depthwise conv follows its input's.
With GroupNorm, a permutation must keep every channel inside its group, so `groups[name]`
records the constraint and the random generators shuffle within groups.

Grouped (Fed2) models permute every grouped layer within its groups. A grouped conv's
kernel (k, k, in/G, out), a grouped FC's (G, in/G, out/G) and the decoupled head's
(G, F/G, C) hold one group's slice of the previous layer's channels on an axis, so that axis
is reordered by the within-group part of the permutation, group by group (`InGroup`).

Shuffle test (paper Alg. 1): start from the identity; for j = 0..J-2 draw i uniformly from
j+1..J-1 and swap positions i and j with probability P_sf. The released code's window
variant draws i from j..min(J-1, j + floor(J * window)).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Path = Tuple[str, ...]


class Flat(NamedTuple):
    """An axis that flattens (..., C) feature maps, channels fastest, permuted by `name`."""

    name: str


class InGroup(NamedTuple):
    """An axis holding one group's slice of permutation `name`'s channels (of G contiguous
    groups); the group is the index along axis `by` (in G contiguous blocks). `flat`: the
    slice flattens (spatial, channel) feature maps, channels fastest."""

    name: str
    by: int
    groups: int
    flat: bool = False


Axis = Union[None, str, Flat, InGroup]


@dataclasses.dataclass(frozen=True)
class PermutationSpec:
    """axes[path] = one entry per axis of that leaf: None, a permutation name, or Flat(name)."""

    axes: Dict[Path, Tuple[Axis, ...]]
    sizes: Dict[str, int]
    groups: Dict[str, int]

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self.sizes)


def _leaves(variables: Mapping[str, Any]) -> Dict[Path, Any]:
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {tuple(k.key for k in path): leaf for path, leaf in flat}


class _Builder:
    """Accumulates axis assignments for the leaves of a variables tree."""

    def __init__(self, variables: Mapping[str, Any], groups: int):
        self.leaves = _leaves(variables)
        self.axes: Dict[Path, Tuple[Axis, ...]] = {p: (None,) * np.ndim(x)
                                                   for p, x in self.leaves.items()}
        self.sizes: Dict[str, int] = {}
        self.group_of: Dict[str, int] = {}
        self.norm_groups = groups

    def _set(self, path: Path, axis: int, value: Axis) -> None:
        if path in self.axes:
            entry = list(self.axes[path])
            entry[axis] = value
            self.axes[path] = tuple(entry)

    def layer(self, name: str, perm_in: Axis, perm_out: Optional[str]) -> None:
        """A Dense or Conv layer `name` (kernel's last two axes are in, out) and its norm."""
        kernel = ("params", name, "kernel")
        if kernel not in self.leaves:
            raise KeyError(f"no layer {name!r} in these variables")
        nd = np.ndim(self.leaves[kernel])
        self._set(kernel, nd - 2, perm_in)
        if perm_out is None:
            return
        self.sizes[perm_out] = int(self.leaves[kernel].shape[-1])
        self._set(kernel, nd - 1, perm_out)
        self._set(("params", name, "bias"), 0, perm_out)
        norm = f"{name}_norm"
        for col in ("params", "batch_stats"):
            for leaf in ("scale", "bias", "mean", "var"):
                self._set((col, norm, leaf), 0, perm_out)
        if ("params", norm, "scale") in self.leaves and ("batch_stats", norm, "mean") not in \
                self.leaves:  # GroupNorm: permute within groups only
            self.group_of[perm_out] = self.norm_groups

    def spec(self) -> PermutationSpec:
        groups = {n: self.group_of.get(n, 1) for n in self.sizes}
        return PermutationSpec(dict(self.axes), dict(self.sizes), groups)


def _grouped_spec(model: Any, variables: Mapping[str, Any]) -> PermutationSpec:
    """The spec of a grouped MLP or VGG: shared layers as usual, grouped ones within groups."""
    gc, layout = model.grouped, model.group_layout()
    g = int(gc.groups)
    b = _Builder(variables, getattr(model, "groups", 1))
    prev: Axis = None
    prev_conv = prev_grouped = False
    for name in model.weight_layers():
        conv = name.startswith("conv")
        kind = layout.get(name)
        if kind is None:  # shared
            b.layer(name, Flat(prev) if prev_conv and not conv else prev, name)
        elif kind == "head" or kind == "stacked":
            entry = InGroup(prev, 0, g, flat=prev_conv) if prev_grouped else (
                Flat(prev) if prev_conv else prev)
            b._set(("params", name, "kernel"), 1, entry)
            if kind == "stacked":
                out = InGroup(name, 0, g)
                b._set(("params", name, "kernel"), 2, out)
                b._set(("params", name, "bias"), 1, out)
                b.sizes[name] = int(np.prod(b.leaves[("params", name, "bias")].shape))
        elif prev_grouped:  # a grouped conv: its input axis holds its group's slice
            b.layer(name, None, name)
            b._set(("params", name, "kernel"), 2, InGroup(prev, 3, g))
        else:  # the first grouped layer: dense input, outputs in G blocks
            b.layer(name, Flat(prev) if prev_conv and not conv else prev, name)
        if kind is not None and kind != "head":
            per_group = int(gc.norm_per_group) if conv and gc.norm == "group" else 1
            b.group_of[name] = g * per_group
        prev, prev_conv, prev_grouped = name, conv, kind is not None
    return b.spec()


def _mobilenet_spec(model: Any, variables: Mapping[str, Any]) -> PermutationSpec:
    """MobileNetV1: one permutation per stem and pointwise conv; each depthwise conv (and
    its norm) follows its input's, its channels being tied to them. Grouped blocks permute
    within groups, their grouped pointwise kernels by `InGroup`."""
    gc, layout = getattr(model, "grouped", None), model.group_layout()
    g = int(gc.groups) if gc is not None else 1
    within = g * (int(gc.norm_per_group) if gc is not None and gc.norm == "group" else 1)
    b = _Builder(variables, getattr(model, "groups", 1))
    b.layer("stem", None, "stem")
    prev, prev_grouped = "stem", "stem" in layout
    if prev_grouped:
        b.group_of["stem"] = within
    for i in range(1, len(model.weight_layers()) - 1):
        dw, pw = f"block{i}_dw", f"block{i}_pw"
        constraint = b.group_of.get(prev)
        b.layer(dw, None, prev)
        if constraint is not None or prev_grouped:  # a depthwise GroupNorm nests in these
            b.group_of[prev] = within if prev_grouped else constraint
        if pw in layout and prev_grouped:
            b.layer(pw, None, pw)
            b._set(("params", pw, "kernel"), 2, InGroup(prev, 3, g))
        else:
            b.layer(pw, prev, pw)
        if pw in layout:
            b.group_of[pw] = within
        prev, prev_grouped = pw, pw in layout
    if "head" in layout:
        b._set(("params", "head", "kernel"), 1, InGroup(prev, 0, g))
    else:
        b.layer("head", prev, None)
    return b.spec()


def _numbered(params: Mapping[str, Any], prefix: str) -> list:
    names = [k for k in params if k.startswith(prefix) and k[len(prefix):].isdigit()]
    return sorted(names, key=lambda k: int(k[len(prefix):]))


def spec_for(model: Any, variables: Mapping[str, Any]) -> PermutationSpec:
    """The permutation spec of a `fedjax_pan.models` network (read from its parameters)."""
    if "block1_dw" in variables["params"]:
        return _mobilenet_spec(model, variables)
    if getattr(model, "grouped", None) is not None:
        return _grouped_spec(model, variables)
    groups = getattr(model, "groups", 1)
    b = _Builder(variables, groups)
    params = variables["params"]
    convs, fcs = _numbered(params, "conv"), _numbered(params, "fc")
    if "stem" in params:  # ResNet
        stages = sorted({int(k[5:k.index("_")]) for k in params if k.startswith("stage")})
        per_block = any(k.endswith("_identity") for k in params)
        stream: Axis = "stem" if per_block else "res1"
        b.layer("stem", None, stream)
        for s in stages:
            blocks = sorted({int(k.split("_")[1][5:]) for k in params
                             if k.startswith(f"stage{s}_block")})
            for blk in blocks:
                name = f"stage{s}_block{blk}"
                inner, out = f"{name}_inner", f"{name}_out" if per_block else f"res{s}"
                b.layer(f"{name}_conv1", stream, inner)
                if f"{name}_shortcut" in params:
                    b.layer(f"{name}_shortcut", stream, out)
                elif f"{name}_identity" in params:
                    b.layer(f"{name}_identity", stream, out)
                elif stream != out:
                    raise ValueError(f"{name} changes its stream's channels without a "
                                     "projection or explicit identity shortcut")
                b.layer(f"{name}_conv2", inner, out)
                stream = out
        b.layer("head", stream, None)
        return b.spec()
    prev: Axis = None
    for name in convs:
        b.layer(name, prev, name)
        prev = name
    if convs:
        prev = Flat(prev)
    for name in fcs:
        b.layer(name, prev, name)
        prev = name
    b.layer("head", prev, None)
    return b.spec()


def _in_group_index(entry: InGroup, perms: Mapping[str, Any], shape: Tuple[int, ...],
                    axis: int, xp) -> Any:
    """take_along_axis indices for an `InGroup` axis: each group's own local permutation."""
    perm = perms[entry.name]
    g, n = entry.groups, perm.shape[0] // entry.groups
    local = perm.reshape(g, n) - (xp.arange(g) * n)[:, None]  # (G, n), within-group
    if entry.flat:
        spatial = shape[axis] // n
        local = (xp.arange(spatial)[None, :, None] * n + local[:, None, :]).reshape(g, -1)
    table = local[(xp.arange(shape[entry.by]) * g) // shape[entry.by]]  # (len(by), len(axis))
    if entry.by > axis:
        table = table.T
    index_shape = [1] * len(shape)
    index_shape[entry.by], index_shape[axis] = shape[entry.by], shape[axis]
    return table.reshape(index_shape)


def _axis_index(axis: Axis, perms: Mapping[str, Any], length: int, xp) -> Any:
    if isinstance(axis, Flat):
        perm = perms[axis.name]
        channels = perm.shape[0]
        blocks = length // channels
        return (xp.arange(blocks)[:, None] * channels + perm[None, :]).reshape(-1)
    return perms[axis]


def apply_permutation(spec: PermutationSpec, perms: Mapping[str, Any],
                      variables: Mapping[str, Any]) -> Dict[str, Any]:
    """Variables with every permuted axis reordered; works on numpy and inside jit."""
    def permute(path, leaf):
        key = tuple(k.key for k in path)
        axes = spec.axes.get(key)
        if axes is None:
            raise KeyError(f"leaf {'/'.join(key)} is not covered by the permutation spec")
        xp = jnp if isinstance(leaf, jax.Array) else np
        for axis, entry in enumerate(axes):
            if isinstance(entry, InGroup):
                index = xp.broadcast_to(_in_group_index(entry, perms, leaf.shape, axis, xp),
                                        leaf.shape)
            elif entry is not None:
                index = _axis_index(entry, perms, leaf.shape[axis], xp)
            else:
                continue
            leaf = (_reorder_axis(leaf, index, axis) if xp is jnp else
                    np.take_along_axis(leaf, index, axis) if index.ndim == leaf.ndim else
                    np.take(leaf, index, axis=axis))
        return leaf
    return jax.tree_util.tree_map_with_path(permute, dict(variables))


def _reorder_axis(leaf: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """`leaf` reordered along `axis` by `index` (one entry per position on the axis, or
    leaf's full shape as for take_along_axis), as one gather from the flattened array.
    A gather along an inner axis makes XLA lay its result out column-major, and a kernel
    carried through a compiled training loop then costs a transpose at every step, even
    where the permutation sits in a branch rarely taken (measured on the PAN MLP: 27.6 ->
    44.9 ms a step for one 1024 x 1024 kernel's columns)."""
    shape = leaf.shape
    along = [1] * leaf.ndim
    along[axis] = shape[axis]
    if index.ndim == 1:
        index = index.reshape(along)
    stride = int(np.prod(shape[axis + 1:], dtype=np.int64))
    shift = (index - jnp.arange(shape[axis]).reshape(along)) * stride
    flat = (jnp.arange(leaf.size).reshape(shape) + shift).reshape(-1)
    return leaf.reshape(-1)[flat].reshape(shape)


def inverse(perms: Mapping[str, Any]) -> Dict[str, Any]:
    """The permutations undoing `perms`."""
    return {k: (jnp if isinstance(p, jax.Array) else np).argsort(p) for k, p in perms.items()}


def compose(first: Mapping[str, Any], then: Mapping[str, Any]) -> Dict[str, Any]:
    """The single permutation equal to applying `first`, then `then`."""
    return {k: first[k][then[k]] for k in first}


def identity(spec: PermutationSpec) -> Dict[str, np.ndarray]:
    return {k: np.arange(n) for k, n in spec.sizes.items()}


# ----------------------------------------------------------------------------------------
# The shuffle test.
# ----------------------------------------------------------------------------------------

def shuffle_permutation(rng: np.random.Generator, size: int, p_sf: float,
                        window: Optional[float] = None) -> np.ndarray:
    """Alg. 1's random permutation (or the released code's window variant)."""
    perm = np.arange(size)
    for j in range(size - 1):
        if window is None:
            i = int(rng.integers(j + 1, size))
        else:
            i = int(rng.integers(j, min(size - 1, j + int(np.floor(size * window))) + 1))
        if rng.random() <= p_sf:
            perm[[i, j]] = perm[[j, i]]
    return perm


def shuffle_permutation_jax(key: jax.Array, size: int, p_sf: jax.Array,
                            window: Optional[float] = None) -> jax.Array:
    """Alg. 1 in jax (for shuffling inside compiled local training); same distribution."""
    def body(j, carry):
        perm, key = carry
        key, k_i, k_p = jax.random.split(key, 3)
        if window is None:
            i = jax.random.randint(k_i, (), j + 1, size)
        else:
            hi = jnp.minimum(size - 1, j + int(np.floor(size * window)))
            i = jax.random.randint(k_i, (), j, hi + 1)
        swap = jax.random.uniform(k_p) <= p_sf
        pi, pj = perm[i], perm[j]
        perm = perm.at[j].set(jnp.where(swap, pi, pj)).at[i].set(jnp.where(swap, pj, pi))
        return perm, key
    perm, _ = jax.lax.fori_loop(0, size - 1, body, (jnp.arange(size), key))
    return perm


def _grouped(make, size: int, groups: int):
    """Applies a permutation generator within each of `groups` contiguous channel groups."""
    width = size // groups
    return [make(width) + g * width for g in range(groups)]


def random_permutations(spec: PermutationSpec, rng: np.random.Generator, p_sf: float,
                        window: Optional[float] = None) -> Dict[str, np.ndarray]:
    """One Alg. 1 permutation per hidden layer (within groups for GroupNorm layers)."""
    return {name: np.concatenate(_grouped(lambda w: shuffle_permutation(rng, w, p_sf, window),
                                          size, spec.groups[name]))
            for name, size in spec.sizes.items()}


def random_permutations_jax(spec: PermutationSpec, key: jax.Array, p_sf: jax.Array,
                            window: Optional[float] = None) -> Dict[str, jax.Array]:
    keys = jax.random.split(key, len(spec.sizes))
    out = {}
    for k, (name, size) in zip(keys, spec.sizes.items()):
        group_keys = iter(jax.random.split(k, spec.groups[name]))
        out[name] = jnp.concatenate(_grouped(
            lambda w: shuffle_permutation_jax(next(group_keys), w, p_sf, window),
            size, spec.groups[name]))
    return out


def r_kept(perm: Any) -> float:
    """Fraction of neurons left in place: mean(diag(Pi)) (Fig. 2)."""
    perm = np.asarray(perm)
    return float(np.mean(perm == np.arange(len(perm))))


def fl_shuffle_product(rng: np.random.Generator, size: int, p_sf: float, n_sf: float,
                       steps: int, window: Optional[float] = None) -> np.ndarray:
    """The product of Alg. 2's permutations over `steps` local steps (shuffle w.p. n_sf/steps)."""
    total = np.arange(size)
    for _ in range(steps):
        if rng.random() <= n_sf / steps:
            total = total[shuffle_permutation(rng, size, p_sf, window)]
    return total


def shuffle_error(model: Any, variables: Mapping[str, Any], perms: Mapping[str, Any],
                  spec: PermutationSpec, inputs: jax.Array) -> float:
    """Eq. 8: mean over inputs of ||h_L,sf - h_L||_2 / J_L, in eval mode."""
    out = model.apply(variables, inputs, train=False)
    out_sf = model.apply(apply_permutation(spec, perms, variables), inputs, train=False)
    diff = np.asarray(out_sf, np.float64) - np.asarray(out, np.float64)
    return float(np.mean(np.linalg.norm(diff, axis=-1)) / diff.shape[-1])
