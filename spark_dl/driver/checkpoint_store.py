"""Checkpoints kept by the driver: the latest one of a ``run()``, across its attempts and, with
``HorovodRunner(checkpoint_dir=...)``, across runs. Ranks send and read it with
:func:`spark_dl.save_checkpoint` / :func:`spark_dl.load_checkpoint`.
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

from spark_dl import protocol
from spark_dl.errors import LaunchRefused
from spark_dl.transport.channel import send_reply


@dataclass(frozen=True)
class CheckpointInfo:
    """What the driver knows of the checkpoint it holds."""

    step: int | None
    attempt: int
    nbytes: int
    saved_at: float  # time.time()
    job_id: str = ""
    shards: tuple[int, ...] | None = None  # a sharded checkpoint: each rank's bytes, in rank order


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
    File: magic line | u64 header length | JSON header (step, attempt, saved_at, nbytes, job_id,
    shards) | blob (a sharded checkpoint's: every rank's pickled shard, in rank order).

    Shards of a sharded save wait in files of their own next to it (``.shard-<k>-<rank>.tmp``, the
    k-th sharded save of each rank of the attempt) until the last one arrives.
    """

    def __init__(self, directory: str | os.PathLike | None = None, job_id: str = "") -> None:
        self._lock = threading.Lock()
        self._keep = directory is not None
        self._dir: str | None = (os.path.abspath(os.path.expanduser(os.fspath(directory)))
                                 if directory is not None else None)
        self.job_id = job_id
        self.info: CheckpointInfo | None = None
        self._attempt = 0
        self._lock_file: BinaryIO | None = None
        # sharded saves of this attempt not yet complete: k -> (ranks, {rank: (file, nbytes, step)})
        self._pending: dict[int, tuple[int, dict[int, tuple[str, int, int | None]]]] = {}
        self._saves: dict[int, int] = {}  # rank -> its sharded saves in this attempt
        # the bytes the ranks of a restart are being sent: one copy, however many load at once
        self._share_lock = threading.Lock()  # taken before _lock, never inside it
        self._shared: tuple[CheckpointInfo | None, bytes | None] | None = None
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
                    f"{path} is not a spark-dl checkpoint ({e}). "
                    "Delete it to start over, or pass another checkpoint_dir."
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

    @property
    def attempt(self) -> int:
        return self._attempt

    @attempt.setter
    def attempt(self, attempt: int) -> None:
        """A new attempt: its ranks count their sharded saves from 0; the last one's unfinished go."""
        with self._lock:
            self._attempt = attempt
            self._drop_pending(None)
            self._saves.clear()

    def _path(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="spark-dl-checkpoint-")
        return os.path.join(self._dir, FILE_NAME)

    def save(self, blob: bytes | memoryview, step: int | None, shards: tuple[int, ...] | None = None) -> None:
        """Store ``blob`` (``shards``: the sizes of the ranks' parts it is made of) as the latest."""
        with self._lock:
            self._write(step, shards, len(blob), lambda f: f.write(blob))
        with self._share_lock:  # the senders still going keep the bytes they hold
            self._shared = None

    def save_shard(self, rank: int, ranks: int, blob: bytes | memoryview, step: int | None) -> bool:
        """Keep ``rank``'s part of its next sharded save (of ``ranks`` ranks); whether it was the
        last part missing, so that this save became the latest checkpoint."""
        with self._lock:
            k = self._saves.get(rank, 0)
            want, parts = self._pending.setdefault(k, (ranks, {}))
            if ranks != want:
                raise ValueError(f"rank {rank} saved a shard of {ranks} ranks, but the others' of the same save "
                                 f"were of {want}")
            self._saves[rank] = k + 1
            part = os.path.join(os.path.dirname(self._path()), f".shard-{k}-{rank}.tmp")
            try:
                with open(part, "wb") as f:
                    f.write(blob)
            except OSError as e:
                raise _write_failed(part, e) from e
            parts[rank] = (part, len(blob), step)
            if len(parts) < want:
                return False
            ordered = [parts[r] for r in range(want)]

            def body(f) -> None:
                for name, _, _ in ordered:
                    with open(name, "rb") as src:
                        shutil.copyfileobj(src, f, 1 << 20)

            sizes = tuple(n for _, n, _ in ordered)
            self._write(ordered[0][2], sizes, sum(sizes), body)
            self._drop_pending(k)  # this save's parts, and any older save that never completed
        with self._share_lock:
            self._shared = None
        return True

    def _drop_pending(self, upto: int | None) -> None:
        for k in [k for k in self._pending if upto is None or k <= upto]:
            for name, _, _ in self._pending.pop(k)[1].values():
                try:
                    os.unlink(name)
                except OSError:
                    pass

    def _write(self, step: int | None, shards: tuple[int, ...] | None, nbytes: int, body) -> None:
        path = self._path()
        info = CheckpointInfo(step, self._attempt, nbytes, time.time(), self.job_id,
                              None if shards is None else tuple(shards))
        header = json.dumps(dataclasses.asdict(info)).encode()
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_MAGIC + _HEADER.pack(len(header)) + header)
                body(f)
                if self._keep:  # a driver that dies next must find the whole file
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:  # a full disk: the part written would hold its space until the next save
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _write_failed(path, e) from e
        self.info = info

    def load(self) -> bytes | None:
        return self._load()[1]

    def _load(self) -> tuple[CheckpointInfo | None, bytes | None]:
        with self._lock:
            if self.info is None:
                return None, None
            with open(self._path(), "rb") as f:
                info, _ = _read_header(f)
                blob = f.read()
            if len(blob) != info.nbytes:
                raise ValueError(f"{self._path()} is truncated: {len(blob)} of {info.nbytes} bytes")
            return info, blob

    def handle(self, conn, rank: int | None, kind: str, data: dict) -> bool:
        """Serve a rank's ``checkpoint/*`` request (on its channel thread) and reply. Returns whether
        a save made a checkpoint the latest (a sharded save: with its last shard) or a load was
        answered with one."""
        reply: dict[str, Any] = {"id": data.get("id")}
        done, sending = False, False
        try:
            if kind == protocol.CHECKPOINT_SAVE and data.get("sharded"):
                if rank is None:
                    raise ValueError("a sharded checkpoint came from no rank")
                done = self.save_shard(rank, data["world"], data["blob"], data.get("step"))
            elif kind == protocol.CHECKPOINT_SAVE:
                if rank != 0:
                    raise ValueError(f"rank {rank} sent a checkpoint; only rank 0's are kept")
                self.save(data["blob"], data.get("step"))
                done = True
            elif kind == protocol.CHECKPOINT_LOAD:
                info, blob = self.start_sending()
                sending = True
                reply.update(_select(info, blob, rank, data.get("shard"), data.get("world")))
                done = True
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as e:  # noqa: BLE001 - the rank raises it, with this text
            reply["error"] = f"{type(e).__name__}: {e}"
        try:
            send_reply(conn, reply)
        finally:
            if sending:
                self.done_sending()
        return done

    def start_sending(self) -> tuple[CheckpointInfo | None, bytes | None]:
        """:meth:`load` for a rank's request: ranks loading at the same time (every rank of a
        restart) are sent one shared copy, not one each; call :meth:`done_sending` after."""
        with self._share_lock:
            if self._shared is None:
                self._shared = self._load()
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
        shards = "" if i.shards is None else f", a shard for each of {len(i.shards)} ranks"
        return (f"load_checkpoint() returns the one saved {at} ({_size(i.nbytes)}{shards}, "
                f"{time.time() - i.saved_at:.0f} s ago)")

    def from_earlier_run(self) -> bool:
        """Whether the checkpoint held now was saved by an earlier ``run()`` (in ``checkpoint_dir``)."""
        return self.info is not None and self.info.job_id != self.job_id

    def close(self) -> None:
        """End of ``run()``: a temporary checkpoint is deleted, one in ``checkpoint_dir`` kept."""
        with self._lock:
            self._drop_pending(None)
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
        if fields.get("shards") is not None:
            fields["shards"] = tuple(operator.index(k) for k in fields["shards"])
            if sum(fields["shards"]) != fields["nbytes"]:
                raise ValueError("the shards' sizes do not add up to the checkpoint's")
        info = CheckpointInfo(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"corrupt header: {e}") from e
    return info, len(_MAGIC) + _HEADER.size + n


def _write_failed(path: str, e: OSError) -> OSError:
    return OSError(f"writing {path} failed ({e.strerror or e}); the previous checkpoint is kept. Free space on "
                   "that disk, or pass a checkpoint_dir on a disk with room for the state")


def _select(info: CheckpointInfo | None, blob: bytes | None, rank: int | None, shard: int | str | None,
            world: int | None) -> dict[str, Any]:
    """The reply to ``load_checkpoint(shard=...)`` on ``rank`` of ``world``: the blob (out of band:
    a view of the one shared copy, never a copy), the sizes with ``"all"``, or ``refused``."""
    if info is None or blob is None:
        return {"blob": None}
    sizes = info.shards if info.shards is not None else (len(blob),)
    if shard == "all":
        return {"blob": pickle.PickleBuffer(blob), "sizes": list(sizes)}
    if shard is None:
        if info.shards is None:
            return {"blob": pickle.PickleBuffer(blob)}
        if world != len(sizes):
            return {"refused": f"the checkpoint was saved by {len(sizes)} ranks, one shard each, but this run has "
                               f"{world}: load the shard of your choice with load_checkpoint(shard=k), or every "
                               "shard with load_checkpoint(shard='all') and split their state for this many ranks, "
                               f"or run on {len(sizes)} ranks"}
        shard = rank
    if not isinstance(shard, int) or not 0 <= shard < len(sizes):
        whose = (f"has shards 0 to {len(sizes) - 1}" if info.shards is not None
                 else "was saved by rank 0 alone (save_checkpoint without sharded=True): its only shard is 0")
        return {"refused": f"there is no shard {shard}: the checkpoint {whose}"}
    at = sum(sizes[:shard])
    return {"blob": pickle.PickleBuffer(memoryview(blob)[at:at + sizes[shard]])}


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
