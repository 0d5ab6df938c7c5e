"""TorchEstimator.fit(df) / TorchModel.transform(df): training on a DataFrame across ranks in a barrier
stage and predicting on the executors, checked against the same model run on the driver."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from spark_dl.estimator import TorchEstimator, TorchModel

from spark_dl import LaunchRefused, RankFailed
from spark_dl.compat.estimator.options import split_validation


@pytest.fixture
def digits(spark):
    from sklearn.datasets import load_digits

    d = load_digits()
    rows = [([float(v) / 16 for v in x], int(y)) for x, y in zip(d.data, d.target)]
    df = spark.createDataFrame(rows, "pixels array<float>, label long")
    return df.randomSplit([0.8, 0.2], seed=0)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def test_fit_then_transform_classifies_held_out_digits(digits):
    train, test = digits
    model = _mlp()
    est = TorchEstimator(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),  # Horovod's style
                         loss=torch.nn.functional.cross_entropy, feature_cols="pixels", label_cols="label",
                         batch_size=32, epochs=5, num_proc=2)
    fitted = est.fit(train)
    assert est.last_run.succeeded and est.last_run.attempts == 1
    assert len(fitted.history) == 5 and fitted.history[-1] < fitted.history[0] / 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), _mlp().state_dict().values())), \
        "the estimator's own model is left as it was"
    predicted = fitted.transform(test)
    assert predicted.schema["prediction"].dataType.simpleString() == "array<float>"
    rows = predicted.select("pixels", "label", "prediction").collect()
    accuracy = np.mean([int(np.argmax(r.prediction)) == r.label for r in rows])
    assert accuracy > 0.9, accuracy
    # the executors' predictions are the trained model's, row for row
    x = torch.tensor([r.pixels for r in rows])
    with torch.no_grad():
        expected = fitted.getModel()(x)
    torch.testing.assert_close(torch.tensor([r.prediction for r in rows]), expected)


def test_top_k_at_its_default_ratio_follows_the_estimators_optimizer(digits, tmp_path, monkeypatch, sqlite_uri):
    """TorchEstimator tells the DDP hook its optimizer, so ``TopK()`` keeps 10% of the entries under
    Adam, where 1% trains a worse model (docs/guide/compression.md), and 1% under momentum SGD: the
    bytes it sent say which, and both train."""
    import mlflow

    from spark_dl.compression import ErrorFeedback, TopK

    monkeypatch.setenv("SPARK_DL_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    train, test = digits
    client, ratios = mlflow.MlflowClient(sqlite_uri), {}
    for name, opt in (("adam", functools.partial(torch.optim.Adam, lr=0.016 * 2)),  # Adam's best lr on digits
                      ("sgd", functools.partial(torch.optim.SGD, lr=0.1 * 2, momentum=0.9))):
        est = TorchEstimator(model=_mlp(), optimizer=opt, loss=torch.nn.functional.cross_entropy,
                             feature_cols="pixels", label_cols="label", batch_size=32, epochs=4, num_proc=2,
                             gradient_compression=ErrorFeedback(TopK(ramp_steps=0)), progress=False)
        rows = est.fit(train).transform(test).select("label", "prediction").collect()
        accuracy = np.mean([int(np.argmax(r.prediction)) == r.label for r in rows])
        assert accuracy > 0.9, (name, accuracy)
        history = client.get_metric_history(est.last_run.mlflow_run_id, "comm/compression_ratio")
        ratios[name] = history[-1].value
    # dense bytes over bytes sent: 32 bits against 64 bits (a value and an index) per kept entry
    assert 3.5 < ratios["adam"] < 6 and ratios["sgd"] > 25, ratios


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, a, b):  # one tensor per feature column
        return self.w(torch.stack([a, b], dim=1)).squeeze(1)


def test_regression_with_two_feature_columns_and_an_optimizer_factory(spark):
    from pyspark.sql import functions as F

    df = spark.range(400).select((F.rand(1) * 2 - 1).alias("a"), (F.rand(2) * 2 - 1).alias("b"))
    df = df.withColumn("y", 3 * F.col("a") - 2 * F.col("b") + 0.5)  # double columns, float32 weights: cast
    torch.manual_seed(0)
    fitted = TorchEstimator(model=TwoInputs(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                            loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols=["y"],
                            batch_size=16, epochs=20, num_proc=2, prediction_col="y_hat",
                            # "auto" is taken as any compressor is (3 parameters: too few to compress)
                            gradient_compression="auto").fit(df)
    w, bias = fitted.getModel().w.weight.detach()[0].tolist(), fitted.getModel().w.bias.item()
    assert w == pytest.approx([3, -2], abs=0.05) and bias == pytest.approx(0.5, abs=0.05)
    predicted = fitted.transform(df)
    assert predicted.schema["y_hat"].dataType.simpleString() == "float"
    errors = [abs(r.y_hat - r.y) for r in predicted.collect()]
    assert max(errors) < 0.1


def test_validation_holds_rows_out_and_reports_their_loss(spark):
    from pyspark.sql import functions as F

    df = spark.range(400).select((F.rand(1) * 2 - 1).alias("a"), (F.rand(2) * 2 - 1).alias("b"))
    df = df.withColumn("y", 3 * F.col("a") - 2 * F.col("b") + 0.5).withColumn("is_val", F.col("a") > 0.8)
    for validation in (0.25, "is_val"):
        torch.manual_seed(0)
        fitted = TorchEstimator(model=TwoInputs(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols="y",
                                batch_size=16, epochs=6, num_proc=2, validation=validation).fit(df)
        assert len(fitted.history) == len(fitted.val_history) == 6
        assert fitted.val_history[-1] < fitted.val_history[0] / 10 and fitted.val_history[-1] < 0.05
    with pytest.raises(LaunchRefused, match="validation must be a fraction"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
                       feature_cols=["a", "b"], label_cols="y", validation=1.5)
    with pytest.raises(LaunchRefused, match=r"the DataFrame passed as validation= is empty: there is nothing to shard: "
                       r"no row of column 'is_val' is true \(or 1\); mark some rows, or pass a fraction"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
                       feature_cols=["a", "b"], label_cols="y", validation="is_val").fit(df.filter("a < 0.5"))
    with pytest.raises(LaunchRefused, match=r"validation=0.001 held out no rows; hold out a larger fraction "
                       r"\(validation=0.2\), mark the held-out rows with a column \(validation='is_val'\)"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
                       feature_cols=["a", "b"], label_cols="y", validation=0.001).fit(df.limit(20))
    with pytest.raises(LaunchRefused, match="'held' is not a column"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
                       feature_cols=["a", "b"], label_cols="y", validation="held").fit(df)


def _accuracy(output, label):
    return (output.argmax(1) == label).float().mean()


def test_metrics_on_training_and_held_out_rows(digits):
    train, _ = digits
    est = TorchEstimator(model=_mlp(), optimizer=functools.partial(torch.optim.Adam, lr=0.01),
                         loss=torch.nn.functional.cross_entropy, feature_cols="pixels", label_cols="label",
                         batch_size=32, epochs=4, num_proc=2, validation=0.2,
                         metrics={"accuracy": _accuracy, "rows_seen": lambda output, label: len(label)})
    fitted = est.fit(train)
    m = fitted.metric_history
    assert sorted(m) == ["accuracy", "rows_seen", "val_accuracy", "val_rows_seen"]
    assert all(len(v) == 4 for v in m.values())
    assert m["accuracy"][-1] > m["accuracy"][0] and m["val_accuracy"][-1] > 0.85
    # a plain number per batch works too, and the average is over rows: a full batch has 32
    assert 16 < m["rows_seen"][0] <= 32
    # the held-out accuracy is the trained model's on exactly those rows (averaged over rows; the
    # few rows repeated to even out the ranks' shares move it by less than a point)
    _, held_out = split_validation(train, est.getValidation(), est.getSeed())
    rows = held_out.collect()
    with torch.no_grad():
        out = fitted.getModel()(torch.tensor([r.pixels for r in rows]))
    assert m["val_accuracy"][-1] == pytest.approx(float(_accuracy(out, torch.tensor([r.label for r in rows]))),
                                                  abs=0.01)
    history = fitted.getHistory()
    assert history["loss"] == fitted.history and history["val_loss"] == fitted.val_history
    assert history["val_accuracy"] == m["val_accuracy"]
    for bad, message in [({"loss": _accuracy}, "other than 'loss'"), ([lambda o, y: 0], "distinct function names"),
                         ({"acc": 3}, "must be a function"), ("accuracy", "must be a dict")]:
        with pytest.raises(LaunchRefused, match=message):
            TorchEstimator(model=_mlp(), optimizer=torch.optim.SGD, loss=torch.nn.functional.cross_entropy,
                           feature_cols="pixels", label_cols="label", metrics=bad)


def test_sample_weights_scale_each_rows_loss(spark):
    from pyspark.sql import functions as F

    df = spark.range(400).select((F.rand(1) * 2 - 1).alias("a"), (F.rand(2) * 2 - 1).alias("b"), "id")
    # every third row's label is garbage, and weighs nothing
    bad = F.col("id") % 3 == 0
    df = df.withColumn("y", F.when(bad, F.lit(100.0)).otherwise(3 * F.col("a") - 2 * F.col("b") + 0.5))
    df = df.withColumn("w", F.when(bad, 0.0).otherwise(1.0))

    def fit(**kwargs):
        torch.manual_seed(0)
        return TorchEstimator(model=TwoInputs(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                              loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols="y",
                              batch_size=16, epochs=20, num_proc=2, **kwargs).fit(df)

    weighted = fit(sample_weight_col="w", validation=0.2)
    w, bias = weighted.getModel().w.weight.detach()[0].tolist(), weighted.getModel().w.bias.item()
    assert w == pytest.approx([3, -2], abs=0.05) and bias == pytest.approx(0.5, abs=0.05)
    assert weighted.val_history[-1] < 0.01  # the held-out loss is weighted too
    unweighted = fit()
    assert abs(unweighted.getModel().w.bias.item() - 0.5) > 10  # the garbage rows pull it far off
    with pytest.raises(LaunchRefused, match="'weight' is not a column"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
                       feature_cols=["a", "b"], label_cols="y", sample_weight_col="weight").fit(df)
    with pytest.raises(LaunchRefused, match="sample_weight_col must be a column name"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
                       feature_cols=["a", "b"], label_cols="y", sample_weight_col=3)
    with pytest.raises(RankFailed, match="reduction='none'"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=lambda out, y: ((out - y) ** 2).mean(),
                       feature_cols=["a", "b"], label_cols="y", sample_weight_col="w", num_proc=2).fit(df)


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.out = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, images):  # [N, 1, 8, 8]: input_shapes makes them from the 64-number column
        assert images.dim() == 4, images.shape
        return self.out(torch.nn.functional.max_pool2d(torch.relu(self.conv(images)), 2).flatten(1))


def test_input_shapes_reshape_features_for_fit_and_transform(digits):
    train, test = digits
    fitted = TorchEstimator(model=_Conv(), optimizer=functools.partial(torch.optim.Adam, lr=0.01),
                            loss=torch.nn.functional.cross_entropy, feature_cols="pixels", label_cols="label",
                            batch_size=32, epochs=4, num_proc=2, input_shapes=[[-1, 1, 8, 8]]).fit(train)
    rows = fitted.transform(test).select("label", "prediction").collect()
    assert np.mean([int(np.argmax(r.prediction)) == r.label for r in rows]) > 0.9
    for bad in ([[-1, 64], [-1, 64]], [[-1, -1, 8]], [[0, 64]], [[-1, 1.5]], "-1,64"):
        with pytest.raises(LaunchRefused, match="input_shapes must be one shape per feature column"):
            TorchEstimator(model=_Conv(), optimizer=torch.optim.SGD, loss=torch.nn.functional.cross_entropy,
                           feature_cols="pixels", label_cols="label", input_shapes=bad)
    with pytest.raises(RankFailed, match=r"input_shapes gives column 'pixels' the shape \[-1, 1, 9, 9\]"):
        TorchEstimator(model=_Conv(), optimizer=torch.optim.SGD, loss=torch.nn.functional.cross_entropy,
                       feature_cols="pixels", label_cols="label", num_proc=2,
                       input_shapes=[[-1, 1, 9, 9]]).fit(train)


def test_a_column_that_is_both_feature_and_label_is_sent_once(digits):
    train, _ = digits  # an autoencoder: the pixels are its input and its target
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 64))
    fitted = TorchEstimator(model=model, optimizer=functools.partial(torch.optim.Adam, lr=0.01),
                            loss=torch.nn.functional.mse_loss, feature_cols="pixels", label_cols="pixels",
                            batch_size=64, epochs=4, num_proc=2).fit(train)
    assert fitted.history[-1] < fitted.history[0] / 2


def test_bad_estimators_and_inputs_are_refused(spark, digits):
    train, _ = digits
    model = _mlp()
    other = torch.nn.Linear(2, 2)
    good = dict(model=model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                loss=torch.nn.functional.cross_entropy, feature_cols="pixels", label_cols="label")
    for change, match in [
        ({"model": "net"}, "model must be a torch.nn.Module"),
        ({"optimizer": torch.optim.SGD(other.parameters(), lr=0.1)}, "parameters that are not model's"),
        ({"optimizer": 0.1}, "optimizer must be a torch.optim.Optimizer"),
        ({"loss": "mse"}, "loss must be a function"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"feature_cols": []}, "feature_cols must be a column name"),
        ({"max_restarts": -1}, "max_restarts must be an int >= 0"),
        ({"backward_passes_per_step": 0}, "backward_passes_per_step must be an int >= 1, got 0"),
        ({"val_batch_size": 2.5}, "val_batch_size must be an int >= 1, got 2.5"),
        ({"train_steps_per_epoch": 0}, "train_steps_per_epoch must be an int >= 1"),
        ({"gradient_compression": "fp16"}, "gradient_compression must be a compressor from spark_dl.compression "
                                            r"\(FP16\(\), QSGD\(\), PowerSGD\(\), ...\), 'auto' or None, got 'fp16'"),
        ({"loss": torch.nn.MSELoss}, r"loss is the class torch.nn.modules.loss.MSELoss, not a loss: pass an instance"),
        ({"feature_cols": None}, "feature_cols must be a column name or a non-empty list of them, got None"),
        ({"seed": "a"}, "seed must be an int"),
        ({"shuffle": 1}, "shuffle must be True or False"),
        ({"prediction_col": ""}, "prediction_col must be a column name"),
    ]:
        with pytest.raises(LaunchRefused, match=match):
            TorchEstimator(**{**good, **change})
    with pytest.raises(LaunchRefused, match=r"columns \['image'\] are not in the DataFrame"):
        TorchEstimator(**{**good, "feature_cols": "image"}).fit(train)
    strings = spark.createDataFrame([("a", 1)], "pixels string, label long")
    with pytest.raises(LaunchRefused, match="column 'pixels' has type string"):
        TorchEstimator(**good).fit(strings)
    fitted = TorchModel(model, ["pixels"])
    with pytest.raises(LaunchRefused, match="already has a column 'label'"):
        TorchModel(model, ["pixels"], prediction_col="label").transform(train)
    with pytest.raises(LaunchRefused, match="empty"):
        fitted.transform(train.limit(0))
    import pandas as pd

    with pytest.raises(LaunchRefused, match=r"TorchEstimator.fit\(df\) takes a pyspark.sql.DataFrame, got pandas"):
        TorchEstimator(**good).fit(pd.DataFrame({"pixels": [1.0], "label": [0]}))
    with pytest.raises(LaunchRefused, match=r"TorchModel.transform\(df\) takes a pyspark.sql.DataFrame, got None"):
        fitted.transform(None)
    # the model and the columns do not fit: the driver's one-row probe says so, with the shapes
    with pytest.raises(LaunchRefused, match=r"running the model on one row of feature_cols \['pixels'\] \(tensors of "
                                            r"shapes \[\(1, 64\)\]\) failed with RuntimeError: mat1 and mat2"):
        TorchModel(torch.nn.Linear(3, 1), ["pixels"]).transform(train)

    class Dict(torch.nn.Module):
        def forward(self, x):
            return {"y": x}

    with pytest.raises(LaunchRefused,
                       match="must return a tensor or a tuple/list of tensors to predict with, got dict"):
        TorchModel(Dict(), ["pixels"]).transform(train)
    # counts computed with numpy are taken as ints
    est = TorchEstimator(**{**good, "batch_size": np.int64(16), "num_proc": np.int32(2), "random_seed": np.int64(3)})
    assert (type(est.getBatchSize()), est.getNumProc(), est.getRandomSeed()) == (int, 2, 3)


def test_an_optimizer_function_that_returns_no_optimizer_is_named(digits):
    train, _ = digits
    est = TorchEstimator(model=_mlp(), optimizer=lambda params: None, loss=torch.nn.functional.cross_entropy,
                         feature_cols="pixels", label_cols="label", num_proc=2)
    with pytest.raises(RankFailed, match=r"optimizer\(params\) returned NoneType, not a torch.optim.Optimizer"):
        est.fit(train.limit(64))


def failing_loss(output, labels):
    raise ValueError(f"labels of shape {tuple(labels.shape)} do not fit outputs of shape {tuple(output.shape)}")


def test_a_loss_that_fails_on_the_ranks_raises_rank_failed(digits):
    train, _ = digits
    model = _mlp()
    est = TorchEstimator(model=model, optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss=failing_loss,
                         feature_cols="pixels", label_cols="label", batch_size=8, num_proc=2)
    with pytest.raises(RankFailed, match=r"labels of shape \(8,\) do not fit outputs of shape \(8, 10\)"):
        est.fit(train)


class FailsOnce:
    """mse_loss that raises on rank 1's ``calls``-th call of the first attempt (a lost executor)."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.n = 0

    def __call__(self, output, y):
        import spark_dl

        self.n += 1
        ctx = spark_dl.get_context()
        if ctx.attempt == 0 and ctx.rank == 1 and self.n == self.calls:
            raise RuntimeError("executor preempted (pretend)")
        return torch.nn.functional.mse_loss(output, y)


def _regression(spark):
    from pyspark.sql import functions as F

    df = spark.range(400).select((F.rand(1) * 2 - 1).alias("a"), (F.rand(2) * 2 - 1).alias("b"))
    return df.withColumn("y", 3 * F.col("a") - 2 * F.col("b") + 0.5)


def test_a_restarted_fit_resumes_after_its_last_epoch_and_ends_as_an_uninterrupted_one(spark, capfd):
    df = _regression(spark)

    def fit(loss, **options):
        torch.manual_seed(0)
        est = TorchEstimator(model=TwoInputs(), optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5),
                             loss=loss, feature_cols=["a", "b"], label_cols="y", batch_size=16, epochs=6,
                             num_proc=2, **options)
        return est, est.fit(df)

    _, plain = fit(torch.nn.functional.mse_loss)
    # 200 rows a rank: 13 batches an epoch; the 45th call is in epoch 3 (0-based), after epoch 2's checkpoint
    est, resumed = fit(FailsOnce(calls=45), max_restarts=1)
    assert est.last_run.attempts == 2 and len(est.last_run.failures) == 1
    assert "load_checkpoint() returns the one saved at step 2" in capfd.readouterr().err
    assert len(resumed.history) == 6 and resumed.history == pytest.approx(plain.history, rel=1e-6)
    for mine, theirs in zip(resumed.getModel().parameters(), plain.getModel().parameters()):
        torch.testing.assert_close(mine, theirs)  # model and momentum came back from the checkpoint


def _rows(output, y):
    return len(y)  # a metric whose row-weighted mean is the batch size


def test_compression_accumulation_and_step_limits(spark, tmp_path, monkeypatch, sqlite_uri):
    import mlflow

    from spark_dl.compression import FP16
    from spark_dl.driver.checkpoint_store import CheckpointStore

    monkeypatch.setenv("SPARK_DL_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    torch.manual_seed(0)
    est = TorchEstimator(model=TwoInputs(), optimizer=functools.partial(torch.optim.Adam, lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols="y", batch_size=16,
                         epochs=4, num_proc=2, validation=0.25, metrics={"rows": _rows},
                         gradient_compression=FP16(), backward_passes_per_step=2, train_steps_per_epoch=5,
                         val_batch_size=20, validation_steps_per_epoch=2, checkpoint_dir=str(tmp_path / "ckpt"),
                         progress=False)
    fitted = est.fit(_regression(spark))
    # 5 batches of 16 rows an epoch, optimizer steps after batches 2, 4 and 5; 2 held-out batches of 20
    assert fitted.metric_history == {"rows": [16.0] * 4, "val_rows": [20.0] * 4}
    saved = CheckpointStore(tmp_path / "ckpt").load()
    import cloudpickle

    state = cloudpickle.loads(saved)["spark_dl.estimator"]
    assert state["epoch"] == 3 and state["optimizer"]["state"][0]["step"].item() == 4 * 3
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    ratios = [m.value for m in client.get_metric_history(est.last_run.mlflow_run_id, "comm/compression_ratio")]
    assert ratios and all(r == pytest.approx(2.0) for r in ratios)  # fp16 sends half of fp32's bytes
    # the trained model is in the run (log_model=True by default), as the fit returned it
    import mlflow.pytorch

    logged = mlflow.pytorch.load_model(f"runs:/{est.last_run.mlflow_run_id}/model")
    torch.testing.assert_close(logged.w.weight, fitted.getModel().w.weight)
    # a second fit with the same checkpoint_dir finds every epoch done: it returns the saved model
    again = est.fit(_regression(spark))
    assert again.history == fitted.history
    torch.testing.assert_close(again.getModel().w.weight, fitted.getModel().w.weight)


class _TrainsButFailsInEval(torch.nn.Module):
    """Stands for a model whose logged CPU copy cannot run on the example (a forward that makes
    CUDA tensors): here, any forward in eval mode fails."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)

    def forward(self, a):
        if not self.training:
            raise RuntimeError("this forward needs the GPU")
        return self.w(a.unsqueeze(1)).squeeze(1)


def test_a_model_that_cannot_run_on_its_example_is_still_logged_without_a_signature(spark, tmp_path, monkeypatch,
                                                                                     sqlite_uri, capfd):
    import mlflow

    monkeypatch.setenv("SPARK_DL_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    est = TorchEstimator(model=_TrainsButFailsInEval(), optimizer=torch.optim.SGD, loss=torch.nn.functional.mse_loss,
                         feature_cols="a", label_cols="y", batch_size=16, epochs=1, num_proc=2, progress=False,
                         driver_log_verbosity="all")
    est.fit(_regression(spark))
    assert "spark-dl: the model is logged without a signature: log_model('model'): the model cannot take its " \
           "input_example" in capfd.readouterr().err
    info = mlflow.models.get_model_info(f"runs:/{est.last_run.mlflow_run_id}/model")
    assert info.signature is None


class _Zero(TwoInputs):
    """Predicts 0 for every row (weights 0; lr=0 keeps them so)."""

    def __init__(self):
        super().__init__()
        torch.nn.init.zeros_(self.w.weight)
        torch.nn.init.zeros_(self.w.bias)


def _abs_error(output, y):
    return (output - y).abs().mean()


@pytest.mark.parametrize("val_batch_size", [2, 1])
def test_held_out_loss_and_metrics_count_each_held_out_row_once(spark, val_batch_size):
    # 3 held-out rows on 2 ranks: remainder="pad" repeats one to even the shares out; it must not
    # count (with batches of 1, one rank's last batch holds nothing but the repeat)
    rows = [(float(i % 3), float(i % 2), 0.0, False) for i in range(20)] + [
        (0.0, 0.0, 0.0, True), (0.0, 0.0, 0.0, True), (0.0, 0.0, 100.0, True)]
    df = spark.createDataFrame(rows, "a float, b float, y float, is_val boolean")
    fitted = TorchEstimator(model=_Zero(), optimizer=functools.partial(torch.optim.SGD, lr=0.0),
                            loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols="y",
                            batch_size=8, num_proc=2, validation="is_val", val_batch_size=val_batch_size,
                            metrics={"abs_error": _abs_error}, verbose=0, log_model=False).fit(df)
    assert fitted.val_history == [pytest.approx(100.0 ** 2 / 3)]
    assert fitted.metric_history["val_abs_error"] == [pytest.approx(100.0 / 3)]
    assert fitted.history == [0.0]


def _classes(spark, label_type):
    from pyspark.sql import functions as F

    df = spark.range(64).select((F.rand(1) * 2 - 1).cast("float").alias("a"),
                                (F.rand(2) * 2 - 1).cast("float").alias("b"))
    return df.withColumn("c", (F.col("a") > F.col("b")).cast(label_type))


class _TwoClasses(torch.nn.Module):
    def __init__(self, out=2):
        super().__init__()
        self.w = torch.nn.Linear(2, out)

    def forward(self, a, b):
        return self.w(torch.stack([a, b], 1)).squeeze(-1)


@pytest.mark.parametrize("label_type", ["int", "tinyint"])
def test_int_and_byte_labels_are_class_indices(spark, label_type):
    torch.manual_seed(0)
    fitted = TorchEstimator(model=_TwoClasses(), optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                            loss=torch.nn.functional.cross_entropy, feature_cols=["a", "b"], label_cols="c",
                            batch_size=8, epochs=3, num_proc=2, verbose=0,
                            log_model=False).fit(_classes(spark, label_type))
    assert len(fitted.history) == 3 and fitted.history[-1] < fitted.history[0]


def test_a_label_of_the_wrong_dtype_for_its_loss_is_named_with_the_cast(spark):
    good = dict(optimizer=functools.partial(torch.optim.SGD, lr=0.1), feature_cols=["a", "b"], label_cols="c",
                batch_size=8, num_proc=2, verbose=0, log_model=False)
    # a StringIndexer's double label as class indices
    with pytest.raises(RankFailed, match=r"the loss refused label column 'c', read as torch.float32 \(expected target "
                                         r"dtype to be Long.*cast the column first: df.withColumn\('c', "
                                         r"F.col\('c'\).cast\(\"long\"\)\)"):
        TorchEstimator(model=_TwoClasses(), loss=torch.nn.functional.cross_entropy, **good).fit(
            _classes(spark, "double"))
    # integer 0/1 as a BCE target
    with pytest.raises(RankFailed, match=r"the loss refused label column 'c', read as torch.int64 .*BCE or MSE losses "
                                         r"must be floats; cast the column first: .*cast\(\"float\"\)"):
        TorchEstimator(model=_TwoClasses(1), loss=torch.nn.BCEWithLogitsLoss(), **good).fit(_classes(spark, "long"))


def test_dotted_column_names_in_transform_and_in_validation(spark):
    from pyspark.sql import functions as F

    df = _regression(spark).withColumnRenamed("a", "a.b").withColumn("x.y", F.lit(1.0))
    df = df.withColumn("is.val", F.col("b") > 0.6)
    torch.manual_seed(0)
    fitted = TorchEstimator(model=TwoInputs(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                            loss=torch.nn.functional.mse_loss, feature_cols=["a.b", "b"], label_cols="y",
                            batch_size=16, epochs=2, num_proc=2, validation="is.val", verbose=0,
                            log_model=False).fit(df)
    assert len(fitted.val_history) == 2
    predicted = fitted.transform(df)
    assert predicted.columns == ["a.b", "b", "y", "x.y", "is.val", "prediction"]
    rows = predicted.collect()
    with torch.no_grad():
        expected = fitted.getModel()(torch.tensor([r["a.b"] for r in rows]).float(),
                                     torch.tensor([r["b"] for r in rows]).float())
    torch.testing.assert_close(torch.tensor([r["prediction"] for r in rows]), expected)
    assert {r["x.y"] for r in rows} == {1.0}
    # a dotted column the model does not read
    assert TorchModel(torch.nn.Linear(1, 1), ["b"], input_shapes=[[-1, 1]]).transform(df).count() == 400


def test_a_null_feature_in_transform_names_the_column_and_the_fix(spark):
    from pyspark.sql import functions as F

    df = _regression(spark).withColumn("id", F.monotonically_increasing_id())
    df = df.withColumn("a", F.when(F.col("id") == 7, None).otherwise(F.col("a")))
    predicted = TorchModel(TwoInputs(), ["a", "b"]).transform(df)  # its first row has no null
    with pytest.raises(Exception, match=r"TorchModel.transform: column 'a' has nulls; fill or drop them before "
                                        r"transform \(df.na.drop\(subset=\['a'\]\)") as caught:
        predicted.collect()
    assert str(caught.value).lstrip().startswith("An exception was thrown from the Python worker")


def test_transform_leaves_the_models_mode_as_it_was(spark):
    df = _regression(spark)
    model = TwoInputs()
    TorchModel(model, ["a", "b"]).transform(df)
    assert model.training
    model.eval()
    TorchModel(model, ["a", "b"]).transform(df)
    assert not model.training


def test_a_model_taking_one_column_twice_transforms(spark):
    predicted = TorchModel(TwoInputs(), ["a", "a"]).transform(_regression(spark).limit(3)).collect()
    assert len(predicted) == 3 and all(isinstance(r["prediction"], float) for r in predicted)


def test_refusals_name_what_a_torch_estimator_takes(spark):
    est = dict(model=TwoInputs(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
               loss=torch.nn.functional.mse_loss, feature_cols=["a", "b"], label_cols="y", verbose=0)
    df = _regression(spark)
    with pytest.raises(LaunchRefused, match=r"has 1 row\(s\), fewer than the 2 ranks: each rank trains on rows of "
                                            r"its own; give it at least num_proc=2 rows, or use a smaller num_proc") \
            as caught:
        TorchEstimator(**est, num_proc=2).fit(df.limit(1))
    assert "shards(" not in str(caught.value) and "remainder" not in str(caught.value)
    with pytest.raises(LaunchRefused, match=r"num_proc=5 needs 5 task slots at once.*Use num_proc <= 4") as caught:
        TorchEstimator(**est, num_proc=5).fit(df)
    assert "np=" not in str(caught.value).replace("num_proc=", "")
