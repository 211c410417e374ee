"""Local multi-process runs: N processes of `fedjax_pan.run.main` on this machine.

  python -m fedjax_pan.run.launch --processes=2 --devices=2 -- --config=FILE --workdir=DIR
  python -m fedjax_pan.run.launch compare DIR_A DIR_B [--tolerance=1e-4] [--accuracy_tolerance=1e-3]

The first form starts N processes joined by JAX's runtime (process 0 coordinates on
localhost, at `--port` or a free port), each with `--devices` CPU devices
(JAX_NUM_CPU_DEVICES) where given, and waits for them: process 0's output is shown, the
others' is kept in a temporary folder. A process that fails stops the rest within seconds
(they watch each other; any still running 5 s later gets SIGTERM, then SIGKILL), and one
line says how each ended. Its exit status is the first failure's (128 + n for a process
killed by signal n), else 0. On a cluster, start one `python -m fedjax_pan ...
--distributed` per host instead (docs/guides/hosts.md).

The second form compares two runs' metrics.jsonl round by round (variants included) and
exits 1 where a number differs by more than the tolerance (relative, and absolute near 0);
accuracies, counts over examples, by more than `accuracy_tolerance` (absolute): float32
sums taken in another order can move an example across a decision boundary (one test
example of 10,000 is 1e-4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Metrics that measure the machine, not the training.
_UNCOMPARED = ("seconds",)
GRACE = 5.0  # seconds the other processes get to stop by themselves, then after SIGTERM


def free_port() -> int:
    """A TCP port nothing listens on now (for process 0's coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def commands(processes: int, main_args: Sequence[str], port: int) -> List[List[str]]:
    """The command line of each process."""
    return [[sys.executable, "-m", "fedjax_pan.run.main", *main_args,
             f"--coordinator=localhost:{port}", f"--num_processes={processes}",
             f"--process_id={i}"] for i in range(processes)]


def launch(processes: int, main_args: Sequence[str], devices: Optional[int] = None,
           port: Optional[int] = None, poll_seconds: float = 0.2, grace: float = GRACE) -> int:
    """Runs `main_args` in `processes` local processes (`supervise`); the first failure's
    exit status, else 0."""
    env = dict(os.environ)
    if devices is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
    return supervise(commands(processes, main_args, port or free_port()), env,
                     poll_seconds=poll_seconds, grace=grace)


def _status(code: int) -> int:
    """A process's exit status as a shell reports it (128 + n for signal n)."""
    return 128 - code if code < 0 else code


def _how(code: int, sent: Optional[int]) -> str:
    """How a process ended, given the signal this launcher sent it last, if any."""
    if code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name
    if sent == -code:
        return f"was stopped ({name})"
    return f"was killed by {name} (status {_status(code)})"


def supervise(cmds: Sequence[Sequence[str]], env: Optional[Dict[str, str]] = None,
              poll_seconds: float = 0.2, grace: float = GRACE) -> int:
    """Runs `cmds` side by side until all have ended (the first with this process's
    output, the others' into files of a temporary folder) and returns the first failure's
    status, 128 + n for a process killed by signal n (of failures seen in the same poll,
    a killed process's: the others follow from it), else 0; interrupted, 130 or 143.

    Once a process has failed (or this one is interrupted: Ctrl-C reaches them all), the
    others are given `grace` seconds to stop by themselves (a run's processes watch each
    other), then SIGTERM, then SIGKILL `grace` seconds later; one line then says how
    each ended.
    """
    logs = tempfile.mkdtemp(prefix="fedjax_pan-launch-")
    procs: List[subprocess.Popen] = []
    files = []
    for i, cmd in enumerate(cmds):
        out = None
        if i:
            out = open(os.path.join(logs, f"process{i}.log"), "w")
            files.append(out)
        procs.append(subprocess.Popen(list(cmd), env=env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None))
    first: Optional[int] = None  # the process whose failure ends the run
    interrupted: Optional[int] = None  # the signal that interrupted this process
    sent: Dict[int, int] = {}  # process: the signal sent to it last
    deadline = math.inf  # when the processes still running get the next signal
    previous = _on_sigterm()
    try:
        while True:
            try:
                codes = [p.poll() for p in procs]  # every process, every time
                now = time.monotonic()
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed and first is None and interrupted is None:
                    first = min(failed, key=lambda i: (codes[i] > 0, i))
                    deadline = now + grace
                if all(c is not None for c in codes):
                    break
                if now >= deadline:
                    signum = signal.SIGKILL if sent else signal.SIGTERM
                    for i, p in enumerate(procs):
                        if p.poll() is None:
                            p.send_signal(signum)
                            sent[i] = signum
                    deadline = now + grace
                time.sleep(poll_seconds)
            except KeyboardInterrupt as e:
                interrupted = interrupted or getattr(e, "signum", signal.SIGINT)
                if deadline == math.inf:
                    deadline = time.monotonic() + grace
    finally:
        _restore_sigterm(previous)
        for p in procs:  # this process failed: leave nothing running
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    if first is None and interrupted is None:
        shutil.rmtree(logs, ignore_errors=True)
        return 0
    codes = [p.returncode for p in procs]
    order = [first] + [i for i in range(len(procs)) if i != first] if first is not None \
        else list(range(len(procs)))
    what = "; ".join(f"process {i} {_how(codes[i], sent.get(i))}" for i in order)
    if interrupted is not None:
        what = f"interrupted ({signal.Signals(interrupted).name}); {what}"
    # Process 0 printed its error line where it exited with a status; else this is it.
    lead = "launch:" if codes[0] > 0 else "error:"
    where = f"; the other processes' output is in {logs}" if len(procs) > 1 else ""
    print(f"{lead} {what}{where}", file=sys.stderr)
    return _status(codes[first]) if first is not None else 128 + interrupted


class _Terminated(KeyboardInterrupt):
    signum = signal.SIGTERM


def _on_sigterm() -> Any:
    """SIGTERM to the launcher (a scheduler's time limit) unwinds like Ctrl-C."""
    def handler(signum: int, frame: Any) -> None:
        raise _Terminated()
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _rows(workdir: str) -> Dict[str, List[dict]]:
    """{run name: metrics rows}: the workdir's own run, or each variant's."""
    own = os.path.join(workdir, "metrics.jsonl")
    paths = {"run": own} if os.path.isfile(own) else {
        name: os.path.join(workdir, name, "metrics.jsonl") for name in sorted(os.listdir(workdir))
        if os.path.isfile(os.path.join(workdir, name, "metrics.jsonl"))}
    if not paths:
        raise ValueError(f"{workdir!r} holds no metrics.jsonl")
    out = {}
    for name, path in paths.items():
        with open(path) as f:
            out[name] = [json.loads(line) for line in f if line.strip()]
    return out


def compare(a: str, b: str, tolerance: float = 1e-4, accuracy_tolerance: float = 1e-3
            ) -> Tuple[float, List[str]]:
    """(the largest relative difference between runs `a` and `b`'s numbers other than
    accuracies, the differences beyond `tolerance` or, for accuracies, beyond
    `accuracy_tolerance` (absolute), each as a line)."""
    rows_a, rows_b = _rows(a), _rows(b)
    problems: List[str] = []
    if sorted(rows_a) != sorted(rows_b):
        return math.inf, [f"runs differ: {sorted(rows_a)} vs {sorted(rows_b)}"]
    worst = 0.0
    for name in rows_a:
        if len(rows_a[name]) != len(rows_b[name]):
            problems.append(f"{name}: {len(rows_a[name])} rows vs {len(rows_b[name])}")
            continue
        for ra, rb in zip(rows_a[name], rows_b[name]):
            for key in sorted(set(ra) | set(rb)):
                if key in _UNCOMPARED:
                    continue
                x, y = ra.get(key), rb.get(key)
                if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
                    if x != y:
                        problems.append(f"{name} round {ra.get('round')}: {key} {x!r} vs {y!r}")
                    continue
                if "accuracy" in key:
                    if abs(x - y) > accuracy_tolerance:
                        problems.append(f"{name} round {ra['round']}: {key} {x!r} vs {y!r}")
                    continue
                diff = abs(x - y) / max(abs(x), abs(y), 1e-3)
                worst = max(worst, diff)
                if diff > tolerance:
                    problems.append(f"{name} round {ra['round']}: {key} {x!r} vs {y!r}")
    return worst, problems


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        parser = argparse.ArgumentParser(
            prog="python -m fedjax_pan.run.launch compare",
            description="Compares two runs' metrics.jsonl round by round (variants "
                        "included); exits 1 where a number differs by more than the "
                        "tolerance, 2 where a run cannot be read.")
        parser.add_argument("a", metavar="DIR_A", help="one run's workdir")
        parser.add_argument("b", metavar="DIR_B", help="the other run's workdir")
        parser.add_argument("--tolerance", type=float, default=1e-4,
                            help="relative difference allowed (absolute near 0; default "
                                 "%(default)g)")
        parser.add_argument("--accuracy_tolerance", type=float, default=1e-3,
                            help="absolute difference allowed in accuracies (default "
                                 "%(default)g)")
        args = parser.parse_args(argv[1:])
        try:
            worst, problems = compare(args.a, args.b, args.tolerance, args.accuracy_tolerance)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for line in problems[:20]:
            print(line)
        print(f"largest relative difference {worst:.3g} (tolerance {args.tolerance:g}; "
              f"accuracies within {args.accuracy_tolerance:g} absolute): "
              f"{'equal' if not problems else 'different'}")
        return 1 if problems else 0
    main_args: List[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, main_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m fedjax_pan.run.launch",
                                     usage="%(prog)s --processes=N [--devices=D] [--port=P] "
                                           "-- MAIN_ARGS\n       %(prog)s compare DIR_A DIR_B "
                                           "[--tolerance=T] [--accuracy_tolerance=T]",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, required=True, help="processes to start")
    parser.add_argument("--devices", type=int, default=None,
                        help="CPU devices per process (JAX_NUM_CPU_DEVICES)")
    parser.add_argument("--port", type=int, default=None,
                        help="process 0's coordinator port (default: a free one)")
    args = parser.parse_args(argv)
    if args.processes < 1:
        print(f"error: --processes={args.processes} must be at least 1", file=sys.stderr)
        return 2
    if args.devices is not None and args.devices < 1:
        print(f"error: --devices={args.devices} must be at least 1", file=sys.stderr)
        return 2
    if not main_args:
        print("error: give fedjax_pan.run.main's arguments after --", file=sys.stderr)
        return 2
    if args.port is not None and not 0 < args.port < 65536:
        print(f"error: --port={args.port} is not a TCP port", file=sys.stderr)
        return 2
    if args.port is not None:
        from fedjax_pan.engine.distributed import port_in_use  # imports JAX: only here
        if port_in_use(args.port):
            print(f"error: --port={args.port} is in use on this host; pick a free port, or "
                  "leave --port out for one", file=sys.stderr)
            return 2
    return launch(args.processes, main_args, args.devices, args.port)


if __name__ == "__main__":
    sys.exit(main())
