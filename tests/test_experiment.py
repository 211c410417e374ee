"""Config-driven runs: resume equals an uninterrupted run, bad input, divergence, workdirs."""

import importlib.util
import json
import os
import re
import shutil

import pytest

from conftest import ROOT
from fedjax_pan import experiment


def config(preset="smoke", **changes):
    spec = importlib.util.spec_from_file_location("fmnist_mlp",
                                                  os.path.join(ROOT, "configs", "fmnist_mlp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(preset)
    cfg.dataset.name = "synthetic"  # fast and always available
    for key, value in changes.items():
        node = cfg
        *path, last = key.split("__")
        for part in path:
            node = node[part]
        node[last] = value
    return cfg


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in f]


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(config(rounds=4, checkpoint_every=2), full, progress=False)
    experiment.train(config(rounds=3, checkpoint_every=2), part, progress=False)
    # Crash after round 3 was logged but before its checkpoint landed: drop that checkpoint.
    shutil.rmtree(os.path.join(part, "checkpoints", "3"))
    assert len(metrics(part)) == 3
    summary = experiment.train(config(rounds=4, checkpoint_every=2), part, resume=True,
                               progress=False)
    assert metrics(part) == metrics(full)
    assert summary["rounds"] == 4 and len(metrics(full)) == 4
    assert summary["compiles_after_first_round"] == 0


def test_resume_refuses_a_different_config(tmp_path):
    workdir = str(tmp_path / "w")
    experiment.train(config(rounds=1), workdir, progress=False)
    with pytest.raises(experiment.ConfigError, match="partition"):
        experiment.train(config(rounds=2, partition__alpha=0.5), workdir, resume=True,
                         progress=False)


@pytest.mark.parametrize("changes,match", [
    (dict(partition__alpha=0.0), "alpha"), (dict(partition__alpha=-1.0), "alpha"),
    (dict(participation=0.0), "participation"), (dict(participation=1.2), "participation"),
    (dict(partition__num_clients=5000), "exceeds"), (dict(model__name="vgg7"), "vgg7"),
    (dict(dataset__name="imagenet"), "imagenet"), (dict(execution__strategy="gpu"), "gpu"),
    (dict(partition__scheme="shards"), "shards"), (dict(local__batch_size=0), "batch_size"),
    (dict(pan__kind="pow"), "pow"), (dict(model__norm="layer"), "layer"),
])
def test_bad_configs_fail_before_touching_the_workdir(tmp_path, changes, match):
    workdir = tmp_path / "w"
    with pytest.raises(experiment.ConfigError, match=match):
        experiment.train(config(**changes), str(workdir), progress=False)
    assert not workdir.exists()


def test_non_empty_workdir_is_refused_and_kept(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(experiment.ConfigError, match="not empty"):
        experiment.train(config(rounds=1), str(tmp_path), progress=False)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    experiment.train(config(rounds=1), str(tmp_path), overwrite=True, progress=False)
    assert not (tmp_path / "notes.txt").exists()
    assert {"config.json", "metrics.jsonl", "summary.json", "curve.png", "checkpoints"} <= \
        set(os.listdir(tmp_path))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = config(rounds=5, optimizer__lr=1e8, optimizer__grad_clip=0.0, checkpoint_every=10)
    with pytest.raises(experiment.TrainingDiverged, match=r"in round (\d+)") as info:
        experiment.train(cfg, str(tmp_path), progress=False)
    bad = int(re.search(r"in round (\d+)", str(info.value)).group(1))
    # No periodic checkpoint was due, so the state before the bad round is what is kept.
    assert os.listdir(tmp_path / "checkpoints") == [str(bad - 1)]
    assert f"round {bad - 1}" in str(info.value)
    assert len(metrics(tmp_path)) == bad - 1


def test_variants_write_a_comparison(tmp_path):
    cfg = config("compare", rounds=1, partition__num_clients=10, local__epochs=0.5)
    summaries = experiment.run(cfg, str(tmp_path), progress=False)
    assert set(summaries) == {"pans_off", "pans_on"}
    assert {"comparison.json", "comparison.csv", "curves.png"} <= set(os.listdir(tmp_path))
    # Same seed and data: only the PANs differ, and they change the result.
    assert metrics(tmp_path / "pans_off") != metrics(tmp_path / "pans_on")
    assert "pans_on" in experiment.format_table(summaries)


def test_summary_uses_the_last_five_evaluations():
    rows = [{"round": r, "test_accuracy": r / 10, "test_loss": 1.0} for r in range(1, 9)]
    s = experiment.summarize(rows)
    assert s["final_accuracy"] == pytest.approx((0.4 + 0.5 + 0.6 + 0.7 + 0.8) / 5)
    assert s["best_accuracy"] == pytest.approx(0.8)


def test_local_test_accuracy_is_logged_when_asked(tmp_path):
    cfg = config(rounds=2, eval__local=True, partition__scheme="iid")
    experiment.train(cfg, str(tmp_path), progress=False)
    row = metrics(tmp_path)[-1]
    assert row["local_test_accuracy_min"] <= row["local_test_accuracy_mean"] <= 1.0
    # IID clients hold (nearly) the global label mix: their expected accuracy is the global one.
    assert abs(row["local_test_accuracy_mean"] - row["test_accuracy"]) < 0.03
