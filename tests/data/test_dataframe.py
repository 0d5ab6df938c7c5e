"""Training on a Spark DataFrame: shards from the barrier tasks' own partitions, equal sizes,
one global shuffle per epoch, clear refusals."""
from __future__ import annotations

import pytest

import spark_dl
from spark_dl import HorovodRunner, LaunchRefused
from spark_dl.data import shards


def read_epochs(data, epochs, batch_size):
    import os

    spark_dl.init()
    directory = os.environ.get("SPARK_DL_SHARD")
    out = {"len": len(data), "total": data.total_rows, "epochs": [],
           "shard_file": os.path.join(directory, f"{data.key}.arrow"), "shard_files": sorted(os.listdir(directory))}
    for e in range(epochs):
        ids, feats = [], []
        for batch in data.batches(batch_size, epoch=e):
            ids += batch["id"].tolist()
            if "x" in batch:
                feats.append(batch["x"])
        out["epochs"].append(ids)
        if feats:
            out["x_shape"] = tuple(feats[0].shape[1:])
            out["x_first"] = feats[0][0].tolist()
            out["id_for_x_first"] = ids[0]
    import sys

    out["pandas"] = "pandas" in sys.modules  # reading shards needs none (importing it took 0.3 s)
    return out


@pytest.fixture
def df(spark):
    from pyspark.sql import functions as F

    # 103 rows in 7 partitions: more partitions than ranks, and not divisible by 2 or 3
    return spark.range(103).repartition(7).select(
        F.col("id"), F.array(F.col("id").cast("float"), (F.col("id") * 2).cast("float")).alias("x"),
        (F.col("id") % 10).cast("int").alias("label"),
    )


def test_each_rank_reads_an_equal_shard_and_every_epoch_is_one_global_shuffle(df):
    ranks = HorovodRunner(np=2).run_all(read_epochs, data=shards(df, ["id", "x"], seed=7), epochs=3, batch_size=16)
    assert [r["len"] for r in ranks] == [51, 51] and ranks[0]["total"] == 103
    for e in range(3):
        a, b = ranks[0]["epochs"][e], ranks[1]["epochs"][e]
        assert len(a) == len(b) == 51
        assert not set(a) & set(b), "ranks must not share rows within an epoch"
        assert len(set(a) | set(b)) == 102  # the remainder (one row) dropped
    # a different global order each epoch, and not each rank shuffling its own fixed rows
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    assert set(ranks[0]["epochs"][0]) != set(ranks[0]["epochs"][1])
    # array columns arrive as rows of a 2-D tensor, aligned with their ids
    assert ranks[0]["x_shape"] == (2,)
    i = ranks[0]["id_for_x_first"]
    assert ranks[0]["x_first"] == [float(i), float(2 * i)]
    # the rows came from the task's own partition file, not through the driver
    assert all(r["shard_files"] == ["data.arrow"] for r in ranks)
    assert not any(r["pandas"] for r in ranks)


@pytest.mark.parametrize("values, arrow_type", [
    ([1.5, -2.0, 3.25], "float32"), ([1.5, -2.0], "float64"), ([0.5, 2.0], "float16"), ([-3, 0, 7], "int8"),
    ([-3, 70000], "int32"), ([-1, 2 ** 40], "int64"), ([250, 3], "uint8"), ([2 ** 63], "uint64"), ([], "int16"),
    ([True, False, True], "bool_"),  # bit-packed: through pyarrow's own conversion
])
def test_arrow_columns_become_the_same_writable_arrays_as_pyarrows_to_numpy(values, arrow_type):
    import pyarrow as pa

    from spark_dl.rank.shards import _numpy

    array = pa.array(values + values, type=getattr(pa, arrow_type)())
    for a in (array, array.slice(len(values))):  # a slice starts at an offset into its buffer
        got, want = _numpy(a), a.to_numpy(zero_copy_only=False)
        assert got.dtype == want.dtype and got.tolist() == want.tolist() and got.flags.writeable


def test_pad_repeats_rows_so_no_row_is_lost(df):
    ranks = HorovodRunner(np=3).run_all(read_epochs, data=shards(df, ["id", "x"], remainder="pad"), epochs=1,
                                        batch_size=50)
    assert [r["len"] for r in ranks] == [35, 35, 35]
    seen = [i for r in ranks for i in r["epochs"][0]]
    assert set(seen) == set(range(103)) and len(seen) == 105


def test_fewer_partitions_than_ranks(spark):
    one = spark.range(10).coalesce(1)
    ranks = HorovodRunner(np=2).run_all(read_epochs, data=shards(one, shuffle=False), epochs=1, batch_size=4)
    a, b = ranks[0]["epochs"][0], ranks[1]["epochs"][0]
    assert len(a) == len(b) == 5 and sorted(a + b) == list(range(10))
    # without shuffling, an epoch reads the rows in the same order every time
    again = HorovodRunner(np=2).run_all(read_epochs, data=shards(one, shuffle=False), epochs=2, batch_size=4)
    assert again[0]["epochs"][0] == again[0]["epochs"][1]


def test_bad_dataframes_are_refused_before_launch(spark, df):
    with pytest.raises(LaunchRefused, match="empty"):
        HorovodRunner(np=2).run(read_epochs, data=shards(spark.range(0)), epochs=1, batch_size=4)
    with pytest.raises(LaunchRefused, match=r"column 'name' has type string, .*StringIndexer\(inputCol='name'"):
        shards(spark.createDataFrame([("a", 1)], ["name", "n"]))
    typed = spark.sql("select cast(1.5 as decimal(10,2)) as price, timestamp'2026-01-01 00:00:00' as t, "
                      "array(cast(1 as decimal(4,1))) as ds")
    with pytest.raises(LaunchRefused, match=r"column 'price' has type decimal\(10,2\), .*cast it first: "
                       r"df.withColumn\('price', F.col\('price'\).cast\('double'\)\)"):
        shards(typed, ["price"])
    with pytest.raises(LaunchRefused, match=r"column 't' has type timestamp, .*F.unix_timestamp\(F.col\('t'\)\)"):
        shards(typed, ["t"])
    with pytest.raises(LaunchRefused, match=r"column 'ds' has type array<decimal\(4,1\)>, .*cast\('array<double>'\)"):
        shards(typed, ["ds"])
    with pytest.raises(LaunchRefused, match=r"\['nope'\] are not in the DataFrame"):
        shards(df, ["nope"])
    with pytest.raises(LaunchRefused, match="np > 0"):
        HorovodRunner(np=-2).run(read_epochs, data=shards(df), epochs=1, batch_size=4)
    with pytest.raises(LaunchRefused, match="as a keyword argument"):
        HorovodRunner(np=2).run(read_epochs, shards(df), 1, 4)


def test_dataframes_that_leave_ranks_nothing_or_are_not_dataframes_are_refused(spark, df):
    import pandas as pd

    one = spark.range(1)
    with pytest.raises(LaunchRefused, match=r"has 1 row\(s\), fewer than the 2 ranks: remainder='drop' leaves every "
                                            r"rank empty; use shards\(df, remainder='pad'\)"):
        HorovodRunner(np=2).run(read_epochs, data=shards(one), epochs=1, batch_size=4)
    padded = HorovodRunner(np=2).run_all(read_epochs, data=shards(one, remainder="pad"), epochs=1, batch_size=4)
    assert [r["epochs"][0] for r in padded] == [[0], [0]]
    for bad, match in [(pd.DataFrame({"a": [1]}), r"got pandas[.\w]*DataFrame: .*spark.createDataFrame\(pdf\)"),
                       (None, "takes a pyspark.sql.DataFrame, got None"),
                       (spark.sparkContext.parallelize([1]), r"got pyspark.core.rdd.RDD: .*rdd.toDF\(\)")]:
        with pytest.raises(LaunchRefused, match=match):
            shards(bad)
    stream = spark.readStream.format("rate").load()
    with pytest.raises(LaunchRefused, match="streaming DataFrame: .*spark.read.table"):
        shards(stream)


@pytest.mark.parametrize("kwargs, match", [
    ({"columns": []}, r"columns\) must be a column name or a non-empty list of column names \(str\), got \[\]"),
    ({"columns": ["id", 3]}, r"non-empty list of column names .*got \['id', 3\]"),
    ({"seed": "a"}, "seed must be an int"),
    ({"seed": 1.5}, "seed must be an int"),
    ({"shuffle": "yes"}, "shuffle must be True or False"),
])
def test_bad_shard_options_are_refused(df, kwargs, match):
    with pytest.raises(LaunchRefused, match=match):
        shards(df, **kwargs)


def read_odd_columns(data):
    import numpy

    spark_dl.init()
    batch = next(data.batches(numpy.int64(8), epoch=numpy.int64(0)))
    out = {k: v.tolist() for k, v in batch.items()}
    for bad in (2.5, "4", None):
        try:
            next(data.batches(bad))
        except ValueError as e:
            out[f"batch_size={bad!r}"] = str(e)
    try:
        next(data.batches(4, epoch=1.5))
    except ValueError as e:
        out["epoch"] = str(e)
    return out


def test_odd_column_names_one_name_huge_seeds_and_numpy_counts(spark):
    """A column named with a dot (not a nested field), one name as a str, a seed from
    time.time_ns() (past 64 bits once mixed with the epoch), numpy batch sizes and epochs."""
    from pyspark.sql import functions as F

    df = spark.range(8).select(F.col("id").alias("a.b"), (F.col("id") * 2).alias("y"))
    out = HorovodRunner(np=2).run(read_odd_columns, data=shards(df, ["a.b", "y"], seed=1_800_000_000_000_000_000))
    assert sorted(out) == sorted(["a.b", "y", "batch_size=2.5", "batch_size='4'", "batch_size=None", "epoch"])
    assert [2 * a for a in out["a.b"]] == out["y"] and len(out["y"]) == 4
    assert "batch_size must be an int >= 1, got 2.5" in out["batch_size=2.5"]
    assert "epoch must be an int" in out["epoch"]
    single = HorovodRunner(np=2).run(read_odd_columns, data=shards(df, "y"))
    assert "y" in single and "a.b" not in single
    twice = df.crossJoin(df.select("y"))  # two columns named y
    with pytest.raises(LaunchRefused, match=r"more than one column named \['y'\]"):
        shards(twice, ["y"])


def read_arrays(data):
    spark_dl.init()
    try:
        return next(data.batches(4))["x"].tolist()
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("rows, match", [
    ("array(1.0D, NULL)", "has null elements inside its arrays"),
    ("CAST(NULL AS array<double>)", "has null rows"),
])
def test_nulls_in_array_columns_are_named(spark, rows, match):
    df = spark.sql(f"SELECT id, IF(id = 1, {rows}, array(1.0D, 2.0D)) AS x FROM range(4)")
    out = HorovodRunner(np=2).run_all(read_arrays, data=shards(df, ["x"]))
    assert any(isinstance(o, str) and match in o for o in out), out


def test_a_dataframe_of_a_stopped_session_is_refused():
    """Its own SparkSession, in a subprocess: stopping the shared one would end the test session's."""
    import subprocess
    import sys

    code = (
        "from pyspark.sql import SparkSession\n"
        "from spark_dl.data import shards\n"
        "s = SparkSession.builder.master('local[1]').config('spark.ui.enabled', 'false').getOrCreate()\n"
        "df = s.range(4)\n"
        "s.stop()\n"
        "shards(df)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "LaunchRefused" in proc.stderr and "a SparkSession that was stopped" in proc.stderr
    assert "Py4J" not in proc.stderr


def read_then_fail_once(data, epochs, batch_size):
    import os

    out = read_epochs(data, epochs, batch_size)
    if spark_dl.get_context().attempt == 0 and spark_dl.get_context().rank == 1:
        os._exit(4)
    return {**out, "attempt": spark_dl.get_context().attempt}


def test_a_restarted_run_reads_the_dataframe_again(df):
    runner = HorovodRunner(np=2, max_restarts=1)
    ranks = runner.run_all(read_then_fail_once, data=shards(df, ["id"], seed=7), epochs=1, batch_size=16)
    assert [r["attempt"] for r in ranks] == [1, 1] and runner.last_run.attempts == 2
    a, b = ranks[0]["epochs"][0], ranks[1]["epochs"][0]
    assert len(a) == len(b) == 51 and not set(a) & set(b) and len(set(a) | set(b)) == 102
    assert all("restart1" in r["shard_file"] for r in ranks)  # the second attempt's own partition files


def read_two(train, val):
    import torch.distributed as dist

    spark_dl.init()
    mine = {"train": [int(v) for b in train.batches(4) for v in b["id"]],
            "val": [(float(b["y"][i]), b["v"][i].tolist()) for b in val.batches(3) for i in range(len(b["y"]))],
            "columns": (train.columns, val.columns)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def test_several_dataframes_in_one_run_each_sharded_on_its_own(spark, df):
    val = spark.createDataFrame([(float(i), [float(i), -float(i)]) for i in range(7)], "y double, v array<double>")
    out = HorovodRunner(np=2).run(read_two, train=shards(df.select("id"), shuffle=False),
                                  val=shards(val, shuffle=False, remainder="pad"))
    train = out[0]["train"] + out[1]["train"]
    assert len(train) == len(set(train)) == 102 and set(train) <= set(range(103))  # 103 rows, "drop": one left out
    held_out = out[0]["val"] + out[1]["val"]
    assert len(out[0]["val"]) == len(out[1]["val"]) == 4  # 7 rows padded to 4 per rank
    assert {y for y, _ in held_out} == {float(i) for i in range(7)} and all(v == [y, -y] for y, v in held_out)
    assert out[0]["columns"] == (["id"], ["y", "v"])


def test_the_same_shards_twice_is_refused(df):
    data = shards(df)
    with pytest.raises(LaunchRefused, match="same shards"):
        HorovodRunner(np=2).run(read_two, train=data, val=data)


def test_without_shuffling_the_dropped_rows_move_on_each_epoch(spark):
    one = spark.range(10).coalesce(1)
    # 10 rows on 3 ranks: one dropped per epoch, a different one each epoch, in a fixed order
    ranks = HorovodRunner(np=3).run_all(read_epochs, data=shards(one, shuffle=False), epochs=3, batch_size=2)
    epochs = [[i for r in ranks for i in r["epochs"][e]] for e in range(3)]  # in rank order
    assert all(len(e) == len(set(e)) == 9 for e in epochs)
    dropped = [set(range(10)) - set(e) for e in epochs]
    assert all(len(d) == 1 for d in dropped) and len(set.union(*dropped)) == 3
    # the same order, each epoch starting one row later
    assert epochs[1][:-1] == epochs[0][1:] and epochs[2][:-1] == epochs[1][1:]


def read_padding(data):
    spark_dl.init()
    return [(int(i), bool(p)) for b in data.batches(2, padding="is_pad") for i, p in zip(b["id"], b["is_pad"])]


def test_padding_marks_the_rows_pad_repeats(spark):
    ranks = HorovodRunner(np=3).run_all(read_padding, data=shards(spark.range(7), shuffle=False, remainder="pad"))
    rows = [row for r in ranks for row in r]
    assert len(rows) == 9 and sorted(i for i, pad in rows if not pad) == list(range(7))
    assert [i for i, pad in rows if pad] == [i for i, _ in rows[:2]]  # wrapped around to the start
    assert [pad for _, pad in rows] == [False] * 7 + [True] * 2


def read_in_every_pattern(data, batch_size):
    import itertools

    spark_dl.init()

    def ids(batches):
        return [b["id"].tolist() for b in batches]

    out = {p: [ids(data.batches(batch_size, epoch=e, prefetch=p)) for e in range(2)] for p in (False, True)}
    # two iterators open at once: they fetch in turn, in one order on every rank
    out["zipped"] = [(a["id"].tolist(), b["id"].tolist())
                     for a, b in zip(data.batches(batch_size, epoch=0), data.batches(batch_size, epoch=1))]
    # an epoch cut short (as train_steps_per_epoch does), then the next
    out["short"] = ids(itertools.islice(data.batches(batch_size, epoch=0), 2))
    # one cut short and still open while the next epoch is read: its fetch in flight comes first
    cut = data.batches(batch_size, epoch=1)
    out["cut"] = ids([next(cut), next(cut)])
    out["while_open"] = ids(data.batches(batch_size, epoch=0))
    del cut
    out["after"] = ids(data.batches(batch_size, epoch=1))
    return out


def test_the_next_batch_is_fetched_in_the_background_and_every_pattern_reads_the_same_rows(df):
    ranks = HorovodRunner(np=2).run_all(read_in_every_pattern, data=shards(df, ["id"], seed=3), batch_size=8)
    for r in ranks:
        plain = r[False]
        assert r[True] == plain and len(plain[0]) == 7  # 51 rows: 6 batches of 8 and one of 3
        assert r["zipped"] == list(zip(plain[0], plain[1]))
        assert r["short"] == plain[0][:2] and r["cut"] == plain[1][:2]
        assert r["while_open"] == plain[0] and r["after"] == plain[1]
    assert not set(sum(ranks[0][False][0], [])) & set(sum(ranks[1][False][0], []))
