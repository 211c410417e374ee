"""The in-memory dataset every loader returns, the error the loaders raise, and
per-channel statistics: what `sources` and `files` share, so that `sources` (which calls
`files`' loaders) is the only one of the two importing the other."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["Dataset", "DataError", "Stats", "channel_stats"]

Stats = tuple[tuple[float, ...], tuple[float, ...]]


class DataError(Exception):
    """Dataset files are missing, corrupt or truncated (the message names which)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A classification dataset held in memory.

    Images are NHWC (uint8 for real data, float32 for `synthetic`), labels int32
    of shape (N,) with values in [0, num_classes). `train_groups` (int32, (N,)) is the
    natural client of each training example (FEMNIST: writer index), None for datasets
    without one; `stats` the per-channel (mean, std) computed at load time for datasets
    with no published values (None: use `NORMALIZATION[name]`).
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    train_groups: Optional[np.ndarray] = None
    stats: Optional[Stats] = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_classes, (int, np.integer)) or self.num_classes < 1:
            raise ValueError(f"{self.name}: num_classes must be a positive int, "
                             f"got {self.num_classes!r}")
        for split in ("train", "test"):
            images = getattr(self, f"{split}_images")
            labels = getattr(self, f"{split}_labels")
            if images.ndim != 4:
                raise ValueError(f"{self.name}: {split}_images must be 4-D NHWC, "
                                 f"got shape {images.shape}")
            if images.dtype not in (np.uint8, np.float32):
                raise ValueError(f"{self.name}: {split}_images must be uint8 or float32, "
                                 f"got {images.dtype}")
            if labels.dtype != np.int32 or labels.ndim != 1:
                raise ValueError(f"{self.name}: {split}_labels must be 1-D int32, got "
                                 f"{labels.dtype} of shape {labels.shape}")
            if len(images) != len(labels):
                raise ValueError(f"{self.name}: {len(images)} {split} images but "
                                 f"{len(labels)} labels")
            if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise ValueError(f"{self.name}: {split} labels span [{labels.min()}, "
                                 f"{labels.max()}], outside [0, {self.num_classes})")
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise ValueError(f"{self.name}: train images {self.train_images.shape[1:]} and test "
                             f"images {self.test_images.shape[1:]} differ in shape")
        groups = self.train_groups
        if groups is not None:
            if groups.dtype != np.int32 or groups.shape != self.train_labels.shape:
                raise ValueError(f"{self.name}: train_groups must be int32 of shape "
                                 f"{self.train_labels.shape}, got {groups.dtype} of shape "
                                 f"{groups.shape}")
            if groups.size and groups.min() < 0:
                raise ValueError(f"{self.name}: train_groups must be >= 0, got {groups.min()}")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of one image."""
        return tuple(int(d) for d in self.train_images.shape[1:])  # type: ignore[return-value]

    @property
    def num_train(self) -> int:
        return int(len(self.train_labels))

    @property
    def num_test(self) -> int:
        return int(len(self.test_labels))


def channel_stats(images: np.ndarray) -> Stats:
    """Per-channel (mean, std) of uint8 NHWC `images` in [0, 1] units (std over all
    pixels of a channel), exact, from a 256-bin histogram (no float copy of the images)."""
    if images.dtype != np.uint8 or images.ndim != 4 or not images.size:
        raise ValueError(f"channel_stats needs non-empty uint8 NHWC images, got "
                         f"{images.dtype} of shape {images.shape}")
    values = np.arange(256, dtype=np.float64) / 255
    means, stds = [], []
    for c in range(images.shape[-1]):
        counts = np.bincount(images[..., c].reshape(-1), minlength=256).astype(np.float64)
        p = counts / counts.sum()
        mean = float(p @ values)
        means.append(mean)
        stds.append(float(np.sqrt(max(p @ (values - mean) ** 2, 0.0))))
    return tuple(means), tuple(stds)
