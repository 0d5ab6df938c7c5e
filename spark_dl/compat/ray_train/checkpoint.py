"""Ray's ``Checkpoint`` (a directory of files) and ``Result`` (what ``TorchTrainer.fit()`` returns),
and a checkpoint's files packed into bytes for the trip from the workers to the driver."""
from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from spark_dl.compat.ray_train import archive
from spark_dl.compat.ray_train.config import local_filesystem, local_path
from spark_dl.compat.ray_train.record import RECORD, read_record, score


class Checkpoint:
    """A directory of files, as Ray's ``Checkpoint``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> "Checkpoint":
        if not os.path.isdir(path):
            raise ValueError(f"Checkpoint.from_directory({os.fspath(path)!r}): not a directory")
        return cls(path)

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """A copy of the files in ``path`` (default: a new temporary directory); returns it."""
        dest = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="checkpoint-")
        shutil.copytree(self.path, dest, dirs_exist_ok=True)
        return dest

    @contextmanager
    def as_directory(self) -> Iterator[str]:
        yield self.path

    # Ray keeps a checkpoint's metadata in a JSON file among its files, so it travels and merges with them
    _METADATA = ".metadata.json"

    def get_metadata(self) -> dict[str, Any]:
        """The metadata stored with this checkpoint (``{}`` if none)."""
        try:
            with open(os.path.join(self.path, self._METADATA)) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Store ``metadata`` (JSON-serialisable) with this checkpoint, replacing what was there."""
        if not isinstance(metadata, Mapping):
            raise TypeError(f"Checkpoint metadata must be a dict, got {type(metadata).__name__}")
        try:
            text = json.dumps(dict(metadata))
        except (TypeError, ValueError) as e:
            raise TypeError("Checkpoint metadata must be JSON-serialisable (numbers, strings, lists, dicts): "
                            f"{e}") from e
        with open(os.path.join(self.path, self._METADATA), "w") as f:
            f.write(text)

    def update_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Add ``metadata``'s keys to this checkpoint's metadata."""
        if not isinstance(metadata, Mapping):
            raise TypeError(f"Checkpoint metadata must be a dict, got {type(metadata).__name__}")
        self.set_metadata({**self.get_metadata(), **metadata})

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"


def pack_checkpoint(directory: str) -> bytes:
    """``directory``'s files as one tar (:mod:`spark_dl.ray_train.archive`), in memory."""
    buf = io.BytesIO()
    archive.pack(directory, buf)
    return buf.getvalue()


def unpack_checkpoint(data: bytes, directory: str) -> Checkpoint:
    """The files :func:`pack_checkpoint` packed, extracted into ``directory``."""
    archive.unpack(io.BytesIO(data), directory)
    return Checkpoint(directory)



@dataclass
class Result:
    """What ``TorchTrainer.fit()`` returns: rank 0's last reported ``metrics``, the latest
    ``checkpoint`` reported in this fit (in ``path``), the kept ``best_checkpoints`` with their
    metrics, ``error`` (always None: a failed run raises)."""

    metrics: dict | None
    checkpoint: Checkpoint | None
    path: str
    reports: list[dict]
    error: BaseException | None = None
    best_checkpoints: list[tuple[Checkpoint, dict]] = field(default_factory=list)  # kept, in report order

    @property
    def metrics_dataframe(self):
        """Every report of rank 0, in order, as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.reports)

    @property
    def filesystem(self) -> Any:
        """Ray's: the file system ``path`` is on; spark-dl's runs are on file system paths (pyarrow's local one)."""
        from pyarrow.fs import LocalFileSystem

        return LocalFileSystem()

    @classmethod
    def from_path(cls, path: str | os.PathLike, storage_filesystem: Any = None) -> "Result":
        """Ray's: the Result of the run in ``path`` (``storage_path/name``, a ``Result.path``), from its
        record: ``metrics`` its last report, ``checkpoint`` its latest kept one, ``best_checkpoints``
        the kept ones, every report (a restored run's earlier fits' first). ``error`` is None: a
        failed run's error is raised by its ``fit()``, not recorded."""
        if storage_filesystem is not None and not local_filesystem(storage_filesystem):
            raise ValueError(f"Result.from_path(storage_filesystem={type(storage_filesystem).__name__}): spark-dl's "
                             "runs are on file system paths; pass the folder where the storage is mounted")
        path = os.path.abspath(local_path(os.fspath(path)))
        expected = (f"expected a TorchTrainer run's folder, storage_path/name (Result.path), holding its record "
                    f"{RECORD}")
        if not os.path.isdir(path):
            raise ValueError(f"Result.from_path({path!r}): no such folder; {expected}")
        record = read_record(path)
        if record is None:
            raise ValueError(f"Result.from_path({path!r}): not a run folder (no readable {RECORD}); "
                             f"{expected}")
        kept = [(Checkpoint(os.path.join(path, folder)), metrics) for folder, metrics in record.get("kept", [])
                if os.path.isdir(os.path.join(path, folder))]
        reports = list(record["reports"])
        return cls(reports[-1] if reports else None, kept[-1][0] if kept else None, path, reports,
                   best_checkpoints=kept)

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """Ray's: of the kept checkpoints, the one whose report has the lowest (``mode="min"``) or
        highest (``"max"``) ``metric`` (``"val/loss"`` reaches into nested dicts); those without a
        number there are left out; None if none has one."""
        if mode not in ("min", "max"):
            raise ValueError(f"get_best_checkpoint(mode={mode!r}): 'min' or 'max'")
        scored = [(score(m, metric), c) for c, m in self.best_checkpoints]
        scored = [(v, c) for v, c in scored if v is not None]
        if not scored:
            return None
        pick = min if mode == "min" else max
        return pick(scored, key=lambda vc: vc[0])[1]
