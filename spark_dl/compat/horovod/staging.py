"""Horovod's Parquet staging (``horovod.spark.common.util.prepare_data``) for ``TorchEstimator.fit_on_parquet``.

``prepare_data`` writes a DataFrame's training rows (and held-out rows) once, as Parquet under a
Store; each ``fit_on_parquet`` of an estimator with that store reads them back instead of
recomputing the DataFrame, so a grid of models trains on one prepared data set. Spark's executors
write and read the files, so the Store's path must be one that every executor and the driver see:
any path on a local master, the ``/dbfs`` mount on Databricks, a shared file system elsewhere.

The staged data stays after the ``with`` block, as in Horovod (a later ``prepare_data`` of the
same DataFrame, columns and validation in this process reuses it); :func:`clear_training_cache`
forgets it and, with ``remove_data=True``, deletes its files. A new data set never overwrites
files already there: it takes the next index whose folders do not exist.
"""
from __future__ import annotations

import contextlib
import pathlib
import shutil
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from spark_dl.compat.estimator.options import column_list, split_validation
from spark_dl.errors import LaunchRefused, as_int


@dataclass
class _Staged:
    df: Any  # held, so its identity is not reused for another DataFrame while the entry lives
    store: Any
    train_rows: int
    val_rows: int
    columns: list[str]


_lock = threading.Lock()
_cache: dict[tuple, int] = {}
_staged: dict[int, _Staged] = {}


def spark_path(path: str) -> str:
    """A Store's local path as the URI Spark reads and writes (``file:///...``): a bare path would
    mean the cluster's default file system (HDFS on YARN), not the mount the driver sees."""
    return pathlib.Path(path).as_uri()


@contextlib.contextmanager
def prepare_data(num_processes: int, store: Any, df: Any, label_columns: Sequence[str] | str,
                 feature_columns: Sequence[str] | str | None = None, validation: float | str | None = None,
                 sample_weight_col: str | None = None, compress_sparse: bool = False,
                 partitions_per_process: int = 10, verbose: int = 0, *, seed: int = 0) -> Iterator[int]:
    """Stage ``df``'s ``feature_columns + label_columns`` (and ``sample_weight_col``) as Parquet in
    ``store``, held-out rows apart (``validation``: a fraction, split with ``seed``, or a column of
    booleans); yield the data set's index for ``estimator.fit_on_parquet(dataset_idx=...)``."""
    from spark_dl.compat.horovod.store import Store
    from spark_dl.driver.shards import check_dataframe, quoted

    check_dataframe(df, "prepare_data(df)")
    if not isinstance(store, Store):
        raise LaunchRefused(f"prepare_data stages its Parquet files in a Store: pass "
                            f"store=Store.create('/dbfs/...') (horovod.spark.common.store), got {type(store).__name__}")
    n, parts = as_int(num_processes), as_int(partitions_per_process)
    if n is None or parts is None or n <= 0 or parts <= 0:
        raise LaunchRefused(f"num_processes={num_processes} and partitions_per_process={partitions_per_process} must "
                            "both be ints > 0")
    if as_int(seed) is None:
        raise LaunchRefused(f"seed must be an int (the validation split's), got {seed!r}")
    if not isinstance(compress_sparse, bool):
        raise LaunchRefused(f"compress_sparse must be True or False, got {compress_sparse!r}")
    # compress_sparse: Spark's Parquet already keeps a SparseVector's indices and values only (the ranks read
    # Vector columns dense), so either value stages the same files
    if not label_columns:
        raise LaunchRefused("prepare_data needs label_columns (a column name or a list of them)")
    labels = column_list(label_columns, "label_columns")
    features = ([c for c in df.columns if c not in labels] if feature_columns is None
                else column_list(feature_columns, "feature_columns"))
    columns = features + labels + ([sample_weight_col] if sample_weight_col is not None else [])
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise LaunchRefused(f"prepare_data: columns {missing} are not in the DataFrame (it has {list(df.columns)})")
    _check_validation(validation, df)

    key = (store.get_train_data_path(), store.get_val_data_path(), tuple(columns), validation, seed)
    with _lock:
        idx = _cache.get((id(df),) + key)
        entry = _staged.get(idx) if idx is not None else None
        reuse = entry is not None and entry.df is df and store.exists(store.get_train_data_path(idx))
        if not reuse:
            idx = _next_index(store)
            _staged[idx] = _Staged(df, store, 0, 0, columns)  # reserved while it is written
    if reuse:
        if verbose:
            print(f"prepare_data: reusing data set {idx} ({entry.train_rows} training rows)")
        yield idx
        return
    try:
        train_rows, val_rows = _write(df, store, idx, columns, validation, seed, n * parts, verbose, quoted)
    except BaseException:
        with _lock:
            del _staged[idx]
        raise
    with _lock:
        _staged[idx] = _Staged(df, store, train_rows, val_rows, columns)
        _cache[(id(df),) + key] = idx
    yield idx


def _check_validation(validation: Any, df: Any) -> None:
    if validation is None:
        return
    if isinstance(validation, float):
        if not 0 < validation < 1:
            raise LaunchRefused(f"validation={validation} must be a fraction in (0, 1), a column name, or None")
    elif isinstance(validation, str):
        if validation not in df.columns:
            raise LaunchRefused(f"validation={validation!r} is not a column of the DataFrame (it has "
                                f"{list(df.columns)}); pass a column of booleans or 0/1, or a fraction such as 0.1")
    else:
        raise LaunchRefused(f"validation must be a fraction (float), a column name (str) or None, got "
                            f"{type(validation).__name__}")


def _next_index(store: Any) -> int:
    idx = 0
    while (idx in _staged or store.exists(store.get_train_data_path(idx))
           or store.exists(store.get_val_data_path(idx))):
        idx += 1
    return idx


def _write(df, store, idx: int, columns: list[str], validation, seed: int, partitions: int, verbose: int,
           quoted) -> tuple[int, int]:
    train, held_out = split_validation(df, validation, seed)
    paths = [store.get_train_data_path(idx)] + ([store.get_val_data_path(idx)] if held_out is not None else [])
    try:
        counts = []
        for part, path in zip([train, held_out], paths):
            if verbose:
                print(f"prepare_data: writing {path} ({partitions} partitions)")
            # Spark's default mode: an error if the folder exists (Spark Connect takes no "errorifexists")
            part.select(*[quoted(c) for c in columns]).repartition(partitions).write.parquet(spark_path(path))
            counts.append(df.sparkSession.read.parquet(spark_path(path)).count())
        if counts[0] == 0:
            why = ("the DataFrame has no rows" if sum(counts) == 0 else
                   f"validation={validation!r} held out all {sum(counts)} rows")
            raise LaunchRefused(f"prepare_data: no training rows to stage ({why})")
        if held_out is not None and counts[1] == 0:
            raise LaunchRefused(f"prepare_data: validation={validation!r} held out no rows; hold out a larger "
                                "fraction, mark some rows in the column, or leave validation=None")
    except BaseException:
        for path in paths:  # a failed staging leaves nothing a later fit_on_parquet could take for data
            shutil.rmtree(path, ignore_errors=True)
        raise
    if verbose:
        print(f"prepare_data: data set {idx}: {counts[0]} training rows" +
              (f", {counts[1]} held out" if counts[1:] else ""))
    return counts[0], (counts[1] if counts[1:] else 0)


def get_dataset_properties(dataset_idx: int) -> dict[str, Any]:
    """What ``prepare_data`` staged as data set ``dataset_idx`` in this process: rows and columns."""
    with _lock:
        entry = _staged.get(dataset_idx)
    if entry is None or entry.train_rows == 0:
        raise LaunchRefused(f"dataset_idx={dataset_idx!r} is no data set prepare_data staged in this process "
                            f"(it staged {sorted(i for i, e in _staged.items() if e.train_rows) or 'none'})")
    return {"train_rows": entry.train_rows, "val_rows": entry.val_rows, "columns": list(entry.columns)}


def clear_training_cache(remove_data: bool = False) -> None:
    """Forget the staged data sets (a later ``prepare_data`` stages its DataFrame again);
    ``remove_data=True`` also deletes their Parquet folders."""
    with _lock:
        entries = list(_staged.items())
        _staged.clear()
        _cache.clear()
    if remove_data:
        for idx, entry in entries:
            for path in (entry.store.get_train_data_path(idx), entry.store.get_val_data_path(idx)):
                shutil.rmtree(path, ignore_errors=True)


__all__ = ["clear_training_cache", "get_dataset_properties", "prepare_data"]
