"""Train on a Spark DataFrame, the driver's half: ``shards(df)`` checks the DataFrame and what the
barrier stage maps over (:class:`ShardSet`); each rank reads its rows as a
:class:`spark_dl.rank.shards.Shards` (see there for the per-epoch global shuffle).

``HorovodRunner(np=2).run(main, data=spark_dl.data.shards(df, ...))``: the DataFrame is
repartitioned to one partition per barrier task; each task streams its partition's Arrow batches
to a local Arrow file (no shared storage, :mod:`spark_dl.task.partitions`) and its rank gets a
``Shards`` object in place of the DataFrame.
"""
from __future__ import annotations

import functools
from typing import Any

from spark_dl.errors import LaunchRefused, as_int
from spark_dl.rank.shards import Shards
from spark_dl.task.partitions import DATASET_TAG


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
    from spark_dl.driver import cluster

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
    raise LaunchRefused(f"column {name!r} has type {dtype.simpleString()}, "
                        f"which spark-dl cannot turn into a tensor: {fix}")


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

    TAG = DATASET_TAG

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
