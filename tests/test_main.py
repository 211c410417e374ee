"""The command line: exit statuses, one-line errors, and a real-data smoke run."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, needs_fmnist
from fedjax_pan import main

SMOKE = "--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py") + ":smoke"


def _cli(args, tmp_path):
    out = subprocess.run([sys.executable, "-m", "fedjax_pan.main", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout, out.stderr


@pytest.mark.parametrize("extra,word", [
    (["--config.partition.alpha=-0.5"], "alpha"),
    (["--config.no_such_key=1"], "no_such_key"),
    (["--config.participation=2.0"], "participation"),
])
def test_bad_values_exit_2_with_one_line(tmp_path, extra, word):
    workdir = tmp_path / "w"
    code, _, err = _cli([SMOKE, f"--workdir={workdir}", "--noprogress",
                         "--config.dataset.name=synthetic", *extra], tmp_path)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], err
    assert not workdir.exists()


def test_missing_workdir_unknown_preset_and_missing_file(tmp_path, capsys):
    assert main.main(["prog", SMOKE]) == 2
    bad_preset = SMOKE.replace(":smoke", ":nosuchpreset")
    assert main.main(["prog", bad_preset, f"--workdir={tmp_path}/w"]) == 2
    assert main.main(["prog", "--config=configs/nofile.py", f"--workdir={tmp_path}/w"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error:") for line in lines)
    assert "nosuchpreset" in lines[1] and "nofile.py" in lines[2]


@needs_fmnist
def test_real_data_smoke_run(tmp_path, capsys):
    workdir = tmp_path / "smoke"
    assert main.main(["prog", SMOKE, f"--workdir={workdir}", "--noprogress"]) == 0
    with open(workdir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) == {"round", "test_accuracy", "test_loss", "train_loss", "seconds"}
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    with open(workdir / "summary.json") as f:
        summary = json.load(f)
    assert summary["rounds"] == 3 and 0.0 < summary["final_accuracy"] <= 1.0
    assert "final acc" in capsys.readouterr().out
    # The same workdir again is refused (exit 2) and left as it was.
    before = sorted(os.listdir(workdir))
    assert main.main(["prog", SMOKE, f"--workdir={workdir}", "--noprogress"]) == 2
    assert sorted(os.listdir(workdir)) == before
