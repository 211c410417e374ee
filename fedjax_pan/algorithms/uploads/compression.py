"""What a client sends, compressed: composable transforms over pytrees, optax style, with
the exact size of every message.

A `Transform` is a pair of pure functions and a static wire format:

    init(params)                    -> state      (per client; () when stateless)
    apply(x, state, ctx)            -> (decoded, state)
    wire(layout)                    -> layout     (per leaf, from shapes alone)

`x` is a pytree of float arrays (a model update, or a model), `decoded` what the receiver
reconstructs (dense, same shapes), and `ctx` a `Context` (the sender's key, the reference
model the message is taken against, each leaf's incoming `Layout`). Every message has a
fixed format, so its size is a Python integer known before anything runs:

    bytes = index_bytes + ceil(count * value_bits / 8) + extra_bytes       (per leaf)

Formats (SPEC): dense 4d; top-k 4k values plus int32 indices (4k) or a d-bit bitmap,
whichever is smaller; random-k 4k plus a 4-byte seed from which the receiver draws the
same positions (Konecny et al. 2016); QSGD with s levels 1 + ceil(log2(s + 1)) bits a
value plus the 4-byte norm (no Elias coding); sign 1 bit a value plus a 4-byte scale;
b-bit uniform quantisation b bits a value plus the 4-byte minimum and maximum.
Sparsifiers act per leaf (layer-wise, as Deep Gradient Compression) with
k = ceil(ratio * d). Transforms chain (`chain(top_k(0.1), qsgd(16))` sends 10% of each
layer at 6 bits a value), and `error_feedback` wraps any of them (Stich et al. 2018;
Karimireddy et al. 2019): p = x + e, send C(p), keep e <- p - C(p).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pan.references import Reference

PyTree = Any
tree_map = jax.tree_util.tree_map
INDEX_BYTES = 4  # an int32 position
SMALL_LEAF = 1 << 15  # top-k masks of smaller leaves use lax.top_k (measured crossover)
SCALAR_BYTES = 4  # a float32 norm, scale or bound


class Layout(NamedTuple):
    """The wire format of one leaf (Python numbers, static)."""

    size: int  # d, the leaf's coordinates
    count: int  # values sent
    value_bits: int  # bits a value
    index_bytes: int  # positions of the values (0: all d, in order)
    extra_bytes: int  # norms, scales, bounds

    @property
    def nbytes(self) -> int:
        return self.index_bytes + math.ceil(self.count * self.value_bits / 8) + self.extra_bytes

    @property
    def sparse(self) -> bool:
        return self.count < self.size


def dense_layout(leaf: Any) -> Layout:
    """A leaf (array or shape-dtype struct) sent as it is."""
    d = int(np.prod(leaf.shape))
    return Layout(d, d, 8 * np.dtype(leaf.dtype).itemsize, 0, 0)


class Context(NamedTuple):
    key: jax.Array  # the sender's key for this message
    reference: PyTree  # the model the message is taken against (the broadcast)
    layouts: PyTree  # each leaf's incoming Layout


class Transform(NamedTuple):
    init: Callable[[PyTree], PyTree]
    apply: Callable[[PyTree, PyTree, Context], Tuple[PyTree, PyTree]]
    wire: Callable[[Layout], Layout]
    name: str = "transform"


def _stateless(params: PyTree) -> tuple:
    del params
    return ()


def _is_layout(x: Any) -> bool:
    return isinstance(x, Layout)


def layouts(transform: Transform, tree: PyTree) -> PyTree:
    """Each leaf's Layout once `transform` has encoded it (leaves: arrays or structs)."""
    return tree_map(lambda leaf: transform.wire(dense_layout(leaf)), tree)


def message_bytes(transform: Transform, tree: PyTree) -> int:
    """Bytes of `tree` sent through `transform` (exact, from shapes alone)."""
    return int(sum(l.nbytes for l in jax.tree_util.tree_leaves(
        layouts(transform, tree), is_leaf=_is_layout)))


def apply(transform: Transform, x: PyTree, state: Optional[PyTree], key: jax.Array,
          reference: Optional[PyTree] = None) -> Tuple[PyTree, PyTree]:
    """`transform` on `x` sent dense: (decoded, new state); `state` None: its initial."""
    state = transform.init(x) if state is None else state
    incoming = tree_map(dense_layout, x)
    return transform.apply(x, state, Context(key, reference, incoming))


def _leafwise(fn: Callable[..., jax.Array], wire: Callable[[Layout], Layout], name: str
              ) -> Transform:
    """A stateless transform of each leaf: fn(leaf, key, layout, reference_leaf)."""
    def apply_(x, state, ctx):
        leaves, treedef = jax.tree_util.tree_flatten(x)
        keys = jax.random.split(ctx.key, max(len(leaves), 1))
        lays = jax.tree_util.tree_leaves(ctx.layouts, is_leaf=_is_layout)
        refs = ([None] * len(leaves) if ctx.reference is None
                else jax.tree_util.tree_leaves(ctx.reference))
        out = [fn(v, k, l, r) for v, k, l, r in zip(leaves, keys, lays, refs)]
        return jax.tree_util.tree_unflatten(treedef, out), state
    return Transform(_stateless, apply_, wire, name)


def identity() -> Transform:
    """Sends everything as it is (the default: results equal the untransformed run)."""
    return Transform(_stateless, lambda x, state, ctx: (x, state), lambda l: l, "identity")


def kept(ratio: float, d: int) -> int:
    """k = ceil(ratio * d), at least 1: the values a sparsifier keeps of d."""
    return max(1, min(d, math.ceil(ratio * d)))


def _check_ratio(ratio: float, what: str) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{what} needs a ratio in (0, 1], got {ratio}")


def _sparse_wire(ratio: float, index_bytes: Callable[[int, int], int]):
    def wire(l: Layout) -> Layout:
        k = kept(ratio, l.count)  # of the values already sent
        return l._replace(count=k, index_bytes=index_bytes(k, l.size))
    return wire


def _positions_bytes(k: int, d: int) -> int:
    """Int32 indices or a d-bit bitmap, whichever is smaller."""
    return min(INDEX_BYTES * k, math.ceil(d / 8))


def _kth_digit(counts: jax.Array, k: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """(the largest digit j with #(digit >= j) >= k, #(digit > j)) from a histogram."""
    at_least = jnp.cumsum(counts[::-1])[::-1]  # at_least[j] = #(digit >= j)
    j = jnp.sum(at_least >= k) - 1  # at_least is non-increasing
    above = at_least[j] - counts[j]
    return j, above


def top_k_mask(scores: jax.Array, k: int) -> jax.Array:
    """A boolean mask of `scores`' shape keeping its k largest entries (ties: the lower
    index), for non-negative float32 scores.

    A radix select on the scores' bit patterns (which order non-negative floats as
    integers): a histogram of the high 16 bits finds the k-th largest value's bin, a
    histogram of the low 15 bits within that bin its exact value; three passes over the
    leaf, where a sort or `lax.top_k` takes ten times longer on CPU at k = 10% of a large
    layer (leaves under `SMALL_LEAF` entries use `lax.top_k`). Ties at the k-th value are
    taken in index order.
    """
    flat = scores.reshape(-1).astype(jnp.float32)
    if k >= flat.size:
        return jnp.ones(scores.shape, bool)
    if flat.size < SMALL_LEAF:
        # Below this size `lax.top_k` beats the select's fixed 2^16-bin histograms.
        _, index = jax.lax.top_k(flat, k)  # ties: the lower index first
        return jnp.zeros(flat.shape, bool).at[index].set(True).reshape(scores.shape)
    bits = jax.lax.bitcast_convert_type(flat, jnp.int32)
    high, low = bits >> 15, bits & 0x7FFF
    j, above_high = _kth_digit(jnp.zeros(1 << 16, jnp.int32).at[high].add(1), k)
    in_bin = (high == j).astype(jnp.int32)
    low_counts = jnp.zeros(1 << 15, jnp.int32).at[low].add(in_bin)
    l, above_low = _kth_digit(low_counts, k - above_high)
    value = (j << 15) | l
    need = k - above_high - above_low  # taken from the ties at `value`
    above, at = bits > value, bits == value
    ties = jax.lax.cond(need == low_counts[l], lambda: at,
                        lambda: at & (jnp.cumsum(at) <= need))
    return (above | ties).reshape(scores.shape)


def top_k(ratio: float, score: str = "magnitude") -> Transform:
    """Keeps the k = ceil(ratio * d) entries of each leaf with the largest scores: |x|
    ('magnitude'), or |(x - reference) * x| ('importance': the first-order loss change of
    zeroing a weight, |dL/dw * w|, with the round's summed gradient, which plain local SGD
    makes exactly -(x - reference) / lr; for a model message). Of a sparse input, k of its
    `count` values are kept."""
    _check_ratio(ratio, "top_k")
    if score not in ("magnitude", "importance"):
        raise ValueError(f"top_k score must be 'magnitude' or 'importance', got {score!r}")

    def fn(v, key, layout, ref):
        del key
        if score == "importance":
            if ref is None:
                raise ValueError("importance scores need the reference model")
            s = jnp.abs((v - ref) * v)
        else:
            s = jnp.abs(v)
        return jnp.where(top_k_mask(s, kept(ratio, layout.count)), v, 0).astype(v.dtype)
    return _leafwise(fn, _sparse_wire(ratio, _positions_bytes), f"top_k({ratio})")


def random_k(ratio: float, unbiased: bool = False) -> Transform:
    """Keeps k = ceil(ratio * d) positions of each leaf drawn uniformly from the sender's
    key (the receiver draws the same ones from the 4-byte seed); `unbiased` scales the kept
    values by d / k so that E[decoded] = x. Of a sparse input it draws among all d."""
    _check_ratio(ratio, "random_k")

    def fn(v, key, layout, ref):
        del ref
        k = kept(ratio, layout.size)
        # The k largest of d uniform draws: a uniform k-subset (a permutation's sort costs
        # 20x more on CPU).
        mask = top_k_mask(jax.random.uniform(key, v.shape), k)
        scale = layout.size / k if unbiased else 1.0
        return jnp.where(mask, v * scale, 0).astype(v.dtype)

    def wire(l: Layout) -> Layout:
        return l._replace(count=min(l.count, kept(ratio, l.size)), index_bytes=SCALAR_BYTES)
    return _leafwise(fn, wire, f"random_k({ratio})")


def qsgd_bits(levels: int) -> int:
    """Bits a coordinate under QSGD with s levels: a sign and a level in 0..s."""
    return 1 + math.ceil(math.log2(levels + 1))


def qsgd(levels: int) -> Transform:
    """QSGD (Alistarh et al. 2017) with s levels, per leaf: ||v|| sign(v_i) xi_i / s, xi_i
    = l or l + 1 with P(l + 1) = |v_i| s / ||v|| - l, l = floor(|v_i| s / ||v||): unbiased,
    stochastic rounding from the sender's key. Zeros stay zero (sparse inputs stay sparse)."""
    if levels < 1:
        raise ValueError(f"qsgd needs levels >= 1, got {levels}")

    def fn(v, key, layout, ref):
        del layout, ref
        x = v.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(x * x))
        r = jnp.where(norm > 0, jnp.abs(x) / jnp.where(norm > 0, norm, 1.0), 0.0) * levels
        low = jnp.floor(r)
        up = jax.random.uniform(key, x.shape) < (r - low)
        return (norm * jnp.sign(x) * (low + up) / levels).astype(v.dtype)

    def wire(l: Layout) -> Layout:
        return l._replace(value_bits=qsgd_bits(levels), extra_bytes=l.extra_bytes + SCALAR_BYTES)
    return _leafwise(fn, wire, f"qsgd({levels})")


def sign() -> Transform:
    """Scaled sign per leaf (Karimireddy et al. 2019): sign(v) times the mean |v| of the
    values sent, 1 bit a value and a 4-byte scale. Zeros stay zero."""
    def fn(v, key, layout, ref):
        del key, ref
        a = jnp.abs(v.astype(jnp.float32))
        sent = jnp.sum(v != 0) if layout.sparse else layout.size
        scale = jnp.sum(a) / jnp.maximum(sent, 1)
        return (scale * jnp.sign(v)).astype(v.dtype)

    def wire(l: Layout) -> Layout:
        return l._replace(value_bits=1, extra_bytes=l.extra_bytes + SCALAR_BYTES)
    return _leafwise(fn, wire, "sign")


def quantize(bits: int, stochastic: bool = True) -> Transform:
    """Uniform b-bit quantisation per leaf: 2^b levels from the leaf's minimum to its
    maximum (both sent), rounded stochastically (unbiased) or to the nearest level. Of a
    sparse input only the values sent are quantised."""
    if not 1 <= bits <= 16:
        raise ValueError(f"quantize needs 1 <= bits <= 16, got {bits}")
    steps = 2 ** bits - 1

    def fn(v, key, layout, ref):
        del ref
        x = v.astype(jnp.float32)
        sent = (x != 0) if layout.sparse else jnp.ones(x.shape, bool)
        lo = jnp.min(jnp.where(sent, x, jnp.inf))
        hi = jnp.max(jnp.where(sent, x, -jnp.inf))
        width = jnp.where(hi > lo, hi - lo, 1.0)
        r = (x - lo) / width * steps
        low = jnp.floor(r)
        q = low + (jax.random.uniform(key, x.shape) < r - low) if stochastic else jnp.round(r)
        out = jnp.where(hi > lo, lo + jnp.clip(q, 0, steps) * width / steps, x)
        return jnp.where(sent, out, 0).astype(v.dtype)

    def wire(l: Layout) -> Layout:
        return l._replace(value_bits=bits, extra_bytes=l.extra_bytes + 2 * SCALAR_BYTES)
    return _leafwise(fn, wire, f"quantize({bits})")


def chain(*transforms: Transform) -> Transform:
    """The transforms applied in order, each to the previous one's decoded message and
    format; states are a tuple, one a transform."""
    if not transforms:
        return identity()

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def apply_(x, state, ctx):
        new, lays = [], ctx.layouts
        keys = jax.random.split(ctx.key, len(transforms))
        for t, s, k in zip(transforms, state, keys, strict=True):
            x, s = t.apply(x, s, ctx._replace(key=k, layouts=lays))
            lays = tree_map(t.wire, lays, is_leaf=_is_layout)
            new.append(s)
        return x, tuple(new)

    def wire(l: Layout) -> Layout:
        for t in transforms:
            l = t.wire(l)
        return l
    return Transform(init, apply_, wire, " + ".join(t.name for t in transforms))


class FeedbackState(NamedTuple):
    residual: PyTree  # e: what was not sent yet
    inner: PyTree


def error_feedback(inner: Transform) -> Transform:
    """`inner` with error feedback: p = x + e; send C(p); e <- p - C(p) (kept by the
    sender across rounds; sent + new residual = input + old residual)."""
    def init(params):
        return FeedbackState(tree_map(jnp.zeros_like, params), inner.init(params))

    def apply_(x, state, ctx):
        p = tree_map(jnp.add, x, state.residual)
        sent, s = inner.apply(p, state.inner, ctx)
        return sent, FeedbackState(tree_map(jnp.subtract, p, sent), s)
    return Transform(init, apply_, inner.wire, f"ef({inner.name})")


def clip_by_norm(x: PyTree, bound: jax.Array) -> Tuple[PyTree, jax.Array]:
    """`x` scaled to global L2 norm at most `bound` (x * min(1, bound / ||x||)), and ||x||."""
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(v.astype(jnp.float32)))
                        for v in jax.tree_util.tree_leaves(x)))
    factor = jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-12))
    return tree_map(lambda v: (v * factor).astype(v.dtype), x), norm


# Names the config's `compression.upload` / `.download` accept, and how each is built from
# the section's options (ratio, levels, bits, score).
METHODS = ("none", "top_k", "random_k", "qsgd", "sign", "quantize", "magnitude_mask",
           "importance_mask")


# Options of `config.compression` that are methods of their own (each with a reference).
OPTIONS = ("error_feedback", "vote", "mask_before")
_SLIDES = "Slides 001, compression part (post- and pre-training masks, Theta_p = Theta * M^P)"
REFERENCES = {
    "top_k": Reference(
        "Aji & Heafield, EMNLP 2017 (sparse communication: the largest |x|); layer-wise "
        "selection as Lin et al., ICLR 2018 (Deep Gradient Compression)", None,
        ("k = ceil(ratio d) per leaf (DGC's layer-wise choice; Aji & Heafield use one global "
         "threshold): a message's size is then known from shapes alone",
         "ties at the k-th magnitude are broken by position (any k of them is a top-k)")),
    "random_k": Reference(
        "Konecny et al., 'Federated Learning: Strategies for Improving Communication "
        "Efficiency', 2016 (random mask from a shared seed)", None,
        ("config's random_k keeps the values unscaled, a biased compressor; "
         "random_k(ratio, unbiased=True) is the unbiased d / k form",)),
    "qsgd": Reference("Alistarh et al., NeurIPS 2017 (QSGD, Eq. of Q_s with s levels)", None,
                      ("one bucket per leaf (the paper's bucket size d = the layer)",
                       "the size counts 1 + ceil(log2(s + 1)) bits a value, without the "
                       "paper's Elias coding (an upper bound on its bytes)")),
    "sign": Reference(
        "Karimireddy et al., ICML 2019 (EF-SGD's scaled sign ||p||_1 / d sign(p))", None,
        ("per leaf, the scale over the values sent (the paper: one scale for the vector)",)),
    "quantize": Reference(
        "Uniform b-bit quantisation between the message's minimum and maximum with "
        "unbiased stochastic rounding (Suresh et al., ICML 2017, stochastic k-level "
        "quantisation)", None,
        ("one [min, max] range per leaf; no rotation (Suresh et al.'s rotated variant)",)),
    "magnitude_mask": Reference(_SLIDES + ": post-training magnitude mask, keeping the "
                                "largest |w|", None,
                                ("per leaf, k = ceil(ratio d) (the slides leave the scope "
                                 "open)",)),
    "importance_mask": Reference(
        _SLIDES + ": importance mask |dL/dw * w|", None,
        ("dL/dw is the round's summed gradient -(w - w_ref) / lr of plain local SGD, not a "
         "fresh gradient: no extra pass over the data",)),
    "error_feedback": Reference(
        "Stich et al., NeurIPS 2018; Karimireddy et al., ICML 2019 (p = x + e, send C(p), "
        "e <- p - C(p))", None, ()),
    "vote": Reference("Bernstein et al., ICLR 2019 (signSGD with majority vote)", None,
                      ("the server steps by the vote's sign times the clients' mean scale "
                       "(the paper's step is the server learning rate); the scale keeps "
                       "FedAvg's server rule unchanged",)),
    "mask_before": Reference(
        _SLIDES + ": pre-training mask, L_i = l(D_i, Theta) + lambda_1 ||Theta * M^r||_1",
        None, ("the L1 term is applied as its proximal step (soft-thresholding by "
               "lr lambda_1) after each local step, not through the loss's subgradient",)),
}


def from_name(name: str, ratio: float = 0.1, levels: int = 16, bits: int = 8,
              feedback: bool = False, quantize_bits: int = 0) -> Transform:
    """The transform `name` (METHODS), then `quantize_bits`-bit quantisation of the values
    kept (0: none), wrapped in error feedback where `feedback`."""
    builders = {"none": identity, "top_k": lambda: top_k(ratio),
                "random_k": lambda: random_k(ratio), "qsgd": lambda: qsgd(levels),
                "sign": sign, "quantize": lambda: quantize(bits),
                "magnitude_mask": lambda: top_k(ratio, "magnitude"),
                "importance_mask": lambda: top_k(ratio, "importance")}
    if name not in builders:
        raise ValueError(f"unknown compression {name!r}; expected one of {METHODS}")
    t = builders[name]()
    if quantize_bits:
        t = chain(t, quantize(quantize_bits))
    return error_feedback(t) if feedback else t


__all__ = ["Layout", "Context", "Transform", "dense_layout", "layouts", "message_bytes",
           "apply", "identity", "kept", "top_k_mask", "top_k", "random_k", "qsgd",
           "qsgd_bits", "sign", "quantize", "chain", "FeedbackState", "error_feedback",
           "clip_by_norm", "METHODS", "OPTIONS", "REFERENCES", "from_name"]
