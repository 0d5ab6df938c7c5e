"""TorchEstimator saved and loaded through Spark ML's writers: alone (every setting, the model's
weights and the optimizer's state), in an unfitted Pipeline, and in a tuned CrossValidatorModel;
what cannot be saved or loaded is refused naming it."""
from __future__ import annotations

import functools
import threading

import pytest
import torch
from pyspark.errors import AnalysisException
from pyspark.ml.util import DefaultParamsReader
from spark_dl.estimator import TorchEstimator, TorchModel
from test_estimator_params import _Line, _lines


def _estimator(**options) -> TorchEstimator:
    torch.manual_seed(0)
    settings = dict(model=_Line(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                    loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols="y", batch_size=16,
                    epochs=3, num_proc=2, log_model=False, random_seed=0)
    return TorchEstimator(**{**settings, **options})


def test_an_estimator_saves_and_loads_every_setting_and_fits_as_before(spark, tmp_path):
    df = _lines(spark)
    model = _Line()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model(torch.ones(4), torch.ones(4)).sum().backward()
    optimizer.step()  # state (Adam's moments) the loaded optimizer must keep, on the loaded model's weights
    est = _estimator(model=model, optimizer=optimizer, metrics={"mae": lambda out, y: (out - y).abs().mean()},
                     validation=0.2, max_restarts=1)
    path = str(tmp_path / "est")
    est.save(path)

    loaded = TorchEstimator.load(path)
    assert isinstance(loaded, TorchEstimator) and loaded.uid == est.uid
    assert (loaded.getEpochs(), loaded.getBatchSize(), loaded.getFeatureCols(), loaded.getValidation()) == (
        3, 16, ["a", "b"], 0.2)
    assert loaded.runner_options == {"max_restarts": 1}
    for a, b in zip(loaded.getModel().parameters(), model.parameters()):
        assert torch.equal(a, b) and a is not b
    opt = loaded.getOptimizer()
    assert [p for g in opt.param_groups for p in g["params"]] == list(loaded.getModel().parameters())
    assert opt.state_dict()["state"][0]["step"] == 1  # Adam's state came along
    assert loaded.explainParam(loaded.epochs) == est.explainParam(est.epochs)
    meta = DefaultParamsReader.loadMetadata(path, spark)
    assert meta["paramMap"]["epochs"] == 3 and "model" not in meta["paramMap"]  # the plain ones, readable

    fitted, refitted = est.fit(df), loaded.fit(df)
    assert refitted.history == pytest.approx(fitted.history, rel=1e-5)
    assert refitted.metric_history["val_mae"] == pytest.approx(fitted.metric_history["val_mae"], rel=1e-5)

    with pytest.raises(AnalysisException, match="already exists"):
        est.save(path)  # Spark ML's rule: overwrite() to replace
    est.setEpochs(5).write().overwrite().save(path)
    assert TorchEstimator.load(path).getEpochs() == 5


def test_an_unfitted_pipeline_with_the_estimator_saves_and_loads(spark, tmp_path):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import SQLTransformer

    scale = SQLTransformer(statement="SELECT *, a * 2 AS a2 FROM __THIS__")
    pipeline = Pipeline(stages=[scale, _estimator(feature_cols=["a2", "b"], epochs=2)])
    pipeline.save(str(tmp_path / "pipeline"))
    loaded = Pipeline.load(str(tmp_path / "pipeline"))
    est = loaded.getStages()[1]
    assert isinstance(est, TorchEstimator) and est.getFeatureCols() == ["a2", "b"] and est.getEpochs() == 2
    fitted = loaded.fit(_lines(spark))
    assert isinstance(fitted.stages[1], TorchModel) and len(fitted.stages[1].history) == 2


def test_a_cross_validator_model_over_the_estimator_saves_and_loads(spark, tmp_path):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder

    df = _lines(spark, 240)
    est = _estimator()
    grid = ParamGridBuilder().addGrid(est.epochs, [1, 6]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1, parallelism=2,
                        evaluator=RegressionEvaluator(labelCol="y", predictionCol="prediction"))
    tuned = cv.fit(df)
    assert tuned.avgMetrics[1] < tuned.avgMetrics[0]  # more epochs fit the line better
    tuned.save(str(tmp_path / "cv"))
    loaded = CrossValidatorModel.load(str(tmp_path / "cv"))
    assert loaded.avgMetrics == tuned.avgMetrics
    assert isinstance(loaded.getEstimator(), TorchEstimator) and loaded.getEstimator().uid == est.uid
    assert [m[loaded.getEstimator().epochs] for m in loaded.getEstimatorParamMaps()] == [1, 6]
    best = loaded.bestModel
    assert isinstance(best, TorchModel) and best.history == tuned.bestModel.history
    rows = loaded.transform(df).select("prediction").collect()
    assert [r.prediction for r in rows] == pytest.approx([r.prediction for r in tuned.transform(df).collect()])


class _Locked(_Line):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def test_a_setting_that_cannot_be_pickled_is_named_and_nothing_is_written(spark, tmp_path):
    est = _estimator(model=_Locked())
    with pytest.raises(TypeError, match=r"TorchEstimator cannot be saved: its setting 'model' cannot be pickled"):
        est.save(str(tmp_path / "est"))
    assert not (tmp_path / "est").exists()


def test_loading_something_else_as_an_estimator_is_refused_naming_it(spark, tmp_path):
    from pyspark.ml.feature import SQLTransformer

    SQLTransformer(statement="SELECT * FROM __THIS__").save(str(tmp_path / "sql"))
    with pytest.raises(ValueError,
                       match=r"holds a org.apache.spark.ml.feature.SQLTransformer, not a spark-dl TorchEstimator"):
        TorchEstimator.load(str(tmp_path / "sql"))
    with pytest.raises(TypeError, match="TorchEstimator.load takes a path"):
        TorchEstimator.load(tmp_path / "sql")
    model = TorchModel(_Line(), ["a", "b"])
    model.save(str(tmp_path / "model"))
    with pytest.raises(ValueError, match=r"holds a spark_dl.estimator.TorchModel, not a spark-dl TorchEstimator"):
        TorchEstimator.load(str(tmp_path / "model"))
