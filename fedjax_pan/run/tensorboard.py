"""TensorBoard event files beside a workdir's metrics.jsonl, holding the same rows.

One scalar per numeric field of a row, tagged with the field's name, at the row's round
(`STEP_KEY`): ints and floats (NaN and infinities included, as TensorBoard shows them),
bools as 0 or 1; strings, None, lists and dicts are skipped. TensorBoard stores a scalar as
a 32-bit float, so metrics.jsonl remains the exact record.

A `Writer` starts a new event file and writes into it first the rows it is given (those a
resumed run keeps, rounds after its checkpoint dropped). The file opens with a
SessionLog.START at step 0, which makes TensorBoard drop every step it read from the
earlier files (tensorboardX's `purge_step=0`), and the rows' repeated steps make
TensorBoard's fast loader drop them too; so no round shows twice and each shows its
current value, also in a TensorBoard that was already watching. Each row is flushed as it is
written (a running job shows in TensorBoard), and nothing runs in the background.
"""

from __future__ import annotations

import numbers
import os
import socket
import time
from typing import Any, Dict, Iterable, Mapping

import numpy as np

__all__ = ["STEP_KEY", "scalars", "Writer"]

STEP_KEY = "round"


def scalars(row: Mapping[str, Any]) -> Dict[str, float]:
    """{tag: value} of `row`'s numeric fields except `STEP_KEY` (bools as 0.0 / 1.0)."""
    out = {}
    for key, value in row.items():
        if key != STEP_KEY and isinstance(value, (numbers.Real, np.bool_)):  # bools too
            out[key] = float(value)
    return out


class Writer:
    """A new event file in `logdir` holding `rows`, extended by `write`.

    >>> w = Writer(workdir, rows)       # rows already in metrics.jsonl
    >>> w.write(3, {"round": 3, "test_accuracy": 0.8})
    >>> w.close()
    """

    def __init__(self, logdir: str, rows: Iterable[Mapping[str, Any]] = ()):
        # Imported here: only a run that writes a workdir needs it.
        from tensorboardX import RecordWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        # Earlier files stay (TensorBoard's legacy loader stops at a file deleted under
        # it). Events are written in this thread: tensorboardX's SummaryWriter queues them
        # for a thread of its own, and its flush does not wait for them. The name sorts by
        # time to the nanosecond, so TensorBoard reads a resumed run's file last.
        now = time.time_ns()
        name = f"events.out.tfevents.{now // 10**9}.{socket.gethostname()}.{now % 10**9:09d}"
        self._file = RecordWriter(os.path.join(logdir, name))
        try:
            self._put(Event(wall_time=now / 1e9, file_version="brain.Event:2"))
            self._put(Event(wall_time=now / 1e9, step=0,
                            session_log=SessionLog(status=SessionLog.START)))
            for row in rows:
                self._add(row[STEP_KEY], row)
            self._file.flush()
        except BaseException:
            self.close()
            raise

    def _put(self, event: Any) -> None:
        self._file.write(event.SerializeToString())

    def _add(self, step: int, row: Mapping[str, Any]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars(row).items()]
        if values:
            self._put(self._event(wall_time=time.time(), step=int(step),
                                  summary=self._summary(value=values)))

    def write(self, step: int, row: Mapping[str, Any]) -> None:
        """`row`'s scalars at `step`, on disk when this returns."""
        self._add(step, row)
        self._file.flush()

    def close(self) -> None:
        """Closes the file (again: nothing)."""
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

