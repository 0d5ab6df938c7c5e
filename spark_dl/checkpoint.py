"""Checkpoints kept by the driver, so a restarted run resumes where the failed one left off.

Rank 0 sends its state to the driver with :func:`save_checkpoint`; the driver keeps the latest one
in a file of its own, for the length of ``run()`` or, with ``HorovodRunner(checkpoint_dir=...)``,
for later runs too. After a failure, ``HorovodRunner(max_restarts=N)`` launches the job again and
every rank gets that state back from :func:`load_checkpoint`. The state travels over the job's
authenticated channel, so executors need no shared storage, and an executor that is lost with its
disk loses nothing.
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
import pickle
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

from . import rank as rank_api
from . import unpickle
from .channel import send_reply
from .errors import LaunchRefused


def save_checkpoint(state: Any, step: int | None = None) -> bool:
    """Make ``state`` this run's latest checkpoint; returns once the driver has stored it.

    Only rank 0's state is kept: on other ranks (and outside a rank process) this does nothing
    and returns False, so every rank may call it; in a process a rank started, it raises.
    ``state`` is anything cloudpickle can pickle,
    typically ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}``;
    ``step`` is shown in the driver's restart message. Metrics logged before the call reach the
    driver before the checkpoint, so a restart loses none of them. It passes through the driver's memory:
    for checkpoints of several GB, write them to shared storage and save their path here.
    """
    if step is not None:
        try:
            step = operator.index(step)  # ints, numpy ints; the driver stores it in a JSON header
        except TypeError:
            raise TypeError(f"save_checkpoint: step must be an int or None, got {step!r}") from None
    if not _in_rank_process("save_checkpoint") or rank_api.get_context().rank != 0:
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
    reply = rank_api.request("checkpoint/save", {"blob": pickle.PickleBuffer(blob), "step": step})
    if "error" in reply:
        raise RuntimeError(f"the driver could not store the checkpoint: {reply['error']}")
    return True


def load_checkpoint(map_location: Any = None) -> Any | None:
    """The latest state rank 0 saved with :func:`save_checkpoint` in this run, or None.

    Every rank gets the same state. On a run's first attempt nothing has been saved yet, so
    this returns None, unless ``checkpoint_dir`` holds an earlier run's (outside a rank process,
    always None; in a process a rank started, it raises).

    Tensors saved on a GPU come back on this rank's own GPU (not on the device rank 0 saved them
    from, which every rank would fill), or on the CPU where this rank has none; CPU tensors stay
    on the CPU. ``map_location`` overrides that as ``torch.load``'s does (``"cpu"``, a device, a
    ``{"cuda:0": "cuda:1"}`` dict or a ``(storage, location)`` function) for every tensor.
    """
    unpickle.check_map_location(map_location, "load_checkpoint")
    if not _in_rank_process("load_checkpoint"):
        return None
    reply = rank_api.request("checkpoint/load", {})
    if "error" in reply:
        raise RuntimeError(f"the driver could not read the checkpoint: {reply['error']}")
    if reply["blob"] is None:
        return None
    return unpickle.loads(reply["blob"], unpickle.rank_device if map_location is None else map_location)


def _in_rank_process(name: str) -> bool:
    """Whether this is a rank process; outside one the checkpoint functions do nothing. A process
    a rank started (it inherits the rank's environment, not its link to the driver) raises: there,
    doing nothing would lose the checkpoint without a word."""
    if rank_api.in_rank_process():
        return True
    if os.environ.get("SPARK_DL_JOB_ID"):
        raise RuntimeError(
            f"{name} was called in a process started by a spark-dl rank (pid {os.getpid()}: a subprocess, or a "
            "DataLoader worker of the 'spawn' start method), which has no link to the driver: call it in the rank's "
            "own process (run a training script with HorovodRunner.run_script, not a subprocess)"
        )
    return False


@dataclass(frozen=True)
class CheckpointInfo:
    """What the driver knows of the checkpoint it holds."""

    step: int | None
    attempt: int
    nbytes: int
    saved_at: float  # time.time()
    job_id: str = ""


_MAGIC = b"SPARKDL-CKPT-1\n"
_HEADER = struct.Struct(">Q")
FILE_NAME = "latest.ckpt"
LOCK_NAME = ".lock"


class CheckpointStore:
    """The driver's side: the latest checkpoint of one ``run()``, across its attempts.

    Without a directory it lives in a private temporary one, removed by :meth:`close`. With
    ``directory`` (``HorovodRunner(checkpoint_dir=...)``) it is the file ``latest.ckpt`` there,
    kept after the run, and a checkpoint already in it is what the first attempt resumes from; the
    run holds the directory (a lock on ``.lock`` there) until :meth:`close`, so a second run cannot
    overwrite its checkpoints. Either way it is replaced atomically: a failed write leaves the
    previous one in place.
    File: magic line | u64 header length | JSON header (step, attempt, saved_at, nbytes, job_id) | blob.
    """

    def __init__(self, directory: str | os.PathLike | None = None, job_id: str = "") -> None:
        self._lock = threading.Lock()
        self._keep = directory is not None
        self._dir: str | None = (os.path.abspath(os.path.expanduser(os.fspath(directory)))
                                 if directory is not None else None)
        self.job_id = job_id
        self.info: CheckpointInfo | None = None
        self.attempt = 0
        self._lock_file: BinaryIO | None = None
        # the bytes the ranks of a restart are being sent: one copy, however many load at once
        self._share_lock = threading.Lock()  # taken before _lock, never inside it
        self._shared: bytes | None = None
        self._senders = 0
        if self._dir is not None:
            self._open_directory()

    def _open_directory(self) -> None:
        assert self._dir is not None
        where = f"checkpoint_dir={self._dir!r}"
        try:
            os.makedirs(self._dir, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self._dir, prefix=".spark-dl-probe-")
            os.close(fd)
            os.unlink(probe)
            lock = open(os.path.join(self._dir, LOCK_NAME), "a+b")  # a file object: closed if the store is dropped
        except OSError as e:
            raise LaunchRefused(
                f"{where} cannot hold checkpoints: {type(e).__name__}: {e}. Pass a directory the driver "
                "can write (it is created if missing)."
            ) from e
        self._hold(lock, where)
        path = self._path()
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    self.info, _ = _read_header(f)
            except (OSError, ValueError) as e:
                self.close()
                raise LaunchRefused(
                    f"{path} is not a spark-dl checkpoint ({e}). Delete it to start over, or pass another checkpoint_dir."
                ) from e

    def _hold(self, lock: BinaryIO, where: str) -> None:
        """Lock the directory (through its open ``lock`` file) for this run: two runs writing one
        checkpoint (a job retried while its first driver still runs) would each overwrite the other's.
        The OS drops the lock when the driver dies, so a run after a killed driver resumes at once."""
        try:
            import fcntl
        except ImportError:  # not POSIX: unguarded
            lock.close()
            return
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read(1024).decode(errors="replace").strip() or "another run"
            lock.close()
            raise LaunchRefused(
                f"{where} is in use by {holder}: two runs writing one checkpoint overwrite each other's. Wait for "
                "that run to end (or stop it), or pass another checkpoint_dir."
            ) from None
        except OSError:  # a file system without locks (some FUSE mounts): unguarded
            lock.close()
            return
        lock.truncate(0)
        lock.write(f"run {self.job_id} (pid {os.getpid()} on {socket.gethostname()})".encode())
        lock.flush()
        self._lock_file = lock

    def _path(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="spark-dl-checkpoint-")
        return os.path.join(self._dir, FILE_NAME)

    def save(self, blob: bytes | memoryview, step: int | None) -> None:
        with self._lock:
            path = self._path()
            info = CheckpointInfo(step, self.attempt, len(blob), time.time(), self.job_id)
            header = json.dumps(dataclasses.asdict(info)).encode()
            tmp = path + ".tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(_MAGIC + _HEADER.pack(len(header)) + header)
                    f.write(blob)
                    if self._keep:  # a driver that dies next must find the whole file
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:  # a full disk: the part written would hold its space until the next save
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise OSError(f"writing {path} failed ({e.strerror or e}); the previous checkpoint is kept. Free "
                              "space on that disk, or pass a checkpoint_dir on a disk with room for the state") from e
            self.info = info
        with self._share_lock:  # the senders still going keep the bytes they hold
            self._shared = None

    def load(self) -> bytes | None:
        with self._lock:
            if self.info is None:
                return None
            with open(self._path(), "rb") as f:
                info, _ = _read_header(f)
                blob = f.read()
            if len(blob) != info.nbytes:
                raise ValueError(f"{self._path()} is truncated: {len(blob)} of {info.nbytes} bytes")
            return blob

    def handle(self, conn, rank: int | None, kind: str, data: dict) -> bool:
        """Serve a rank's ``checkpoint/*`` request (on its channel thread) and reply; whether it
        was served."""
        reply: dict[str, Any] = {"id": data.get("id")}
        try:
            if kind == "checkpoint/save":
                if rank != 0:
                    raise ValueError(f"rank {rank} sent a checkpoint; only rank 0's are kept")
                self.save(data["blob"], data.get("step"))
            elif kind == "checkpoint/load":
                blob = self.start_sending()
                reply["blob"] = None if blob is None else pickle.PickleBuffer(blob)  # sent out of band
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as e:  # noqa: BLE001 - the rank raises it, with this text
            reply["error"] = f"{type(e).__name__}: {e}"
        try:
            send_reply(conn, reply)
        finally:
            if "blob" in reply:
                self.done_sending()
        return "error" not in reply

    def start_sending(self) -> bytes | None:
        """:meth:`load` for a rank's request: ranks loading at the same time (every rank of a
        restart) are sent one shared copy, not one each; call :meth:`done_sending` after."""
        with self._share_lock:
            if self._shared is None:
                self._shared = self.load()
            self._senders += 1
            return self._shared

    def done_sending(self) -> None:
        with self._share_lock:
            self._senders -= 1
            if not self._senders:
                self._shared = None

    def describe(self) -> str:
        """For the driver's messages: which checkpoint the next attempt will find."""
        i = self.info
        if i is None:
            return "no checkpoint was saved, so it starts over"
        if i.step is not None:
            at = f"at step {i.step}"
        elif i.job_id and i.job_id != self.job_id:
            at = f"by run {i.job_id}"
        else:
            at = f"in attempt {i.attempt + 1}"
        return f"load_checkpoint() returns the one saved {at} ({_size(i.nbytes)}, {time.time() - i.saved_at:.0f} s ago)"

    def from_earlier_run(self) -> bool:
        """Whether the checkpoint held now was saved by an earlier ``run()`` (in ``checkpoint_dir``)."""
        return self.info is not None and self.info.job_id != self.job_id

    def close(self) -> None:
        """End of ``run()``: a temporary checkpoint is deleted, one in ``checkpoint_dir`` kept."""
        with self._lock:
            if not self._keep and self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
                self.info = None
            if self._lock_file is not None:  # releases the directory to the next run
                self._lock_file.close()
                self._lock_file = None


def _read_header(f) -> tuple[CheckpointInfo, int]:
    magic = f.read(len(_MAGIC))
    if magic != _MAGIC:
        raise ValueError("no spark-dl checkpoint header")
    raw = f.read(_HEADER.size)
    if len(raw) != _HEADER.size:
        raise ValueError("truncated header")
    (n,) = _HEADER.unpack(raw)
    if n > 1 << 20:
        raise ValueError("corrupt header length")
    try:
        fields = json.loads(f.read(n))
        info = CheckpointInfo(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"corrupt header: {e}") from e
    return info, len(_MAGIC) + _HEADER.size + n


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
