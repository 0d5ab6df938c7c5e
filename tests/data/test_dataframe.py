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
    out = {"len": len(data), "total": data.total_rows, "epochs": [], "shard_file": os.path.join(directory, f"{data.key}.arrow"),
           "shard_files": sorted(os.listdir(directory))}
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
    with pytest.raises(LaunchRefused, match=r"column 'name' has type string"):
        shards(spark.createDataFrame([("a", 1)], ["name", "n"]))
    with pytest.raises(LaunchRefused, match=r"\['nope'\] are not in the DataFrame"):
        shards(df, ["nope"])
    with pytest.raises(LaunchRefused, match="np > 0"):
        HorovodRunner(np=-2).run(read_epochs, data=shards(df), epochs=1, batch_size=4)
    with pytest.raises(LaunchRefused, match="as a keyword argument"):
        HorovodRunner(np=2).run(read_epochs, shards(df), 1, 4)


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
