"""Train on a Spark DataFrame: each rank reads its shard from its own barrier task's partition.

Driver: ``HorovodRunner(np=2).run(main, data=spark_dl.data.shards(df, ...))``. The DataFrame is
repartitioned to one partition per barrier task; each task streams its partition's Arrow batches
to a local Arrow file (no shared storage) and its rank gets a :class:`Shards` object in place of
the DataFrame.

Rank: ``for batch in data.batches(batch_size, epoch)`` yields ``{column: torch.Tensor}``. Every
epoch is ONE global shuffle of all rows with a seed every rank shares, then cut into equal
shards (Goyal et al.: per-worker shuffles sample differently from the large-batch SGD they
stand for). Every rank computes every rank's order, so the rows a rank needs are fetched from
the ranks that hold them with one exchange per batch (byte counts, then rows), in a background
thread one batch ahead; a rank holds its own file (memory-mapped) plus a batch or two.
Shards are equal on every rank (``"drop"`` the remainder or ``"pad"`` by wrapping around):
uneven inputs would hang collectives at the end of an epoch.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import LaunchRefused, as_int

SHARD_ENV = "SPARK_DL_SHARD"


def shards(df: Any, columns: list[str] | str | None = None, *, shuffle: bool = True, seed: int = 0,
           remainder: str = "drop") -> "DataFrameShards":
    """Mark ``df`` to be sharded across the ranks of a run (pass the result as a kwarg)."""
    return DataFrameShards(df, columns, shuffle, seed, remainder)


def check_dataframe(df: Any, what: str = "shards(df)") -> None:
    """Refuse, naming the fix, what cannot be read as a batch Spark DataFrame."""
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        kind = f"{type(df).__module__}.{type(df).__qualname__}" if df is not None else "None"
        hint = ""
        if type(df).__module__.startswith("pandas"):
            hint = ": turn it into one with spark.createDataFrame(pdf)"
        elif type(df).__name__ == "RDD":
            hint = ": turn it into one with rdd.toDF() or spark.createDataFrame(rdd)"
        raise LaunchRefused(f"{what} takes a pyspark.sql.DataFrame, got {kind}{hint}")
    if df.isStreaming:
        raise LaunchRefused(f"{what} got a streaming DataFrame: training reads a fixed set of rows; write the stream "
                            "to a table first (writeStream ... .toTable(name)) and pass spark.read.table(name)")
    from . import cluster

    if not cluster.is_connect(df.sparkSession) and df.sparkSession.sparkContext._jsc is None:
        raise LaunchRefused(f"{what} got a DataFrame of a SparkSession that was stopped: build it again in the "
                            "active session")


def quoted(column: str) -> Any:
    """``F.col`` of a column by its exact name: ``a.b`` is a column named so, not field ``b`` of ``a``."""
    from pyspark.sql import functions as F

    return F.col("`" + column.replace("`", "``") + "`")


def _check_type(name: str, dtype: Any) -> str:
    from pyspark.sql import types as T

    numeric = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.BooleanType)
    if isinstance(dtype, numeric):
        return "scalar"
    if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, numeric):
        return "array"
    # Spark ML's Vector (VectorAssembler's, StandardScaler's), read through as_array; known by name, as
    # importing pyspark.ml.linalg imports all of pyspark.ml (0.6 s of pandas and scipy)
    if type(dtype).__name__ == "VectorUDT" and type(dtype).__module__.startswith("pyspark.ml"):
        return "vector"
    col = f"F.col({name!r})"
    if isinstance(dtype, T.DecimalType):
        fix = f"cast it first: df.withColumn({name!r}, {col}.cast('double'))"
    elif isinstance(dtype, (T.TimestampType, T.TimestampNTZType, T.DateType)):
        fix = (f"turn it into a number first, e.g. seconds since the epoch: df.withColumn({name!r}, "
               f"F.unix_timestamp({col}).cast('double'))")
    elif isinstance(dtype, T.StringType):
        fix = (f"index it first (pyspark.ml.feature.StringIndexer(inputCol={name!r}, outputCol=...)) or cast text that "
               f"holds numbers: df.withColumn({name!r}, {col}.cast('double'))")
    elif isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, T.DecimalType):
        fix = f"cast its elements first: df.withColumn({name!r}, {col}.cast('array<double>'))"
    else:
        fix = ("use numeric columns or arrays of numbers (e.g. images flattened to array<float>), or drop it with "
               "columns=[...]")
    raise LaunchRefused(f"column {name!r} has type {dtype.simpleString()}, which spark-dl cannot turn into a tensor: {fix}")


def as_array(column: str) -> Any:
    """A Vector column (kind "vector") as ``array<double>`` (dense, whatever its storage)."""
    from pyspark.ml.functions import vector_to_array

    return vector_to_array(quoted(column))


def column_kinds(df: Any, columns: list[str]) -> dict[str, str]:
    """``{column: "scalar" | "array" | "vector"}``: how each column becomes a tensor; a refusal naming the fix
    for a column that is missing, named twice in the DataFrame, or that cannot be one."""
    names = list(df.columns)
    missing = [c for c in columns if c not in names]
    if missing:
        raise LaunchRefused(f"columns {missing} are not in the DataFrame (it has {names})")
    twice = sorted({c for c in columns if names.count(c) > 1})
    if twice:
        raise LaunchRefused(f"the DataFrame has more than one column named {twice} (a join's both sides?): "
                            "rename or drop one, e.g. df.withColumnRenamed or select with aliases")
    fields = {f.name: f.dataType for f in df.schema.fields}
    return {c: _check_type(c, fields[c]) for c in columns}


def column_names(columns: Any, what: str) -> list[str]:
    """``columns`` as a list of names: one name, or a non-empty list of them."""
    if isinstance(columns, str):
        return [columns]
    if (isinstance(columns, (list, tuple)) and columns
            and all(isinstance(c, str) for c in columns)):
        return list(columns)
    raise LaunchRefused(f"{what} must be a column name or a non-empty list of column names (str), got {columns!r}")


class DataFrameShards:
    """Driver-side marker: a DataFrame to shard across the ranks. Validated before launch."""

    def __init__(self, df: Any, columns: list[str] | str | None, shuffle: bool, seed: int, remainder: str) -> None:
        check_dataframe(df)
        if remainder not in ("drop", "pad"):
            raise LaunchRefused(f"remainder must be 'drop' or 'pad', got {remainder!r}")
        if not isinstance(shuffle, bool):
            raise LaunchRefused(f"shuffle must be True or False, got {shuffle!r}")
        if as_int(seed) is None:
            raise LaunchRefused(f"seed must be an int (every epoch's shuffle derives from it), got {seed!r}")
        # a column named twice (an autoencoder's features as its labels) is sent once
        columns = list(dict.fromkeys(column_names(columns, "shards(df, columns)") if columns is not None
                                     else df.columns))
        kinds = column_kinds(df, columns)
        self.df = df.select(*[as_array(c).alias(c) if kinds[c] == "vector" else quoted(c) for c in columns])
        kinds = {c: "array" if k == "vector" else k for c, k in kinds.items()}
        self.spec = Shards(columns=columns, kinds=kinds, shuffle=shuffle, seed=as_int(seed), remainder=remainder)
        self.empty_hint = ""  # what the refusal of an empty DataFrame adds: the fix, where the caller knows it
        # the fix for fewer rows than ranks, where the caller knows better ones (an estimator has no shards())
        self.few_rows_hint = "use shards(df, remainder='pad') (ranks wrap around), fewer ranks, or more rows"
        self.few_rows_reason = "remainder='drop' leaves every rank empty"

    @functools.cached_property
    def schema(self):
        """The selected columns' Spark schema (asked of Spark once: through Connect, a round trip)."""
        return self.df.schema

    def arrow_schema(self):
        from pyspark.sql.pandas.types import to_arrow_schema

        return to_arrow_schema(self.schema)

    def check_rows(self, np: int, name: str = "") -> None:
        """Refuse a DataFrame that leaves the ranks nothing to read: empty, or (``remainder="drop"``)
        with fewer rows than ranks (one Spark job, which reads at most ``np`` rows)."""
        which = f"passed as {name}=" if name else "to train on"
        rows = self.df.limit(np).count()
        if rows == 0:
            raise LaunchRefused(f"the DataFrame {which} is empty: there is nothing to shard{self.empty_hint}")
        if rows < np and self.spec.remainder == "drop":
            raise LaunchRefused(
                f"the DataFrame {which} has {rows} row(s), fewer than the {np} ranks: {self.few_rows_reason}; "
                f"{self.few_rows_hint}")


class ShardSet:
    """Driver side: the run's DataFrames, by keyword, read in one barrier stage. Several are sent
    as one union, each row tagged with its DataFrame and carried in a struct column of its own, and
    each task splits its partition into one Arrow file per DataFrame."""

    TAG = "__spark_dl_dataset"

    def __init__(self, named: dict[str, DataFrameShards]) -> None:
        self.named = named
        for key, data in named.items():
            data.spec.key = key

    def check_rows(self, np: int) -> None:
        for key, data in self.named.items():
            data.check_rows(np, key if len(self.named) > 1 else "")

    def schemas(self) -> dict[str, Any]:
        return {key: data.arrow_schema() for key, data in self.named.items()}

    def dataframe(self):
        """What the barrier stage maps over: the one DataFrame, or the tagged union of several."""
        if len(self.named) == 1:
            df = next(iter(self.named.values())).df
            if any("." in c or "`" in c for c in df.columns):
                # mapInArrow resolves each column by its name, reading "a.b" as field b of a: the
                # rows travel under plain names, and the task writes them with the real ones
                df = df.select(*[quoted(c).alias(f"_spark_dl_{i}") for i, c in enumerate(df.columns)])
            return df
        from pyspark.sql import functions as F
        from pyspark.sql import types as T

        keys = list(self.named)
        parts = []
        for key, data in self.named.items():
            cols = [F.lit(key).alias(self.TAG)]
            for other in keys:
                if other == key:
                    cols.append(F.struct(*[quoted(c) for c in data.spec.columns]).alias(other))
                else:
                    shape = T.StructType(self.named[other].schema.fields)
                    cols.append(F.lit(None).cast(shape).alias(other))
            parts.append(data.df.select(*cols))
        union = parts[0]
        for part in parts[1:]:
            union = union.unionByName(part)
        return union


@dataclass
class Shards:
    """What ``main`` receives in place of the DataFrame: this rank's view of the sharded rows."""

    columns: list[str]
    kinds: dict[str, str]
    shuffle: bool = True
    seed: int = 0
    remainder: str = "drop"
    key: str = "data"  # the keyword it was passed as: its file in the task's shard directory
    _state: dict = field(default_factory=dict, repr=False, compare=False)

    # -- the world's rows ----------------------------------------------------------------------
    def _open(self) -> dict:
        if self._state:
            return self._state
        import pyarrow as pa
        import torch
        import torch.distributed as dist

        directory = os.environ.get(SHARD_ENV)
        if directory is None:
            raise RuntimeError("no shard for this rank: pass spark_dl.data.shards(df) to HorovodRunner(np>0).run")
        path = os.path.join(directory, f"{self.key}.arrow")
        if not dist.is_initialized():
            raise RuntimeError("call spark_dl.init() (or dist.init_process_group) before reading the data")
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        group = dist.new_group(backend="gloo")  # row exchange stays on CPU whatever the model uses
        counts = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        counts[dist.get_rank()] = table.num_rows
        dist.all_reduce(counts, group=group)
        chunks = table.to_batches()
        starts = [0]  # each chunk's first row
        for c in chunks:
            starts.append(starts[-1] + c.num_rows)
        self._state.update(table=table, chunks=chunks, starts=starts, group=group, counts=counts.tolist(),
                           rank=dist.get_rank(), world=dist.get_world_size())
        return self._state

    @property
    def total_rows(self) -> int:
        """Rows in the whole DataFrame."""
        return sum(self._open()["counts"])

    def __len__(self) -> int:
        """Rows this rank reads per epoch: the same on every rank."""
        s = self._open()
        n, w = sum(s["counts"]), s["world"]
        return -(-n // w) if self.remainder == "pad" else n // w

    def _orders(self, epoch: int):
        """Every rank's global row indices for ``epoch``, one row of a ``[world, len(self)]``
        tensor: one shared shuffle, cut into equal slices. Each rank computes all of them, so
        no rank has to be told which rows another wants."""
        import torch

        s = self._open()
        n, w, per = sum(s["counts"]), s["world"], len(self)
        if self.shuffle:
            # mod 2**63: a seed such as time.time_ns() would overflow the generator's 64 bits
            seed = (self.seed * 1_000_003 + epoch) % (1 << 63)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        else:
            # "drop" leaves out n mod w rows: each epoch starts that many rows later, so the rows left
            # out move on and every row is read within a few epochs, in a fixed order
            perm = torch.roll(torch.arange(n), -(epoch * (n - per * w)) % max(n, 1))
        if per * w > n:  # pad: wrap around to the start of the same permutation
            perm = torch.cat([perm, perm[: per * w - n]])
        return perm[: per * w].reshape(w, per)

    # -- batches -------------------------------------------------------------------------------
    def batches(self, batch_size: int, epoch: int = 0, drop_last: bool = False,
                padding: str | None = None, prefetch: bool = True) -> Iterator[dict]:
        """This rank's rows for ``epoch`` as ``{column: tensor}`` batches. Every rank must
        iterate the same number of batches (it does: shards are equal), since each batch is
        fetched with a collective. ``padding="is_pad"`` adds a bool tensor under that key, true
        for the rows ``remainder="pad"`` repeats (wrapped around): leave them out of a mean over
        the rows, and each row counts once. ``prefetch``: the next batch is fetched in a
        background thread while the caller works on this one (alone among this object's
        iterators: with two open at once, both fetch in turn)."""
        import torch

        if as_int(batch_size) is None or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if as_int(epoch) is None:
            raise ValueError(f"epoch must be an int (it picks the epoch's shuffle), got {epoch!r}")
        if padding is not None and (not isinstance(padding, str) or padding in self.columns):
            raise ValueError(f"padding must name a key other than the columns {self.columns}, got {padding!r}")
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
        batch_size, epoch = as_int(batch_size), as_int(epoch)
        orders = self._orders(epoch)
        s = self._state
        per = orders.shape[1]
        stop = per - per % batch_size if drop_last else per
        starts = range(0, stop, batch_size)
        # position in the epoch's (wrapped) order: from n on, a row read a second time
        first = s["rank"] * per
        n = self.total_rows

        def fetch(start: int) -> dict:
            batch = self._fetch(orders[:, start:start + batch_size])
            if padding is not None:
                rows = min(batch_size, stop - start)
                batch[padding] = torch.arange(first + start, first + start + rows) >= n
            return batch

        s["open"] = s.get("open", 0) + 1
        ahead = None  # the next batch, fetched in the background
        try:
            for i, start in enumerate(starts):
                if ahead is not None:
                    batch, ahead = ahead.result(), None
                else:
                    self._settle()
                    batch = fetch(start)
                # the same decision on every rank (the same program order), so the fetches every
                # rank issues on the group stay in one order
                if prefetch and s["open"] == 1 and i + 1 < len(starts):
                    ahead = self._ahead(fetch, starts[i + 1])
                yield batch
        finally:
            s["open"] -= 1
            if ahead is not None:  # every rank fetches it: let it finish, so the group's next call is the next one
                self._settle()

    def _ahead(self, fetch: Any, start: int):
        """Run ``fetch(start)`` on this object's fetch thread; it is the group's next collective."""
        from concurrent.futures import ThreadPoolExecutor

        s = self._state
        if "pool" not in s:
            s["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spark-dl-shards")
        s["inflight"] = s["pool"].submit(fetch, start)
        return s["inflight"]

    def _settle(self) -> None:
        """Wait for a fetch in flight on the group (a closed iterator's): the next must follow it.
        Its error, if any, belongs to the iterator that asked for it."""
        inflight = self._state.pop("inflight", None)
        if inflight is not None:
            inflight.exception()

    def _fetch(self, wanted) -> dict:
        """Exchange rows so this rank gets ``wanted[rank]`` (global indices), in that order;
        ``wanted[d]`` is what rank ``d`` gets from the same call."""
        import pyarrow as pa
        import torch
        import torch.distributed as dist

        s = self._open()
        w, rank, counts = s["world"], s["rank"], s["counts"]
        offsets = [sum(counts[:i]) for i in range(w)]
        lo, hi = offsets[rank], offsets[rank] + counts[rank]
        payloads = []
        for d in range(w):
            want = wanted[d]
            local = want[(want >= lo) & (want < hi)] - lo
            payloads.append(_ipc_bytes(_take(s["table"].schema, s["chunks"], s["starts"], local.numpy())))
        send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8) if any(payloads) \
            else torch.zeros(0, dtype=torch.uint8)
        in_splits = [len(p) for p in payloads]
        out_splits_t = torch.empty(w, dtype=torch.int64)
        dist.all_to_all_single(out_splits_t, torch.tensor(in_splits, dtype=torch.int64), group=s["group"])
        out_splits = out_splits_t.tolist()
        recv = torch.empty(sum(out_splits), dtype=torch.uint8)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=s["group"])

        pieces, pos = [], 0
        raw = recv.numpy().tobytes()
        for src, size in enumerate(out_splits):
            pieces.append((src, pa.ipc.open_stream(raw[pos:pos + size]).read_all()))
            pos += size
        # rows arrived grouped by source rank, each group in `wanted` order: restore that order
        want = wanted[rank]
        src_of = torch.bucketize(want, torch.tensor(offsets[1:], dtype=torch.int64), right=True)
        table = pa.concat_tables([t for _, t in pieces]).combine_chunks()  # a batch: one take, below
        position = torch.empty(len(want), dtype=torch.int64)
        start = 0
        for src, t in pieces:
            idx = (src_of == src).nonzero().flatten()
            position[idx] = torch.arange(start, start + t.num_rows)
            start += t.num_rows
        table = table.take(_indices(position.numpy()))
        return {c: _to_tensor(table.column(c), self.kinds[c], c) for c in self.columns}


def _take(schema, chunks: list, starts: list[int], rows):
    """``rows`` (a numpy array of row numbers) of the table held as record batches ``chunks``
    (the first rows of which are ``starts``), in that order. pyarrow's ``take`` on a table of several chunks concatenates them all first, a copy
    of the whole shard per batch (40x slower than this for 5 chunks of 10,000 rows); here each
    chunk that holds some of the rows gives them with a take of its own."""
    import numpy as np
    import pyarrow as pa

    if len(chunks) == 1:
        return pa.Table.from_batches([chunks[0].take(_indices(rows))])
    which = np.searchsorted(starts, rows, side="right") - 1
    order = np.argsort(which, kind="stable")  # the rows grouped by chunk, each group in the given order
    parts = [chunks[c].take(_indices(rows[which == c] - starts[c])) for c in np.unique(which)]
    grouped = pa.Table.from_batches(parts, schema=schema).combine_chunks()
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return grouped.take(_indices(back))


def _indices(rows):
    """Row numbers (a numpy array) as an Arrow int64 array, without ``pa.array``: that imports
    pandas the first time it is called (to check for a Series), 0.4 s of a rank's first batch."""
    import numpy as np
    import pyarrow as pa

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])


def _ipc_bytes(table) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _to_tensor(column, kind: str, name: str, before: str = "training"):
    """A column's tensor; nulls are refused, naming the column and the fix to apply ``before``."""
    import numpy as np
    import torch

    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    drop = f"df.na.drop(subset=[{name!r}])"
    if kind == "scalar":
        if column.null_count:
            raise ValueError(f"column {name!r} has nulls; fill or drop them before {before} ({drop}, or "
                             f"df.na.fill(0, subset=[{name!r}]))")
        return torch.from_numpy(_numpy(column))
    if column.null_count:
        raise ValueError(f"array column {name!r} has null rows; fill or drop them before {before} ({drop})")
    if column.flatten().null_count:
        raise ValueError(f"array column {name!r} has null elements inside its arrays; fill them (e.g. "
                         f"F.transform({name!r}, lambda v: F.coalesce(v, F.lit(0)))) or drop those rows before {before}")
    lengths = np.diff(_numpy(column.offsets))
    if len(lengths) and (lengths != lengths[0]).any():
        raise ValueError(f"array column {name!r} has rows of different lengths; pad them to one length")
    values = _numpy(column.flatten())
    return torch.from_numpy(values.reshape(len(column), -1))


def _numpy(array):
    """An Arrow array without nulls as a writable numpy array (as torch wants). Fixed-width numbers
    are read off their data buffer: ``to_numpy`` imports pandas first, 0.3 s of a rank's first batch."""
    import numpy as np
    import pyarrow as pa

    t = array.type
    if array.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_floating(t)):
        kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
        dtype = np.dtype(f"{kind}{t.bit_width // 8}")  # Arrow buffers are in native byte order
        return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                             offset=array.offset * dtype.itemsize).copy()
    return np.array(array.to_numpy(zero_copy_only=False))


def write_partitions(batches: Iterator, directory: str, schemas: dict[str, Any]) -> None:
    """Barrier task: this partition's rows, one Arrow file per DataFrame (``<key>.arrow``); with
    several, each batch is split by :attr:`ShardSet.TAG` and each key's struct column unpacked."""
    if len(schemas) == 1:
        key, schema = next(iter(schemas.items()))
        write_partition(batches, os.path.join(directory, f"{key}.arrow"), schema)
        return
    import pyarrow as pa
    import pyarrow.compute as pc

    sinks = {key: pa.OSFile(os.path.join(directory, f"{key}.arrow"), "wb") for key in schemas}
    writers = {key: pa.ipc.new_file(sinks[key], schema) for key, schema in schemas.items()}
    try:
        for batch in batches:
            tags = batch.column(ShardSet.TAG)
            for key, schema in schemas.items():
                rows = batch.column(key).filter(pc.equal(tags, key))
                if len(rows):
                    writers[key].write_batch(pa.RecordBatch.from_arrays(rows.flatten(), schema=schema))
    finally:
        for key in schemas:
            writers[key].close()
            sinks[key].close()


def write_partition(batches: Iterator, path: str, schema) -> int:
    """Barrier task: stream this partition's Arrow batches to a local Arrow file; return its rows.
    An empty partition still gets a file with the schema (a rank with no rows serves none)."""
    import pyarrow as pa

    rows = 0
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(pa.RecordBatch.from_arrays(batch.columns, schema=schema))  # the real names
            rows += batch.num_rows
    return rows
