"""TorchEstimator's settings as Spark ML Params, with Horovod's names and accessors: read and set
through getters/setters (checked as the constructor checks them), overridden by a param map for one
fit, and tuned by Spark ML's own TrainValidationSplit over a grid of learning rates (two fits at once)."""
from __future__ import annotations

import functools
import time

import pytest
import torch
from spark_dl.estimator import TorchEstimator, TorchModel

from spark_dl import LaunchRefused


class _Line(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, a, b):
        return self.w(torch.stack([a, b], 1)).squeeze(1)


def _estimator(**options) -> TorchEstimator:
    torch.manual_seed(0)
    settings = dict(model=_Line(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                    loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols="y", batch_size=16,
                    epochs=4, num_proc=2, log_model=False)
    return TorchEstimator(**{**settings, **options})


def _lines(spark, n: int = 200):
    from pyspark.sql import functions as F

    df = spark.range(n).select(F.rand(1).cast("float").alias("a"), F.rand(2).cast("float").alias("b"))
    return df.withColumn("y", (3 * F.col("a") - 2 * F.col("b")).cast("float"))


def test_settings_are_params_read_and_set_with_horovods_accessors():
    def step():
        return None

    est = _estimator(feature_cols=["a", "b"], label_cols="y", validation=0.25)
    names = {p.name for p in est.params}
    assert {"model", "optimizer", "loss", "epochs", "batch_size", "num_proc", "feature_cols", "label_cols",
            "validation", "store", "run_id", "gradient_compression", "callbacks"} <= names
    assert est.epochs.name == "epochs" and est.epochs.parent == est.uid
    # every Param's default is the constructor's
    import inspect

    from spark_dl.compat.estimator.estimator import _REQUIRED, _SETTINGS

    signature = inspect.signature(TorchEstimator.__init__).parameters
    assert {n: p.default for n, p in signature.items() if n in _SETTINGS} == {
        n: inspect.Parameter.empty if d is _REQUIRED else d for n, (d, _) in _SETTINGS.items()}
    # the getters give the checked, normalised values; unset ones their defaults
    assert (est.getEpochs(), est.getBatchSize(), est.getNumProc()) == (4, 16, 2)
    assert est.getLabelCols() == ["y"] and est.getValidation() == 0.25 and est.getShuffle() is True
    assert est.getRunId() is None and est.getGradientCompression() is None
    assert est.isSet(est.epochs) and not est.isSet(est.shuffle) and est.hasDefault(est.shuffle)
    assert "epochs: passes over the data (default: 1, current: 4)" in est.explainParams()
    # setters return the estimator and check like the constructor
    assert est.setEpochs(6).setBatchSize(8) is est and (est.getEpochs(), est.getBatchSize()) == (6, 8)
    assert est.setLabelCols("y").getLabelCols() == ["y"]
    assert est.setParams(seed=3, shuffle=False) is est and (est.getSeed(), est.getShuffle()) == (3, False)
    for call, message in [(lambda: est.setBatchSize(0), "batch_size must be an int >= 1, got 0"),
                          (lambda: est.setValidation(1.5), "validation must be a fraction of the rows in"),
                          (lambda: est.setModel("net"), "model must be a torch.nn.Module, got str"),
                          (lambda: est.setParams(epoch=3), "TorchEstimator has no setting 'epoch'; its settings "
                                                           "are model, optimizer"),
                          (lambda: est.setParams(num_proc=2, np=2), "no setting 'np'")]:
        with pytest.raises(LaunchRefused, match=message):
            call()
    # checked together: a setting that contradicts another is refused, the old value kept
    est.setTrainMinibatchFn(lambda: step)
    with pytest.raises(LaunchRefused, match="train_minibatch_fn runs each batch's optimizer step itself"):
        est.setBackwardPassesPerStep(2)
    assert est.getBackwardPassesPerStep() == 1 and (est.getEpochs(), est.getBatchSize()) == (6, 8)
    # Spark ML's copy: the same uid, the extra values on the copy only
    copied = est.copy({est.epochs: 9})
    assert copied.uid == est.uid and copied.getEpochs() == 9 and est.getEpochs() == 6


def test_a_param_map_sets_one_fit_and_a_bad_value_in_it_is_refused_before_launch(spark):
    df = _lines(spark)
    est = _estimator()
    assert est.last_run is None
    fitted = est.fit(df, {est.epochs: 2, est.batch_size: 25})
    assert isinstance(fitted, TorchModel) and len(fitted.history) == 2
    assert est.getEpochs() == 4 and est.getBatchSize() == 16  # the estimator's own values are kept
    assert est.last_run.succeeded and est.last_run.world_sizes == (2,)  # that fit's run, reported here
    # the map's values are checked as the constructor's, before anything is launched
    started = time.monotonic()
    with pytest.raises(LaunchRefused, match="batch_size must be an int >= 1, got 0"):
        est.fit(df, {est.batch_size: 0})
    assert time.monotonic() - started < 5
    with pytest.raises(LaunchRefused, match=r"validation must be a fraction of the rows in \(0, 1\)"):
        est.fit(df, {est.validation: 2.0})
    # a list of maps fits once per map, in order
    two = est.fit(df, [{est.epochs: 1}, {est.epochs: 3}])
    assert [len(m.history) for m in two] == [1, 3]


def test_train_validation_split_tunes_the_learning_rate_through_a_param_grid(spark, tmp_path):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    df = _lines(spark, 300)
    est = _estimator(epochs=10)
    slow, fast = functools.partial(torch.optim.SGD, lr=1e-4), functools.partial(torch.optim.SGD, lr=0.3)
    grid = ParamGridBuilder().addGrid(est.optimizer, [slow, fast]).build()
    # parallelism=2: the two grid points' fits run at once, two barrier stages on local[4]'s 4 slots
    tvs = TrainValidationSplit(estimator=est, estimatorParamMaps=grid, trainRatio=0.75, seed=1, parallelism=2,
                               evaluator=RegressionEvaluator(labelCol="y", predictionCol="prediction"))
    tuned = tvs.fit(df)
    slow_rmse, fast_rmse = tuned.validationMetrics
    assert fast_rmse < slow_rmse / 5
    best = tuned.bestModel
    assert isinstance(best, TorchModel) and len(best.history) == 10
    assert best.history[-1] < best.history[0] / 10  # refitted on all rows with the better lr
    assert est.getOptimizer() is not fast  # the grid's values reached the copies, not the estimator
    # Spark's tuning writer stores a grid's values as JSON: a grid over optimizers is refused, saying so
    with pytest.raises(TypeError, match="partial is not JSON serializable"):
        tuned.save(str(tmp_path / "tuned"))
