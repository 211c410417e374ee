"""TensorBoard event files hold metrics.jsonl's numeric fields, as TensorBoard's own loader
reads them: for a run from the command line, each variant of a config, and a run resumed
after a crash (no round twice, neither from the files nor in a TensorBoard watching)."""

import glob
import importlib.util
import json
import math
import os
import shutil

import numpy as np
from tensorboard.backend.event_processing import event_accumulator, event_multiplexer

from conftest import ROOT
from fedjax_pan.config import defaults
from fedjax_pan.run import experiment, main, tensorboard

CONFIG = os.path.join(ROOT, "configs", "fmnist_mlp.py")
CLI = ["prog", f"--config={CONFIG}:smoke", "--noprogress", "--config.dataset.name=synthetic",
       "--config.model.options.hidden=(32, 32)"]


def accumulator(logdir):
    return event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0})  # 0: keep every step


def shown(acc):
    """{tag: [(step, value), ...]} of the scalars `acc` holds after loading what is new."""
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def logged(workdir):
    """The same read from metrics.jsonl: each number but the round, at 32 bits as
    TensorBoard keeps it."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            for key, value in row.items():
                if key != "round" and isinstance(value, (int, float)):
                    out.setdefault(key, []).append((row["round"], float(np.float32(value))))
    return out


def event_files(logdir):
    return sorted(glob.glob(os.path.join(str(logdir), "events.out.tfevents.*")))


def test_numbers_are_scalars_and_the_rest_is_skipped():
    row = {"round": 4, "acc": 0.5, "count": 3, "flag": True, "off": np.bool_(False),
           "x64": np.float64(0.25), "nan": float("nan"), "name": "fedavg", "none": None,
           "list": [1.0], "dict": {"a": 1.0}}
    out = tensorboard.scalars(row)
    assert set(out) == {"acc", "count", "flag", "off", "x64", "nan"}
    assert (out["acc"], out["count"], out["flag"], out["off"], out["x64"]) == (
        0.5, 3.0, 1.0, 0.0, 0.25)
    assert math.isnan(out["nan"])


def test_a_new_writer_replaces_the_steps_of_earlier_files(tmp_path):
    rows = [{"round": r, "acc": r / 8, "flag": r % 2 == 1, "note": "x"} for r in (1, 2, 3)]
    w = tensorboard.Writer(str(tmp_path))
    for row in rows:
        w.write(row["round"], row)
    watching = accumulator(tmp_path)  # a TensorBoard open while the run goes on
    assert shown(watching) == {"acc": [(1, 0.125), (2, 0.25), (3, 0.375)],
                               "flag": [(1, 1.0), (2, 0.0), (3, 1.0)]}  # flushed, not closed
    w.close()
    w.close()
    # Resumed from round 1: round 2 again with another value, round 3 not (yet).
    w = tensorboard.Writer(str(tmp_path), rows[:1])
    w.write(2, {"round": 2, "acc": 0.75})
    w.close()
    want = {"acc": [(1, 0.125), (2, 0.75)], "flag": [(1, 1.0)]}
    assert len(event_files(tmp_path)) == 2
    assert shown(accumulator(tmp_path)) == want
    assert shown(watching) == want


def test_a_command_line_run_and_its_resume_show_the_rows_once(tmp_path):
    w = str(tmp_path / "w")
    assert main.main([*CLI, f"--workdir={w}", "--config.checkpoint_every=2"]) == 0
    first = logged(w)
    assert [s for s, _ in first["test_accuracy"]] == [1, 2, 3]
    assert {"test_accuracy", "test_loss", "train_loss", "upload_bytes", "seconds"} <= set(first)
    watching = accumulator(w)
    assert shown(watching) == first
    # A crash after round 3 was logged, before its checkpoint landed: --resume recomputes
    # round 3 (its `seconds` differ) from the checkpoint of round 2.
    shutil.rmtree(os.path.join(w, "checkpoints", "3"))
    assert main.main([*CLI, f"--workdir={w}", "--resume", "--config.checkpoint_every=2",
                      "--config.rounds=4"]) == 0
    rows = logged(w)
    assert [s for s, _ in rows["test_accuracy"]] == [1, 2, 3, 4]
    assert rows["seconds"][:2] == first["seconds"][:2] != rows["seconds"][2:3]
    assert shown(accumulator(w)) == rows
    assert shown(watching) == rows
    # Resuming the finished run writes no event file.
    before = event_files(w)
    assert main.main([*CLI, f"--workdir={w}", "--resume", "--config.checkpoint_every=2",
                      "--config.rounds=4"]) == 0
    assert event_files(w) == before and len(before) == 2


def test_each_variant_is_a_run_of_its_own(tmp_path):
    spec = importlib.util.spec_from_file_location("fmnist_mlp", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = defaults.set_keys(module.get_config("smoke"), {
        "rounds": 2, "dataset.name": "synthetic", "model.options": {"hidden": [32, 32]},
        "variants": {"pans_off": {"pan": {"amplitude": 0.0}},
                     "pans_on": {"pan": {"amplitude": 0.1}}}})
    experiment.run(cfg, str(tmp_path), progress=False)
    assert event_files(tmp_path) == []
    runs = event_multiplexer.EventMultiplexer().AddRunsFromDirectory(str(tmp_path))
    assert set(runs.Runs()) == {"pans_off", "pans_on"}  # what `tensorboard --logdir` lists
    for name in ("pans_off", "pans_on"):
        rows = logged(tmp_path / name)
        assert [s for s, _ in rows["test_accuracy"]] == [1, 2]
        assert shown(accumulator(tmp_path / name)) == rows
    assert logged(tmp_path / "pans_off") != logged(tmp_path / "pans_on")
