"""The launcher's watch over its processes, and each process's watch over the others
(`distributed._Watch`, with a stand-in for the coordination service's key-value store)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fedjax_pan.engine import distributed
from fedjax_pan.run import launch


def _python(code: str) -> list:
    return [sys.executable, "-c", code]


SLEEP = _python("import time; time.sleep(60)")


def _supervise(cmds, capsys, grace=0.5):
    start = time.monotonic()
    status = launch.supervise(cmds, grace=grace, poll_seconds=0.05)
    lines = capsys.readouterr().err.strip().splitlines()
    return status, time.monotonic() - start, lines


def test_a_failure_of_any_process_stops_the_others(capsys):
    # Process 0 would run a minute: the failure of process 1 is seen all the same.
    status, seconds, lines = _supervise([SLEEP, _python("import sys; sys.exit(3)")], capsys)
    assert status == 3 and seconds < 20
    assert len(lines) == 1 and lines[0].startswith(
        "error: process 1 exited with status 3; process 0 was stopped (SIGTERM); the other "
        "processes' output is in "), lines


def test_a_process_deaf_to_sigterm_is_killed(tmp_path, capsys):
    ready = str(tmp_path / "ready")
    deaf = _python(f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   f"open({ready!r}, 'w').close(); time.sleep(60)")
    kill = _python(f"import os, signal, time\nwhile not os.path.exists({ready!r}): "
                   f"time.sleep(0.01)\nos.kill(os.getpid(), signal.SIGKILL)")
    status, seconds, lines = _supervise([deaf, kill, SLEEP], capsys)
    assert status == 128 + signal.SIGKILL and seconds < 20
    assert lines[0].startswith("error: process 1 was killed by SIGKILL (status 137); process 0 "
                               "was stopped (SIGKILL); process 2 was stopped (SIGTERM)"), lines


def test_processes_that_stop_by_themselves_are_not_signalled(capsys):
    # As a run's processes do once one of them ends: process 0 says why, with its status.
    status, _, lines = _supervise(
        [_python("import sys, time; time.sleep(0.5); sys.exit(143)"),
         _python("import sys; sys.exit(143)")], capsys, grace=30)
    assert status == 143
    assert lines[0].startswith("launch: process 1 exited with status 143; process 0 exited "
                               "with status 143;"), lines


def test_a_launcher_stopped_by_sigterm_stops_its_processes(tmp_path):
    # A scheduler's time limit: the launcher passes it on, and waits for them.
    ready = [str(tmp_path / f"ready{i}") for i in range(2)]
    cmds = [_python(f"import time; open({r!r}, 'w').close(); time.sleep(60)") for r in ready]
    launcher = subprocess.Popen(
        _python(f"import sys; from fedjax_pan.run import launch; "
                f"sys.exit(launch.supervise({cmds!r}, grace=0.5))"),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(r) for r in ready):  # (its handler is set by then)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    err = launcher.communicate(timeout=30)[1]
    assert launcher.returncode == 143, err
    assert err.startswith("error: interrupted (SIGTERM); process 0 was stopped (SIGTERM); "
                          "process 1 was stopped (SIGTERM); "), err


def test_processes_that_succeed_say_nothing(capsys):
    status, _, lines = _supervise([_python("pass"), _python("pass")], capsys)
    assert status == 0 and lines == []


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_refused_before_jax_starts(busy_port, monkeypatch, capsys):
    import jax

    def joined(*args, **kwargs):
        raise AssertionError("JAX was started")
    monkeypatch.setattr(jax.distributed, "initialize", joined)
    with pytest.raises(distributed.ConfigError,
                       match=f"--coordinator=localhost:{busy_port}: port {busy_port} is in use "
                             "on this host, where process 0 serves the coordinator"):
        distributed.initialize(f"localhost:{busy_port}", 2, 0)
    # Only process 0 listens there: the others connect to it.
    with pytest.raises(AssertionError, match="JAX was started"):
        distributed.initialize(f"localhost:{busy_port}", 2, 1)
    monkeypatch.setattr(launch, "supervise", joined)
    assert launch.main(["--processes=2", f"--port={busy_port}", "--", "--workdir=x"]) == 2
    assert capsys.readouterr().err == (f"error: --port={busy_port} is in use on this host; "
                                       "pick a free port, or leave --port out for one\n")
    assert not distributed.port_in_use(launch.free_port())


class Store:
    """The coordination service's key-value store, as `_Watch` uses it."""

    def __init__(self):
        self.data = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.data and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
        self.data[key] = value

    def key_value_try_get(self, key):
        return self.data[key]

    def key_value_dir_get(self, prefix):
        return sorted((k, v) for k, v in self.data.items() if k.startswith(prefix))


def _watch(tmp_path, me=0, count=2, peer_timeout=5.0):
    return distributed._Watch(Store(), me, count, peer_timeout, str(tmp_path / "w"))


def _post(watch, process, status, message):
    watch.client.key_value_set(f"fedjax_pan/ended/{process}", json.dumps(
        {"process": process, "status": status, "message": message}))


def test_an_error_that_follows_from_another_process_names_it(tmp_path):
    watch = _watch(tmp_path)
    (tmp_path / "w" / "checkpoints" / "2").mkdir(parents=True)
    _post(watch, 1, 143, "interrupted in round 3; rounds 1-2 are saved in W")
    watch.check(time.monotonic())
    assert watch.ending("unexpected ValueError: Gloo AllGather failed", 1, "x") == (
        "process 1 stopped: interrupted in round 3; rounds 1-2 are saved in W; continue "
        "with --resume", 143)
    assert watch.status == 143  # what the process exits with
    assert "fedjax_pan/ended/0" not in watch.client.data


def test_an_error_of_its_own_is_posted_for_the_others(tmp_path):
    watch = _watch(tmp_path, me=1)
    watch.beat = 0.01  # how long an unforeseen error waits for word of the others
    text = "unexpected KeyError: 'x' (traceback in /tmp/f.log)"
    assert watch.ending(text, 1, text) == (text, 1)
    assert json.loads(watch.client.data["fedjax_pan/ended/1"]) == {
        "process": 1, "status": 1, "message": text}
    # The same kind of error as the first process's (a SIGTERM to every process): its own.
    watch = _watch(tmp_path, me=1)
    _post(watch, 0, 143, "interrupted in round 3")
    watch.check(time.monotonic())
    assert watch.ending("interrupted in round 4", 143, "interrupted in round 4") == (
        "interrupted in round 4", 143)


def test_a_process_without_heartbeat_is_declared_lost(tmp_path):
    watch = _watch(tmp_path, count=3, peer_timeout=5.0)
    store = watch.client
    store.key_value_set("fedjax_pan/beat/1", "7")
    store.key_value_set("fedjax_pan/beat/2", "7")
    watch.check(100.0)
    store.key_value_set("fedjax_pan/beat/2", "8", allow_overwrite=True)
    watch.check(104.0)
    assert watch.cause is None
    watch.check(106.0)  # process 1's beat has not moved for 6 s
    assert watch.cause == {"process": 1, "status": 1, "lost": True, "message":
                           "no word from it for 5 s (killed, out of memory, or its host "
                           "failed)"}
    assert json.loads(store.data["fedjax_pan/ended/1"]) == watch.cause
    assert watch.ending("unexpected ValueError: Gloo failed", 1, "x") == (
        "process 1 stopped: no word from it for 5 s (killed, out of memory, or its host "
        "failed); run the command again", 1)


def test_a_process_gone_from_this_machine_is_declared_lost_at_once(tmp_path):
    watch = _watch(tmp_path)
    gone = subprocess.Popen(_python("pass"))
    gone.wait()
    watch.client.key_value_set("fedjax_pan/host/1", json.dumps(
        {"pid": gone.pid, "machine": distributed._machine()}))
    watch.check(0.0)
    assert watch.cause["message"].startswith("it ended without a word")
    # A process that posted its error before exiting is reported by it.
    watch = _watch(tmp_path)
    _post(watch, 1, 2, "config.x must be > 0")
    assert watch._declare(1, "it ended without a word")["message"] == "config.x must be > 0"


def test_a_zombie_is_not_alive():
    child = subprocess.Popen(_python("pass"))
    deadline = time.monotonic() + 30
    while distributed._alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # dead, not reaped: /proc says Z
    assert not distributed._alive(child.pid)
    assert os.path.exists(f"/proc/{child.pid}") and child.wait() == 0
    assert distributed._alive(os.getpid())
