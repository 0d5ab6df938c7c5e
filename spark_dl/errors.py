"""Typed errors. Each says what went wrong, where, and what to do next."""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Sequence


class SparkDLError(Exception):
    """Base class of every error spark-dl raises."""


class LaunchRefused(SparkDLError, ValueError):
    """A run was refused before anything was launched (bad arguments or cluster state)."""


class NoGPUs(LaunchRefused, RuntimeError):
    """``use_gpu=True`` where there are no GPUs to give the processes: a ``RuntimeError`` too,
    raised when the ``TorchDistributor`` is made, as PySpark's is."""


def env_choice(name: str, choices: tuple[str, ...], meanings: str) -> str:
    """Environment variable ``name``, one of ``choices`` in any case (unset or empty: the first),
    or a refusal that lists them and says what each means."""
    value = (os.environ.get(name) or choices[0]).strip().lower()
    if value not in choices:
        raise LaunchRefused(f"{name}={os.environ.get(name)!r} is not one of {choices}: {meanings}")
    return value


def as_int(value: Any) -> int | None:
    """``value`` as a Python int when it is a whole number, numpy's included (``len(df) // 2`` and
    ``np.int64`` counts are common); ``None`` for anything else, bools too."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def in_range(value: Any, *, low: float | None = None, high: float | None = None, low_open: bool = False,
             high_open: bool = False, integer: bool = False) -> bool:
    """Whether ``value`` is a number (an integer when ``integer``; numpy's included, bools not),
    finite, and within the bounds (each closed unless ``low_open``/``high_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        return False
    # an int is finite (math.isfinite would overflow on a huge one)
    if not isinstance(value, numbers.Integral) and not math.isfinite(value):
        return False
    return (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high))


def env_number(name: str, default: float, *, minimum: float = 0.0, integer: bool = False, unit: str = "") -> float:
    """Environment variable ``name`` as a finite number ``>= minimum`` (unset or empty: ``default``), or a
    refusal that names the variable, its value and what it must be."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if not in_range(value, low=minimum):  # None (not a number), NaN and inf too
        kind = "an integer" if integer else "a number"
        raise LaunchRefused(f"{name}={os.environ.get(name)!r} is not {kind} >= {_plain(minimum)}{unit}: set it "
                            f"to one or unset it for the default, {_plain(default)}{unit}")
    return value


def _plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


class JobFailed(SparkDLError, RuntimeError):
    """A run failed outside user code: lost executor, failed Spark stage, time-out, bad channel.

    A ``RuntimeError``, as PySpark's ``TorchDistributor`` raises, so code catching that keeps working.

    ``previous_failures`` holds the errors of the attempts before this one when the run was
    restarted (``HorovodRunner(max_restarts=...)``), oldest first.
    """

    previous_failures: tuple["JobFailed", ...] = ()
    # rank -> every thread's stack, as faulthandler prints them, where the driver asked the ranks
    # before stopping them (a stall, a run_timeout); empty otherwise
    stacks: dict[int, str] = {}


class RankFailed(JobFailed):
    """A rank process failed: it raised in ``main``, exited non-zero, or was killed.

    Carries the failing rank, its host, the remote traceback and the rank's last output lines,
    so the error is useful without digging through executor logs.
    """

    def __init__(
        self,
        rank: int,
        host: str,
        summary: str,
        remote_traceback: str = "",
        last_lines: Sequence[str] = (),
        exit_code: int | None = None,
        exc_type: str | None = None,
        hint: str = "",
    ) -> None:
        self.rank = rank
        self.host = host
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.last_lines = list(last_lines)
        self.exit_code = exit_code
        self.exc_type = exc_type
        self.hint = hint  # what the driver saw that explains the summary, and the fix
        super().__init__(self._format())

    def _format(self) -> str:
        parts = [f"rank {self.rank} on {self.host} failed: {self.summary}"]
        if self.hint:
            parts.append(self.hint)
        if self.remote_traceback:
            parts.append("Remote traceback (rank %d):\n%s" % (self.rank, self.remote_traceback.rstrip()))
        if self.last_lines:
            n = len(self.last_lines)
            what = "output line" if n == 1 else f"{n} output lines"
            parts.append(f"Last {what} of rank {self.rank}:\n" + "\n".join(self.last_lines))
        return "\n\n".join(parts)

    def __reduce__(self):
        return (
            type(self),
            (self.rank, self.host, self.summary, self.remote_traceback, self.last_lines,
             self.exit_code, self.exc_type, self.hint),
        )


class RankStalled(JobFailed):
    """Ranks waited in a collective for longer than ``stall_timeout`` for ranks that never joined it.

    ``waiting``: the ranks inside the collective; ``stalled``: the ranks they waited for (empty when
    every rank waited, in different collectives); ``stacks``: every rank's threads' stacks.
    """

    def __init__(self, summary: str, waiting: Sequence[int] = (), stalled: Sequence[int] = (),
                 stacks: dict[int, str] | None = None, shown: str = "") -> None:
        self.summary = summary
        self.waiting = tuple(waiting)
        self.stalled = tuple(stalled)
        self.stacks = dict(stacks or {})
        self.shown = shown  # the stacks as the message shows them
        super().__init__(f"{summary}\n\n{shown}" if shown else summary)

    def __reduce__(self):
        return (type(self), (self.summary, self.waiting, self.stalled, self.stacks, self.shown))


class ResultNotPicklable(TypeError):
    """A rank's ``main`` returned a value that cannot be pickled to the driver (raised in the rank,
    the cause of its ``RankFailed``)."""


class TrackingWarning(UserWarning):
    """MLflow tracking is degraded (server unreachable, data dropped); training is not affected."""
