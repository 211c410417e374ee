"""Client data without copies, and the paper's local-work semantics.

The training set lives once on the device; a client is a row of a padded index table.
Batches are gathered inside the compiled step: in epoch e, client k visits its examples
in the order of a permutation drawn from fold_in(key_k, e), B at a time. The permutation
is drawn at the fixed width of the largest client, so every execution strategy (and the
sequential reference) sees the same batches; executors draw it once per epoch and carry
it through the epoch's steps. A last partial batch of r examples is
computed on `tail_rows` rows (r rounded up to a multiple of ceil(B/4): at most three
compiled tail shapes, not one per size) or, where clients step in lockstep, on B rows; the
padding rows are masked either way. No batch is wider than the largest client: the
executors use min(B, largest size) for B, which gives the same batches and steps (a B
above every client's size makes each epoch one batch of the whole client either way).

Training batches may be augmented (`Augment`: torchvision's RandomCrop(padding) and
RandomHorizontalFlip), inside the compiled step, each example from its own key
fold_in(fold_in(fold_in(key_k, AUGMENT_STREAM), step), row): the same crops under every
strategy, whatever rows a batch is computed on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

STEP_MODES = ("epochs", "authors", "steps")
AUGMENT_STREAM = 7919  # folded into a client's data key for its augmentation draws
AUGMENTS = ("none", "crop_flip")  # config.dataset.augment


class Augment(NamedTuple):
    """Random crops of the image's size from the image padded by `pad` pixels of value
    `fill` (per channel; what black becomes after normalisation), and horizontal flips
    with probability 1/2 when `flip`."""

    pad: int = 4
    flip: bool = True
    fill: Tuple[float, ...] = (0.0,)


def augment_batch(x: jax.Array, key: jax.Array, augment: Augment) -> jax.Array:
    """`augment` applied to a batch (B, H, W, C), example i drawn from fold_in(key, i)."""
    b, h, w, c = x.shape
    p = int(augment.pad)
    fill = jnp.broadcast_to(jnp.asarray(augment.fill, x.dtype), (c,))
    padded = jnp.broadcast_to(fill, (b, h + 2 * p, w + 2 * p, c))
    padded = jax.lax.dynamic_update_slice(padded, x, (0, p, p, 0))

    def one(image, i):
        k_crop, k_flip = jax.random.split(jax.random.fold_in(key, i))
        dy, dx = jax.random.randint(k_crop, (2,), 0, 2 * p + 1)
        out = jax.lax.dynamic_slice(image, (dy, dx, 0), (h, w, c))
        if augment.flip:
            out = jnp.where(jax.random.bernoulli(k_flip), out[:, ::-1], out)
        return out
    return jax.vmap(one)(padded, jnp.arange(b))


def augment_key(key: jax.Array, step: jax.Array) -> jax.Array:
    """The key of a client's augmentation draws at local step `step`."""
    return jax.random.fold_in(jax.random.fold_in(key, AUGMENT_STREAM), step)


@dataclasses.dataclass(frozen=True)
class LocalWork:
    """How much a client trains per round.

    mode 'epochs': E passes over its data, ceil(n/B) steps each (the paper);
    'authors': max(floor(E * ceil(n/B)), 5) steps cycling reshuffled epochs (released code);
    'steps': exactly `local_steps` steps cycling reshuffled epochs.
    """

    batch_size: int = 64
    epochs: float = 5.0
    mode: str = "epochs"
    local_steps: Optional[int] = None
    augment: Optional[Augment] = None  # training-batch augmentation

    def __post_init__(self):
        if self.mode not in STEP_MODES:
            raise ValueError(f"unknown local work mode {self.mode!r}; expected one of {STEP_MODES}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.mode == "steps" and (self.local_steps is None or self.local_steps < 1):
            raise ValueError(f"mode 'steps' needs local_steps >= 1, got {self.local_steps}")
        if self.mode != "steps" and not self.epochs > 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")

    def num_steps(self, sizes: np.ndarray) -> np.ndarray:
        """Local steps per client for client sizes `sizes` (host integers)."""
        sizes = np.asarray(sizes, np.int64)
        batches = -(-sizes // self.batch_size)
        if self.mode == "steps":
            return np.full_like(sizes, self.local_steps)
        if self.mode == "authors":
            return np.maximum(np.floor(self.epochs * batches).astype(np.int64), 5)
        return np.ceil(self.epochs * batches - 1e-9).astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class ClientData:
    """Device-resident training data and the clients' index table.

    images (N, H, W, C) float32 (normalised); labels (N,) int32; index_table (K, max_n)
    int32 padded with 0; sizes (K,) host ints; label_counts (K, C) float32, each client's
    label histogram (handed to algorithms in their `ClientContext`).
    """

    images: jax.Array
    labels: jax.Array
    index_table: jax.Array
    sizes: np.ndarray
    label_counts: Optional[jax.Array] = None

    @classmethod
    def create(cls, images: np.ndarray, labels: np.ndarray,
               client_indices: Sequence[np.ndarray],
               num_classes: Optional[int] = None) -> "ClientData":
        sizes = np.asarray([len(ix) for ix in client_indices], np.int64)
        if len(sizes) == 0 or sizes.min() < 1:
            raise ValueError("every client needs at least one example")
        table = np.zeros((len(sizes), int(sizes.max())), np.int32)
        for k, ix in enumerate(client_indices):
            table[k, :len(ix)] = ix
        labels = np.asarray(labels)
        num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
        counts = np.stack([np.bincount(labels[ix], minlength=num_classes)
                           for ix in client_indices]).astype(np.float32)
        return cls(jnp.asarray(images, jnp.float32), jnp.asarray(labels, jnp.int32),
                   jnp.asarray(table), sizes, jnp.asarray(counts))

    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    @property
    def max_size(self) -> int:
        return int(self.index_table.shape[1])


def epoch_order(key: jax.Array, epoch: jax.Array, size: jax.Array, width: int) -> jax.Array:
    """Positions 0..size-1 in a random order for this epoch, then the padding positions."""
    u = jax.random.uniform(jax.random.fold_in(key, epoch), (width,))
    u = jnp.where(jnp.arange(width) < size, u, 2.0)  # padding sorts last
    return jnp.argsort(u).astype(jnp.int32)


def batch_order(key: jax.Array, epoch: jax.Array, size: jax.Array, width: int,
                batch_size: int) -> jax.Array:
    """The epoch's order (`epoch_order`) followed by B zeros, so that any batch of it
    slices in bounds. Drawn once per epoch: at the full table width the sort costs
    about a fifth of an MLP step (1.6 ms at width 7,063 on 2 CPU cores)."""
    return jnp.concatenate([epoch_order(key, epoch, size, width),
                            jnp.zeros((batch_size,), jnp.int32)])


def make_batch(images: jax.Array, labels: jax.Array, index_row: jax.Array, size: jax.Array,
               order: jax.Array, b: jax.Array, batch_size: int,
               rows: Optional[int] = None) -> Dict[str, jax.Array]:
    """Batch `b` of an epoch whose example order is `order` (from `batch_order`), on
    `rows` rows (default B; fewer for a last partial batch); rows past the client's data
    are masked."""
    rows = batch_size if rows is None else rows
    start = b * batch_size
    pos = jax.lax.dynamic_slice(order, (start,), (rows,))
    mask = (start + jnp.arange(rows)) < size
    idx = index_row[pos]
    return {"x": images[idx], "y": labels[idx], "mask": mask.astype(jnp.float32)}


def step_batch(images: jax.Array, labels: jax.Array, index_row: jax.Array, size: jax.Array,
               key: jax.Array, step: jax.Array, batch_size: int,
               rows: Optional[int] = None) -> Dict[str, jax.Array]:
    """The client's batch at local step `step` (cycling reshuffled epochs), drawing its
    epoch's order anew: the definition the executors' once-per-epoch orders must match."""
    per_epoch = (size + batch_size - 1) // batch_size
    order = batch_order(key, step // per_epoch, size, index_row.shape[0], batch_size)
    return make_batch(images, labels, index_row, size, order, step % per_epoch, batch_size,
                      rows)


def tail_rows(sizes: np.ndarray, batch_size: int) -> np.ndarray:
    """Rows computed for each client's last partial batch, 0 where it has none.

    The remainder n mod B rounded up to a multiple of ceil(B/4), so at most 3 tail shapes
    are compiled (each costs a compilation of the step); a remainder that rounds up to B
    is just a masked full batch (0).
    """
    granule = -(-batch_size // 4)
    rows = -(-(np.asarray(sizes, np.int64) % batch_size) // granule) * granule
    return np.where(rows >= batch_size, 0, rows)


def step_rows(size: int, steps: int, batch_size: int) -> list:
    """Rows computed at each of a client's local steps when it runs alone."""
    tail = int(tail_rows(np.asarray([size]), batch_size)[0])
    per_epoch = -(-size // batch_size)
    return [tail if tail and t % per_epoch == per_epoch - 1 else batch_size
            for t in range(steps)]


def computed_alone(sizes: np.ndarray, steps: np.ndarray, batch_size: int) -> int:
    """Batch rows computed by clients of `sizes` taking `steps`, each running alone."""
    return sum(sum(step_rows(int(n), int(s), batch_size)) for n, s in zip(sizes, steps))


def client_keys(base_key: jax.Array, round_index: int, client_ids: np.ndarray) -> jax.Array:
    """One key per client for a round, independent of how clients are executed."""
    round_key = jax.random.fold_in(base_key, round_index)
    return jax.vmap(lambda c: jax.random.fold_in(round_key, c))(jnp.asarray(client_ids))


def real_examples(work: LocalWork, sizes: np.ndarray) -> int:
    """Real (unmasked) examples processed by clients of `sizes` in one round."""
    total = 0
    for n, s in zip(np.asarray(sizes), work.num_steps(sizes)):
        full, rest = divmod(int(s), math.ceil(n / work.batch_size))
        total += full * int(n) + rest * work.batch_size  # a partial epoch has only full batches
    return total
