"""TorchEstimator and TorchModel as Spark ML stages: in a ``Pipeline`` after a Spark stage, and saved
and loaded (alone and in a ``PipelineModel``) through Spark ML's writers, predictions unchanged."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from spark_dl.estimator import TorchEstimator, TorchModel

from spark_dl.errors import LaunchRefused


def _digits(spark):
    from sklearn.datasets import load_digits

    d = load_digits()
    rows = [([float(v) for v in x], int(y)) for x, y in zip(d.data[:600], d.target[:600])]
    return spark.createDataFrame(rows, "pixels array<float>, label long")


def _estimator(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return TorchEstimator(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                          loss=torch.nn.functional.cross_entropy, feature_cols="scaled", label_cols="label",
                          batch_size=32, epochs=4, num_proc=2, log_model=False, **options)


def _predictions(df):
    return np.array([r.prediction for r in df.orderBy("id").select("prediction").collect()])


def test_a_pipeline_fits_a_spark_stage_then_the_estimator_and_saves_and_loads_as_one(spark, tmp_path):
    from pyspark.ml import Estimator, Model, Pipeline, PipelineModel
    from pyspark.ml.feature import SQLTransformer
    from pyspark.sql import functions as F

    df = _digits(spark).withColumn("id", F.monotonically_increasing_id())
    scale = SQLTransformer(statement="SELECT *, transform(pixels, v -> v / 16) AS scaled FROM __THIS__")
    est = _estimator()
    assert isinstance(est, Estimator) and est.uid.startswith("TorchEstimator_")
    fitted = Pipeline(stages=[scale, est]).fit(df)
    torch_stage = fitted.stages[1]
    assert isinstance(torch_stage, TorchModel) and isinstance(torch_stage, Model)
    assert len(torch_stage.history) == 4 and torch_stage.history[-1] < torch_stage.history[0] / 2
    predicted = fitted.transform(df)
    rows = predicted.select("label", "prediction").collect()
    assert np.mean([int(np.argmax(r.prediction)) == r.label for r in rows]) > 0.9
    before = _predictions(predicted)

    fitted.save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    again = loaded.stages[1]
    assert isinstance(again, TorchModel) and again.uid == torch_stage.uid
    assert again.feature_cols == ["scaled"] and again.history == torch_stage.history
    np.testing.assert_array_equal(_predictions(loaded.transform(df)), before)

    # a param map for another stage passes through the estimator (Spark ML's copy of every stage)
    other = SQLTransformer(statement="SELECT *, transform(pixels, v -> v / 8) AS scaled FROM __THIS__")
    refit = Pipeline(stages=[other, _estimator()]).fit(df, {other.statement: scale.getStatement()})
    assert refit.stages[1].history == pytest.approx(torch_stage.history, rel=1e-5)


def test_a_torch_model_saves_and_loads_with_its_histories_and_shapes(spark, tmp_path):
    from pyspark.sql import functions as F

    df = (_digits(spark).withColumn("scaled", F.transform("pixels", lambda v: v / 16))
          .withColumn("id", F.monotonically_increasing_id()))
    model = _estimator(validation=0.2, metrics={"acc": lambda out, y: (out.argmax(1) == y).float().mean()}).fit(df)
    path = str(tmp_path / "m")
    model.save(path)
    assert sorted(os.listdir(path)) == ["metadata", "model"]
    loaded = TorchModel.load(path)
    assert loaded.getHistory() == model.getHistory() and set(loaded.getHistory()) == {"loss", "val_loss", "acc",
                                                                                       "val_acc"}
    assert (loaded.feature_cols, loaded.prediction_col, loaded.input_shapes, loaded.label_cols) == (
        ["scaled"], "prediction", None, ["label"])
    np.testing.assert_array_equal(_predictions(loaded.transform(df)), _predictions(model.transform(df)))

    with pytest.raises(Exception, match="already exists"):
        model.save(path)  # Spark ML's rule: overwrite() to replace
    model.write().overwrite().save(path)
    assert TorchModel.load(path).uid == model.uid

    shaped = TorchModel(torch.nn.Flatten(), ["pixels"], input_shapes=[(-1, 8, 8)])
    shaped.write().save(str(tmp_path / "shaped"))
    assert TorchModel.load(str(tmp_path / "shaped")).input_shapes == [(-1, 8, 8)]


def test_loading_something_else_as_a_torch_model_is_refused_naming_it(spark, tmp_path):
    from pyspark.ml.feature import SQLTransformer

    SQLTransformer(statement="SELECT * FROM __THIS__").save(str(tmp_path / "sql"))
    with pytest.raises(ValueError, match=r"holds a org\.apache\.spark\.ml\.feature\.SQLTransformer, not a spark-dl "
                                         r"TorchModel: load it with that class"):
        TorchModel.load(str(tmp_path / "sql"))
    with pytest.raises(TypeError, match="TorchModel.load takes a path"):
        TorchModel.load(tmp_path / "sql")


def test_spark_ml_vector_columns_train_and_predict_as_arrays(spark):
    """A VectorAssembler's (sparse where rows are mostly zeros) and a StandardScaler's outputs feed
    the estimator as they are; transform keeps the input columns, types included."""
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.sql import functions as F

    df = spark.range(400).select((F.rand(1) * 4).alias("a"), F.when(F.rand(2) > 0.7, F.rand(3) * 2).otherwise(0.0)
                                 .alias("b"), *[F.lit(0.0).alias(f"z{i}") for i in range(4)])
    df = df.withColumn("y", 3 * F.col("a") - 2 * F.col("b") + 0.5)
    assembler = VectorAssembler(inputCols=["a", "b", "z0", "z1", "z2", "z3"], outputCol="raw")
    assert any(r.raw.__class__.__name__ == "SparseVector" for r in assembler.transform(df).collect())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 1), torch.nn.Flatten(0))
    est = TorchEstimator(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols="features", label_cols="y",
                         batch_size=16, epochs=40, num_proc=2, log_model=False)
    fitted = Pipeline(stages=[assembler, StandardScaler(inputCol="raw", outputCol="features"), est]).fit(df)
    out = fitted.transform(df)
    assert out.columns == ["a", "b", "z0", "z1", "z2", "z3", "y", "raw", "features", "prediction"]
    assert out.schema["features"].dataType.typeName() == "vectorudt"
    rows = out.collect()
    assert np.mean([abs(r.prediction - r.y) for r in rows]) < 0.1
    module = fitted.stages[2].getModel()
    for column in ("features", "raw"):  # dense (StandardScaler's) and partly sparse (VectorAssembler's)
        predicted = TorchModel(module, [column], prediction_col="p").transform(out).collect()
        with torch.no_grad():  # the executors read each vector as its dense array
            expected = module(torch.tensor(np.array([r[column].toArray() for r in predicted]), dtype=torch.float32))
        torch.testing.assert_close(torch.tensor([r.p for r in predicted]), expected)


def test_transform_runs_no_job_where_the_schema_gives_each_columns_size_and_else_reads_a_row(spark):
    """Numbers, Spark ML vectors (their size is in the column's metadata) and arrays with
    input_shapes: transform is lazy, as Spark ML's own transformers are, so it cuts short no
    Python worker upstream. A bare array column's size is read off the first row; a model that
    refuses zeros is run on that row too."""
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    df = spark.range(8).select((F.col("id") + 1.0).alias("a"), F.array(F.col("id") * 1.0, F.lit(1.0)).alias("arr"))
    df = VectorAssembler(inputCols=["a", "a"], outputCol="vec").transform(df)
    tracker = spark.sparkContext.statusTracker()

    def jobs_of(make) -> tuple[int, object]:
        group = f"probe-{id(make)}"
        spark.sparkContext.setJobGroup(group, "transform only")
        try:
            out = make()
        finally:
            spark.sparkContext.setJobGroup("", "")
        return len(tracker.getJobIdsForGroup(group)), out

    class Positive(torch.nn.Module):  # refuses what is not a real row
        def forward(self, x):
            if not bool((x > 0).all()):
                raise ValueError("inputs must be positive")
            return x * 1.0

    column = torch.nn.Unflatten(0, (-1, 1))  # a number column's batch: one value a row
    lazy = [TorchModel(torch.nn.Sequential(column, torch.nn.Linear(1, 3)), ["a"]),
            TorchModel(torch.nn.Linear(2, 1), ["vec"]),
            TorchModel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2)), ["arr"],
                       input_shapes=[[-1, 1, 2]])]
    for model in lazy:
        n, out = jobs_of(lambda model=model: model.transform(df))
        assert n == 0, model.getModel()
        assert len(out.collect()) == 8
    n, out = jobs_of(lambda: TorchModel(torch.nn.Linear(2, 1), ["arr"]).transform(df))
    assert n >= 1  # the first row gives the array's size
    n, out = jobs_of(lambda: TorchModel(Positive(), ["a"]).transform(df))
    assert n >= 1  # zeros refused: the first row is read instead
    assert sorted(r.prediction for r in out.collect()) == [float(i) for i in range(1, 9)]
    # an empty DataFrame transforms to an empty one where no row is needed, and is refused where one is
    assert TorchModel(torch.nn.Sequential(column, torch.nn.Linear(1, 3)), ["a"]).transform(df.limit(0)).collect() == []
    with pytest.raises(LaunchRefused, match="empty.*input_shapes= gives the array columns' sizes"):
        TorchModel(torch.nn.Linear(2, 1), ["arr"]).transform(df.limit(0))
