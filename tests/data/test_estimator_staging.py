"""Horovod's Parquet staging: ``prepare_data`` writes a DataFrame's rows once into a Store (the
executors write the files), ``TorchEstimator.fit_on_parquet`` trains on them; Horovod's imports
as they are, on real barrier stages."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from spark_dl.estimator import TorchEstimator
from spark_dl.horovod import staging
from spark_dl.horovod.store import Store

from spark_dl import LaunchRefused


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, a, b):
        return self.w(torch.stack([a, b], dim=1)).squeeze(1)


def _regression(spark, rows=400):
    from pyspark.sql import functions as F

    df = spark.range(rows).select((F.rand(1) * 2 - 1).alias("a"), (F.rand(2) * 2 - 1).alias("b"))
    return (df.withColumn("y", 3 * F.col("a") - 2 * F.col("b") + 0.5)
              .withColumn("y2", F.col("a") + F.col("b")).withColumn("is_val", F.col("a") > 0.8))


@pytest.fixture
def forget_staged():
    """This process's staged data sets forgotten after the test, as a later test expects none."""
    yield
    staging.clear_training_cache()


def _files(path):
    return {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)}


def test_prepare_data_stages_once_on_the_executors_and_fit_on_parquet_trains_on_it(spark_cluster, tmp_path,
                                                                                     horovod_imports, forget_staged):
    """On two executor JVMs: the staged folders hold exactly the rows the estimator's own split would
    (same seed), a fit on them converges and reports the held-out loss, staging the same DataFrame
    again reuses the files, other columns get the next index, the data outlives the block, a param
    map applies to one fit only, and clear_training_cache(remove_data=True) deletes it."""
    import horovod.spark.torch as hvd
    from horovod.spark.common import util
    from horovod.spark.common.store import Store as HorovodStore

    spark = spark_cluster
    store = HorovodStore.create(str(tmp_path / "store"))
    df = _regression(spark)
    with util.prepare_data(2, store, df, label_columns=["y"], feature_columns=["a", "b"], validation=0.25) as idx:
        assert idx == 0
        assert store.get_train_data_path(idx) == f"{tmp_path}/store/intermediate_train_data.0"
        train = spark.read.parquet(store.get_train_data_path(idx))
        held = spark.read.parquet(store.get_val_data_path(idx))
        assert train.columns == ["a", "b", "y"] and train.rdd.getNumPartitions() <= 20
        expected_train, expected_held = df.randomSplit([0.75, 0.25], seed=0)  # fit(df, validation=0.25)'s rows

        def rows(d):
            return sorted(tuple(r) for r in d.select("a", "b", "y").collect())
        assert rows(train) == rows(expected_train) and rows(held) == rows(expected_held)
        props = util.get_dataset_properties(idx)
        assert props == {"train_rows": train.count(), "val_rows": held.count(), "columns": ["a", "b", "y"]}
        assert props["train_rows"] + props["val_rows"] == 400 and 60 < props["val_rows"] < 140

        torch.manual_seed(0)
        est = hvd.TorchEstimator(num_proc=2, store=store, model=TwoInputs(),
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                 loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols=["y"],
                                 batch_size=16, epochs=12, validation=0.25, verbose=0, log_model=False)
        fitted = est.fit_on_parquet(dataset_idx=idx)
        w, bias = fitted.getModel().w.weight.detach()[0].tolist(), fitted.getModel().w.bias.item()
        assert w == pytest.approx([3, -2], abs=0.05) and bias == pytest.approx(0.5, abs=0.05)
        assert len(fitted.history) == len(fitted.val_history) == 12 and fitted.val_history[-1] < 0.01
        assert os.path.isfile(os.path.join(store.get_checkpoint_path(est.last_run_id), "latest.ckpt"))

        before = _files(store.get_train_data_path(idx))
        with util.prepare_data(2, store, df, label_columns=["y"], feature_columns=["a", "b"],
                               validation=0.25) as again:
            assert again == idx and _files(store.get_train_data_path(idx)) == before  # not written again
        with util.prepare_data(2, store, df, label_columns="y2", feature_columns=["a", "b"]) as other:
            assert other == 1 and not store.exists(store.get_val_data_path(other))
            assert spark.read.parquet(store.get_train_data_path(other)).count() == 400

    assert store.exists(store.get_train_data_path(0)) and store.exists(store.get_train_data_path(1))
    one_epoch = est.fit_on_parquet(params={est.epochs: 1}, dataset_idx=0)
    assert len(one_epoch.history) == 1 and est.getEpochs() == 12
    util.clear_training_cache(remove_data=True)
    assert sorted(os.listdir(store.prefix_path)) == ["runs"]
    with pytest.raises(LaunchRefused, match="dataset_idx=0 is no data set prepare_data staged in this process"):
        util.get_dataset_properties(0)


def test_a_new_data_set_never_overwrites_files_already_in_the_store(spark, tmp_path):
    store = Store.create(str(tmp_path / "store"), train_path=str(tmp_path / "mine"), runs_path=str(tmp_path / "runs"))
    assert store.get_train_data_path(3) == f"{tmp_path}/mine.3" and store.get_run_path("r") == f"{tmp_path}/runs/r"
    assert store.get_val_data_path() == f"{tmp_path}/store/intermediate_val_data"
    os.makedirs(f"{tmp_path}/mine.0")  # another process's data set
    open(f"{tmp_path}/mine.0/keep", "w").close()
    df = _regression(spark, rows=50)
    try:
        with staging.prepare_data(2, store, df, "y", ["a", "b"], partitions_per_process=1) as idx:
            assert idx == 1 and os.listdir(f"{tmp_path}/mine.0") == ["keep"]
            assert spark.read.parquet(store.get_train_data_path(idx)).rdd.getNumPartitions() <= 2
            # the estimator reads the estimator's columns only, so extra staged columns are fine; missing ones are not
            est = TorchEstimator(num_proc=2, store=store, model=TwoInputs(), optimizer=torch.optim.SGD,
                                 loss=torch.nn.functional.mse_loss, feature_cols=["a", "y2"], label_cols="y")
            with pytest.raises(LaunchRefused, match=r"fit_on_parquet: columns \['y2'\] are not in the staged data at "
                               rf"{tmp_path}/mine.1 \(it has \['a', 'b', 'y'\]\); stage them with prepare_data"):
                est.fit_on_parquet(dataset_idx=idx)
    finally:
        staging.clear_training_cache(remove_data=True)
    assert os.listdir(f"{tmp_path}/mine.0") == ["keep"] and not os.path.exists(f"{tmp_path}/mine.1")


class VectorInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.w(x).squeeze(1)


def test_spark_ml_vectors_stage_as_spark_stores_them_and_train_dense(spark, tmp_path):
    """A Spark ML Vector column, every third row a SparseVector, is staged as a Vector column, with
    compress_sparse=True as Horovod code passes it, and the fit reads it dense."""
    import random

    from pyspark.ml.linalg import Vectors, VectorUDT

    rng = random.Random(0)
    rows = []
    for i in range(300):
        a, b = rng.uniform(-1, 1), rng.uniform(-1, 1)
        x = Vectors.sparse(2, {0: a}) if i % 3 == 0 else Vectors.dense([a, b])
        rows.append((x, 3 * a - 2 * (0.0 if i % 3 == 0 else b)))
    df = spark.createDataFrame(rows, ["x", "y"])
    store = Store.create(str(tmp_path / "store"))
    try:
        with staging.prepare_data(2, store, df, "y", "x", compress_sparse=True) as idx:
            staged = spark.read.parquet(store.get_train_data_path(idx))
            assert isinstance(staged.schema["x"].dataType, VectorUDT)
            assert sorted(r.x.toArray().tolist() for r in staged.collect()) == sorted(
                r.x.toArray().tolist() for r in df.collect())
            torch.manual_seed(0)
            fitted = TorchEstimator(num_proc=2, store=store, model=VectorInput(),
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y",
                                    batch_size=16, epochs=3, verbose=0, log_model=False).fit_on_parquet(dataset_idx=idx)
            assert len(fitted.history) == 3 and fitted.history[-1] < fitted.history[0] / 3
    finally:
        staging.clear_training_cache(remove_data=True)


def test_staging_and_fit_on_parquet_refusals_name_the_fix(spark, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    df = _regression(spark, rows=40)
    good = dict(num_processes=2, store=store, df=df, label_columns=["y"], feature_columns=["a", "b"])
    for change, match in [
        ({"store": str(tmp_path)}, r"prepare_data stages its Parquet files in a Store: pass store=Store.create"),
        ({"num_processes": 0}, "num_processes=0 and partitions_per_process=10 must both be ints > 0"),
        ({"partitions_per_process": 1.5}, "num_processes=2 and partitions_per_process=1.5 must both be ints > 0"),
        ({"seed": None}, r"seed must be an int \(the validation split's\), got None"),
        ({"compress_sparse": "yes"}, r"compress_sparse must be True or False, got 'yes'"),
        ({"label_columns": []}, r"prepare_data needs label_columns"),
        ({"feature_columns": ["a", "c"]},
         r"prepare_data: columns \['c'\] are not in the DataFrame \(it has \['a', 'b'"),
        ({"sample_weight_col": "w"}, r"columns \['w'\] are not in the DataFrame"),
        ({"validation": 1.5}, r"validation=1.5 must be a fraction in \(0, 1\), a column name, or None"),
        ({"validation": "held"}, "validation='held' is not a column of the DataFrame"),
        ({"validation": 1}, "validation must be a fraction .* got int"),
        ({"df": df.toPandas()}, r"prepare_data\(df\) takes a pyspark.sql.DataFrame, got pandas.*spark.createDataFrame"),
    ]:
        with pytest.raises(LaunchRefused, match=match):
            with staging.prepare_data(**{**good, **change}):
                pytest.fail("staged")
    # nothing is left behind by a staging that finds no rows to hold out, or none to train on
    for change, match in [
        ({"df": df.filter("a > 2"), "validation": 0.5}, r"no training rows to stage \(the DataFrame has no rows\)"),
        ({"df": df.filter("a < 0.5"), "validation": "is_val"}, r"validation='is_val' held out no rows"),
        ({"df": df.filter("a > 0.8"), "validation": "is_val"}, r"no training rows to stage \(validation='is_val' "
                                                               r"held out all \d+ rows\)"),
    ]:
        with pytest.raises(LaunchRefused, match=match):
            with staging.prepare_data(**{**good, **change}):
                pytest.fail("staged")
        assert not os.path.exists(store.prefix_path) or os.listdir(store.prefix_path) == []
    # the estimator: no store, no staged data, a bad index, validation without staged held-out rows
    est = dict(num_proc=2, model=TwoInputs(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
               feature_cols=["a", "b"], label_cols="y")
    with pytest.raises(LaunchRefused, match=r"fit_on_parquet reads the Parquet data prepare_data staged in a Store: "
                                            r"build the estimator with store=Store.create"):
        TorchEstimator(**est).fit_on_parquet()
    with pytest.raises(LaunchRefused, match=rf"fit_on_parquet\(dataset_idx=4\): no staged training data at "
                                            rf"{tmp_path}/store/intermediate_train_data.4; stage it first: with "
                                            r"prepare_data\(num_proc, store, df"):
        TorchEstimator(**est, store=store).fit_on_parquet(dataset_idx=4)
    for bad in ("0", -1, 1.0):
        with pytest.raises(LaunchRefused, match="dataset_idx must be the int prepare_data yields"):
            TorchEstimator(**est, store=store).fit_on_parquet(dataset_idx=bad)
    with pytest.raises(LaunchRefused, match=r"fit_on_parquet\(params=\) takes one param map"):
        TorchEstimator(**est, store=store).fit_on_parquet(params=[{}])
    try:
        with staging.prepare_data(**good) as idx:
            with pytest.raises(LaunchRefused, match=rf"validation=0.2, but data set {idx} has no held-out rows \(no "
                                                    rf"{tmp_path}/store/intermediate_val_data.{idx}\): stage them with "
                                                    r"prepare_data\(..., validation=0.2\)"):
                TorchEstimator(**est, store=store, validation=0.2).fit_on_parquet(dataset_idx=idx)
    finally:
        staging.clear_training_cache(remove_data=True)
    with pytest.raises(LaunchRefused, match=r"Store.create takes prefix_path and the keywords train_path, val_path, "
                                            r"test_path, runs_path here; got \['storage_options'\] more"):
        Store.create(str(tmp_path), storage_options={})
