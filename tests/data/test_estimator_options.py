"""TorchEstimator's Horovod options beyond the basic fit: a loss per model output (loss lists,
loss_weights, loss_constructors) with a prediction column per output, transformation_fn,
train_minibatch_fn, and callbacks (EarlyStopping, with its state surviving a restart), on real
barrier stages."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from spark_dl.estimator import EarlyStopping, TorchEstimator, TorchModel

from spark_dl import LaunchRefused, RankFailed


def _two_targets(spark, rows=400):
    from pyspark.sql import functions as F

    df = spark.range(rows).select((F.rand(1) * 2 - 1).cast("float").alias("a"),
                                  (F.rand(2) * 2 - 1).cast("float").alias("b"))
    return (df.withColumn("y1", (3 * F.col("a") - 2 * F.col("b")).cast("float"))
              .withColumn("y2", (F.col("a") + F.col("b") + 1).cast("float")))


class TwoHeads(torch.nn.Module):
    """One output per label column, each of shape (batch, 1): the labels (batch,) are reshaped to it."""

    def __init__(self):
        super().__init__()
        self.h1 = torch.nn.Linear(2, 1)
        self.h2 = torch.nn.Linear(2, 1)

    def forward(self, a, b):
        x = torch.stack([a, b], dim=1)
        return self.h1(x), self.h2(x)


def test_a_loss_per_output_weighted_and_a_prediction_column_per_output(spark):
    df = _two_targets(spark)
    torch.manual_seed(0)
    model = TwoHeads()
    # a zero weight: the second head gets no gradient at all (plain SGD leaves it exactly as it was)
    fitted = TorchEstimator(model=model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                            loss=torch.nn.functional.mse_loss, loss_weights=[1.0, 0.0], feature_cols=["a", "b"],
                            label_cols=["y1", "y2"], batch_size=16, epochs=15, num_proc=2).fit(df)
    trained = fitted.getModel()
    assert trained.h1.weight.detach()[0].tolist() == pytest.approx([3, -2], abs=0.05)
    assert torch.equal(trained.h2.weight, model.h2.weight) and torch.equal(trained.h2.bias, model.h2.bias)

    # built on the ranks, one per output, weighted 1/2 each by default: both heads learn
    torch.manual_seed(0)
    fitted = TorchEstimator(model=TwoHeads(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                            loss_constructors=[torch.nn.MSELoss, torch.nn.MSELoss], feature_cols=["a", "b"],
                            label_cols=["y1", "y2"], batch_size=16, epochs=15, num_proc=2).fit(df)
    predicted = fitted.transform(df)
    assert [f.name for f in predicted.schema.fields][-2:] == ["prediction_y1", "prediction_y2"]
    rows = predicted.collect()
    assert max(abs(r.prediction_y1 - r.y1) for r in rows) < 0.1
    assert max(abs(r.prediction_y2 - r.y2) for r in rows) < 0.1
    named = TorchModel(fitted.getModel(), ["a", "b"], prediction_col=["p", "q"]).transform(df)
    assert named.columns[-2:] == ["p", "q"]
    with pytest.raises(LaunchRefused, match=r"returns 2 outputs: prediction_col must name each"):
        TorchModel(fitted.getModel(), ["a", "b"], prediction_col=["p"]).transform(df)


def _scaled(batch):
    """x arrives in [0, 100]: the model sees it in [0, 1]."""
    return {**batch, "x": batch["x"] / 100}


class OneInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)

    def forward(self, x):
        return self.w(x.unsqueeze(1)).squeeze(1)


def _hundreds(spark):
    from pyspark.sql import functions as F

    df = spark.range(400).select((F.rand(3) * 100).cast("float").alias("x"))
    return df.withColumn("y", (3 * F.col("x") / 100 - 1).cast("float"))


def test_transformation_fn_changes_training_and_held_out_batches(spark, capfd):
    torch.manual_seed(0)
    est = TorchEstimator(model=OneInput(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                         loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y", batch_size=16,
                         epochs=25, num_proc=2, validation=0.25, transformation_fn=_scaled)
    fitted = est.fit(_hundreds(spark))
    w = fitted.getModel().w
    # without the scaling, x up to 100 at lr 0.2 diverges; the held-out rows are scaled too
    assert w.weight.item() == pytest.approx(3 / 100 * 100, abs=0.1) and w.bias.item() == pytest.approx(-1, abs=0.05)
    assert fitted.val_history[-1] < 1e-3
    # verbose=1 (Horovod's default): one line per epoch on the driver
    out = capfd.readouterr().out
    assert "[0]<log>: epoch 1/25: loss " in out and "[0]<log>: epoch 25/25: loss " in out and ", val_loss " in out


class ColumnOutput(OneInput):
    def forward(self, x):
        return self.w(x.unsqueeze(1))  # (batch, 1): the label is given that shape by label_shapes


def test_label_shapes_give_the_labels_the_outputs_shape(spark, tmp_path, monkeypatch, sqlite_uri):
    import mlflow

    monkeypatch.setenv("SPARK_DL_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    torch.manual_seed(0)
    est = TorchEstimator(model=ColumnOutput(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                         loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y", batch_size=16,
                         epochs=25, num_proc=2, transformation_fn=_scaled, label_shapes=[[-1, 1]], progress=False)
    fitted = est.fit(_hundreds(spark))
    # without label_shapes, mse_loss would broadcast (16, 1) against (16,) to (16, 16) and fit the mean
    assert fitted.getModel().w.weight.item() == pytest.approx(3, abs=0.1)
    assert fitted.getModel().w.bias.item() == pytest.approx(-1, abs=0.05)
    # the logged model's signature comes from a few rows of its input (one feature column)
    info = mlflow.models.get_model_info(f"runs:/{est.last_run.mlflow_run_id}/model")
    assert info.signature.inputs.inputs[0].shape == (-1,) and info.signature.outputs.inputs[0].shape == (-1, 1)
    with pytest.raises(LaunchRefused, match="log_model must be True or False"):
        TorchEstimator(model=ColumnOutput(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                       loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y", log_model="yes")


def _noisy_on_the_cpu(batch):
    """Random noise (torch's generator: random_seed makes it repeat) on ranks that see no GPU."""
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "", "use_gpu=False hides the GPUs from the ranks"
    return {**batch, "x": batch["x"] / 100 + 0.1 * torch.randn(batch["x"].shape)}


def test_random_seed_repeats_a_fit_and_use_gpu_false_hides_the_gpus(spark):
    df = _hundreds(spark).limit(200)

    def fit(seed):
        torch.manual_seed(0)
        return TorchEstimator(model=OneInput(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                              loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y", batch_size=16,
                              epochs=2, num_proc=2, transformation_fn=_noisy_on_the_cpu, random_seed=seed,
                              use_gpu=False, verbose=0).fit(df).getModel().w.weight.item()

    first, again, other = fit(1), fit(1), fit(2)
    assert first == again and other != first


def _not_a_batch(batch):
    return list(batch.values())


def test_failures_on_the_ranks_name_the_option(spark):
    est = TorchEstimator(model=OneInput(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                         loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y", batch_size=16,
                         num_proc=2, transformation_fn=_not_a_batch)
    with pytest.raises(RankFailed, match=r"transformation_fn must return the batch as a dict .* it returned list"):
        est.fit(_hundreds(spark))
    # a loss per output, but the model has one output for two label columns
    est = TorchEstimator(model=OneInput(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                         loss=[torch.nn.functional.mse_loss] * 2, feature_cols="x", label_cols=["y", "x"],
                         batch_size=16, num_proc=2)
    with pytest.raises(RankFailed, match=r"must return one output per label column \(2\), as a tuple; it returned 1"):
        est.fit(_hundreds(spark))
    est = TorchEstimator(model=OneInput(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                         loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y", batch_size=16,
                         num_proc=2, label_shapes=[[-1, 3]])
    with pytest.raises(RankFailed, match=r"label_shapes gives column 'y' the shape \[-1, 3\], which its batch of "
                                         r"shape \[16\] cannot take"):
        est.fit(_hundreds(spark))


def horovods_step():
    """Horovod's default train_minibatch, written as its users write their own."""
    def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
        optimizer.zero_grad()
        outputs = model(*inputs)
        outputs, labels = transform_outputs(outputs, labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        optimizer.step()
        return outputs, loss
    return train_minibatch


def frozen_step():
    """Computes the loss and gradients, then throws the gradients away before stepping."""
    def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
        outputs, labels = transform_outputs(model(*inputs), labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        return outputs, loss
    return train_minibatch


def test_train_minibatch_fn_runs_each_step(spark):
    from pyspark.sql import functions as F

    df = _two_targets(spark, rows=200).withColumn("w", (F.col("a") > 0).cast("float") + 0.5)

    def fit(**options):
        torch.manual_seed(0)
        return TorchEstimator(model=TwoHeads(), optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5),
                              loss=[torch.nn.functional.mse_loss] * 2, loss_weights=[0.7, 0.3], feature_cols=["a", "b"],
                              label_cols=["y1", "y2"], sample_weight_col="w", batch_size=16, epochs=3, num_proc=2,
                              **options).fit(df)

    built_in, custom, frozen = fit(), fit(train_minibatch_fn=horovods_step), fit(train_minibatch_fn=frozen_step)
    # the same step by hand (outputs reshaped, the weighted per-output loss with sample weights)
    assert custom.history == pytest.approx(built_in.history, rel=1e-6)
    for mine, theirs in zip(custom.getModel().parameters(), built_in.getModel().parameters()):
        torch.testing.assert_close(mine, theirs)
    # and the custom step is what ran: no gradients, no change
    torch.manual_seed(0)
    for mine, initial in zip(frozen.getModel().parameters(), TwoHeads().parameters()):
        assert torch.equal(mine, initial)


class Freeze:
    """Sets the learning rate to 0 from epoch ``at`` on (the held-out loss stops improving);
    rank 1 fails at the start of epoch ``fail_at`` of the first attempt (a lost executor); rank 0
    writes each hook it sees to ``log``."""

    def __init__(self, at: int, fail_at: int, log: str) -> None:
        self.at, self.fail_at, self.log = at, fail_at, log

    def _write(self, trainer, *event) -> None:
        if trainer.rank == 0:
            with open(self.log, "a") as f:
                f.write(json.dumps(event) + "\n")

    def on_train_begin(self, trainer):
        self._write(trainer, "train_begin", trainer.start_epoch, trainer.world_size)

    def on_epoch_begin(self, epoch, trainer):
        import torch.distributed as dist

        import spark_dl

        if epoch >= self.at:
            for group in trainer.optimizer.param_groups:
                group["lr"] = 0.0
        self._write(trainer, "epoch_begin", epoch)
        if spark_dl.get_context().attempt == 0 and epoch == self.fail_at:
            dist.barrier()  # rank 0 has stored the last epoch's checkpoint and written this event
            if trainer.rank == 1:
                raise RuntimeError("executor lost (pretend)")

    def on_epoch_end(self, epoch, logs, trainer):
        self._write(trainer, "epoch_end", epoch, sorted(logs))

    def on_train_end(self, logs, trainer):
        self._write(trainer, "train_end", sorted(logs))


def test_early_stopping_and_callback_hooks_survive_a_restart(spark, tmp_path):
    log = str(tmp_path / "events")
    torch.manual_seed(0)
    stopper = EarlyStopping(monitor="val_loss", patience=1, min_delta=1e-9)
    est = TorchEstimator(model=OneInput(), optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                         loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y", batch_size=16,
                         epochs=10, num_proc=2, validation=0.25, transformation_fn=_scaled,
                         callbacks=[Freeze(at=2, fail_at=3, log=log), stopper], max_restarts=1)
    fitted = est.fit(_hundreds(spark))
    # epochs 0 and 1 improve; from 2 on nothing changes: epoch 2 is patience's one epoch, epoch 3
    # stops the fit. Rank 1 failed as epoch 3 began, so the second attempt ran it, with the
    # stopper's count (one epoch without improvement) restored from epoch 2's checkpoint:
    # otherwise it would have stopped only after epoch 4
    assert est.last_run.attempts == 2
    assert len(fitted.history) == len(fitted.val_history) == 4
    assert fitted.val_history[1] < fitted.val_history[0] and fitted.val_history[3] == fitted.val_history[1]
    events = [json.loads(line) for line in open(log)]
    keys = ["loss", "val_loss"]
    assert events == [
        ["train_begin", 0, 2], ["epoch_begin", 0], ["epoch_end", 0, keys], ["epoch_begin", 1], ["epoch_end", 1, keys],
        ["epoch_begin", 2], ["epoch_end", 2, keys],
        # both ranks began epoch 3 before rank 1 failed: the first attempt's epoch 3 never ended
        ["epoch_begin", 3],
        ["train_begin", 3, 2], ["epoch_begin", 3], ["epoch_end", 3, keys], ["train_end", keys]]
    assert stopper.wait == 0, "the estimator's own callbacks are left as they were (the ranks ran copies)"


def test_bad_loss_and_option_combinations_are_refused(spark):
    good = dict(model=OneInput(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y")
    no_loss = {k: v for k, v in good.items() if k != "loss"}
    for change, match in [
        ({"loss": "mse"}, "loss must be a function"),
        ({"loss_constructors": [torch.nn.MSELoss]}, "exactly one of loss= .* and loss_constructors="),
        ({"loss": None}, "exactly one of loss="),
        ({"loss": [torch.nn.functional.mse_loss] * 3, "label_cols": ["y", "x"]},
         r"loss has 3 losses for 2 label columns \['y', 'x'\]"),
        ({"loss_weights": [1.0, 2.0]}, r"loss_weights must be a list of 1 numbers, one per label column \['y'\]"),
        ({"loss_weights": ["1"]}, "loss_weights must be a list of 1 numbers"),
        ({"transformation_fn": "scale"}, "transformation_fn must be a function, got str"),
        ({"label_shapes": [[-1, 1], [-1]]}, r"label_shapes must be one shape per label column \(1: \['y'\]\)"),
        ({"train_minibatch_fn": horovods_step, "backward_passes_per_step": 2},
         "train_minibatch_fn runs each batch's optimizer step itself"),
        ({"callbacks": EarlyStopping()}, "callbacks must be a list"),
        ({"callbacks": [object()]}, "has none of the hooks on_train_begin"),
        ({"callbacks": [EarlyStopping()]}, r"EarlyStopping monitors 'val_loss', which this fit will not log \(the "
                                           r"val_ keys need validation=\); it logs \['loss'\]"),
        ({"callbacks": [EarlyStopping("accuracy")], "validation": 0.1}, r"it logs \['loss', 'val_loss'\]"),
    ]:
        with pytest.raises(LaunchRefused, match=match):
            TorchEstimator(**{**good, **change})
    for change, match in [
        ({"run_id": "r1"}, r"run_id='r1' names a run in a Store: pass store=Store.create\('/dbfs/...'\) too"),
        ({"store": "/tmp/store", "checkpoint_dir": "/tmp/c"}, "pass store= .* or checkpoint_dir=, not both"),
        ({"store": 5}, r"store must be a Store \(horovod.spark.common.store.Store.create\(path\)\) or a path, got int"),
        ({"store": "hdfs://nn/x"}, "keeps its checkpoints in the driver's files; use a path on the driver's disk"),
        ({"store": "/tmp/store", "run_id": "a/b"}, "run_id must be a non-empty name without '/'"),
        ({"backend": object()}, "backend= is Horovod's SparkBackend"),
        ({"np": 2}, r"unknown options \['np'\] \(the ranks are num_proc\)"),
        ({"epochz": 2},
         r"unknown options \['epochz'\]: they are neither its own nor HorovodRunner's \(driver_log_verbosity"),
        ({"verbose": 3}, "verbose must be 0, 1 or 2"),
        ({"random_seed": "1"}, "random_seed must be an int or None"),
        ({"use_gpu": "no"}, "use_gpu must be True or False"),
    ]:
        with pytest.raises(LaunchRefused, match=match):
            TorchEstimator(**{**good, **change})
    with pytest.warns(UserWarning, match="shuffle_buffer_size, reader_pool_type tune Horovod's Petastorm reader"):
        est = TorchEstimator(**good, shuffle_buffer_size=100, reader_pool_type="thread", max_restarts=1)
    assert est.runner_options == {"max_restarts": 1}
    with pytest.raises(LaunchRefused, match="loss_constructors must be a function \\(\\) -> loss"):
        TorchEstimator(**no_loss, loss_constructors=[1])
    for args, match in [({"patience": -1}, "patience must be an int >= 0"), ({"mode": "up"}, "mode must be"),
                        ({"min_delta": -0.1}, "min_delta must be a number >= 0"), ({"monitor": ""}, "monitor must")]:
        with pytest.raises(ValueError, match=match):
            EarlyStopping(**args)
    assert EarlyStopping("val_accuracy").mode == "max" and EarlyStopping().mode == "min"


def test_horovods_estimator_code_with_a_store_resumes_its_run_id(spark, tmp_path, horovod_imports):
    """Horovod's imports and arguments as they are: store= and run_id= keep each run's checkpoint in
    <store>/runs/<run_id>/checkpoint, so a fit of the same run_id goes on where the last stopped, a
    fit without one starts a new run; setOutputCols names the prediction column."""
    _store_run_ids(spark, tmp_path)


def _store_run_ids(spark, tmp_path):
    import os

    import horovod.spark.torch as hvd
    from horovod.spark.common.store import HDFSStore, Store

    store = Store.create(f"file://{tmp_path}/store")
    assert type(store).__name__ == "LocalStore" and store.prefix_path == f"{tmp_path}/store"
    df = _two_targets(spark, rows=200)

    def estimator(epochs, run_id=None):
        torch.manual_seed(0)
        return hvd.TorchEstimator(num_proc=2, store=store, run_id=run_id, model=OneInput(),
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                  loss=torch.nn.functional.mse_loss,
                                  feature_cols=["a"], label_cols=["y1"], batch_size=20, epochs=epochs, verbose=0,
                                  log_model=False)

    first = estimator(2, run_id="r1").fit(df)
    assert sorted(os.listdir(store.get_checkpoint_path("r1"))) == [".lock", "latest.ckpt"]
    assert store.get_checkpoint_path("r1") == f"{tmp_path}/store/runs/r1/checkpoint"
    more = estimator(4, run_id="r1").fit(df)  # the same run: epochs 3 and 4 only
    assert len(more.history) == 4 and more.history[:2] == first.history
    fresh = estimator(2)
    fresh.fit(df)
    one = fresh.last_run_id
    fresh.fit(df)
    assert one.startswith("run_") and fresh.last_run_id != one
    assert sorted(os.listdir(f"{tmp_path}/store/runs")) == sorted(["r1", one, fresh.last_run_id])
    out = first.setOutputCols(["y_hat"]).transform(df)
    assert "y_hat" in out.columns and first.getOutputCols() == ["y_hat"]
    for bad in ([], "", [1], None):
        with pytest.raises(LaunchRefused, match=r"setOutputCols\(value\) must be a column name or a non-empty list "
                                                r"of them, got"):
            first.setOutputCols(bad)
    assert first.getOutputCols() == ["y_hat"]
    with pytest.raises(LaunchRefused, match="HDFSStore\\('hdfs://nn/x'\\): spark-dl's estimator keeps its checkpoints"):
        HDFSStore("hdfs://nn/x")

