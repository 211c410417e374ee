"""Image-classification datasets as in-memory NumPy arrays.

`load(name)` returns a `Dataset` with NHWC uint8 images and int32 labels.
Fashion-MNIST (and MNIST, when pointed at a folder) is read from the raw IDX
files with NumPy alone; FEMNIST, GTSRB and CINIC-10 from their public release
files in a directory the user gives (`fedjax_pan.data.files`); every other
dataset is read from a TFDS dataset that was already prepared in the
array_record format (`tfds.data_source`), which needs no TensorFlow.
`synthetic()` builds a small learnable float32 dataset for fast tests.

`NORMALIZATION` holds per-channel (mean, std) of the *training* split in [0, 1]
pixel units (std over all pixels of a channel). Source: the values commonly
quoted in PyTorch/torchvision training recipes for these datasets (mnist's
0.1307/0.3081 are the PyTorch MNIST example's). fashion_mnist's are re-derived
from the real files in tests/test_sources.py; the others are not re-checked here
because their data are not installed. cinic10's are the CINIC-10 authors' published
values (train split). gtsrb's are the values quoted in PyTorch GTSRB recipes for the
training images resized to 32x32, as `load` does (not re-checked here). FEMNIST has
no published statistics for LEAF's white-background pixels: `load` computes them from
the loaded training split (`Dataset.stats`, `channel_stats`), so it is not in the table;
`normalization(ds)` gives whichever applies. EMNIST is TFDS's default config (byclass);
TFDS stores EMNIST images transposed relative to MNIST, and `load` keeps them so.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from fedjax_pan.data import files as files_lib
from fedjax_pan.data.dataset import Dataset, DataError, Stats, channel_stats

__all__ = [
    "Dataset", "DataError", "NORMALIZATION", "AUTHORS_NORMALIZATION", "load", "normalize",
    "normalization", "channel_stats", "read_idx", "subset", "synthetic", "DATASETS", "GROUPED_DATASETS", "SHAPES",
]


NORMALIZATION: dict[str, Stats] = {
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "emnist": ((0.1736,), (0.3317,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn_cropped": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "cinic10": ((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835)),
    "gtsrb": ((0.3337, 0.3064, 0.3171), (0.2672, 0.2564, 0.2629)),
}

NORMALIZATIONS = ("standard", "authors")  # config.dataset.normalization

# The PAN authors' CIFAR constants (their cifar_data.py, for CIFAR-10 and CIFAR-100 alike;
# the std values are the widely copied 0.2023/0.1994/0.2010, not the data's own).
AUTHORS_NORMALIZATION: dict[str, Stats] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
}

# (input shape, classes) of each dataset as loaded (`synthetic`: its defaults), known
# before the load: a model's size follows from them.
SHAPES: dict[str, tuple[tuple[int, int, int], int]] = {
    **{name: ((28, 28, 1), 10) for name in ("fashion_mnist", "mnist", "synthetic")},
    "emnist": ((28, 28, 1), 62), "femnist": ((28, 28, 1), 62),
    **{name: ((32, 32, 3), 10) for name in ("cifar10", "svhn_cropped", "cinic10")},
    "cifar100": ((32, 32, 3), 100), "gtsrb": ((32, 32, 3), 43)}

# Names accepted by `load`, in a stable order for error messages (femnist's statistics
# are computed at load time, see the module docstring).
DATASETS: tuple[str, ...] = (*NORMALIZATION, "femnist")
# Datasets whose training examples carry natural client groups (`Dataset.train_groups`),
# the only ones partition scheme 'natural' applies to.
GROUPED_DATASETS: tuple[str, ...] = ("femnist",)

FASHION_MNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
_ENV_DIRS = {"fashion_mnist": "FEDJAX_PAN_FASHION_MNIST_DIR", "mnist": "FEDJAX_PAN_MNIST_DIR",
             "femnist": "FEDJAX_PAN_FEMNIST_DIR", "gtsrb": "FEDJAX_PAN_GTSRB_DIR",
             "cinic10": "FEDJAX_PAN_CINIC10_DIR"}
_FILE_DATASETS = ("femnist", "gtsrb", "cinic10")  # read by fedjax_pan.data.files
_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_IDX_MAGIC = {0x00000801: 1, 0x00000803: 3}  # magic -> number of dims (uint8 only)
_GZIP_MAGIC = b"\x1f\x8b"


# ---------------------------------------------------------------------------
# IDX files


def read_idx(path: Union[str, os.PathLike]) -> np.ndarray:
    """Read a uint8 IDX file (plain or gzip) with NumPy: images (N, H, W), labels (N,).

    Raises `DataError` naming `path` if it is missing, not valid gzip/IDX, or truncated.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read IDX file {path}: {e}") from e
    # Sniff the gzip magic as well as the suffix, so a renamed file still reads.
    if path.endswith(".gz") or raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (gzip.BadGzipFile, EOFError, zlib.error, OSError) as e:
            raise DataError(f"corrupt or truncated gzip file {path}: "
                            f"{type(e).__name__}: {e}") from e
    if len(raw) < 4:
        raise DataError(f"IDX file {path} is truncated: {len(raw)} bytes, too short for a header")
    (magic,) = struct.unpack(">I", raw[:4])
    if magic not in _IDX_MAGIC:
        raise DataError(f"IDX file {path} has bad magic number 0x{magic:08x} (expected "
                        f"0x00000801 for uint8 labels or 0x00000803 for uint8 images)")
    ndim = _IDX_MAGIC[magic]
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"IDX file {path} is truncated inside its header "
                        f"({len(raw)} of {header_len} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    expected = int(np.prod(dims, dtype=np.int64))
    actual = len(raw) - header_len
    if actual != expected:
        what = "truncated" if actual < expected else "has trailing bytes"
        raise DataError(f"IDX file {path} {what}: header says dims {dims} = {expected} bytes "
                        f"of data, found {actual}")
    # Copy so callers get an ordinary writable array, not a view of immutable bytes.
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims).copy()


def _find_idx_files(directory: str) -> Optional[dict[str, str]]:
    """Paths of the four IDX files in `directory`; None if none exist there."""
    found, missing = {}, []
    for key, stem in _IDX_FILES.items():
        for candidate in (stem, stem + ".gz"):
            path = os.path.join(directory, candidate)
            if os.path.isfile(path):
                found[key] = path
                break
        else:
            missing.append(stem + "[.gz]")
    if not found:
        return None
    if missing:
        # A half-present copy is a broken download, not an absent one: say so
        # instead of silently switching to another source.
        raise DataError(f"IDX files missing in {directory}: {', '.join(missing)}")
    return found


def _load_idx(name: str, files: dict[str, str]) -> Dataset:
    arrays = {key: read_idx(path) for key, path in files.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        img_path, lbl_path = files[f"{split}_images"], files[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1:
            raise DataError(f"{name}: expected images (N, H, W) in {img_path} and labels (N,) "
                            f"in {lbl_path}, got {images.shape} and {labels.shape}")
        if len(images) != len(labels):
            raise DataError(f"{name}: {len(images)} images in {img_path} but "
                            f"{len(labels)} labels in {lbl_path}")
        if labels.size and labels.max() >= 10:
            raise DataError(f"{name}: label {labels.max()} in {lbl_path} is outside [0, 10)")
    return Dataset(
        name=name,
        train_images=arrays["train_images"][..., None],
        train_labels=arrays["train_labels"].astype(np.int32),
        test_images=arrays["test_images"][..., None],
        test_labels=arrays["test_labels"].astype(np.int32),
        num_classes=10,
    )


# ---------------------------------------------------------------------------
# TFDS


def _prepare_hint(name: str) -> str:
    return (f"Prepare it with TFDS on a machine with TensorFlow (pip install "
            f"'fedjax_pan[tfds-prepare]'; python -m "
            f"tensorflow_datasets.scripts.download_and_prepare --datasets={name} "
            f"--file_format=array_record) and point data_dir / TFDS_DATA_DIR at it.")


def _load_tfds(name: str, data_dir: Optional[str]) -> Dataset:
    import tensorflow_datasets as tfds  # slow import, and only needed here

    # TFDS logs a warning for a folder it finds unprepared; the error below says more.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        prepared = builder.is_prepared()
    except Exception as e:  # noqa: BLE001 - any TFDS failure means the same to the caller
        raise DataError(f"dataset {name!r}: TFDS cannot create a builder "
                        f"({type(e).__name__}: {e})") from e
    finally:
        absl_logger.setLevel(level)
    where = builder.data_dir
    if not prepared:
        # download_and_prepare needs TensorFlow; without it TFDS fails late
        # (possibly after network attempts), so fail fast with the real reason.
        if importlib.util.find_spec("tensorflow") is None:
            reason = "TensorFlow is not installed"
        else:
            try:
                builder.download_and_prepare(file_format="array_record")
                reason = None
            except Exception as e:  # noqa: BLE001 - network, TF, disk: all reported alike
                reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            raise DataError(f"dataset {name!r} is not prepared in {where} and could not be "
                            f"prepared ({reason}). {_prepare_hint(name)}")

    splits = {}
    for split in ("train", "test"):
        try:
            source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
            records = source.__getitems__(range(len(source)))
        except Exception as e:  # noqa: BLE001 - e.g. prepared as tfrecord, corrupt shards
            raise DataError(f"dataset {name!r} in {where}: cannot read split {split!r} "
                            f"({type(e).__name__}: {e}). {_prepare_hint(name)}") from e
        if not records:
            raise DataError(f"dataset {name!r} in {where}: split {split!r} is empty")
        images = np.stack([np.asarray(r["image"], dtype=np.uint8) for r in records])
        labels = np.asarray([r["label"] for r in records], dtype=np.int32)
        if images.ndim == 3:  # defensive: grayscale stored without a channel axis
            images = images[..., None]
        splits[split] = (images, labels)

    num_classes = int(builder.info.features["label"].num_classes)
    try:
        return Dataset(name=name, train_images=splits["train"][0], train_labels=splits["train"][1],
                       test_images=splits["test"][0], test_labels=splits["test"][1],
                       num_classes=num_classes)
    except ValueError as e:
        raise DataError(f"dataset {name!r} in {where} is inconsistent: {e}") from e


# ---------------------------------------------------------------------------
# Public entry points


def load(name: str, *, data_dir: Optional[Union[str, os.PathLike]] = None) -> Dataset:
    """Load dataset `name` (one of `DATASETS`) fully into memory.

    fashion_mnist / mnist read IDX files from `data_dir`, else $FEDJAX_PAN_<NAME>_DIR,
    else (fashion_mnist only) /usr/share/datasets/fashion-mnist; femnist / gtsrb /
    cinic10 read their release files from `data_dir`, else $FEDJAX_PAN_<NAME>_DIR (one
    of them is required; see `fedjax_pan.data.files`, whose defaults apply); everything
    else, or when no IDX files are there, comes from prepared TFDS data under `data_dir`.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    data_dir = None if data_dir is None else os.fspath(data_dir)
    if name in _FILE_DATASETS:

        var = _ENV_DIRS[name]
        if data_dir is None:
            data_dir = os.environ.get(var) or None
            if data_dir is None:
                raise DataError(f"{name}: no data directory: pass data_dir "
                                f"(--config.dataset.data_dir) or set ${var} to a copy of "
                                f"{files_lib.LAYOUTS[name]}")
            if not os.path.isdir(data_dir):
                raise DataError(f"${var}={data_dir} is not a directory; point it at a copy of "
                                f"{files_lib.LAYOUTS[name]} or unset it")
        return files_lib.LOADERS[name](data_dir)
    searched = None
    if name in _ENV_DIRS:
        var = _ENV_DIRS[name]
        if data_dir is None and os.environ.get(var):
            # An explicit choice: report it, never fall back silently to another source.
            env_dir = os.environ[var]
            expected = ", ".join(f"{stem}[.gz]" for stem in _IDX_FILES.values())
            if not os.path.isdir(env_dir):
                raise DataError(f"${var}={env_dir} is not a directory; point it at the "
                                f"{name} IDX files ({expected}) or unset it")
            files = _find_idx_files(env_dir)
            if files is None:
                raise DataError(f"${var}={env_dir} holds no {name} IDX files (expected "
                                f"{expected}); point it at them or unset it")
            return _load_idx(name, files)
        idx_dir = data_dir or (FASHION_MNIST_DEFAULT_DIR if name == "fashion_mnist" else None)
        if idx_dir is not None:
            files = _find_idx_files(idx_dir)
            if files is not None:
                return _load_idx(name, files)
            searched = (f"no IDX files in {idx_dir}" + (
                " (install the Debian package dataset-fashion-mnist)"
                if idx_dir == FASHION_MNIST_DEFAULT_DIR else "") +
                f" and ${var} is not set")
    try:
        return _load_tfds(name, data_dir)
    except DataError as e:
        if searched is None:
            raise
        raise DataError(f"{name}: {searched}; TFDS: {e}") from e


def subset(ds: Dataset, train_limit: Optional[int] = None, test_limit: Optional[int] = None,
           seed: int = 0) -> Dataset:
    """At most `train_limit` / `test_limit` examples of each split: a seeded random subset
    kept in the original order (train drawn first, from numpy's default_rng(seed)).
    `train_groups` follow their examples; `stats` stay those of the loaded split."""
    rng = np.random.default_rng(seed)

    def keep(n: int, limit: Optional[int]) -> Optional[np.ndarray]:
        if not limit or limit >= n:
            return None
        return np.sort(rng.permutation(n)[:limit])

    train, test = keep(ds.num_train, train_limit), keep(ds.num_test, test_limit)
    groups = ds.train_groups
    return dataclasses.replace(
        ds,
        train_images=ds.train_images if train is None else ds.train_images[train],
        train_labels=ds.train_labels if train is None else ds.train_labels[train],
        train_groups=groups if train is None or groups is None else groups[train],
        test_images=ds.test_images if test is None else ds.test_images[test],
        test_labels=ds.test_labels if test is None else ds.test_labels[test])


def normalize(images: Any, name_or_stats: Union[str, Stats, Sequence[Sequence[float]]]) -> Any:
    """Map integer pixels to float32 `(x / 255 - mean) / std` per channel (NumPy or JAX).

    Floating-point input is taken to be normalised already (e.g. `synthetic`) and
    returned unchanged.
    """
    if not np.issubdtype(images.dtype, np.integer):
        return images
    if isinstance(name_or_stats, str):
        if name_or_stats not in NORMALIZATION:
            hint = (" (its statistics are computed at load time: pass normalization(ds))"
                    if name_or_stats in DATASETS else "")
            raise ValueError(f"no normalisation statistics for {name_or_stats!r}{hint}; "
                             f"known: {', '.join(NORMALIZATION)}")
        name_or_stats = NORMALIZATION[name_or_stats]
    mean, std = (np.asarray(s, dtype=np.float32) for s in name_or_stats)
    if mean.shape != std.shape or mean.shape != (images.shape[-1],):
        raise ValueError(f"stats of shape {mean.shape}/{std.shape} do not match "
                         f"{images.shape[-1]} channels")
    scale, shift = np.float32(1 / 255) / std, mean / std
    if isinstance(images, np.ndarray):
        # In place: one float32 buffer instead of three temporaries (~3x faster on 60k images).
        out = images.astype(np.float32)
        out *= scale
        out -= shift
        return out
    # Operators only, so JAX arrays (also under jit) stay JAX arrays.
    return images.astype(np.float32) * scale - shift


def normalization(ds: Dataset) -> Optional[Stats]:
    """The (mean, std) that `normalize` should use for `ds`: its load-time `stats` if set,
    else `NORMALIZATION[ds.name]`; None when neither exists (e.g. `synthetic`)."""
    return ds.stats if ds.stats is not None else NORMALIZATION.get(ds.name)


def _smooth_field(rng: np.random.Generator, shape: tuple[int, int, int]) -> np.ndarray:
    """Gaussian noise on a coarse grid, bilinearly upsampled to `shape`, standardised."""
    h, w, c = shape
    gh, gw = max(2, h // 4), max(2, w // 4)
    coarse = rng.standard_normal((gh, gw, c))
    ys, xs = np.linspace(0, gh - 1, h), np.linspace(0, gw - 1, w)
    y0, x0 = np.minimum(ys.astype(int), gh - 2), np.minimum(xs.astype(int), gw - 2)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    top = coarse[y0][:, x0] * (1 - fx) + coarse[y0][:, x0 + 1] * fx
    bottom = coarse[y0 + 1][:, x0] * (1 - fx) + coarse[y0 + 1][:, x0 + 1] * fx
    field = top * (1 - fy) + bottom * fy
    return (field - field.mean()) / (field.std() + 1e-8)


def synthetic(num_train: int = 1000, num_test: int = 200,
              image_shape: tuple[int, int, int] = (28, 28, 1), num_classes: int = 10,
              seed: int = 0, noise: float = 1.0) -> Dataset:
    """A learnable float32 dataset: smooth per-class template plus Gaussian noise.

    Pixels are scaled to roughly zero mean and unit variance; the same seed gives
    the same templates whatever the sizes. Larger `noise` makes the task harder.
    """
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise ValueError(f"image_shape must be (H, W, C) with positive sizes, got {image_shape}")
    if num_train < 1 or num_test < 0 or num_classes < 1 or noise < 0:
        raise ValueError(f"invalid synthetic sizes: num_train={num_train}, num_test={num_test}, "
                         f"num_classes={num_classes}, noise={noise}")
    image_shape = tuple(int(d) for d in image_shape)
    # Independent streams: templates do not depend on how many examples are drawn.
    template_rng, train_rng, test_rng = np.random.default_rng(seed).spawn(3)
    templates = np.stack([_smooth_field(template_rng, image_shape) for _ in range(num_classes)])
    scale = np.float32(1 / np.sqrt(1 + noise ** 2))

    def draw(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(n) % num_classes).astype(np.int32)
        eps = rng.standard_normal((n, *image_shape), dtype=np.float32)
        images = (templates[labels].astype(np.float32) + np.float32(noise) * eps) * scale
        return images, labels

    train_images, train_labels = draw(train_rng, num_train)
    test_images, test_labels = draw(test_rng, num_test)
    return Dataset(name="synthetic", train_images=train_images, train_labels=train_labels,
                   test_images=test_images, test_labels=test_labels, num_classes=int(num_classes))
