"""The checkpoint a ``fit()`` resumes from (``resume_from_checkpoint``, ``TorchTrainer.restore``).

Its files are not packed into the training closure: a checkpoint of several GB would pass through
the driver's memory, Spark's task binary and every task. The workers get its path and a fingerprint
of its listing (names, sizes, whole-second mtimes, as rsync compares files). A worker that sees the
same listing at that path (a shared file system, one machine) reads it in place, as Ray's workers
read a checkpoint in local storage; any other worker fetches it from the driver at its first
``get_checkpoint()``, in chunks over the job's channel, into a temporary folder. With
``SPARK_DL_RAY_STORAGE=driver`` every worker fetches it.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from spark_dl import LaunchRefused
from spark_dl.compat.ray_train.archive import pack, unpack
from spark_dl.rank import context as rank_api
from spark_dl.rank.context import scratch_dir

REQUEST = "request/ray_train_resume"
CHUNK_BYTES = 32 << 20  # one reply: bounds what a fetch holds in memory on either side


def fingerprint(directory: str) -> str:
    """A digest of what ``directory`` holds: every entry's relative name, kind, size and mtime."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(root, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, directory)
            if os.path.islink(path):
                entry = f"L {rel} {os.readlink(path)}"
            elif name in dirs:
                entry = f"D {rel}"
            else:
                entry = f"F {rel} {st.st_size} {int(st.st_mtime)}"
            h.update(entry.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class Resume:
    """What the workers get instead of the files: where the driver sees them and what they are."""

    path: str  # absolute, on the driver
    digest: str
    in_place: bool  # False under SPARK_DL_RAY_STORAGE=driver: always fetched

    @classmethod
    def of(cls, path: str, mode: str) -> "Resume":
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            raise LaunchRefused(f"resume_from_checkpoint={path!r} is not a directory (any more): "
                                "pass Checkpoint.from_directory() of a folder that exists on the driver")
        return cls(path, fingerprint(path), mode != "driver")

    def readable(self) -> bool:
        """Whether this worker sees the driver's files at ``path``."""
        if not self.in_place:
            return False
        try:
            return os.path.isdir(self.path) and fingerprint(self.path) == self.digest
        except OSError:  # no permission, a file vanishing mid-walk: fetch it instead
            return False

    def fetch(self, directory: str) -> None:
        """Copy the files from the driver into ``directory`` (a rank process's request)."""
        fd, archive = tempfile.mkstemp(prefix="spark-dl-resume-", suffix=".tar", dir=scratch_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                offset, size = 0, None
                while size is None or offset < size:
                    reply = rank_api.request(REQUEST, {"path": self.path, "offset": offset})
                    if "error" in reply:
                        raise RuntimeError(f"train.get_checkpoint(): the driver could not send resume_from_checkpoint "
                                           f"({self.path}): {reply['error']}")
                    size = reply["size"]
                    f.write(reply["data"])
                    offset += len(reply["data"])
                    if not reply["data"] and offset < size:  # cannot happen with a sane server; never spin
                        raise RuntimeError(f"train.get_checkpoint(): the driver's copy of {self.path} ended at "
                                           f"{offset} of {size} bytes")
            with open(archive, "rb") as f:
                unpack(f, directory)
        finally:
            os.unlink(archive)


class _Server:
    """The observer hooks a request server has no use for."""

    def on_start(self, job: dict) -> None:
        pass

    def on_log(self, rank: int, stream: str, line: str) -> None:
        pass

    def on_message(self, rank: int, kind: str, data: Any) -> None:
        pass

    def on_finish(self, error: BaseException | None) -> None:
        pass


class ResumeServer(_Server):
    """Driver-side observer: packs the resumed checkpoint into a temporary tar file at the first
    request (once, for all workers) and serves it in ``CHUNK_BYTES`` pieces."""

    def __init__(self, resume: Resume) -> None:
        self.resume = resume
        self._lock = threading.Lock()
        self._archive: str | None = None
        self._error: str | None = None

    def _pack(self) -> str:
        with self._lock:
            if self._error is not None:
                raise RuntimeError(self._error)
            if self._archive is None:
                fd, archive = tempfile.mkstemp(prefix="spark-dl-resume-", suffix=".tar")
                try:
                    with os.fdopen(fd, "wb") as f:
                        pack(self.resume.path, f)
                except OSError as e:
                    os.unlink(archive)
                    self._error = f"{type(e).__name__}: {e}"
                    raise RuntimeError(self._error) from e
                self._archive = archive
            return self._archive

    def on_request(self, rank: int | None, kind: str, data: dict) -> dict | None:
        if kind != REQUEST or data.get("path") != self.resume.path:
            return None
        archive = self._pack()
        offset = int(data["offset"])
        with open(archive, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            chunk = f.read(CHUNK_BYTES)
        return {"size": size, "data": pickle.PickleBuffer(chunk)}  # out of band: not copied into the pickle

    def for_relay(self) -> "PackedResumeServer":
        """The server barrier task 0 runs when it relays the run (a Spark Connect client the
        executors cannot reach): the files packed, to travel in the task closure."""
        with open(self._pack(), "rb") as f:
            return PackedResumeServer(self.resume.path, f.read())

    def on_finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._archive is not None:
                os.unlink(self._archive)
                self._archive = None


class PackedResumeServer(_Server):
    """:class:`ResumeServer` with the packed files in hand (picklable): the relay's copy."""

    def __init__(self, path: str, data: bytes) -> None:
        self.path, self.data = path, data

    def on_request(self, rank: int | None, kind: str, data: dict) -> dict | None:
        if kind != REQUEST or data.get("path") != self.path:
            return None
        offset = int(data["offset"])
        chunk = memoryview(self.data)[offset:offset + CHUNK_BYTES]
        return {"size": len(self.data), "data": pickle.PickleBuffer(chunk)}


def fetched_directory(resume: Resume) -> str:
    """A new temporary folder holding the driver's copy of ``resume`` (the caller removes it)."""
    directory = tempfile.mkdtemp(prefix="spark-dl-checkpoint-", dir=scratch_dir())
    try:
        resume.fetch(directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory
