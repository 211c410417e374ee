"""The command line: exit statuses, one-line errors, and a real-data smoke run."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, needs_fmnist, signal_on_call
from fedjax_pan.run import main

SMOKE = "--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py") + ":smoke"


def _cli(args, tmp_path):
    out = subprocess.run([sys.executable, "-m", "fedjax_pan.run.main", *args], cwd=ROOT,
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
    assert set(rows[0]) == {"round", "test_accuracy", "test_loss", "train_loss", "seconds",
                            "upload_bytes", "download_bytes", "upload_bytes_total",
                            "download_bytes_total", "upload_bytes_per_client",
                            "download_bytes_per_client"}
    # 4 of 20 clients a round, each sending the MLP's 2,913,290 float32 deltas and
    # receiving as many parameters.
    assert all(r["upload_bytes"] == r["download_bytes"] == 4 * 4 * 2913290 for r in rows)
    assert [r["upload_bytes_total"] for r in rows] == [k * 4 * 4 * 2913290 for k in (1, 2, 3)]
    assert all(r["download_bytes_per_client"] == 4 * 2913290 for r in rows)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    with open(workdir / "summary.json") as f:
        summary = json.load(f)
    assert summary["rounds"] == 3 and 0.0 < summary["final_accuracy"] <= 1.0
    assert "final acc" in capsys.readouterr().out
    # The same workdir again is refused (exit 2) and left as it was.
    before = sorted(os.listdir(workdir))
    assert main.main(["prog", SMOKE, f"--workdir={workdir}", "--noprogress"]) == 2
    assert sorted(os.listdir(workdir)) == before


SYNTHETIC = [SMOKE, "--noprogress", "--config.dataset.name=synthetic"]


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in f]


# SIGTERM in the default run; SIGINT (the same path, about 10 s) with the slow tests.
@pytest.mark.parametrize("sig,status", [pytest.param(signal.SIGINT, 130,
                                                     marks=pytest.mark.slow),
                                        (signal.SIGTERM, 143)])
def test_a_signal_ends_in_one_line_and_the_run_resumes_exactly(tmp_path, sig, status):
    workdir = str(tmp_path / "w")
    args = [sys.executable, "-m", "fedjax_pan.run.main", *SYNTHETIC, f"--workdir={workdir}",
            "--config.rounds=100000", "--config.checkpoint_every=1000"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(workdir, "metrics.jsonl")) and len(_rows(workdir)) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # ignored the signal: leave no run behind
        proc.kill()
        proc.communicate()
        raise
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == status, err
    assert len(lines) == 1 and re.match(r"error: interrupted in round (\d+); rounds 1-\d+ are "
                                        r"saved in .*; continue with --resume$", lines[0]), err
    done = int(re.search(r"rounds 1-(\d+)", lines[0]).group(1))
    assert os.listdir(os.path.join(workdir, "checkpoints")) == [str(done)]
    assert len(_rows(workdir)) == done
    if sig != signal.SIGINT:  # the rest does not depend on which signal it was
        return
    # Resumed to two rounds more, it matches a run that was never interrupted.
    more = [f"--config.rounds={done + 2}", "--config.checkpoint_every=1000"]
    assert main.main(["prog", *SYNTHETIC, f"--workdir={workdir}", "--resume", *more]) == 0
    again = str(tmp_path / "uninterrupted")
    assert main.main(["prog", *SYNTHETIC, f"--workdir={again}", *more]) == 0
    assert _rows(workdir) == _rows(again)
    with open(os.path.join(workdir, "summary.json")) as f:
        assert json.load(f)["processes"] == 2


def test_each_kind_of_failure_has_its_status(tmp_path, capsys, monkeypatch):
    w = str(tmp_path / "w")
    assert main.main(["prog", *SYNTHETIC, f"--workdir={w}", "--config.max_train_loss=0.01"]) == 3
    # Nothing was kept, so the same command runs again (and diverges again).
    assert main.main(["prog", *SYNTHETIC, f"--workdir={w}", "--config.max_train_loss=0.01"]) == 3
    from fedjax_pan.run import experiment

    def boom(*args, **kwargs):
        raise RuntimeError("an unforeseen bug")
    monkeypatch.setattr(experiment, "run", boom)
    assert main.main(["prog", *SYNTHETIC, f"--workdir={tmp_path / 'x'}"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error:") for line in lines)
    assert "diverged in round 1" in lines[0]
    log = re.search(r"traceback in (\S+)\)$", lines[2]).group(1)
    assert "an unforeseen bug" in lines[2] and "Traceback" in open(log).read()
    os.unlink(log)


def test_unknown_override_keys_name_the_valid_ones(tmp_path, capsys):
    for key in ("nonexistent", "optimizer.momentun", "model.options.hidden"):
        assert main.main(["prog", *SYNTHETIC, f"--workdir={tmp_path}/w",
                          f"--config.{key}=1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    assert "'nonexistent'; valid keys at the top level: seed, rounds" in lines[0]
    assert "did you mean optimizer.momentum?" in lines[1]
    # The model's options are free-form: set from the command line, checked by the model.
    assert "option hidden must be a list of positive integers, got 1" in lines[2]
    assert not (tmp_path / "w").exists()


def test_ctrl_c_while_the_results_are_written_keeps_them(tmp_path, capsys, monkeypatch):
    from fedjax_pan.run import reporting
    # Arrives while the curve is being drawn.
    signal_on_call(monkeypatch, reporting, "plot_curves", signal.SIGINT, 1)
    w = tmp_path / "w"
    assert main.main(["prog", *SYNTHETIC, f"--workdir={w}", "--config.rounds=1"]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: interrupted; {w} keeps the rounds saved so far; continue with "
                     f"--resume"]
    assert (w / "curve.png").stat().st_size > 1000 and (w / "summary.json").exists()


def test_model_options_are_set_from_the_command_line(tmp_path, capsys):
    w = tmp_path / "w"
    assert main.main(["prog", *SYNTHETIC, f"--workdir={w}", "--config.algorithm=fed2",
                      "--config.rounds=1", "--config.model.options.hidden=(32, 32)"]) == 2
    hint = capsys.readouterr().err.strip()
    option = re.search(r"--config\.model\.options\.grouped=\"(.*?)\"", hint)
    assert option and "needs a grouped model" in hint, hint
    # The hint, followed literally, runs (G = 10 groups over the MLP's last 2 of 3 layers).
    assert main.main(["prog", *SYNTHETIC, f"--workdir={w}", "--config.algorithm=fed2",
                      "--config.rounds=1", f"--config.model.options.grouped={option.group(1)}",
                      "--config.model.options.hidden=(32, 32)"]) == 0
    with open(w / "config.json") as f:
        assert json.load(f)["model"]["options"] == {"grouped": {"groups": 10, "depth": 2},
                                                    "hidden": [32, 32]}


@pytest.mark.parametrize("algorithm", [pytest.param("ktpfl", marks=pytest.mark.slow),
                                       "fedrep"])
def test_personalised_algorithms_run_on_the_smoke_preset_as_they_are(tmp_path, capsys,
                                                                     algorithm):
    w = tmp_path / "w"
    assert main.main(["prog", *SYNTHETIC, f"--workdir={w}", f"--config.algorithm={algorithm}",
                      "--config.rounds=1"]) == 2  # no test part: nothing would score them
    err = capsys.readouterr().err.strip()
    assert "config.partition.test_fraction must be > 0" in err and not w.exists()
    assert main.main(["prog", *SYNTHETIC, f"--workdir={w}", f"--config.algorithm={algorithm}",
                      "--config.rounds=1", "--config.partition.test_fraction=0.25"]) == 0
    own = _rows(w)[0]["pfl_accuracy"]
    assert own > 0
    # The table shows what the algorithm keeps: each client's model on its own test part.
    out = capsys.readouterr().out
    assert "own test (last 5)" in out and f"{100 * own:.2f}%" in out
    with open(w / "summary.json") as f:
        assert json.load(f)["final_pfl_accuracy"] == own


def test_a_file_as_the_workdir_or_above_it_exits_4_naming_it(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep")
    for workdir in (notes, notes / "run"):
        assert main.main(["prog", *SYNTHETIC, f"--workdir={workdir}"]) == 4
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"error: cannot write workdir '{workdir}': {notes} exists and is not "
                         "a directory; nothing was written"]
    assert notes.read_text() == "keep" and os.listdir(tmp_path) == ["notes.txt"]
