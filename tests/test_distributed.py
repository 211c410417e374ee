"""Multi-process runs: 2 local processes of 2 CPU devices each against 1 process.

The processes run from different folders, so a workdir given as a relative path exists
only where process 0 runs: the others must neither write it nor need it (a resumed run's
state reaches them from process 0).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, needs_fmnist
from fedjax_pan import workdir
from fedjax_pan.engine import distributed
from fedjax_pan.run import launch
from fedjax_pan.errors import ConfigError

CHECK = "--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py") + ":multiprocess"
SMOKE = ("--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py") + ":smoke",
         "--config.dataset.name=synthetic")


def _env(devices: int) -> dict:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return env


def _processes(args, folders, timeout=600):
    """Runs `args` as len(folders) processes of 2 devices, process i in folders[i]; their
    (exit status, stderr) in process order."""
    procs = [subprocess.Popen(cmd, cwd=folder, env=_env(2), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for cmd, folder in zip(launch.commands(len(folders), args, launch.free_port()),
                                    folders)]
    try:
        out = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, o[1]) for p, o in zip(procs, out)]


def _errors(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("kwargs,word", [
    ({"coordinator": "localhost:1234"}, "--num_processes, --process_id must be given"),
    ({"coordinator": "localhost", "num_processes": 2, "process_id": 0}, "not host:port"),
    ({"coordinator": "h:70000", "num_processes": 2, "process_id": 0}, "not host:port"),
    ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, "--num_processes=0"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "--process_id=2"),
    ({"coordinator": "h:1", "auto": True}, "drop --coordinator"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 1, "peer_timeout": 0},
     "--peer_timeout=0 must be a positive"),
])
def test_bad_multiprocess_flags_are_config_errors(kwargs, word):
    with pytest.raises(ConfigError, match=word.replace("-", r"\-")):
        distributed.initialize(**kwargs)


def test_one_process_needs_no_runtime():
    distributed.initialize()  # no flags: nothing to join
    assert distributed.process_count() == 1 and distributed.is_primary()
    assert distributed.on_primary(lambda: {"a": 1}, "x") == {"a": 1}
    assert distributed.broadcast_json([1, "b"]) == [1, "b"]


def test_compare_finds_a_difference(tmp_path):
    for name, acc, loss in (("a", 0.5, 2.0), ("b", 0.5003, 2.0002)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(
            {"round": 1, "test_accuracy": acc, "test_loss": loss, "seconds": 3.0}) + "\n")
    worst, problems = launch.compare(tmp_path / "a", tmp_path / "b", tolerance=1e-3)
    assert problems == [] and worst == pytest.approx(2e-4 / 2.0002)
    worst, problems = launch.compare(tmp_path / "a", tmp_path / "b", tolerance=1e-5,
                                     accuracy_tolerance=1e-4)
    assert problems == ["run round 1: test_accuracy 0.5 vs 0.5003",
                        "run round 1: test_loss 2.0 vs 2.0002"]
    assert launch.main(["compare", str(tmp_path / "a"), str(tmp_path / "nothing")]) == 2


def test_launcher_refuses_bad_arguments(capsys):
    assert launch.main(["--processes=0", "--", "--workdir=x"]) == 2
    assert launch.main(["--processes=2"]) == 2
    assert launch.main(["--processes=2", "--devices=0", "--", "--workdir=x"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error:") for line in lines)


def test_processes_given_different_configs_stop_together(tmp_path):
    folders = [tmp_path / "p0", tmp_path / "p1"]
    for f in folders:
        f.mkdir()
    smoke = CHECK.replace(":multiprocess", ":smoke")
    common = [smoke, "--workdir=out", "--noprogress", "--config.dataset.name=synthetic"]
    procs = [subprocess.Popen(cmd + extra, cwd=f, env=_env(2), stderr=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, text=True)
             for cmd, f, extra in zip(launch.commands(2, common, launch.free_port()), folders,
                                      ([], ["--config.seed=1"]))]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for code, err in results:
        assert code == 2, err
        assert _errors(err) == ["error: processes [1] were given a config other than "
                                "process 0's; every process must run the same command"], err
    assert not any((f / "out").exists() for f in folders)


@pytest.mark.slow
@needs_fmnist
def test_two_processes_give_one_process_numbers_and_resume(tmp_path):
    # One process of 2 devices: on CPU a process's devices share its thread pool, and
    # more devices than cores can leave a collective waiting for a device that never
    # runs (XLA's rendezvous then aborts the process).
    one = tmp_path / "one"
    run = subprocess.run([sys.executable, "-m", "fedjax_pan.run.main", CHECK, f"--workdir={one}",
                          "--noprogress"], cwd=ROOT, env=_env(2), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    folders = [tmp_path / "p0", tmp_path / "p1"]
    for f in folders:
        f.mkdir()
    # A non-empty workdir is refused by process 0 and the refusal reaches process 1.
    (folders[0] / "out").mkdir()
    (folders[0] / "out" / "keep.txt").write_text("x")
    for code, err in _processes([CHECK, "--workdir=out", "--noprogress"], folders):
        assert code == 2 and len(_errors(err)) == 1 and "is not empty" in err, err
    os.unlink(folders[0] / "out" / "keep.txt")
    # Two rounds, then two more resumed from round 2's checkpoint: process 1 holds no
    # file of the run, so the restored state can only come from process 0.
    args = [CHECK, "--workdir=out", "--noprogress"]
    for extra in (["--config.rounds=2"], ["--resume"]):
        for code, err in _processes(args + extra, folders):
            assert code == 0, err
    assert not (folders[1] / "out").exists()
    two = folders[0] / "out"
    # float32 sums across 2 or 4 devices, in another order: losses to 1e-4 relative (seen:
    # 6e-6), accuracies to 10 test examples of 10,000 (seen: 1).
    worst, problems = launch.compare(one, two, tolerance=1e-4, accuracy_tolerance=1e-3)
    assert problems == [], problems
    for name in ("fedavg", "scaffold", "median"):
        rows = [json.loads(line) for line in open(two / name / "metrics.jsonl")]
        assert [r["round"] for r in rows] == [1, 2, 3, 4]
        summary = json.loads((two / name / "summary.json").read_text())
        assert summary["distributed_processes"] == 2 and summary["processes"] == 2
        assert summary["strategy"] == "sharded"
    # The numbers moved: equal runs that learned nothing would prove little.
    rows = [json.loads(line) for line in open(one / "scaffold" / "metrics.jsonl")]
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.03


def test_a_port_in_use_stops_process_0_with_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("localhost", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run(
            launch.commands(2, [*SMOKE, f"--workdir={tmp_path / 'w'}", "--noprogress"],
                            port)[0], cwd=ROOT, env=_env(1), capture_output=True, text=True,
            timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr == (f"error: --coordinator=localhost:{port}: port {port} is in use on "
                          "this host, where process 0 serves the coordinator; pick a free "
                          "port\n")
    assert not (tmp_path / "w").exists()


def _children(pid: int) -> dict:
    """{process id: pid} of the launcher's processes."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    out = {}
    for kid in kids:
        with open(f"/proc/{kid}/cmdline") as f:
            args = f.read().split("\0")
        out[int(next(a for a in args if a.startswith("--process_id=")).split("=")[1])] = kid
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signum,target,status,error,ended", [
    (signal.SIGTERM, 1, 143, r"process 1 stopped: interrupted in round \d+; rounds? 1(-\d+)? "
     r"(is|are) saved in \S+; continue with --resume",
     "process 1 exited with status 143; process 0 exited with status 143"),
    (signal.SIGKILL, 1, 137, r"process 1 stopped: it ended without a word \(killed, out of "
     r"memory, or crashed\); continue with --resume",
     r"process 1 was killed by SIGKILL \(status 137\); process 0 exited with status 1"),
    (signal.SIGTERM, 0, 143, r"interrupted in round \d+; rounds? 1(-\d+)? (is|are) saved in "
     r"\S+; continue with --resume",
     "process 0 exited with status 143; process 1 exited with status 143"),
], ids=["sigterm-1", "sigkill-1", "sigterm-0"])
def test_a_process_stopped_mid_run_stops_the_others(tmp_path, signum, target, status, error,
                                                    ended):
    # Before, the others waited in their next collective (or at JAX's shutdown barrier)
    # for minutes, and the launcher with them.
    work = tmp_path / "w"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fedjax_pan.run.launch", "--processes=2", "--devices=1", "--",
         *SMOKE, f"--workdir={work}", "--noprogress", "--config.rounds=40"],
        cwd=ROOT, env=_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (work / "metrics.jsonl").exists() or len(
                (work / "metrics.jsonl").read_text().splitlines()) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(_children(launcher.pid)[target], signum)
        start = time.monotonic()
        err = launcher.communicate(timeout=60)[1]
        assert time.monotonic() - start < 30
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == status, err
    assert len(_errors(err)) == 1 and re.fullmatch("error: " + error, _errors(err)[0]), err
    assert re.match(f"launch: {ended}; ", err.splitlines()[-1]), err
    assert workdir.saved_rounds(str(work))  # what the line says to continue from


@pytest.mark.slow
def test_a_silent_process_stops_the_others_after_peer_timeout(tmp_path):
    # Started as a scheduler starts them, without the launcher; process 1 stopped
    # (SIGSTOP) is alive but silent, as a process on a lost host is.
    work = tmp_path / "w"
    args = [*SMOKE, f"--workdir={work}", "--noprogress", "--config.rounds=40",
            "--peer_timeout=3"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_env(1), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
             for cmd in launch.commands(2, args, launch.free_port())]
    try:
        deadline = time.monotonic() + 300
        while not (work / "metrics.jsonl").exists() or len(
                (work / "metrics.jsonl").read_text().splitlines()) < 2:
            assert procs[0].poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGSTOP)
        start = time.monotonic()
        err = procs[0].communicate(timeout=60)[1]
        assert time.monotonic() - start < 30
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 1, err
    assert _errors(err) == ["error: process 1 stopped: no word from it for 3 s (killed, out of "
                            "memory, or its host failed); continue with --resume"], err
