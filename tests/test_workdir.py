"""Workdirs: refusals before writes, atomic files, overwrite that loses nothing, checkpoints."""

import errno
import gc
import os
import shutil
import signal
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan import workdir as wd
from fedjax_pan.errors import ConfigError, Interrupted, WorkdirError

# What tensorstore raised for a full tmpfs while orbax wrote a checkpoint (trimmed).
TENSORSTORE_ENOSPC = ('RESOURCE_EXHAUSTED: Error writing "a/0" in OCDBT database at local file '
                      '"/mnt/ck/2.orbax-checkpoint-tmp/": Failed to write 6914048 bytes to file '
                      "14: No space left on device [os_error_code='28']")


def test_filesystem_faults_are_recognised_in_tensorstore_messages():
    assert wd.as_os_error(ValueError(TENSORSTORE_ENOSPC)).errno == errno.ENOSPC
    assert wd.as_os_error(ValueError("... [os_error_code=30]")).errno == errno.EROFS
    assert wd.as_os_error(OSError(errno.EIO, "x")).errno == errno.EIO
    assert wd.as_os_error(ValueError("shapes do not match")) is None


def test_writing_turns_faults_into_one_line_and_lets_bugs_through():
    with pytest.raises(WorkdirError, match="cannot write the summary: No space left on device"
                                           "; rounds 1-3 are safe"):
        with wd.writing("the summary", lambda: "rounds 1-3 are safe"):
            raise ValueError(TENSORSTORE_ENOSPC)
    with pytest.raises(KeyError):
        with wd.writing("the summary", lambda: ""):
            raise KeyError("a bug, not a fault")


def test_an_atomic_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    wd.write_atomic(str(path), "old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        wd.write_atomic(str(path), "new and longer")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary file left behind
    monkeypatch.undo()
    wd.write_atomic(str(path), "new")
    assert path.read_text() == "new"
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_check_refuses_without_writing(tmp_path, monkeypatch):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not empty"):
        wd.check(str(tmp_path / "w"), resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="exclude each other"):
        wd.check(str(tmp_path / "w"), resume=True, overwrite=True)
    with pytest.raises(ConfigError, match="nothing to resume"):
        wd.check(str(tmp_path / "w"), resume=True, overwrite=False)
    # A file as the workdir, or above it, is a filesystem fault (status 4), naming it.
    (tmp_path / "file").write_text("")
    for workdir in ("file", "file/sub", "file/sub/deeper"):
        for resume, overwrite in ((False, False), (True, False), (False, True)):
            with pytest.raises(WorkdirError, match=f"^cannot write workdir '.*{workdir}': "
                                                   f"{tmp_path / 'file'} exists and is not a "
                                                   "directory; nothing was written$"):
                wd.check(str(tmp_path / workdir), resume=resume, overwrite=overwrite)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(wd.tempfile, "mkstemp", read_only)
    with pytest.raises(WorkdirError, match="cannot write workdir .*Read-only file system.*"
                                           "nothing was written"):
        wd.check(str(tmp_path / "new" / "deeper"), resume=False, overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["file", "w"]
    assert (tmp_path / "w" / "notes.txt").read_text() == "keep"


def _old_run(path):
    path.mkdir()
    (path / "summary.json").write_text("old results")


def test_overwrite_replaces_only_on_success(tmp_path):
    w = tmp_path / "w"
    _old_run(w)
    with wd.claim(str(w), overwrite=True):
        assert os.listdir(w) == []
        (w / "summary.json").write_text("new results")
    assert (w / "summary.json").read_text() == "new results"
    assert os.listdir(tmp_path) == ["w"]  # the old results were deleted


def test_overwrite_that_fails_before_a_round_puts_the_old_results_back(tmp_path):
    w = tmp_path / "w"
    _old_run(w)
    with pytest.raises(WorkdirError, match="disk full; .*holds its earlier results, unchanged"):
        with wd.claim(str(w), overwrite=True):
            (w / "config.json").write_text("{}")
            raise WorkdirError("disk full")
    assert os.listdir(w) == ["summary.json"] and os.listdir(tmp_path) == ["w"]
    assert (w / "summary.json").read_text() == "old results"


def test_a_fresh_run_that_fails_before_a_round_leaves_no_trace(tmp_path):
    for w, existed in ((tmp_path / "new", False), (tmp_path / "empty", True)):
        if existed:
            w.mkdir()
        with pytest.raises(WorkdirError):
            with wd.claim(str(w)):
                (w / "checkpoints").mkdir()
                (w / "config.json").write_text("{}")
                raise WorkdirError("disk full")
        assert w.exists() == existed and (not existed or os.listdir(w) == [])
    # A resumed run keeps what was there, progress or not.
    w = tmp_path / "resumed"
    w.mkdir()
    (w / "config.json").write_text("{}")
    with pytest.raises(Interrupted, match=r"^interrupted; .*resumed keeps the rounds saved so "
                                          r"far; continue with --resume$") as info:
        with wd.claim(str(w), resume=True):
            raise KeyboardInterrupt
    assert info.value.status == 130
    assert os.listdir(w) == ["config.json"]
    # A fresh run interrupted before its first round: nothing kept, the command runs again.
    with pytest.raises(Interrupted, match=r"^interrupted before \S+fresh saved a round; run "
                                          r"the command again$"):
        with wd.claim(str(tmp_path / "fresh")):
            raise KeyboardInterrupt
    assert not (tmp_path / "fresh").exists()


def test_the_advice_depends_on_what_the_workdir_keeps(tmp_path):
    # A run interrupted before its first round, beside another run's saved rounds (a
    # variant, a script's sweep): the same command would be refused, --resume is right.
    w = tmp_path / "w"
    with pytest.raises(Interrupted, match=r"no round of it was saved; continue with "
                                          r"--resume$"):
        with wd.claim(str(w)):
            (w / "a" / "checkpoints" / "3").mkdir(parents=True)
            raise Interrupted("interrupted in round 1; no round of it was saved", 15)
    assert os.listdir(w) == ["a"]
    with pytest.raises(WorkdirError, match=r"free space; run the command again$"):
        with wd.claim(str(tmp_path / "x")):
            with wd.writing("metrics", lambda: "no round of it was saved; free space"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    # Faults that --resume does not mend get no such advice.
    with pytest.raises(WorkdirError, match=r"corrupt$"):
        with wd.claim(str(tmp_path / "y")):
            raise WorkdirError("checkpoint corrupt")


def test_overwrite_that_fails_after_a_round_keeps_both(tmp_path):
    w = tmp_path / "w"
    _old_run(w)
    with pytest.raises(Interrupted) as info:
        with wd.claim(str(w), overwrite=True):
            (w / "checkpoints" / "3").mkdir(parents=True)
            raise KeyboardInterrupt
    aside = [d for d in os.listdir(tmp_path) if d != "w"]
    assert len(aside) == 1 and aside[0].startswith(".w.replaced-")
    assert (tmp_path / aside[0] / "summary.json").read_text() == "old results"
    assert aside[0] in str(info.value)
    assert os.listdir(w / "checkpoints") == ["3"]


def test_checkpoints_round_trip_with_counters_and_catch_flipped_bytes(tmp_path):
    tree = {"w": jnp.arange(64000, dtype=jnp.float32).reshape(80, 800), "step": jnp.int32(7)}
    ck = wd.Checkpoints(str(tmp_path))
    ck.save(2, tree, {"compiles": 5})
    rows = [{"round": 3, "test_accuracy": 0.5}, {"round": 4, "test_accuracy": 0.625}]
    ck.save(4, tree, {"compiles": 9}, rows)
    assert wd.saved_rounds(str(tmp_path)) == [2, 4] and ck.latest() == 4
    restored, counters, record = ck.restore(4, tree)
    np.testing.assert_array_equal(restored["w"], tree["w"])
    assert counters == {"compiles": 9} and record == rows
    assert ck.restore(2, tree)[2] is None  # saved without a record of the rows
    ck.close()
    # Flip bytes in the largest data file of round 4: orbax reads it back without complaint,
    # the digest does not match.
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "checkpoints" / "4")
             for f in fs if os.sep + "d" + os.sep in os.path.join(d, f)]
    big = max(files, key=os.path.getsize)
    data = bytearray(open(big, "rb").read())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    open(big, "wb").write(bytes(data))
    ck = wd.Checkpoints(str(tmp_path))
    with pytest.raises(WorkdirError, match=r"checkpoints/4 .*corrupt.*delete .*checkpoints/4 "
                                           r"to resume from round 2"):
        ck.restore(4, tree)
    restored, _, _ = ck.restore(2, tree)  # the earlier one is intact
    np.testing.assert_array_equal(restored["w"], tree["w"])


def test_a_failed_save_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    ck = wd.Checkpoints(str(tmp_path))
    tree = {"w": jnp.ones((100, 100))}
    ck.save(1, tree, {})
    import orbax.checkpoint as ocp
    real = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        os.makedirs(os.path.join(ck.directory, f"{step}.orbax-checkpoint-tmp-0"))
        raise ValueError(TENSORSTORE_ENOSPC)
    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(ValueError):
        ck.save(2, tree, {})
    assert os.listdir(ck.directory) == ["1"]
    monkeypatch.setattr(ocp.CheckpointManager, "save", real)


def test_signals_wait_for_the_end_of_a_deferred_block():
    seen = []
    with pytest.raises(KeyboardInterrupt) as info:
        with wd.deferred_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            seen.append("the block finished")
    assert seen == ["the block finished"]
    assert wd.signal_number(info.value) == signal.SIGTERM
    # Handlers are restored: SIGINT raises KeyboardInterrupt again at once.
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass


def _deliver(sig):
    """Sends `sig` to this process and runs bytecode until Python has called its handler."""
    os.kill(os.getpid(), sig)
    for _ in range(1000):
        pass


def test_a_signal_in_a_finalizer_is_raised_at_the_next_safe_point(capsys):
    """A handler that raised lost the signal when the garbage collector ran a __del__ at
    that moment ('Exception ignored in ...'); now it waits for a safe point."""
    class Sender:
        def __del__(self):
            _deliver(signal.SIGTERM)
    before, steps = signal.getsignal(signal.SIGTERM), []
    with pytest.raises(KeyboardInterrupt) as info:
        with wd.interrupts_at_safe_points():
            a, b = Sender(), Sender()
            a.other, b.other = b, a  # a cycle: freed by the collector, not by `del`
            del a, b
            gc.collect()  # two SIGTERMs: the second one raises in a __del__, and is kept
            steps.append("the collection ended")
            wd.raise_pending_signal()
            steps.append("past the safe point")
    assert steps == ["the collection ended"]
    assert wd.signal_number(info.value) == signal.SIGTERM
    assert "Exception ignored" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    wd.raise_pending_signal()  # raised once: nothing is left pending


def test_a_signal_in_a_weakref_callback_is_raised_at_the_next_safe_point():
    class Thing:
        pass
    steps = []
    with pytest.raises(KeyboardInterrupt) as info:
        with wd.interrupts_at_safe_points():
            thing = Thing()
            ref = weakref.ref(thing, lambda _: _deliver(signal.SIGINT))
            del thing  # the callback runs here
            steps.append("the callback ran")
            wd.raise_pending_signal()
    assert steps == ["the callback ran"] and ref() is None
    assert wd.signal_number(info.value) == signal.SIGINT


def test_signals_wait_for_safe_points_and_the_same_one_again_raises_at_once():
    with wd.interrupts_at_safe_points():
        _deliver(signal.SIGTERM)
        _deliver(signal.SIGINT)  # another kind waits too; the first is the one raised
        with pytest.raises(KeyboardInterrupt) as info:
            _deliver(signal.SIGTERM)  # insisting: a phase without safe points stops now
        assert wd.signal_number(info.value) == signal.SIGTERM
        wd.raise_pending_signal()  # nothing left: the block ends normally
    steps = []
    with pytest.raises(KeyboardInterrupt) as info:
        with wd.interrupts_at_safe_points():
            _deliver(signal.SIGTERM)
            with wd.deferred_interrupts():
                wd.raise_pending_signal()  # no safe point while files are written
                _deliver(signal.SIGTERM)  # nor does insisting cut them
                steps.append("written")
            steps.append("past the end of the writes")
    assert steps == ["written"] and wd.signal_number(info.value) == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt) as info:
        with wd.interrupts_at_safe_points():
            _deliver(signal.SIGTERM)
            steps.append("after the last safe point")
    assert steps[-1] == "after the last safe point"  # raised as the block ends
    with pytest.raises(ValueError):  # an error on its way out is what is reported...
        with wd.interrupts_at_safe_points():
            _deliver(signal.SIGTERM)
            raise ValueError
    wd.raise_pending_signal()  # ...and later code inherits no signal

def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    ck = wd.Checkpoints(str(tmp_path))
    tree = {"w": jnp.ones((512, 512))}  # 1 MiB of float32
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(wd.shutil, "disk_usage",
                        lambda p: usage._replace(free=(1 << 20) + (1 << 19)))
    with pytest.raises(OSError, match=r"No space left on device \(2.0 MiB needed, 1.5 MiB "
                                      r"free\)") as info:
        ck.save(1, tree, {})
    assert info.value.errno == errno.ENOSPC and os.listdir(ck.directory) == []


def test_stderr_of_a_failed_block_is_dropped_and_of_a_good_one_kept(capfd):
    with pytest.raises(ValueError):
        with wd._stderr_unless_failed():
            os.write(2, b"Traceback from a dying writer thread\n")
            raise ValueError("disk full")
    with wd._stderr_unless_failed():
        os.write(2, b"a warning worth seeing\n")
    err = capfd.readouterr().err
    assert "dying writer" not in err and "a warning worth seeing" in err


def test_a_run_interrupted_before_its_first_round_inside_a_kept_folder(tmp_path):
    # A script's next run, interrupted while it was being set up: its own folder goes,
    # the script's folder with the finished runs stays, and --resume continues.
    out = tmp_path / "out"
    with pytest.raises(Interrupted) as info:
        with wd.claim(str(out)):
            (out / "runs" / "a" / "checkpoints" / "2").mkdir(parents=True)
            with wd.claim(str(out / "runs" / "b")):
                raise KeyboardInterrupt
    assert str(info.value) == (f"interrupted before {out / 'runs' / 'b'} saved a round; "
                               f"continue with --resume")
    assert sorted(os.listdir(out / "runs")) == ["a"]
