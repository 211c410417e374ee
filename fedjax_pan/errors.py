"""The ways a run can end early, each with a one-line message and an exit status."""

from __future__ import annotations


class RunError(Exception):
    """A run that could not finish; `str(e)` is one line saying what happened and what is safe."""

    status = 1
    # Whether the run can continue from what it saved (`workdir.claim` then says how).
    resumable = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = " ".join(str(message).split())
        self.advice = ""  # how to go on, set by whoever knows (the outermost workdir claim)

    def __str__(self) -> str:
        return f"{self.message}; {self.advice}" if self.advice else self.message

    def add(self, text: str) -> None:
        """Appends what a caller knows (e.g. where replaced results were kept)."""
        self.message = f"{self.message}; {text}"


class ConfigError(RunError, ValueError):
    """Invalid input: a config value, a workdir request, missing or corrupt data."""

    status = 2


def require(cond: bool, message: str) -> None:
    """Raises ConfigError(message) unless `cond`: one line for a check on the input."""
    if not cond:
        raise ConfigError(message)


class TrainingDiverged(RunError):
    """The training loss became NaN, infinite, or exceeded `max_train_loss`."""

    status = 3


class WorkdirError(RunError):
    """The workdir could not be written or read back (read-only, full disk, corrupt checkpoint)."""

    status = 4


class Interrupted(RunError):
    """SIGINT or SIGTERM; the status is 128 + the signal number, as shells report it."""

    resumable = True

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.status = 128 + signum
