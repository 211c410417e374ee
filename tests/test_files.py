"""Tests for fedjax_pan.data.files: tiny hand-written copies of each release format (real
JSON, PPM and PNG files) read back exactly, FEMNIST's writer split by hand, the natural
partition, every missing-file message, and the shipped configs of these datasets."""

import csv
import importlib.util
import json
import os

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT
from fedjax_pan import data
from fedjax_pan.run import experiment
from fedjax_pan.config import schema
from fedjax_pan.data import files
from fedjax_pan.data.sources import DataError
from fedjax_pan.errors import ConfigError

# --- FEMNIST (LEAF JSON) --------------------------------------------------------------

SIZES = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # samples of writers w00..w09
# max(1, floor(0.2 * n)) test samples per writer, worked out by hand.
N_TEST = {5: 1, 6: 1, 7: 1, 8: 1, 9: 1, 10: 2, 11: 2, 12: 2, 13: 2, 14: 2}


def leaf_writers(sizes=SIZES, seed=0):
    """{writer id: (uint8 pixels (n, 784), labels (n,))}; pixel 0 is the writer's index,
    pixel 1 the sample's, so every image is unique and traceable; pixel 2 is white."""
    rng = np.random.default_rng(seed)
    out = {}
    for w, n in enumerate(sizes):
        pixels = rng.integers(0, 256, (n, 784), dtype=np.uint8)
        pixels[:, 0], pixels[:, 1], pixels[:, 2] = w, np.arange(n), 255
        out[f"w{w:02d}"] = (pixels, rng.integers(0, files.FEMNIST_CLASSES, n))
    return out


def leaf_json(writers, part=slice(None)):
    """A LEAF JSON document holding `part` of each writer's samples (x in [0, 1])."""
    users = sorted(writers)
    user_data = {w: {"x": (writers[w][0][part] / 255).tolist(),
                     "y": writers[w][1][part].tolist()} for w in users}
    return {"users": users, "num_samples": [len(user_data[w]["y"]) for w in users],
            "user_data": user_data}


def write_leaf(root, writers, layout="all_data"):
    """LEAF's layouts: all_data/ (two files), train/ + test/ (each writer's first samples
    in train, the last two in test), or the JSON files directly in `root`."""
    ids = sorted(writers)
    halves = [{w: writers[w] for w in ids[:4]}, {w: writers[w] for w in ids[4:]}]
    if layout == "train_test":
        docs = {"train/a.json": leaf_json(writers, slice(None, -2)),
                "test/a.json": leaf_json(writers, slice(-2, None))}
    else:
        sub = "all_data/" if layout == "all_data" else ""
        docs = {f"{sub}all_data_{i}.json": leaf_json(h) for i, h in enumerate(halves)}
    for name, doc in docs.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
    return root


@pytest.fixture
def leaf(tmp_path):
    writers = leaf_writers()
    return write_leaf(tmp_path / "leaf", writers), writers


def test_femnist_writer_split_by_hand(leaf):
    root, writers = leaf
    ds = files.femnist(root, writer_fraction=0.3, test_fraction=0.2, seed=0)
    assert ds.name == "femnist" and ds.num_classes == 62 and ds.input_shape == (28, 28, 1)
    for x in (ds.train_images, ds.test_images):
        assert x.dtype == np.uint8
    assert ds.train_labels.dtype == ds.test_labels.dtype == ds.train_groups.dtype == np.int32
    # floor(0.3 * 10) = 3 writers, in id order; each keeps n - N_TEST[n] training samples.
    ids = sorted(writers)
    owner = lambda x: x.reshape(len(x), -1)[:, 0].astype(int)
    sample = lambda x: x.reshape(len(x), -1)[:, 1].astype(int)
    drawn = [int(owner(ds.train_images[ds.train_groups == g])[0]) for g in range(3)]
    assert sorted(set(ds.train_groups.tolist())) == [0, 1, 2] and drawn == sorted(drawn)
    for g, w in enumerate(drawn):
        n = SIZES[w]
        tr = ds.train_groups == g
        te = owner(ds.test_images) == w
        assert (owner(ds.train_images[tr]) == w).all()
        assert tr.sum() == n - N_TEST[n] and te.sum() == N_TEST[n]
        got = np.concatenate([sample(ds.train_images[tr]), sample(ds.test_images[te])])
        np.testing.assert_array_equal(np.sort(got), np.arange(n))
        assert np.all(np.diff(sample(ds.train_images[tr])) > 0)  # file order kept
    assert set(owner(ds.test_images)) == set(drawn)
    assert len(ds.test_labels) == sum(N_TEST[SIZES[w]] for w in drawn)
    # Every image and label is the one written, unchanged (255 = LEAF's white, not inverted).
    for images, labels in ((ds.train_images, ds.train_labels), (ds.test_images, ds.test_labels)):
        for img, label in zip(images, labels):
            pixels, ys = writers[ids[owner(img[None])[0]]]
            i = sample(img[None])[0]
            np.testing.assert_array_equal(img.reshape(-1), pixels[i])
            assert label == ys[i]
    assert (ds.train_images.reshape(len(ds.train_images), -1)[:, 2] == 255).all()
    # Statistics of the loaded training split.
    x = ds.train_images / 255
    np.testing.assert_allclose(ds.stats, ((x.mean(),), (x.std(),)), rtol=1e-12)
    assert data.normalization(ds) == ds.stats


def test_femnist_fractions_and_seeds(leaf):
    root, _ = leaf
    count = lambda **kw: len(set(files.femnist(root, **kw).train_groups.tolist()))
    assert count(writer_fraction=0.25) == 2    # floor(2.5)
    assert count(writer_fraction=0.01) == 1    # at least one writer
    assert count(writer_fraction=1.0) == 10
    everyone = files.femnist(root, writer_fraction=1.0, test_fraction=0.0)
    assert everyone.num_test == 0 and everyone.num_train == sum(SIZES)
    a, b = files.femnist(root, seed=5, writer_fraction=0.5), files.femnist(root, seed=5,
                                                                           writer_fraction=0.5)
    for field in ("train_images", "train_labels", "train_groups", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    c = files.femnist(root, seed=6, writer_fraction=0.5)
    assert not np.array_equal(a.test_images, c.test_images)
    for bad in (dict(writer_fraction=0.0), dict(test_fraction=1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            files.femnist(root, **bad)


@pytest.mark.parametrize("layout", ["train_test", "flat"])
def test_femnist_layouts_agree(tmp_path, leaf, layout):
    root, writers = leaf
    other = write_leaf(tmp_path / layout, writers, layout)
    a, b = files.femnist(root, writer_fraction=0.5), files.femnist(other, writer_fraction=0.5)
    for field in ("train_images", "train_labels", "train_groups", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_natural_partition_is_one_client_per_writer(leaf):
    root, writers = leaf
    ds = files.femnist(root, writer_fraction=0.4)
    parts = data.partition(ds.train_labels, 4, "natural", 0, groups=ds.train_groups)
    assert len(parts) == 4
    flat = ds.train_images.reshape(ds.num_train, -1)
    for g, p in enumerate(parts):
        np.testing.assert_array_equal(p, np.flatnonzero(ds.train_groups == g))
        assert len(set(flat[p, 0].tolist())) == 1  # one writer, all its training samples
    assert sum(map(len, parts)) == ds.num_train


def one_line(e, *needles):
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_femnist_missing_and_bad_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        files.femnist(empty)
    one_line(e, f"under {empty}", "LEAF's FEMNIST JSON files <dir>/all_data/*.json")
    with pytest.raises(DataError) as e:
        files.femnist(tmp_path / "nowhere")
    one_line(e, f"{tmp_path / 'nowhere'} is not a directory", "LEAF")
    (tmp_path / "half" / "train").mkdir(parents=True)
    (tmp_path / "half" / "train" / "a.json").write_text(json.dumps(leaf_json(leaf_writers())))
    with pytest.raises(DataError) as e:
        files.femnist(tmp_path / "half")
    one_line(e, "train/*.json but no test/*.json", str(tmp_path / "half"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.json").write_text("{not json")
    with pytest.raises(DataError) as e:
        files.femnist(tmp_path / "bad")
    one_line(e, str(tmp_path / "bad" / "x.json"))
    doc = leaf_json(leaf_writers([3]))
    doc["user_data"]["w00"]["x"][0] = doc["user_data"]["w00"]["x"][0][:10]
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "x.json").write_text(json.dumps(doc))
    with pytest.raises(DataError) as e:
        files.femnist(tmp_path / "short")
    one_line(e, "w00", str(tmp_path / "short" / "x.json"))
    # One writer of one sample: nothing for the test set (a writer needs 2 to give one).
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "x.json").write_text(json.dumps(leaf_json(leaf_writers([1]))))
    with pytest.raises(DataError) as e:
        files.femnist(tmp_path / "one")
    one_line(e, "1 writer(s) drawn from the 1", "1 sample(s) in all", "2 or more")


# --- GTSRB ----------------------------------------------------------------------------

GTSRB_HEADER = ["Filename", "Width", "Height", "Roi.X1", "Roi.Y1", "Roi.X2", "Roi.Y2",
                "ClassId"]


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=";")
        w.writerow(GTSRB_HEADER)
        for name, (h, wd), label in rows:
            w.writerow([name, wd, h, 1, 1, wd - 2, h - 2, label])


def write_gtsrb(root, rng, classes=(0, 1, 42), per_class=2, labels_in_images=False):
    """GTSRB's release layout; one training image is 35x40 (resized on load), the rest
    32x32. Returns the expected images and labels per split."""
    def image(shape):
        return rng.integers(0, 256, (*shape, 3), dtype=np.uint8)

    expect = {"train": ([], []), "test": ([], [])}
    for c in classes:
        d = root / "Final_Training" / "Images" / f"{c:05d}"
        d.mkdir(parents=True)
        rows = []
        for i in range(per_class):
            shape = (35, 40) if (c, i) == (classes[0], 1) else (32, 32)
            pixels, name = image(shape), f"00000_{i:05d}.ppm"
            Image.fromarray(pixels).save(d / name)
            rows.append((name, shape, c))
            bilinear = Image.fromarray(pixels).resize((32, 32), Image.Resampling.BILINEAR)
            resized = np.asarray(bilinear)
            expect["train"][0].append(resized)
            expect["train"][1].append(c)
        write_csv(d / f"GT-{c:05d}.csv", rows)
    test_dir = root / "Final_Test" / "Images"
    test_dir.mkdir(parents=True)
    rows = []
    for i, c in enumerate([42, 0, 1, 0]):
        pixels, name = image((32, 32)), f"{i:05d}.ppm"
        Image.fromarray(pixels).save(test_dir / name)
        rows.append((name, (32, 32), c))
        expect["test"][0].append(pixels)
        expect["test"][1].append(c)
    write_csv((test_dir if labels_in_images else root) / "GT-final_test.csv", rows)
    return {k: (np.stack(x), np.asarray(y, np.int32)) for k, (x, y) in expect.items()}


@pytest.mark.parametrize("labels_in_images", [False, True])
def test_gtsrb_reads_the_release_layout(tmp_path, labels_in_images):
    expect = write_gtsrb(tmp_path, np.random.default_rng(0),
                         labels_in_images=labels_in_images)
    ds = data.load("gtsrb", data_dir=tmp_path)
    assert ds.name == "gtsrb" and ds.num_classes == 43 and ds.input_shape == (32, 32, 3)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
    assert ds.train_groups is None and ds.stats is None
    for split in ("train", "test"):
        np.testing.assert_array_equal(getattr(ds, f"{split}_images"), expect[split][0])
        np.testing.assert_array_equal(getattr(ds, f"{split}_labels"), expect[split][1])
    np.testing.assert_array_equal(ds.train_labels, [0, 0, 1, 1, 42, 42])


def test_gtsrb_missing_files(tmp_path):
    with pytest.raises(DataError) as e:
        files.gtsrb(tmp_path)
    one_line(e, f"no Final_Training/Images/<class>/*.ppm under {tmp_path}",
             "GTSRB's release layout <dir>/Final_Training/Images/<00000..00042>/*.ppm")
    write_gtsrb(tmp_path, np.random.default_rng(0))
    os.rename(tmp_path / "GT-final_test.csv", tmp_path / "labels.csv")
    with pytest.raises(DataError) as e:
        files.gtsrb(tmp_path)
    one_line(e, "no test labels GT-final_test.csv", str(tmp_path / "Final_Test" / "Images"),
             "GTSRB's release layout")
    # The unlabelled test CSV of the image archive has no ClassId column.
    with open(tmp_path / "labels.csv") as f:
        lines = [";".join(line.strip().split(";")[:-1]) for line in f]
    (tmp_path / "GT-final_test.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        files.gtsrb(tmp_path)
    one_line(e, str(tmp_path / "GT-final_test.csv"), "ClassId")
    os.rename(tmp_path / "labels.csv", tmp_path / "GT-final_test.csv")
    os.remove(tmp_path / "Final_Test" / "Images" / "00002.ppm")
    with pytest.raises(DataError) as e:
        files.gtsrb(tmp_path)
    one_line(e, "1 test images", str(tmp_path / "Final_Test" / "Images" / "00002.ppm"))


# --- CINIC-10 -------------------------------------------------------------------------

def write_cinic10(root, rng, classes=("airplane", "cat", "truck"), per_class=2):
    """CINIC-10's release layout; the first image of each class is grayscale. Returns the
    expected images and labels per split."""
    expect = {}
    for split in ("train", "valid", "test"):
        images, labels = [], []
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(per_class):
                name = f"{split}_{c}_{i}.png"
                if i == 0:
                    gray = rng.integers(0, 256, (32, 32), dtype=np.uint8)
                    Image.fromarray(gray).save(d / name)  # mode L
                    images.append(np.repeat(gray[..., None], 3, axis=-1))
                else:
                    rgb = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                    Image.fromarray(rgb).save(d / name)
                    images.append(rgb)
                labels.append(files.CINIC10_CLASSES.index(c))
        expect[split] = (np.stack(images), np.asarray(labels, np.int32))
    return expect


def test_cinic10_reads_the_release_layout(tmp_path):
    expect = write_cinic10(tmp_path, np.random.default_rng(0))
    ds = data.load("cinic10", data_dir=tmp_path)
    assert ds.name == "cinic10" and ds.num_classes == 10 and ds.input_shape == (32, 32, 3)
    assert ds.train_images.dtype == np.uint8 and ds.test_labels.dtype == np.int32
    for split in ("train", "test"):
        np.testing.assert_array_equal(getattr(ds, f"{split}_images"), expect[split][0])
        np.testing.assert_array_equal(getattr(ds, f"{split}_labels"), expect[split][1])
    np.testing.assert_array_equal(ds.train_labels, [0, 0, 3, 3, 9, 9])  # alphabetical index
    both = files.cinic10(tmp_path, include_valid=True)
    np.testing.assert_array_equal(both.train_images, np.concatenate(
        [expect["train"][0], expect["valid"][0]]))
    np.testing.assert_array_equal(both.train_labels, np.concatenate(
        [expect["train"][1], expect["valid"][1]]))
    assert data.normalization(ds) == data.NORMALIZATION["cinic10"]


def test_cinic10_missing_and_bad_files(tmp_path):
    with pytest.raises(DataError) as e:
        files.cinic10(tmp_path)
    assert str(e.value) == (f"cinic10: no train/<class>/*.png under {tmp_path}; expected "
                            "CINIC-10's release layout <dir>/{train,valid,test}/<class>/*.png")
    write_cinic10(tmp_path, np.random.default_rng(0))
    (tmp_path / "test" / "kitten").mkdir()
    with pytest.raises(DataError) as e:
        files.cinic10(tmp_path)
    one_line(e, str(tmp_path / "test" / "kitten"), "airplane")
    (tmp_path / "test" / "kitten").rmdir()
    Image.fromarray(np.zeros((30, 32, 3), np.uint8)).save(tmp_path / "test" / "cat" / "z.png")
    with pytest.raises(DataError) as e:
        files.cinic10(tmp_path)
    one_line(e, str(tmp_path / "test" / "cat" / "z.png"), "32x30", "expected 32x32")


# --- load: data_dir or $FEDJAX_PAN_<NAME>_DIR -------------------------------------------

@pytest.mark.parametrize("name", ["femnist", "gtsrb", "cinic10"])
def test_load_needs_a_directory(monkeypatch, tmp_path, name):
    var = f"FEDJAX_PAN_{name.upper()}_DIR"
    monkeypatch.delenv(var, raising=False)
    with pytest.raises(DataError) as e:
        data.load(name)
    one_line(e, "data_dir", f"${var}", files.LAYOUTS[name])
    monkeypatch.setenv(var, str(tmp_path / "nowhere"))
    with pytest.raises(DataError) as e:
        data.load(name)
    one_line(e, f"${var}={tmp_path / 'nowhere'} is not a directory")
    with pytest.raises(DataError) as e:
        data.load(name, data_dir=tmp_path)  # data_dir wins over the variable
    one_line(e, str(tmp_path), files.LAYOUTS[name])


def test_load_reads_the_environment_variable(monkeypatch, tmp_path):
    expect = write_cinic10(tmp_path, np.random.default_rng(1), classes=("ship",), per_class=1)
    monkeypatch.setenv("FEDJAX_PAN_CINIC10_DIR", str(tmp_path))
    np.testing.assert_array_equal(data.load("cinic10").test_images, expect["test"][0])


# --- configs --------------------------------------------------------------------------

def load_config(name, preset=None):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.get_config(preset)


def femnist_config(root, **changes):
    _, cfg = load_config("femnist_mlp", "pans_on")
    cfg.dataset.data_dir = str(root)
    cfg.model.options = {"hidden": (8,)}
    cfg.eval.batch_size = 16
    for key, value in changes.items():
        section, field = key.split("__")
        cfg[section][field] = value
    return cfg


def test_femnist_config_builds_one_client_per_writer(tmp_path):
    # load() uses the paper's fractions: floor(0.1 * 30) = 3 writers, so 3 clients.
    root = write_leaf(tmp_path, leaf_writers(sizes=[4, 5, 6] * 10, seed=1))
    exp = experiment.build(femnist_config(root, partition__num_clients=3))
    ds = exp.dataset
    assert ds.name == "femnist" and len(exp.client_indices) == 3
    for g, idx in enumerate(exp.client_indices):
        np.testing.assert_array_equal(idx, np.flatnonzero(ds.train_groups == g))
    with pytest.raises(ConfigError, match=r"num_clients=359.*has 3: set "
                                          r"--config.partition.num_clients=3"):
        experiment.build(femnist_config(root))
    with pytest.raises(ConfigError, match="natural clients"):
        cfg = femnist_config(root, partition__num_clients=3)
        cfg.dataset.name = "synthetic"
        experiment.build(cfg)


@pytest.mark.parametrize("name", ["femnist_mlp", "gtsrb_vgg9", "cinic10_resnet20"])
def test_configs_load_and_validate(tmp_path, name):
    module, _ = load_config(name)
    assert "--config.dataset.data_dir" in module.__doc__ and "accelerator" in module.__doc__
    for preset in module.PRESETS:
        _, cfg = load_config(name, preset)
        cfg.dataset.data_dir = str(tmp_path)
        experiment.validate(cfg)
        assert cfg.participation == 0.1 and cfg.local.epochs == 5 and cfg.rounds == 1000
        if name == "femnist_mlp":
            assert cfg.partition.scheme == "natural" and cfg.local.batch_size == 10
            assert cfg.model.name == "mlp" and cfg.optimizer.lr == 0.05
        else:
            assert cfg.partition.scheme == "dirichlet_by_client"
            assert (cfg.partition.num_clients, cfg.partition.alpha) == (100, 0.1)
            assert cfg.local.batch_size == 64
            assert cfg.optimizer.lr == (0.1 if name == "cinic10_resnet20" else 0.05)
    assert schema.RULES["dataset.name"].check(module.get_config().dataset.name) is None
