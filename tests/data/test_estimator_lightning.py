"""TorchEstimator with a LightningModule (Horovod's horovod.spark.lightning.TorchEstimator): a
Lightning Trainer with DDP over the barrier stage's ranks, fed the DataFrame's shards, on real
Spark; both Lightning packages (pytorch_lightning as Horovod code has it, lightning.pytorch)."""
from __future__ import annotations

import functools
import os

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from spark_dl.estimator import EarlyStopping, TorchEstimator
from test_estimator import TwoInputs, _regression  # the plain estimator's regression, to compare with

from spark_dl import LaunchRefused
from spark_dl.compression import FP16, OneBit


def _steps(module, batch, stage):
    loss = F.mse_loss(module(batch["a"], batch["b"]), batch["y"])
    module.log(f"{stage}_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
    return loss


class PLLine(pl.LightningModule):
    """Horovod's Lightning estimator style: batches are {column: tensor}."""

    def __init__(self, lr=0.1):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)
        self.lr = lr

    def forward(self, a, b):
        return self.w(torch.stack([a, b], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        return _steps(self, batch, "train")

    def validation_step(self, batch, batch_idx):
        _steps(self, batch, "val")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LLine(L.LightningModule):
    """lightning.pytorch's; rank 1 fails in epoch 2 of the first attempt when told to, and every
    epoch logs how many rows the rank saw (the shard: 200 of 400)."""

    def __init__(self, fail=False):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)
        self.fail = fail
        self.rows = 0

    def forward(self, a, b):
        return self.w(torch.stack([a, b], dim=1)).squeeze(1)

    def on_train_epoch_start(self):
        self.rows = 0

    def training_step(self, batch, batch_idx):
        if (self.fail and self.current_epoch == 2 and self.global_rank == 1
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
            raise RuntimeError("executor preempted (pretend)")
        self.rows += len(batch["y"])
        return _steps(self, batch, "train")

    def on_train_epoch_end(self):
        from spark_dl.compression.stats import stats

        self.log("rows", float(self.rows))  # rank 0's
        self.log("compression_ratio", stats.ratio)  # bytes a dense all-reduce would send / bytes sent

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)


def test_horovods_lightning_estimator_trains_as_the_plain_loop_does(spark, tmp_path, monkeypatch, sqlite_uri,
                                                                      horovod_imports):
    """Horovod's imports as they are: the LightningModule, fed the same shards in the same order
    with the same SGD, ends where the plain estimator's loop does; its logged metrics are the
    model's histories and reach the MLflow run; transform predicts with it."""
    import mlflow
    from horovod.spark.lightning import TorchEstimator as LightningEstimator

    monkeypatch.setenv("SPARK_DL_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    df = _regression(spark)
    torch.manual_seed(0)
    est = LightningEstimator(num_proc=2, model=PLLine(), feature_cols=["a", "b"], label_cols=["y"], batch_size=16,
                             epochs=8, validation=0.25, verbose=0, trainer_args={"gradient_clip_val": 100.0})
    est.save(str(tmp_path / "est"))  # saved and loaded as any TorchEstimator: the module and its Trainer arguments
    est = LightningEstimator.load(str(tmp_path / "est"))
    assert est.getTrainerArgs() == {"gradient_clip_val": 100.0} and isinstance(est.getModel(), pl.LightningModule)
    fitted = est.fit(df)
    torch.manual_seed(0)
    plain = TorchEstimator(num_proc=2, model=TwoInputs(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           loss=F.mse_loss, feature_cols=["a", "b"], label_cols=["y"], batch_size=16, epochs=8,
                           validation=0.25, verbose=0, log_model=False, tracking=False).fit(df)
    for mine, theirs in zip(fitted.getModel().w.parameters(), plain.getModel().w.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    w = fitted.getModel().w.weight.detach()[0].tolist()
    assert w == pytest.approx([3, -2], abs=0.05)
    assert sorted(fitted.metric_history) == ["train_loss", "val_loss"]
    assert len(fitted.history) == len(fitted.val_history) == 8 and fitted.val_history[-1] < 0.01
    # the same held-out rows, each once; Lightning's sync_dist mean is the ranks' means averaged, where the
    # plain loop weighs every row alike, and the two ranks' shares differ by the rows padding left out
    assert fitted.val_history == pytest.approx(plain.val_history, rel=0.02)
    assert fitted.history[-1] < fitted.history[0] / 10
    client = mlflow.MlflowClient()
    run = client.get_run(est.last_run.mlflow_run_id)
    assert run.data.metrics["val_loss"] == pytest.approx(fitted.val_history[-1], rel=1e-5)
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 8
    predicted = fitted.transform(df).collect()
    assert max(abs(r.prediction - r.y) for r in predicted) < 0.1
    logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")  # the trained LightningModule
    x = torch.tensor([[0.5, -0.5]])
    torch.testing.assert_close(logged(x[:, 0], x[:, 1]), fitted.getModel()(x[:, 0], x[:, 1]))


def test_a_restarted_lightning_fit_resumes_after_its_last_epoch(spark, capfd):
    """lightning.pytorch's module, FP16-compressed gradients, two batches per step: rank 1 fails in
    epoch 2; the restart resumes from epoch 1's Lightning checkpoint (optimizer momentum and loop
    state included) and ends with the weights and history of an uninterrupted fit."""
    df = _regression(spark)

    def fit(fail, **options):
        torch.manual_seed(0)
        est = TorchEstimator(num_proc=2, model=LLine(fail), feature_cols=["a", "b"], label_cols="y", batch_size=16,
                             epochs=5, gradient_compression=FP16(), backward_passes_per_step=2, **options)
        return est, est.fit(df)

    _, plain = fit(False)
    est, resumed = fit(True, max_restarts=1)
    assert est.last_run.attempts == 2 and "executor preempted (pretend)" in str(est.last_run.failures[0])
    assert "load_checkpoint() returns the one saved at step 1" in capfd.readouterr().err
    assert len(resumed.history) == 5 and resumed.history == pytest.approx(plain.history, rel=1e-6)
    assert resumed.metric_history["rows"] == [200.0] * 5  # each rank its own half of the rows, every epoch
    assert resumed.metric_history["compression_ratio"] == pytest.approx([2.0] * 5, rel=0.01)  # fp16 on the wire
    for mine, theirs in zip(resumed.getModel().parameters(), plain.getModel().parameters()):
        torch.testing.assert_close(mine, theirs)
    assert resumed.history[-1] < resumed.history[0] / 4


def test_a_lightning_fit_tells_an_error_feedback_compressor_its_optimizer(spark, capfd):
    """OneBit() under the module's own momentum SGD: the hook is told that optimizer (else it warns
    "without optimizer=" and compresses the gradient alone), so 1-bit compresses the shared
    velocity and the fit converges as FP16's does."""
    df = _regression(spark)
    torch.manual_seed(0)
    fitted = TorchEstimator(num_proc=2, model=LLine(), feature_cols=["a", "b"], label_cols="y", batch_size=16,
                            epochs=5, gradient_compression=OneBit(), driver_log_verbosity="all").fit(df)
    assert "without optimizer=" not in capfd.readouterr().err
    assert fitted.history[-1] < fitted.history[0] / 4


def test_lightning_settings_are_refused_with_what_to_do_instead():
    good = dict(model=PLLine(), feature_cols=["a", "b"], label_cols="y")
    for change, match in [
        ({"optimizer": torch.optim.SGD}, r"PLLine is a LightningModule: optimizer= has no use \(it comes from its "
                                         r"configure_optimizers\(\)\); leave optimizer=None"),
        ({"loss": F.mse_loss}, "loss= has no use .*training_step"),
        ({"metrics": {"mae": F.l1_loss}}, r"metrics= has no use \(it comes from self.log"),
        ({"train_minibatch_fn": lambda: None}, "train_minibatch_fn= has no use"),
        ({"trainer_args": ["gradient_clip_val"]}, "trainer_args must be a dict of Trainer arguments, got list"),
        ({"trainer_args": {"max_epochs": 3}}, r"trainer_args=\{'max_epochs': ...\}: the estimator sets the Trainer's "
                                              r"max_epochs \(epochs\); leave it out"),
        ({"trainer_args": {"callbacks": pl.callbacks.EarlyStopping("val_loss")}},
         r"trainer_args=\{'callbacks': ...\} must be a list of Lightning callbacks, got EarlyStopping"),
        ({"trainer_args": {"strategy": "ddp"}}, r"sets the Trainer's strategy \(the run's DDP over its ranks\)"),
        ({"callbacks": [EarlyStopping()]}, r"callbacks of a PLLine fit are pytorch_lightning Callbacks \(the module's "
                                           r"package\), got EarlyStopping \(spark-dl's EarlyStopping is for plain "
                                           r"modules: use pytorch_lightning.callbacks.EarlyStopping\)"),
        ({"callbacks": [L.Callback()]}, "are pytorch_lightning Callbacks .* got Callback"),
        ({"logger": "tb"}, r"Lightning option logger='tb' as trainer_args=\{'logger': ...\}"),
        ({"num_gpus": 1}, "num_gpus=1 as use_gpu"),
        ({"log_every_n_steps": 10}, r"log_every_n_steps=10 as trainer_args=\{'log_every_n_steps': ...\}"),
        ({"data_module": object()}, "the estimator feeds the DataFrame's shards to the Trainer"),
    ]:
        with pytest.raises(LaunchRefused, match=match):
            TorchEstimator(**{**good, **change})
    with pytest.warns(UserWarning, match="loader_num_epochs, debug_data_loader tune Horovod's Petastorm reader"):
        TorchEstimator(**good, loader_num_epochs=1, debug_data_loader=True)
    # Horovod's defaults, passed as its code passes them, ask for nothing
    assert TorchEstimator(**good, logger=None, log_every_n_steps=50, terminate_on_nan=False, num_gpus=None,
                          profiler=None, data_module=None).runner_options == {}
    est = TorchEstimator(**good, trainer_args={"gradient_clip_val": 1.0},
                         callbacks=[pl.callbacks.EarlyStopping("val_loss")])
    assert est.getTrainerArgs() == {"gradient_clip_val": 1.0} and est.getOptimizer() is None
    with pytest.raises(LaunchRefused, match=r"TwoInputs is a plain torch.nn.Module: pass optimizer="):
        TorchEstimator(model=TwoInputs(), loss=F.mse_loss, feature_cols=["a", "b"], label_cols="y")
    with pytest.raises(LaunchRefused, match="trainer_args are a LightningModule's Trainer arguments; TwoInputs is a "
                                            "plain torch.nn.Module"):
        TorchEstimator(model=TwoInputs(), optimizer=torch.optim.SGD, loss=F.mse_loss, feature_cols=["a", "b"],
                       label_cols="y", trainer_args={})
