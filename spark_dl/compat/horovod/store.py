"""Horovod's ``Store`` (``horovod.spark.common.store``) for ``TorchEstimator(store=..., run_id=...)``.

As in Horovod, a Store holds an estimator's runs and its staged Parquet data under ``prefix_path``:
each run's checkpoint in ``<prefix_path>/runs/<run_id>/checkpoint``, written by the driver (for
``fit(df)`` the path need only exist on the driver: a local disk, or ``/dbfs/...``), and what
``prepare_data`` stages in ``<prefix_path>/intermediate_train_data.<idx>`` (and ``_val_``), which
Spark's executors write and read (see :mod:`spark_dl.horovod.staging`).
"""
from __future__ import annotations

import os

from spark_dl.errors import LaunchRefused

_DBFS_PREFIXES = ("dbfs:/", "file:///dbfs/")


class Store:
    """Where an estimator keeps its runs' checkpoints and ``prepare_data``'s staged Parquet data.
    Build one with :meth:`create`."""

    def __init__(self, prefix_path: str | os.PathLike, train_path: str | os.PathLike | None = None,
                 val_path: str | os.PathLike | None = None, test_path: str | os.PathLike | None = None,
                 runs_path: str | os.PathLike | None = None) -> None:
        self.prefix_path = _local_path(prefix_path)

        def path(given: str | os.PathLike | None, default: str) -> str:
            return os.path.join(self.prefix_path, default) if given is None else _local_path(given)

        self._train_path = path(train_path, "intermediate_train_data")
        self._val_path = path(val_path, "intermediate_val_data")
        self._test_path = path(test_path, "intermediate_test_data")
        self._runs_path = path(runs_path, "runs")

    @staticmethod
    def create(prefix_path: str | os.PathLike, *args, **kwargs) -> "Store":
        """Horovod's factory: a :class:`DBFSLocalStore` for ``/dbfs/...``, ``dbfs:/...`` and
        ``file:///dbfs/...``, a :class:`LocalStore` for other local paths (``file://`` too).
        HDFS and object-store URLs are refused: name a path on the driver's disk or its DBFS mount.
        Horovod's ``train_path``, ``val_path``, ``test_path`` and ``runs_path`` move those folders."""
        unknown = [k for k in kwargs if k not in _PATHS]
        if args or unknown:
            raise LaunchRefused(f"Store.create takes prefix_path and the keywords {', '.join(_PATHS)} here; got "
                                f"{unknown or f'{len(args)} positional arguments'} more (storage options and "
                                "save_runs have no counterpart: the store is a local or /dbfs path)")
        path = os.fspath(prefix_path) if isinstance(prefix_path, (str, os.PathLike)) else prefix_path
        if isinstance(path, str) and (path.startswith(_DBFS_PREFIXES) or path == "/dbfs" or path.startswith("/dbfs/")):
            return DBFSLocalStore(path, **kwargs)
        return LocalStore(path, **kwargs)

    def get_train_data_path(self, idx: int | None = None) -> str:
        """Where ``prepare_data`` stages the training rows of its data set ``idx``."""
        return _indexed(self._train_path, idx)

    def get_val_data_path(self, idx: int | None = None) -> str:
        """Where ``prepare_data`` stages the held-out rows of its data set ``idx``."""
        return _indexed(self._val_path, idx)

    def get_test_data_path(self, idx: int | None = None) -> str:
        return _indexed(self._test_path, idx)

    def exists(self, path: str) -> bool:
        return os.path.exists(_local_path(path))

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self._runs_path, check_run_id(run_id))

    def get_checkpoint_path(self, run_id: str) -> str:
        """The directory holding ``run_id``'s latest checkpoint (``latest.ckpt``)."""
        return os.path.join(self.get_run_path(run_id), "checkpoint")

    def get_logs_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "logs")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class LocalStore(Store):
    """A Store on the driver's file system."""


class DBFSLocalStore(Store):
    """A Store on Databricks' DBFS through its local mount, ``/dbfs`` (``dbfs:/x`` is ``/dbfs/x``)."""


class HDFSStore(Store):
    """Horovod's HDFS Store: refused here, since the checkpoints are the driver's files."""

    def __init__(self, prefix_path: str | os.PathLike, *args, **kwargs) -> None:
        raise LaunchRefused(f"HDFSStore({os.fspath(prefix_path)!r}): spark-dl's estimator keeps its checkpoints in "
                            "the driver's files, not on HDFS; use Store.create with a path on the driver's disk or "
                            "its /dbfs mount")


_PATHS = ("train_path", "val_path", "test_path", "runs_path")


def _indexed(path: str, idx: int | None) -> str:
    return path if idx is None else f"{path}.{idx}"


def _local_path(prefix_path: str | os.PathLike) -> str:
    if not isinstance(prefix_path, (str, os.PathLike)):
        raise LaunchRefused(f"a Store's prefix_path is a path (str), got {type(prefix_path).__name__}")
    path = os.fspath(prefix_path)
    for prefix in _DBFS_PREFIXES:
        if path.startswith(prefix):
            return "/dbfs/" + path[len(prefix):].lstrip("/")
    if path.startswith("file://"):
        return path[len("file://"):]
    if "://" in path:
        raise LaunchRefused(f"Store {path!r}: spark-dl's estimator keeps its checkpoints in the driver's files; "
                            "use a path on the driver's disk or its /dbfs mount (HDFS and object stores are not "
                            "written to)")
    return os.path.abspath(os.path.expanduser(path))


def check_run_id(run_id: str) -> str:
    """``run_id``, or a refusal: it names a folder under the Store's ``runs/``."""
    if not isinstance(run_id, str) or not run_id or os.sep in run_id or run_id in (".", ".."):
        raise LaunchRefused(f"run_id must be a non-empty name without {os.sep!r} (a folder under the Store's runs/), "
                            f"got {run_id!r}")
    return run_id


__all__ = ["DBFSLocalStore", "HDFSStore", "LocalStore", "Store"]
