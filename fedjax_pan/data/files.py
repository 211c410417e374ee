"""Datasets read from their public release files: FEMNIST (LEAF JSON), GTSRB, CINIC-10.

Each loader takes the directory of an unpacked release (`LAYOUTS` says which layout) and
returns a `Dataset` of uint8 NHWC images and int32 labels; `sources.load(name,
data_dir=...)` calls them with their defaults. Images are decoded with Pillow (a
matplotlib dependency). A missing or malformed file raises a one-line `DataError` that
names the path and the expected layout.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Union

import numpy as np

from fedjax_pan.data.dataset import Dataset, DataError, channel_stats

__all__ = ["femnist", "gtsrb", "cinic10", "LAYOUTS", "LOADERS", "CINIC10_CLASSES",
           "FEMNIST_CLASSES", "GTSRB_CLASSES"]

PathLike = Union[str, os.PathLike]

FEMNIST_CLASSES = 62  # digits, upper- and lower-case letters (LEAF's labels 0..61)
GTSRB_CLASSES = 43
# CINIC-10's class directories; a label is the index here (alphabetical, as CIFAR-10's).
CINIC10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")
IMAGE_SIZE = 32  # GTSRB is resized to, and CINIC-10 comes as, 32x32x3

LAYOUTS = {
    "femnist": "LEAF's FEMNIST JSON files <dir>/all_data/*.json, <dir>/{train,test}/*.json "
               "or <dir>/*.json",
    "gtsrb": "GTSRB's release layout <dir>/Final_Training/Images/<00000..00042>/*.ppm, "
             "<dir>/Final_Test/Images/*.ppm and GT-final_test.csv in <dir> or "
             "<dir>/Final_Test/Images",
    "cinic10": "CINIC-10's release layout <dir>/{train,valid,test}/<class>/*.png",
}


def _fail(name: str, what: str) -> DataError:
    return DataError(f"{name}: {what}; expected {LAYOUTS[name]}")


def _read_image(name: str, path: str, size: int, resize: bool) -> np.ndarray:
    """An RGB uint8 (size, size, 3) array; bilinear-resized when `resize`, else checked."""
    from PIL import Image, UnidentifiedImageError  # lazy: only these loaders need Pillow

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")  # CINIC-10 has grayscale PNGs, PPMs are RGB already
            if resize:
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            elif img.size != (size, size):
                raise DataError(f"{name}: {path} is {img.size[0]}x{img.size[1]}, "
                                f"expected {size}x{size}")
            return np.asarray(img, dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DataError(f"{name}: cannot read image {path} ({type(e).__name__}: {e})") from e


def _read_images(name: str, paths: Sequence[str], resize: bool) -> np.ndarray:
    out = np.empty((len(paths), IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    for i, path in enumerate(paths):
        out[i] = _read_image(name, path, IMAGE_SIZE, resize)
    return out


def _check_dir(name: str, root: str) -> None:
    if not os.path.isdir(root):
        raise _fail(name, f"{root} is not a directory")


# ---------------------------------------------------------------------------
# FEMNIST


def _femnist_files(root: str) -> list[str]:
    """The JSON files of a LEAF FEMNIST copy: all_data/, else train/ + test/, else root."""
    _check_dir("femnist", root)
    jsons = lambda d: sorted(glob.glob(os.path.join(root, d, "*.json")))
    if jsons("all_data"):
        return jsons("all_data")
    train, test = jsons("train"), jsons("test")
    if train or test:
        if not (train and test):
            have, lack = ("train", "test") if train else ("test", "train")
            raise _fail("femnist", f"{have}/*.json but no {lack}/*.json under {root}")
        return train + test
    if jsons(""):
        return jsons("")
    raise _fail("femnist", f"no all_data/*.json, train/*.json + test/*.json or *.json "
                           f"under {root}")


def _read_leaf_json(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{writer: (uint8 images (n, 28, 28, 1), int32 labels (n,))} of one LEAF JSON file."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError included
        raise DataError(f"femnist: cannot read LEAF JSON {path} ({type(e).__name__}: {e})"
                        ) from e
    user_data = doc.get("user_data") if isinstance(doc, dict) else None
    if not isinstance(user_data, dict):
        raise DataError(f"femnist: {path} has no 'user_data' mapping (not a LEAF JSON file)")
    out = {}
    for writer, d in user_data.items():
        try:
            x = np.asarray(d["x"], dtype=np.float64)
            y = np.asarray(d["y"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"femnist: writer {writer!r} in {path} needs 'x', a list of "
                            f"equal-length pixel rows, and 'y', a list of labels "
                            f"({type(e).__name__}: {e})") from e
        if x.ndim != 2 or x.shape[1] != 28 * 28 or y.shape != (len(x),):
            raise DataError(f"femnist: writer {writer!r} in {path}: expected x of shape "
                            f"(n, 784) and y of shape (n,), got {x.shape} and {y.shape}")
        if x.size and not (x.min() >= 0 and x.max() <= 1):
            raise DataError(f"femnist: writer {writer!r} in {path}: pixels must lie in "
                            f"[0, 1], got [{x.min()}, {x.max()}]")
        if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0
                       or y.max() >= FEMNIST_CLASSES):
            raise DataError(f"femnist: writer {writer!r} in {path}: labels must be integers "
                            f"in [0, {FEMNIST_CLASSES}), got {y.dtype} {np.unique(y)[:5]}")
        images = np.rint(x * 255).astype(np.uint8).reshape(-1, 28, 28, 1)
        out[str(writer)] = (images, y.astype(np.int32))
    return out


def _floor(x: float) -> int:
    return math.floor(x + 1e-9)  # 0.29 * 100 is 28.999999999999996 in floating point


def femnist(data_dir: PathLike, *, writer_fraction: float = 0.1, test_fraction: float = 0.2,
            seed: int = 0) -> Dataset:
    """FEMNIST from LEAF's JSON files, split by the PAN paper's protocol (App. C).

    Writers are sorted by id; floor(writer_fraction * #writers) of them (at least one)
    are drawn with numpy's default_rng(seed). Each drawn writer's samples (LEAF's train
    and test files pooled, train first) are shuffled by the same generator, in writer
    order, and the first max(1, floor(test_fraction * n)) go to the global test set (at
    most n - 1, none if test_fraction is 0), the rest, in file order, to training: the
    rounding of the authors' released code. `train_groups[i]` is example i's writer as an
    index into the drawn writers in id order. Pixels are LEAF's `x` times 255 rounded to
    uint8, kept as stored: 255 is the white background (not inverted to MNIST's black);
    `stats` holds the training split's mean and std. 62 classes, 28x28x1 images.
    """
    if not 0 < writer_fraction <= 1:
        raise ValueError(f"writer_fraction={writer_fraction!r} must be in (0, 1]")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction!r} must be in [0, 1)")
    root = os.fspath(data_dir)
    writers: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for path in _femnist_files(root):
        for writer, arrays in _read_leaf_json(path).items():
            writers.setdefault(writer, []).append(arrays)
    ids = sorted(w for w, parts in writers.items() if sum(len(y) for _, y in parts))
    if not ids:
        raise _fail("femnist", f"the JSON files under {root} hold no samples")
    rng = np.random.default_rng(seed)
    count = max(1, _floor(writer_fraction * len(ids)))
    chosen = np.sort(rng.choice(len(ids), size=count, replace=False))
    train_x, train_y, train_g, test_x, test_y = [], [], [], [], []
    for group, w in enumerate(chosen):
        parts = writers[ids[w]]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        n = len(y)
        n_test = 0 if test_fraction == 0 else min(max(1, _floor(test_fraction * n)), n - 1)
        perm = rng.permutation(n)
        test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
        train_x.append(x[train])
        train_y.append(y[train])
        train_g.append(np.full(len(train), group, np.int32))
        test_x.append(x[test])
        test_y.append(y[test])
    images = np.concatenate(train_x)
    if test_fraction > 0 and not sum(len(y) for y in test_y):
        # Only a writer with 2 or more samples gives one to the test set.
        raise _fail("femnist", f"the {count} writer(s) drawn from the {len(ids)} under {root} "
                               f"hold {len(images)} sample(s) in all, too few to give any "
                               f"to the test set (a writer needs 2 or more)")
    return Dataset(name="femnist", train_images=images, train_labels=np.concatenate(train_y),
                   test_images=np.concatenate(test_x), test_labels=np.concatenate(test_y),
                   num_classes=FEMNIST_CLASSES, train_groups=np.concatenate(train_g),
                   stats=channel_stats(images))


# ---------------------------------------------------------------------------
# GTSRB


def _gtsrb_test_labels(root: str) -> tuple[str, list[tuple[str, int]]]:
    """(csv path, [(file name, class id)]) from GT-final_test.csv, in its row order."""
    images_dir = os.path.join(root, "Final_Test", "Images")
    candidates = [os.path.join(root, "GT-final_test.csv"),
                  os.path.join(images_dir, "GT-final_test.csv")]
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        raise _fail("gtsrb", f"no test labels GT-final_test.csv in {root} or {images_dir} "
                             f"(they come in GTSRB_Final_Test_GT.zip)")
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f, delimiter=";"))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"gtsrb: cannot read {path} ({type(e).__name__}: {e})") from e
    try:
        return path, [(r["Filename"], int(r["ClassId"])) for r in rows]
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"gtsrb: {path} needs ';'-separated Filename and ClassId columns "
                        f"with integer ClassId ({type(e).__name__}: {e})") from e


def gtsrb(data_dir: PathLike) -> Dataset:
    """GTSRB from the official release files, every image resized to 32x32x3.

    Training images are `Final_Training/Images/<class>/*.ppm`, labelled by their class
    directory (00000..00042; the GT-<class>.csv files are not needed), in class then file
    name order; test images are those listed in GT-final_test.csv (with ClassId), in its
    order. Images are resized whole with Pillow's bilinear filter, not cropped to the
    ROI columns of the CSVs (as torchvision's GTSRB and the PAN paper's resize).
    """
    root = os.fspath(data_dir)
    _check_dir("gtsrb", root)
    train_dir = os.path.join(root, "Final_Training", "Images")
    paths, labels = [], []
    classes = (sorted(d for d in os.listdir(train_dir) if re.fullmatch(r"\d{5}", d)
                      and os.path.isdir(os.path.join(train_dir, d)))
               if os.path.isdir(train_dir) else [])
    for d in classes:
        if int(d) >= GTSRB_CLASSES:
            raise DataError(f"gtsrb: class directory {os.path.join(train_dir, d)} is outside "
                            f"00000..{GTSRB_CLASSES - 1:05d}")
        files = sorted(glob.glob(os.path.join(train_dir, d, "*.ppm")))
        paths += files
        labels += [int(d)] * len(files)
    if not paths:
        raise _fail("gtsrb", f"no Final_Training/Images/<class>/*.ppm under {root}")
    label_path, rows = _gtsrb_test_labels(root)
    test_dir = os.path.join(root, "Final_Test", "Images")
    test_paths = [os.path.join(test_dir, f) for f, _ in rows]
    missing = [p for p in test_paths if not os.path.isfile(p)]
    if missing:
        raise _fail("gtsrb", f"{len(missing)} test images listed in {label_path} are "
                             f"missing, e.g. {missing[0]}")
    if not rows:
        raise _fail("gtsrb", f"{label_path} lists no test images")
    test_labels = np.asarray([c for _, c in rows], np.int32)
    if test_labels.min() < 0 or test_labels.max() >= GTSRB_CLASSES:
        raise DataError(f"gtsrb: ClassId in {label_path} spans [{test_labels.min()}, "
                        f"{test_labels.max()}], outside [0, {GTSRB_CLASSES})")
    return Dataset(name="gtsrb", train_images=_read_images("gtsrb", paths, resize=True),
                   train_labels=np.asarray(labels, np.int32),
                   test_images=_read_images("gtsrb", test_paths, resize=True),
                   test_labels=test_labels, num_classes=GTSRB_CLASSES)


# ---------------------------------------------------------------------------
# CINIC-10


def _cinic10_split(root: str, split: str) -> tuple[list[str], list[int]]:
    """Image paths and labels of <root>/<split>/<class>/*.png, in class then name order."""
    split_dir = os.path.join(root, split)
    paths: list[str] = []
    labels: list[int] = []
    if not os.path.isdir(split_dir):
        return paths, labels
    for d in sorted(os.listdir(split_dir)):
        if d.startswith(".") or not os.path.isdir(os.path.join(split_dir, d)):
            continue
        if d not in CINIC10_CLASSES:
            raise DataError(f"cinic10: unknown class directory {os.path.join(split_dir, d)}; "
                            f"classes: {', '.join(CINIC10_CLASSES)}")
        files = sorted(glob.glob(os.path.join(split_dir, d, "*.png")))
        paths += files
        labels += [CINIC10_CLASSES.index(d)] * len(files)
    return paths, labels


def cinic10(data_dir: PathLike, *, include_valid: bool = False) -> Dataset:
    """CINIC-10 from its release layout: train (plus valid if `include_valid`; the PAN
    paper does not use it) and test, 32x32x3 PNGs (grayscale ones converted to RGB),
    labels the index of the class directory in `CINIC10_CLASSES`."""
    root = os.fspath(data_dir)
    _check_dir("cinic10", root)
    splits = {}
    for split in ("train", "valid", "test") if include_valid else ("train", "test"):
        paths, labels = _cinic10_split(root, split)
        if not paths:
            raise _fail("cinic10", f"no {split}/<class>/*.png under {root}")
        splits[split] = (paths, labels)
    train_paths, train_labels = splits["train"]
    if include_valid:
        train_paths = train_paths + splits["valid"][0]
        train_labels = train_labels + splits["valid"][1]
    test_paths, test_labels = splits["test"]
    return Dataset(name="cinic10",
                   train_images=_read_images("cinic10", train_paths, resize=False),
                   train_labels=np.asarray(train_labels, np.int32),
                   test_images=_read_images("cinic10", test_paths, resize=False),
                   test_labels=np.asarray(test_labels, np.int32),
                   num_classes=len(CINIC10_CLASSES))


# What `sources.load` calls, by dataset name, with each loader's defaults.
LOADERS: dict[str, Callable[[PathLike], Dataset]] = {
    "femnist": femnist, "gtsrb": gtsrb, "cinic10": cinic10}
