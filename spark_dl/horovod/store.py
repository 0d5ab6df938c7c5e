"""Horovod's ``Store`` (``horovod.spark.common.store``) for ``TorchEstimator(store=..., run_id=...)``.

In Horovod a Store holds an estimator's intermediate Parquet data, checkpoints and logs under
``prefix_path``. spark-dl's estimator reads DataFrame shards directly, so a Store here holds only
what resuming needs: each run's checkpoint, in ``<prefix_path>/runs/<run_id>/checkpoint``, written
by the driver (so the path need only exist on the driver: a local disk, or ``/dbfs/...``).
"""
from __future__ import annotations

import os

from ..errors import LaunchRefused

_DBFS_PREFIXES = ("dbfs:/", "file:///dbfs/")


class Store:
    """Where an estimator keeps its runs' checkpoints. Build one with :meth:`create`."""

    def __init__(self, prefix_path: str | os.PathLike) -> None:
        self.prefix_path = _local_path(prefix_path)

    @staticmethod
    def create(prefix_path: str | os.PathLike, *args, **kwargs) -> "Store":
        """Horovod's factory: a :class:`DBFSLocalStore` for ``/dbfs/...``, ``dbfs:/...`` and
        ``file:///dbfs/...``, a :class:`LocalStore` for other local paths (``file://`` too).
        HDFS and object-store URLs are refused: name a path on the driver's disk or its DBFS mount."""
        if args or kwargs:
            raise LaunchRefused(f"Store.create takes only prefix_path here (its train/val/test paths and storage "
                                f"options are for Horovod's Parquet data, which spark-dl does not write); got "
                                f"{list(kwargs) or len(args)} more")
        path = os.fspath(prefix_path)
        if path.startswith(_DBFS_PREFIXES) or path == "/dbfs" or path.startswith("/dbfs/"):
            return DBFSLocalStore(path)
        return LocalStore(path)

    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self.prefix_path, "runs", check_run_id(run_id))

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
