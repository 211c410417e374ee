"""Workdirs that lose nothing: checks before any write, atomic files, verified checkpoints.

A run first `check`s its workdir without writing to it (refusals cost no data loading),
then `claim`s it: with `overwrite`, the old contents are moved aside and deleted only once
the new run has finished, or put back if it failed before completing a round. Files are
written whole or not at all (`write_atomic`); checkpoints carry a digest of their arrays
and the run's counters, so a corrupt one is reported instead of restored, and a resumed
run's summary covers all of its processes. Filesystem faults surface as one-line
`WorkdirError`s (`writing`). SIGINT/SIGTERM take effect at safe points between rounds,
clients and runs (`interrupts_at_safe_points`, `raise_pending_signal`), never while a
round's files are written (`deferred_interrupts`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import jax
import numpy as np

from fedjax_pan.errors import ConfigError, Interrupted, RunError, WorkdirError

CHECKPOINTS = "checkpoints"
_CHECKPOINT_OVERHEAD = 1 << 20  # bytes beyond the arrays: orbax metadata, OCDBT manifests
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")  # how tensorstore reports errno


# ----------------------------------------------------------------------------------------
# Faults.
# ----------------------------------------------------------------------------------------

def as_os_error(e: BaseException) -> Optional[OSError]:
    """`e` as an OSError when it is a filesystem fault (also tensorstore's ValueErrors)."""
    if isinstance(e, OSError):
        return e
    text = str(e)
    m = _OS_ERROR_CODE.search(text)
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    if "RESOURCE_EXHAUSTED" in text or "No space left" in text:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if "Read-only file system" in text:
        return OSError(errno.EROFS, os.strerror(errno.EROFS))
    return None


@contextlib.contextmanager
def writing(what: str, safe: Callable[[], str],
            only: Tuple[type, ...] = (Exception,)) -> Iterator[None]:
    """Turns a filesystem fault inside the block into a one-line WorkdirError.

    `what` names what was being written; `safe()` says what the workdir still holds;
    `only` narrows the faults converted (around work that is mostly not writing, where
    a library's "RESOURCE_EXHAUSTED" would be device memory, not disk).
    """
    try:
        yield
    except RunError:
        raise
    except only as e:  # noqa: BLE001 - only filesystem faults are converted
        err = as_os_error(e)
        if err is None:
            raise
        reason = err.strerror or str(err)
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        error = WorkdirError(f"cannot write {what}: {reason}{where}; {safe()}")
        error.resumable = True  # once the fault is fixed
        raise error from e


def write_atomic(path: str, text: str) -> None:
    """Writes `text` to `path` whole or not at all (a full disk leaves the old file intact)."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x") as f:  # unlike mkstemp, honours the umask
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Signalled(KeyboardInterrupt):
    """A signal as an exception; a KeyboardInterrupt so SIGINT and SIGTERM unwind alike."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_number(e: BaseException) -> int:
    return getattr(e, "signum", signal.SIGINT)


# SIGINT and SIGTERM are acted on at safe points. A handler that raised would raise
# wherever Python happens to be, also in a weakref callback or a __del__ run by the garbage
# collector, where the exception is printed and dropped ("Exception ignored in ...") and
# the run goes on as if no signal had come.
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
_pending: List[int] = []  # signals received and not raised yet; the first is raised
_depth = {"safe_points": 0, "deferred": 0}  # open `interrupts_at_safe_points` and
                                            # `deferred_interrupts` blocks


def _record(signum: int, frame: Any) -> None:
    """The handler: notes the signal for the next safe point. The same signal again while
    the first waits (a user who insists, a phase with no safe point) raises at once,
    except while files are written (`deferred_interrupts`)."""
    if signum in _pending and not _depth["deferred"]:
        _pending.clear()
        raise _Signalled(signum)
    _pending.append(signum)


def _keeping_signals(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """`sys.unraisablehook` that turns a signal raised where Python drops exceptions back
    into a pending one."""
    def unraisable(args: Any) -> None:
        if isinstance(args.exc_value, _Signalled):
            _pending.append(args.exc_value.signum)
        else:
            hook(args)
    return unraisable


def _install() -> Dict[int, Any]:
    """`_record` for SIGINT and SIGTERM, except where ignored (nohup, a background job);
    the handlers it replaced. ValueError outside the main thread."""
    return {s: signal.signal(s, _record) for s in _INTERRUPTS
            if signal.getsignal(s) is not signal.SIG_IGN}


def _restore(old: Dict[int, Any]) -> None:
    for s, h in old.items():
        with contextlib.suppress(TypeError):  # None: a handler installed outside Python
            signal.signal(s, h)


def raise_pending_signal() -> None:
    """A safe point: raises the first SIGINT/SIGTERM received since the last safe point
    (a KeyboardInterrupt, see `signal_number`), if any, unless files are being written
    (`deferred_interrupts`, which raises it when they are). Called between rounds,
    clients, batches, runs and phases; without `interrupts_at_safe_points` nothing is
    pending outside a `deferred_interrupts` block."""
    if _pending and not _depth["deferred"]:
        signum = _pending[0]
        _pending.clear()
        raise _Signalled(signum)


@contextlib.contextmanager
def interrupts_at_safe_points() -> Iterator[None]:
    """SIGINT and SIGTERM (a batch scheduler's time limit) inside the block raise at its
    next safe point (`raise_pending_signal`) or as it ends, never inside arbitrary code,
    so none is lost and the run in progress saves its round; a second signal of the same
    kind raises at once. The previous handlers afterwards."""
    try:
        old = _install()
    except ValueError:  # not the main thread: signals go to the main thread
        yield
        return
    hook, sys.unraisablehook = sys.unraisablehook, _keeping_signals(sys.unraisablehook)
    _depth["safe_points"] += 1
    finished = False
    try:
        yield
        finished = True
    finally:
        _depth["safe_points"] -= 1
        sys.unraisablehook = hook
        _restore(old)
        if not finished and not _depth["safe_points"]:
            _pending.clear()  # the exception on its way out is the one reported
    raise_pending_signal()  # one that came after the last safe point


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """SIGINT/SIGTERM inside the block take effect when it ends, so its writes complete."""
    try:
        old = _install()
    except ValueError:  # not the main thread: nothing to defer
        yield
        return
    _depth["deferred"] += 1
    finished = False
    try:
        yield
        finished = True
    finally:
        _depth["deferred"] -= 1
        _restore(old)
        if not finished and not _depth["safe_points"]:
            _pending.clear()
    raise_pending_signal()  # (an enclosing block's end, if there is one)


def interrupted(e: BaseException, message: str) -> Interrupted:
    return Interrupted(message, signal_number(e))


# ----------------------------------------------------------------------------------------
# Checking and claiming a workdir.
# ----------------------------------------------------------------------------------------

def rounds_text(last: int) -> str:
    """'round 1' or 'rounds 1-N'."""
    return "round 1" if last == 1 else f"rounds 1-{last}"


def saved_rounds(workdir: str) -> List[int]:
    """Rounds with a finished checkpoint in `workdir` (orbax names them by step)."""
    directory = os.path.join(workdir, CHECKPOINTS)
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def read_config(workdir: str) -> Dict[str, Any]:
    path = os.path.join(workdir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path} to resume ({e}); start again with --overwrite "
                          "or another --workdir") from None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check(workdir: str, *, resume: bool, overwrite: bool) -> None:
    """Everything about the workdir request that can fail, checked without writing to it."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    # A file where the workdir or one of its parents should be is a filesystem fault
    # like any other that stops the run from writing (--workdir=notes.txt/run, say).
    blocker = _nearest_existing(workdir)
    if not os.path.isdir(blocker):
        raise WorkdirError(f"cannot write workdir {workdir!r}: {blocker} exists and is not a "
                           "directory; nothing was written")
    exists = os.path.isdir(workdir) and bool(os.listdir(workdir))
    if resume and not os.path.isfile(os.path.join(workdir, "config.json")):
        raise ConfigError(f"nothing to resume in {workdir!r} (no config.json)")
    if exists and not (resume or overwrite):
        raise ConfigError(f"workdir {workdir!r} is not empty; pass --resume to continue "
                          "or --overwrite to replace it")
    # Probe the place the run will write (or create) with a file that is removed at once.
    probe_dir = _nearest_existing(os.path.dirname(os.path.abspath(workdir)) if overwrite and
                                  exists else workdir)
    try:
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".fedjax_pan-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise WorkdirError(f"cannot write workdir {workdir!r}: {e.strerror or e} (in "
                           f"{probe_dir}); nothing was written") from None


def made_progress(workdir: str) -> bool:
    """`workdir` (or a run inside it) holds a finished checkpoint."""
    pattern = os.path.join(glob.escape(workdir), "**", CHECKPOINTS, "[0-9]*")
    return any(os.path.isdir(p) for p in glob.glob(pattern, recursive=True))


@contextlib.contextmanager
def claim(workdir: str, *, overwrite: bool = False, resume: bool = False) -> Iterator[None]:
    """Creates `workdir` for a run; a run that fails before saving a round leaves no trace.

    With `overwrite`, the old contents are moved aside and deleted only if the run succeeds;
    a failure before any round was saved puts them back, a later one keeps them aside (the
    error says where). A fresh run that fails before saving a round removes what it wrote,
    so the same command can simply be run again.
    """
    aside = None
    existed = os.path.isdir(workdir)
    with writing(f"workdir {workdir!r}", lambda: "nothing was changed"):
        if overwrite and existed and os.listdir(workdir):
            parent, name = os.path.split(os.path.abspath(workdir))
            aside = tempfile.mkdtemp(dir=parent, prefix=f".{name}.replaced-")
            os.rmdir(aside)
            os.rename(workdir, aside)
            existed = False
        os.makedirs(workdir, exist_ok=True)
    try:
        yield
    except BaseException as e:
        kept = resume or made_progress(workdir)
        if isinstance(e, KeyboardInterrupt):  # a signal outside a round: say what is kept
            e = Interrupted(f"interrupted; {workdir} keeps the rounds saved so far" if kept
                            else f"interrupted before {workdir} saved a round",
                            signal_number(e))
        if kept:
            if aside is not None:
                _note(e, f"the results it was replacing are kept in {aside}")
        else:  # nothing of this run is worth keeping: leave the workdir as it was
            if existed:
                for entry in os.listdir(workdir):
                    path = os.path.join(workdir, entry)
                    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
            if aside is not None:
                os.rename(aside, workdir)
                _note(e, f"{workdir} holds its earlier results, unchanged")
        # Only here is it known whether the same command can simply run again, or must
        # continue what this one kept (another run's rounds may be kept beside it); an
        # enclosing claim (a script's folder around one of its runs) knows best.
        if isinstance(e, RunError) and e.resumable:
            e.advice = "continue with --resume" if kept else "run the command again"
        if e is not sys.exc_info()[1]:
            raise e from None
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _note(e: BaseException, text: str) -> None:
    if isinstance(e, RunError):
        e.add(text)
    elif hasattr(e, "add_note"):
        e.add_note(text)


# ----------------------------------------------------------------------------------------
# Checkpoints.
# ----------------------------------------------------------------------------------------

def digest(leaves: List[Any]) -> str:
    """sha256 over each array's dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for x in leaves:
        a = np.asarray(x)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def quiet_absl(level: int = logging.CRITICAL) -> Iterator[None]:
    """absl's log records below `level` dropped inside the block (a library's warnings
    the caller reports in its own words, or that are not the caller's to act on)."""
    logger = logging.getLogger("absl")
    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)


@contextlib.contextmanager
def _stderr_unless_failed() -> Iterator[None]:
    # tensorstore threads print tracebacks straight to file descriptor 2 when their writes
    # fail; the caller reports the failure in one line, so their output is kept only when
    # the block succeeds.
    try:
        saved = os.dup(2)
        buffer = tempfile.TemporaryFile()
    except OSError:
        yield
        return
    sys.stderr.flush()
    os.dup2(buffer.fileno(), 2)
    ok = False
    try:
        yield
        ok = True
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if ok:
            buffer.seek(0)
            text = buffer.read()
            if text:
                sys.stderr.write(text.decode(errors="replace"))
        buffer.close()


class Checkpoints:
    """Orbax checkpoints of a pytree, each with its digest and the run's counters."""

    def __init__(self, workdir: str, max_to_keep: int = 2):
        import orbax.checkpoint as ocp  # slow import, needed only when running
        self.ocp = ocp
        self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINTS))
        alone = {}
        if jax.process_count() > 1:
            # This process alone reads and writes them (process 0 of a multi-process run:
            # the others never wait on its files).
            os.makedirs(self.directory, exist_ok=True)
            me = jax.process_index()
            alone = {"create": False, "multiprocessing_options":
                     ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})}
        options = ocp.CheckpointManagerOptions(
            **{"max_to_keep": max_to_keep, "create": True, "enable_async_checkpointing": False,
               "cleanup_tmp_directories": True, **alone})
        # orbax logs each failed write with a traceback before raising it once; callers
        # report that one error in one line (here and in save / restore).
        with quiet_absl():
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, tree: Any, counters: Dict[str, Any],
             metrics: Optional[List[Dict[str, Any]]] = None) -> None:
        """Saves `tree` as round `step`, with the run's counters and its metrics rows up to
        `step` (the record `metrics.jsonl` is rebuilt from on resume, so a line a crash
        cut short loses nothing); a full disk raises OSError(ENOSPC) (no partial save).

        The free space is checked first: tensorstore's pending writes report a full disk
        from background threads after the error, printing tracebacks no caller can catch.
        """
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
        needed = sum(x.nbytes for x in leaves) + _CHECKPOINT_OVERHEAD
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({needed / 2**20:.1f} "
                          f"MiB needed, {free / 2**20:.1f} MiB free)")
        meta = {"round": step, "digest": digest(leaves), "counters": counters}
        if metrics is not None:
            meta["metrics"] = list(metrics)
        args = self.ocp.args.Composite(
            state=self.ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(leaves)}),
            meta=self.ocp.args.JsonSave(meta))
        try:
            with quiet_absl(), _stderr_unless_failed():
                self.manager.save(step, args=args, force=True)
                self.manager.wait_until_finished()
        except BaseException:
            self._drop_partial()
            raise

    def _drop_partial(self) -> None:
        # A failed save leaves a temporary directory; free its space now.
        for p in glob.glob(os.path.join(glob.escape(self.directory), "*orbax-checkpoint-tmp*")):
            shutil.rmtree(p, ignore_errors=True)

    def restore(self, step: int, template: Any, saved_shapes: bool = False
                ) -> Tuple[Any, Dict[str, Any], Optional[List[Dict[str, Any]]]]:
        """The tree saved at `step` (structured like `template`, and shaped like it unless
        `saved_shapes`: then each leaf keeps its saved shape), its counters and its metrics
        rows (None: a checkpoint written before checkpoints held them).

        Raises WorkdirError when the checkpoint cannot be read or its digest differs.
        """
        leaves, treedef = jax.tree_util.tree_flatten(template)
        target = {f"{i:05d}": x for i, x in enumerate(leaves)}
        path = os.path.join(self.directory, str(step))
        earlier = [s for s in self.manager.all_steps() if s < step]
        advice = (f"delete {path} to resume from round {max(earlier)}" if earlier else
                  "start again with --overwrite")
        try:
            with quiet_absl():
                restored = self.manager.restore(step, args=self.ocp.args.Composite(
                    state=self.ocp.args.StandardRestore(None if saved_shapes else target),
                    meta=self.ocp.args.JsonRestore()))
            meta = restored["meta"]
            values = [np.asarray(restored["state"][k]) for k in sorted(target)]
        except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
            detail = " ".join(str(e).split())[:200]
            raise WorkdirError(f"checkpoint {path} cannot be read ({type(e).__name__}: "
                               f"{detail}); {advice}") from None
        if meta.get("digest") != digest(values):
            raise WorkdirError(f"checkpoint {path} is corrupt (its arrays do not match the "
                               f"digest saved with them); {advice}")
        rows = meta.get("metrics")
        return (jax.tree_util.tree_unflatten(treedef, values), dict(meta.get("counters", {})),
                None if rows is None else [dict(r) for r in rows])

    def close(self) -> None:
        self.manager.close()
