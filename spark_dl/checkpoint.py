"""Checkpoints kept by the driver, so a restarted run resumes where the failed one left off.

Rank 0 sends its state to the driver with :func:`save_checkpoint`; the driver keeps the latest one
in a file of its own for the length of ``run()``. After a failure, ``HorovodRunner(max_restarts=N)``
launches the job again and every rank gets that state back from :func:`load_checkpoint`. The state
travels over the job's authenticated channel, so executors need no shared storage, and an executor
that is lost with its disk loses nothing.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import rank as rank_api


def save_checkpoint(state: Any, step: int | None = None) -> bool:
    """Make ``state`` this run's latest checkpoint; returns once the driver has stored it.

    Only rank 0's state is kept: on other ranks (and outside a rank process) this does nothing
    and returns False, so every rank may call it. ``state`` is anything cloudpickle can pickle,
    typically ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}``;
    ``step`` is shown in the driver's restart message. Metrics logged before the call reach the
    driver before the checkpoint, so a restart loses none of them. It passes through the driver's memory:
    for checkpoints of several GB, write them to shared storage and save their path here.
    """
    if not rank_api.in_rank_process() or rank_api.get_context().rank != 0:
        return False
    import cloudpickle

    try:
        blob = cloudpickle.dumps(state)
    except Exception as e:  # noqa: BLE001 - any pickling failure gets the same advice
        raise TypeError(
            f"save_checkpoint: the state ({type(state).__name__}) cannot be pickled: {type(e).__name__}: {e}. "
            "Save plain data: state_dicts, tensors, numbers (not the model's process group, a DataLoader or a lock)."
        ) from e
    from .tracking.rank import flush_metrics

    flush_metrics()  # the metrics logged so far reach the driver before the checkpoint does
    reply = rank_api.request("checkpoint/save", {"blob": blob, "step": step})
    if "error" in reply:
        raise RuntimeError(f"the driver could not store the checkpoint: {reply['error']}")
    return True


def load_checkpoint() -> Any | None:
    """The latest state rank 0 saved with :func:`save_checkpoint` in this run, or None.

    Every rank gets the same state. On a run's first attempt nothing has been saved yet, so
    this returns None (and outside a rank process, always None).
    """
    if not rank_api.in_rank_process():
        return None
    reply = rank_api.request("checkpoint/load", {})
    if "error" in reply:
        raise RuntimeError(f"the driver could not read the checkpoint: {reply['error']}")
    if reply["blob"] is None:
        return None
    import cloudpickle

    return cloudpickle.loads(reply["blob"])


@dataclass(frozen=True)
class CheckpointInfo:
    """What the driver knows of the checkpoint it holds."""

    step: int | None
    attempt: int
    nbytes: int
    saved_at: float  # time.time()


class CheckpointStore:
    """The driver's side: the latest checkpoint of one ``run()``, across its attempts.

    Kept in a private temporary directory, replaced atomically, removed by :meth:`close`.
    """

    def __init__(self) -> None:
        self._dir: str | None = None
        self._lock = threading.Lock()
        self.info: CheckpointInfo | None = None
        self.attempt = 0

    def _path(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="spark-dl-checkpoint-")
        return os.path.join(self._dir, "latest")

    def save(self, blob: bytes, step: int | None) -> None:
        with self._lock:
            path = self._path()
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # a failed write leaves the previous checkpoint in place
            self.info = CheckpointInfo(step, self.attempt, len(blob), time.time())

    def load(self) -> bytes | None:
        with self._lock:
            if self.info is None:
                return None
            with open(self._path(), "rb") as f:
                return f.read()

    def handle(self, conn, rank: int | None, kind: str, data: dict) -> None:
        """Serve a rank's ``checkpoint/*`` request (on its channel thread) and reply."""
        reply: dict[str, Any] = {"id": data.get("id")}
        try:
            if kind == "checkpoint/save":
                if rank != 0:
                    raise ValueError(f"rank {rank} sent a checkpoint; only rank 0's are kept")
                self.save(data["blob"], data.get("step"))
            elif kind == "checkpoint/load":
                reply["blob"] = self.load()
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as e:  # noqa: BLE001 - the rank raises it, with this text
            reply["error"] = f"{type(e).__name__}: {e}"
        try:
            conn.send("reply", reply)
        except OSError:
            pass  # the rank is gone; its failure is reported on its own

    def describe(self) -> str:
        """For the restart message: which checkpoint the next attempt will find."""
        i = self.info
        if i is None:
            return "no checkpoint was saved, so it starts over"
        at = f"at step {i.step}" if i.step is not None else f"in attempt {i.attempt + 1}"
        return f"load_checkpoint() returns the one saved {at} ({_size(i.nbytes)}, {time.time() - i.saved_at:.0f} s ago)"

    def close(self) -> None:
        with self._lock:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
            self.info = None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
