"""MLflow tracking of HorovodRunner runs, against real MLflow stores (local SQLite and `mlflow server`)."""
from __future__ import annotations

import importlib.metadata
import re
import time
import warnings

import mlflow
import pytest
from mlflow import MlflowClient

import spark_dl
from spark_dl import HorovodRunner, LaunchRefused, RankFailed
from spark_dl.tracking import Tracking, TrackingWarning


def _runs(experiment_ids=("0",)):
    return MlflowClient().search_runs(list(experiment_ids))


def _only_run(experiment_ids=("0",)):
    runs = _runs(experiment_ids)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def _history(run, key):
    return MlflowClient().get_metric_history(run.info.run_id, key)


def train(steps, lr, fail_at=None, sleep=0.0, opt=None):
    import time

    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    rank = dist.get_rank()
    print(f"rank {rank} starts training", flush=True)
    if opt is not None:
        spark_dl.log_params({"optimizer": opt})
    for step in range(steps):
        if fail_at is not None and step == fail_at and rank == 1:
            raise ValueError(f"bad batch at step {step}")
        t = torch.tensor([float(step)])
        dist.all_reduce(t)
        spark_dl.log_metrics({"loss": 1.0 / (step + 1), "acc": step / steps, "lr": lr}, step=step)
        if sleep:
            time.sleep(sleep)
    return "done"


def test_metrics_params_layout_and_logs_land_in_one_run(tracking_uri):
    out = HorovodRunner(np=-2, progress=False).run(
        train, steps=50, lr=0.1, sleep=0.01, opt={"name": "sgd", "momentum": {"value": 0.9, "nesterov": True}}
    )
    assert out == "done"
    run = _only_run()
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["np"] == "-2" and p["world_size"] == "2" and p["mode"] == "local" and p["backend"] == "gloo"
    assert p["lr"] == "0.1" and p["steps"] == "50"  # the user's plain kwargs
    assert p["optimizer.name"] == "sgd" and p["optimizer.momentum.nesterov"] == "True"  # nested: flattened
    assert p["world.num_hosts"] == "1" and p["world.ranks_per_host"] == "2"
    assert [m.step for m in _history(run, "loss")] == list(range(50))
    assert [m.value for m in _history(run, "loss")] == [1.0 / (s + 1) for s in range(50)]
    assert {"acc", "lr", "perf/step_time_s", "perf/steps_per_s"} <= set(run.data.metrics)
    assert not any(k.endswith("/rank1") for k in run.data.metrics)  # only rank 0 unless asked
    assert any(k.startswith("system/") and k.endswith("/cpu_percent") for k in run.data.metrics)
    logs = {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "logs")}
    assert logs == {"logs/rank0.txt", "logs/rank1.txt"}
    text = open(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="logs/rank1.txt")).read()
    assert "rank 1 starts training" in text


def test_every_rank_under_a_suffix_when_asked(tracking_uri):
    HorovodRunner(np=-2, tracking=Tracking(all_ranks=True), progress=False).run(train, steps=20, lr=0.1)
    run = _only_run()
    for r in (0, 1):
        assert [m.step for m in _history(run, f"loss/rank{r}")] == list(range(20))
    assert [m.step for m in _history(run, "loss")] == list(range(20))


def test_1000_steps_reach_a_tracking_server_in_order(server_uri, spark_cluster):
    exp = mlflow.set_experiment("thousand-steps")
    try:
        HorovodRunner(np=2, progress=False).run(train, steps=1000, lr=0.5)
    finally:
        mlflow.set_experiment(experiment_id="0")
    runs = MlflowClient().search_runs([exp.experiment_id])
    assert len(runs) == 1
    hist = _history(runs[0], "loss")
    assert [m.step for m in hist] == list(range(1000))
    assert [m.value for m in hist] == [1.0 / (s + 1) for s in range(1000)]
    ts = [m.timestamp for m in hist]
    assert ts == sorted(ts)
    assert runs[0].data.params["mode"] == "spark" and runs[0].data.params["world.num_hosts"] == "1"


def test_failed_rank_keeps_its_metrics_and_fails_the_run(tracking_uri):
    with pytest.raises(RankFailed, match="bad batch at step 30"):
        HorovodRunner(np=-2, tracking=Tracking(all_ranks=True),
                      progress=False).run(train, steps=100, lr=0.1, fail_at=30)
    run = _only_run()
    assert run.info.status == "FAILED"
    assert "bad batch at step 30" in run.data.tags["spark_dl.error"]
    assert run.data.tags["spark_dl.failed_rank"] == "1"
    assert [m.step for m in _history(run, "loss/rank1")] == list(range(30))  # everything before the failure
    text = open(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="spark_dl_error.txt")).read()
    assert "ValueError: bad batch at step 30" in text


def test_torch_distributor_positional_args_are_params(tracking_uri):
    """TorchDistributor users pass positional args (run(train, 1e-3, 64)): they become arg0, arg1."""
    out = spark_dl.TorchDistributor(num_processes=2, use_gpu=False, progress=False).run(train, 5, 0.25)
    assert out == "done"
    run = _only_run()
    p = run.data.params
    assert p["arg0"] == "5" and p["arg1"] == "0.25" and p["np"] == "-2" and p["main"] == "train"
    assert [m.step for m in _history(run, "loss")] == list(range(5))


def train_resumable(steps, fail_at):
    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    ctx = spark_dl.get_context()
    print(f"rank {ctx.rank} attempt {ctx.attempt}", flush=True)
    state = spark_dl.load_checkpoint()
    for step in range(0 if state is None else state["step"] + 1, steps):
        if ctx.attempt == 0 and step == fail_at and ctx.rank == 1:
            raise ValueError(f"bad batch at step {step}")
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        spark_dl.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        if step % 10 == 9:
            spark_dl.save_checkpoint({"step": step}, step=step)
    return "done"


def test_a_restarted_run_is_one_mlflow_run_that_says_why_it_restarted(tracking_uri):
    runner = HorovodRunner(np=-2, max_restarts=1, progress=False)
    out = runner.run(train_resumable, steps=40, fail_at=25)
    assert out == "done"
    run = _only_run()
    assert runner.last_run.mlflow_run_id == run.info.run_id and runner.last_run.attempts == 2
    assert run.info.status == "FINISHED" and run.data.tags["spark_dl.restarts"] == "1"
    assert "spark_dl.error" not in run.data.tags
    # attempt 1 logged steps 0..24 (those before its last checkpoint, 0..19, surely reached the
    # driver: a checkpoint follows the metrics logged before it); attempt 2 resumed at step 20
    steps = [m.step for m in _history(run, "loss")]
    assert sorted(s for s in steps if s < 20) == list(range(20)) and set(steps) == set(range(40))
    uid = run.info.run_id
    text = open(mlflow.artifacts.download_artifacts(run_id=uid, artifact_path="restarts/attempt1_error.txt")).read()
    assert "ValueError: bad batch at step 25" in text
    log = open(mlflow.artifacts.download_artifacts(run_id=uid, artifact_path="logs/rank1.txt")).read()
    assert log.index("rank 1 attempt 0") < log.index("---- restart 1 follows a failure ----") < log.index(
        "rank 1 attempt 1")


def fluent_main():
    import mlflow

    import spark_dl

    with mlflow.start_run():  # stands for the driver's run inside a rank
        mlflow.log_param("batch", 32)
        mlflow.set_tag("phase", "fluent")
        for step in range(5):
            mlflow.log_metric("fluent_loss", 10.0 - step, step=step)
        mlflow.log_metrics({"m1": 1.0, "m2": 2.0}, step=0)
        mlflow.log_text("hello from a rank", "notes/hello.txt")
    spark_dl.log_metrics({"loss": 0.5}, step=0)
    try:
        mlflow.set_experiment("elsewhere")
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_inside_active_run_with_fluent_calls_from_ranks(tracking_uri):
    with mlflow.start_run() as active:
        refusal = HorovodRunner(np=-2, progress=False).run(fluent_main)
        assert mlflow.active_run().info.run_id == active.info.run_id  # left open
        assert MlflowClient().get_run(active.info.run_id).info.status == "RUNNING"
    assert "driver is the only MLflow client" in refusal
    run = _only_run()  # exactly one run, the user's
    assert run.info.run_id == active.info.run_id
    assert run.data.params["batch"] == "32" and run.data.tags["phase"] == "fluent"
    assert [m.value for m in _history(run, "fluent_loss")] == [10.0, 9.0, 8.0, 7.0, 6.0]
    assert run.data.metrics["m2"] == 2.0 and run.data.metrics["loss"] == 0.5
    text = open(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="notes/hello.txt")).read()
    assert text == "hello from a rank"


def test_set_experiment_is_honoured(tracking_uri):
    exp = mlflow.set_experiment("my-experiment")
    try:
        HorovodRunner(np=-2, progress=False).run(train, steps=3, lr=0.1)
    finally:
        mlflow.set_experiment(experiment_id="0")
    assert _runs() == []
    run = _only_run([exp.experiment_id])
    assert run.info.status == "FINISHED" and len(_history(run, "loss")) == 3


def _train_with_the_server_down(monkeypatch, steps, **options):
    """``(result, TrackingWarnings, seconds, port)`` of a run tracked to a port nothing listens on."""
    with socket_closed_port() as port:
        uri = f"http://127.0.0.1:{port}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        try:
            started = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = HorovodRunner(np=-2, progress=False, **options).run(train, steps=steps, lr=0.1)
            elapsed = time.monotonic() - started
        finally:
            mlflow.set_tracking_uri(None)
    return out, [w for w in caught if issubclass(w.category, TrackingWarning)], elapsed, port


def test_tracking_server_down_never_blocks_training(tmp_path, monkeypatch):
    out, ours, elapsed, port = _train_with_the_server_down(monkeypatch, 200)
    assert out == "done"
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert f"127.0.0.1:{port}" in str(ours[0].message)
    assert elapsed < 30


class socket_closed_port:
    """A port nothing listens on (bound, never listening, so no one else takes it meanwhile)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_progress_bar_on_the_driver(tracking_uri, capfd):
    HorovodRunner(np=-2).run(train, steps=60, lr=0.1, sleep=0.01)
    err = capfd.readouterr().err
    assert "spark-dl" in err and "60step" in err and "loss=0.01667" in err and "step/s" in err


def test_no_tracking_when_turned_off(tracking_uri, monkeypatch, capfd):
    HorovodRunner(np=-2, tracking=False, progress=False).run(train, steps=5, lr=0.1)
    assert "step/s" not in capfd.readouterr().err
    monkeypatch.setenv("SPARK_DL_TRACKING", "0")  # turns off MLflow only; the progress bar is its own switch
    HorovodRunner(np=-2).run(train, steps=5, lr=0.1)
    assert _runs() == []


@pytest.mark.parametrize("value", ["5s", "-1"])
def test_a_bad_system_metrics_interval_is_refused_before_the_run(tracking_uri, monkeypatch, value):
    monkeypatch.setenv("SPARK_DL_SYSTEM_METRICS_INTERVAL", value)
    with pytest.raises(LaunchRefused, match=rf"SPARK_DL_SYSTEM_METRICS_INTERVAL='{value}' is not a number >= 0 s"):
        HorovodRunner(np=-2, progress=False).run(train, steps=5, lr=0.1)
    assert _runs() == [], "refused before an MLflow run was opened"
    HorovodRunner(np=-2, progress=False, tracking=Tracking(system_metrics=False)).run(train, steps=2, lr=0.1)


@pytest.mark.parametrize("kwargs, match", [
    ({"tracking": Tracking(all_ranks=True)}, None),
    ({"tracking": 0}, r"tracking must be True, False, None or spark_dl.tracking.Tracking\(...\), got 0 \(int\)"),
    ({"tracking": "off"}, "tracking must be True, False, None"),
    ({"tracking": {"all_ranks": True}}, "tracking must be True, False, None"),
    ({"progress": "no"}, "progress must be True, False or None"),
])
def test_tracking_and_progress_of_the_wrong_kind_are_refused(kwargs, match):
    if match is None:
        HorovodRunner(np=-2, **kwargs)
        return
    with pytest.raises(LaunchRefused, match=match):
        HorovodRunner(np=-2, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"grace_s": "5"}, r"Tracking\(grace_s=...\) must be a number of seconds >= 0 .*got '5'"),
    ({"grace_s": -1}, "grace_s=...\\) must be a number of seconds >= 0"),
    ({"all_ranks": "no"}, r"Tracking\(all_ranks=...\) must be True or False, got 'no'"),
    ({"rank_logs": None}, "rank_logs=...\\) must be True or False"),
    ({"run_name": 123}, r"Tracking\(run_name=...\) must be a str or None, got 123"),
])
def test_bad_tracking_options_are_refused_at_construction(kwargs, match):
    with pytest.raises(LaunchRefused, match=match):
        Tracking(**kwargs)


def odd_values_main():
    import threading

    import torch

    import spark_dl

    spark_dl.init()
    spark_dl.log_params({"fn": lambda: 1, "lock": threading.Lock(), "nested": {"lr": 0.1}})
    errors = []
    for bad in ({"loss": None}, {"loss": torch.ones(3)}, {"loss": "abc"}, [("loss", 1.0)]):
        try:
            spark_dl.log_metrics(bad)
        except TypeError as e:
            errors.append(str(e))
    try:
        spark_dl.log_metrics({"loss": 1.0}, step="abc")
    except TypeError as e:
        errors.append(str(e))
    try:
        spark_dl.log_metrics({"loss": 1.0}, step=1.7)  # not cut to 1
    except TypeError as e:
        errors.append(str(e))
    spark_dl.log_metrics({"loss": 0.5}, step=torch.tensor(0))  # an integer tensor is a step
    return errors


def test_params_that_cannot_be_pickled_and_metrics_that_are_not_numbers(tracking_uri):
    """A function or a lock as a param value is logged as its text (it stopped the rank's messages
    and lost the result); a metric that is not one number names its key."""
    errors = HorovodRunner(np=-2, progress=False).run(odd_values_main)
    assert "log_metrics: the value of 'loss' is a NoneType, not one number" in errors[0]
    assert "the value of 'loss' is a Tensor of shape (3,), not one number" in errors[1]
    assert ("the value of 'loss' is a str" in errors[2]
            and "log_metrics takes a dict {name: number}, got list" in errors[3])
    assert "step must be an int, got 'abc'" in errors[4] and "step must be an int, got 1.7" in errors[5]
    run = _only_run()
    assert run.info.status == "FINISHED"
    assert run.data.params["fn"].startswith("<function odd_values_main.<locals>.<lambda>")
    assert "lock" in run.data.params["lock"] and run.data.params["nested.lr"] == "0.1"
    assert [m.value for m in _history(run, "loss")] == [0.5]


def bad_artifact_paths_main():
    import mlflow

    import spark_dl

    spark_dl.init()
    errors = []
    for path in ("../../escaped.txt", "/tmp/abs.txt", "notes/"):
        try:
            mlflow.log_text("hi", path)
        except ValueError as e:
            errors.append(str(e))
    mlflow.log_text("kept", "notes/ok.txt")
    return errors


def test_artifact_paths_outside_the_run_are_refused_at_the_call(tracking_uri):
    """MLflow refused them only at the end, where the error read as a failing server, held back the
    writes behind it and left the run RUNNING."""
    errors = HorovodRunner(np=-2, progress=False).run(bad_artifact_paths_main)
    assert len(errors) == 3 and all("must be a file's path relative to the run's artifacts" in e for e in errors)
    assert "'../../escaped.txt'" in errors[0] and "'/tmp/abs.txt'" in errors[1]
    run = _only_run()
    assert run.info.status == "FINISHED"
    assert "notes/ok.txt" in {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "notes")}


def exits_early_main():
    import os

    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    spark_dl.log_metrics({"loss": 1.0}, step=0)
    dist.barrier()  # rank 1's init must not meet a rank 0 that is already gone
    if spark_dl.get_context().rank == 0:
        os._exit(0)
    return 1


def test_a_result_that_never_came_fails_the_mlflow_run_and_last_run(tracking_uri):
    from spark_dl import JobFailed

    runner = HorovodRunner(np=-2, progress=False)
    with pytest.raises(JobFailed, match=r"rank 0 finished without sending its return value: .*os._exit\(0\)"):
        runner.run(exits_early_main)
    assert not runner.last_run.succeeded
    assert _only_run().info.status == "FAILED"


def model_main(hidden):
    import torch

    import spark_dl

    spark_dl.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    spark_dl.log_model(model, "model", input_example=torch.zeros(3, 4))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training goes on: the logged copy must not see this
    spark_dl.log_model(model.state_dict(), "weights")
    return model(torch.ones(1, 4)).detach()


def test_log_model_from_rank0_is_loadable(tracking_uri):
    import torch

    HorovodRunner(np=-2, progress=False).run(model_main, hidden=8)
    run = _only_run()
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert torch.allclose(model(torch.ones(1, 4)), expected(torch.ones(1, 4)))
    info = mlflow.models.get_model_info(f"runs:/{run.info.run_id}/model")
    assert info.signature is not None and tuple(info.signature.inputs.to_dict()[0]["tensor-spec"]["shape"]) == (-1, 4)
    state = mlflow.pytorch.load_state_dict(f"runs:/{run.info.run_id}/weights")
    assert torch.allclose(state["0.weight"], expected[0].weight + 1.0)
    # pinned, and without the +cpu label pip could not install
    reqs = open(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model/requirements.txt")).read()
    assert set(reqs.split()) == {f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}",
                                 f"cloudpickle=={importlib.metadata.version('cloudpickle')}"}


def test_a_models_requirements_name_the_packages_its_classes_and_their_bases_come_from():
    import lightning
    import torch

    from spark_dl.tracking.models import pip_requirements

    class Net(lightning.LightningModule):  # defined here: only its base names a package
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

    assert pip_requirements(Net()) == sorted([f"cloudpickle=={importlib.metadata.version('cloudpickle')}",
                                              f"lightning=={lightning.__version__}",
                                              f"torch=={torch.__version__.split('+')[0]}"])


@pytest.mark.parametrize("given,pinned", [
    ("torch==2.13.0+cpu", "torch==2.13.0"),
    ("torch==2.11.0+cu130", "torch==2.11.0"),
    ('torch==2.11.0+cu130; python_version >= "3.10"', 'torch==2.11.0; python_version >= "3.10"'),
    ("cloudpickle==3.1.1", "cloudpickle==3.1.1"),
    ("numpy>=1.24", "numpy>=1.24"),
])
def test_a_requirement_loses_its_local_version_label_whatever_mlflow_does(given, pinned):
    from spark_dl.tracking.models import without_local_label

    assert without_local_label(given) == pinned


def test_a_run_short_enough_for_one_batch_still_has_its_speed(tracking_uri):
    # No sleep: the 5 steps of rank 0 reach the driver in one ~50 ms batch, which must measure
    # its speed from its own first record (this made the compressed-run test below flaky).
    HorovodRunner(np=-2, progress=False).run(train, steps=5, lr=0.1)
    run = _only_run()
    assert {"perf/step_time_s", "perf/steps_per_s"} <= set(run.data.metrics)
    assert run.data.metrics["perf/step_time_s"] > 0


def compressed_train(steps, compression=None):
    """``compression``: what DistributedOptimizer takes (None: ``QSGD()``)."""
    import spark_dl.horovod as hvd
    import torch

    import spark_dl
    from spark_dl.compression import QSGD

    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(1000, 10)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=QSGD() if compression is None else compression)
    for step in range(steps):
        loss = model(torch.randn(8, 1000)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        spark_dl.log_metrics({"loss": loss.item()}, step=step)


def test_communication_metrics_of_a_compressed_run(tracking_uri):
    HorovodRunner(np=-2, progress=False).run(compressed_train, steps=20)
    run = _only_run()
    for key in ("comm/bytes_sent_per_step", "comm/compression_ratio", "comm/allreduce_s_per_step",
                "perf/step_time_s", "perf/steps_per_s"):
        assert key in run.data.metrics, key
    # QSGD at 4.06 bits per element: about 7.9x fewer bytes than fp32 on the wire
    assert 7.0 < run.data.metrics["comm/compression_ratio"] < 8.5
    assert run.data.metrics["comm/bytes_sent_per_step"] > 0


def test_compression_auto_logs_each_buckets_pick_time_and_bytes(tracking_uri):
    HorovodRunner(np=-2, progress=False).run(compressed_train, steps=25, compression="auto")
    metrics = _only_run().data.metrics
    picked = [k for k in metrics if k.startswith("comm/auto/") and k.endswith("/choice")]
    assert len(picked) == 1  # one fusion bucket: the weight and the bias
    bucket = picked[0][len("comm/auto/"):-len("/choice")]
    assert bucket.startswith("DistributedOptimizer.bucket0.")
    assert metrics[picked[0]] in (0.0, 1.0, 2.0, 3.0)  # an index into Auto.candidates (none, fp16, PowerSGD, OneBit)
    assert metrics[f"comm/auto/{bucket}/seconds"] > 0 and metrics[f"comm/auto/{bucket}/bytes"] > 0
    assert metrics["comm/auto_switches"] == 0


def ray_style_loop(config):
    import spark_dl.ray_train as ray_train

    for epoch in range(config["epochs"]):
        ray_train.report({"loss": 1.0 / (epoch + 1), "phase": "train"})  # a str is kept in the result only


def test_ray_train_reports_are_metrics_and_the_config_params(tracking_uri):
    from spark_dl.ray_train import RunConfig, ScalingConfig, TorchTrainer

    result = TorchTrainer(ray_style_loop, train_loop_config={"epochs": 4, "lr": 0.1}, local_mode=True,
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="ray-style", storage_path=str(tracking_uri[len("sqlite:///"):])
                                               + ".results")).fit()
    assert result.metrics == {"loss": 0.25, "phase": "train"}
    run = _only_run()
    assert run.info.run_name == "ray-style"
    p = run.data.params
    assert p["main"] == "ray_style_loop" and p["train_loop_config.epochs"] == "4" and p["train_loop_config.lr"] == "0.1"
    assert [(m.step, m.value) for m in _history(run, "loss")] == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25)]
    assert "phase" not in run.data.metrics


def lightning_train(lr):
    import lightning as L
    import torch
    from spark_dl.tracking.lightning import SparkDLLogger
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self, lr, hidden=4):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(hidden, 1)

        def training_step(self, batch, _):
            x, y = batch
            loss = (self.layer(x) - y).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    torch.manual_seed(0)
    x = torch.randn(128, 4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, log_every_n_steps=1,
                        logger=SparkDLLogger(), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Net(lr), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16))
    return trainer.global_step


def test_lightning_metrics_and_hyperparameters_reach_the_run(tracking_uri):
    steps = spark_dl.TorchDistributor(num_processes=2, use_gpu=False, progress=False).run(lightning_train, 0.05)
    assert steps == 8  # 2 epochs of 4 steps on each rank's half
    run = _only_run()
    assert run.data.params["lr"] == "0.05" and run.data.params["hidden"] == "4"
    history = _history(run, "train_loss")
    assert [m.step for m in history] == list(range(8)) and history[-1].value < history[0].value


def bad_log_model_calls_main():
    import threading

    import torch

    import spark_dl

    class Locked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
            self.lock = threading.Lock()  # cannot be deep-copied (nor pickled to the driver)

        def forward(self, x):
            return self.layer(x)

    errors = []
    model = torch.nn.Linear(4, 2)
    for name in ("../x", "/abs", "", ".", 5):
        try:
            spark_dl.log_model(model, name)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    locked = Locked()
    try:
        spark_dl.log_model(locked, "locked")
    except TypeError as e:
        errors.append(str(e))
    spark_dl.log_model(locked.state_dict(), "locked_weights")  # the fix the error gives
    import weakref

    weakly = torch.nn.Linear(4, 2)
    weakly.peer = weakref.ref(model)  # deepcopy keeps a weakref as is; pickling it fails
    try:
        spark_dl.log_model(weakly, "weakly")
    except TypeError as e:
        errors.append(str(e))
    spark_dl.log_model(model, "models/v1.0", input_example=torch.zeros(2, 4))  # a nested name MLflow 3 refuses
    return errors


def test_log_model_refuses_a_bad_name_and_a_module_it_cannot_copy_or_pickle_at_the_call(tracking_uri):
    """They were found only on the driver at the end of the run (the model dropped with a
    misleading 'MLflow rejected a write'), or failed the rank with a raw pickling error."""
    import torch

    errors = HorovodRunner(np=-2, progress=False).run(bad_log_model_calls_main)
    assert len(errors) == 7, errors
    for bad, error in zip(("'../x'", "'/abs'", "''", "'.'"), errors):
        assert error.startswith(f"ValueError: log_model: name {bad} must be a folder's path relative to the run's "
                                "artifacts, inside them"), error
        assert "e.g. 'model' or 'models/final'" in error
    assert errors[4] == ("TypeError: log_model: name must be a non-empty str, got 5 (int), "
                         "e.g. 'model' or 'models/final'")
    assert errors[5].startswith("log_model could not copy the module Locked (TypeError: cannot pickle '_thread.lock' "
                                "object). Log its state_dict() instead (spark_dl.log_model(model.state_dict(), name)), "
                                "or remove the attribute that cannot be copied"), errors[5]
    # copied, but not picklable: it was lost on the background sender thread with a traceback on stderr
    assert errors[6].startswith("log_model could not pickle the module Linear to send it to the driver (TypeError: "
                                "cannot pickle 'weakref.ReferenceType' object). "
                                "Log its state_dict() instead"), errors[6]
    run = _only_run()
    assert run.info.status == "FINISHED"
    assert {a.path for a in MlflowClient().list_artifacts(run.info.run_id)} >= {"locked_weights", "models"}
    state = mlflow.pytorch.load_state_dict(f"runs:/{run.info.run_id}/locked_weights")
    assert set(state) == {"layer.weight", "layer.bias"}
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/models/v1.0")
    assert model(torch.ones(1, 4)).shape == (1, 2)
    info = mlflow.models.get_model_info(f"runs:/{run.info.run_id}/models/v1.0")
    assert info.signature is not None


def bad_example_main():
    import torch

    import spark_dl

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    spark_dl.log_metrics({"loss": 1.0}, step=0)
    spark_dl.log_model(model, "model", input_example=torch.zeros(3, 5))  # 5 features, the model takes 4
    return "unreachable"


def test_an_input_example_the_model_cannot_take_fails_the_rank_at_the_call(tracking_uri):
    with pytest.raises(RankFailed) as info:
        HorovodRunner(np=-2, progress=False).run(bad_example_main)
    message = str(info.value)
    assert ("ValueError: log_model('model'): the model cannot take its input_example (a Tensor of shape (3, 5), "
            "dtype torch.float32): RuntimeError: mat1 and mat2 shapes cannot be multiplied") in message, message
    assert ("Pass an input_example the model takes (e.g. one batch of its inputs: model(input_example) must work), "
            "or no input_example") in message
    run = _only_run()
    assert run.info.status == "FAILED" and run.data.metrics["loss"] == 1.0


def test_log_model_outside_a_rank_checks_the_same(tracking_uri):
    """With an active run in the driver, log_model logs there directly: the same checks apply."""
    import threading

    import torch

    class Generating(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 2)
            self.batches = (i for i in range(3))  # a generator cannot be deep-copied

    model = torch.nn.Linear(4, 2)
    with mlflow.start_run() as run:
        with pytest.raises(ValueError, match=r"log_model: name '\.\./x' must be a folder's path relative to the run"):
            spark_dl.log_model(model, "../x")
        with pytest.raises(TypeError, match=r"name must be a non-empty str, got None \(NoneType\)"):
            spark_dl.log_model(model, None)
        with pytest.raises(ValueError) as bad_dtype:
            spark_dl.log_model(model, "model", input_example=torch.zeros(2, 4, dtype=torch.int64))
        with pytest.raises(TypeError) as no_copy:
            spark_dl.log_model(Generating(), "model")
        model.train()
        spark_dl.log_model(model, "model", input_example=torch.zeros(2, 4))
        assert model.training, "the caller's module is left as it was (a copy is logged)"
        locked = torch.nn.Linear(4, 2)
        locked.lock = threading.Lock()
        spark_dl.log_model(locked.state_dict(), "weights")
    message = str(bad_dtype.value)
    assert message.startswith("log_model('model'): the model cannot take its input_example (a Tensor of shape (2, 4), "
                              "dtype torch.int64): RuntimeError: "), message
    assert "Pass an input_example the model takes" in message
    assert str(no_copy.value).startswith("log_model could not copy the module Generating (TypeError: cannot pickle "
                                         "'generator' object). Log its state_dict() instead")
    uri = f"runs:/{run.info.run_id}"
    assert mlflow.models.get_model_info(f"{uri}/model").signature is not None
    assert set(mlflow.pytorch.load_state_dict(f"{uri}/weights")) == {"weight", "bias"}


def test_a_signature_that_cannot_be_inferred_on_the_driver_still_logs_the_model(tracking_uri):
    """The driver's last line of defence (the rank checks the example first): the model is logged
    without a signature, with a warning saying why, instead of being dropped."""
    import numpy as np
    import torch

    from spark_dl.tracking.models import log_torch_model

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with mlflow.start_run() as run:
        with pytest.warns(TrackingWarning, match=r"log_model: no signature could be inferred for model 'model' from "
                                                 r"its input_example \(RuntimeError: .*\); it is logged without"):
            log_torch_model(model, "model", np.zeros((3, 5), dtype=np.float32), run.info.run_id)
    uri = f"runs:/{run.info.run_id}/model"
    assert mlflow.models.get_model_info(uri).signature is None
    assert torch.allclose(mlflow.pytorch.load_model(uri)(torch.ones(1, 4)), model(torch.ones(1, 4)))


def fork_logging_main(batches):
    import torch
    from torch.utils.data import DataLoader, Dataset

    import spark_dl

    class Logging(Dataset):
        def __len__(self):
            return batches

        def __getitem__(self, i):
            spark_dl.log_metrics({"worker_metric": float(i)}, step=i)  # in the DataLoader worker: dropped
            spark_dl.log_params({"worker_param": i})
            return torch.tensor([float(i)])

    seen = 0
    loader = DataLoader(Logging(), batch_size=1, num_workers=1, multiprocessing_context="fork")
    for step, x in enumerate(loader):
        spark_dl.log_metrics({"loss": float(x.sum())}, step=step)
        seen += 1
    return seen


def test_logging_from_a_forked_dataloader_worker_is_dropped_with_a_warning(tracking_uri, capfd):
    """A forked worker inherits the rank's buffer but not the thread sending it: what it logged
    was lost without a word."""
    out = HorovodRunner(np=-2, progress=False, driver_log_verbosity="all").run(fork_logging_main, batches=4)
    assert out == 4
    err = capfd.readouterr().err
    for r in (0, 1):
        warned = [line for line in err.splitlines() if line.startswith(f"[{r}]<stderr>:") and "TrackingWarning" in line]
        assert len(warned) == 1, err  # once per process
        assert (f"spark_dl.log_metrics was called in a process forked from rank {r} (pid ") in warned[0]
        assert ("e.g. a DataLoader worker with num_workers > 0), which has no link to the driver: what it logs is "
                "dropped") in warned[0]
        assert ("Log from the training loop in the rank's main process instead, e.g. return the values with the "
                "batch and log them there.") in warned[0]
    run = _only_run()
    assert run.info.status == "FINISHED"
    assert "worker_metric" not in run.data.metrics and "worker_param" not in run.data.params
    assert [(m.step, m.value) for m in _history(run, "loss")] == [(s, float(s)) for s in range(4)]


def long_params_main(notes, prompt, fine):
    import spark_dl

    if spark_dl.get_context().rank == 0:
        spark_dl.log_params({"notes": notes, "short": "ok"})
        spark_dl.log_params({"notes": notes})  # the same key again: still one warning
    return len(notes)


def test_params_over_mlflows_limit_are_cut_visibly_with_one_warning_per_key(tracking_uri):
    """MLflow refuses a param over 6000 characters: the value is still cut, but marked, and the
    driver says so once per key, whether the driver (a run() kwarg) or the rank cut it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert HorovodRunner(np=-2, progress=False).run(long_params_main, notes="n" * 7000, prompt="p" * 9000,
                                                        fine="f" * 6000) == 7000
    p = _only_run().data.params
    for key, length in (("notes", 7000), ("prompt", 9000)):
        mark = f"...[cut from {length} chars]"
        assert len(p[key]) == 6000 and p[key] == key[0] * (6000 - len(mark)) + mark
        said = [str(w.message) for w in caught
                if issubclass(w.category, TrackingWarning) and f"'{key}'" in str(w.message)]
        assert said == [f"param '{key}' is {length} characters, more than MLflow's limit of 6000: it was logged cut, "
                        f"ending '{mark}'. Log long text as an artifact instead, e.g. spark_dl.tracking."
                        f"log_artifact_bytes(text.encode(), '{key}.txt') or mlflow.log_text(text, '{key}.txt') on "
                        "rank 0, and keep the param short"], said
    assert p["fine"] == "f" * 6000 and p["short"] == "ok"  # at the limit: whole, no warning
    assert not any("'fine'" in str(w.message) for w in caught)


def colliding_main(np, mode, backend, world, lr):
    import spark_dl

    spark_dl.init()  # rank 0 logs its process group's backend
    return spark_dl.get_context().world_size


def test_kwargs_named_like_spark_dls_own_params_are_logged_as_kwargs_dot_name(tracking_uri):
    assert HorovodRunner(np=-2, progress=False).run(colliding_main, np=7, mode="fast", backend="nccl",
                                                    world={"hosts": "mine"}, lr=0.1) == 2
    p = _only_run().data.params
    assert p["np"] == "-2" and p["mode"] == "local" and p["backend"] == "gloo" and p["world_size"] == "2"
    assert p["world.num_hosts"] == "1" and p["world.hosts"] != "mine"
    assert p["kwargs.np"] == "7" and p["kwargs.mode"] == "fast" and p["kwargs.backend"] == "nccl"
    assert p["kwargs.world.hosts"] == "mine" and p["lr"] == "0.1"  # the others keep their names


def world_size_main(**_):
    import spark_dl

    return spark_dl.get_context().world_size


def test_the_runs_arguments_are_logged_without_credentials(tracking_uri, tmp_path):
    """Tracking is on by default, so what a run is given must not land in the store in clear."""
    assert HorovodRunner(np=-2, progress=False).run(world_size_main, hf_token="hf_abc", max_tokens=512,
                                                    db="postgresql://bob:pw@db/x") == 2
    p = _only_run().data.params
    assert p["hf_token"] == "***" and p["max_tokens"] == "512" and p["db"] == "postgresql://bob:***@db/x"
    script = tmp_path / "train.py"
    script.write_text("import spark_dl\nspark_dl.init()\n")
    HorovodRunner(np=-1, progress=False).run_script(script, "--lr", "0.1", "--api-key", "k1", "--token=t1")
    run = next(r for r in _runs() if "argv" in r.data.params)
    assert run.data.params["argv"] == "['--lr', '0.1', '--api-key', '***', '--token=***']"


def relogging_main():
    import spark_dl

    if spark_dl.get_context().rank == 0:
        spark_dl.log_params({"np": 5, "lr": 0.1})
        spark_dl.log_params({"lr": 0.2})
        spark_dl.log_params({"lr": 0.3, "lr_final": 0.3})  # a second change of lr: no second warning
        spark_dl.log_params({"lr": 0.1})  # the same value again: nothing to say
    return "done"


def test_a_param_a_rank_logs_again_with_another_value_is_warned_about_once(tracking_uri):
    """MLflow keeps a param's first value (its log_param raises on a change): the changed value,
    or a rank's 'np' where spark-dl logged its own, was dropped without a word."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert HorovodRunner(np=-2, progress=False).run(relogging_main) == "done"
    p = _only_run().data.params
    assert p["np"] == "-2" and p["lr"] == "0.1" and p["lr_final"] == "0.3"
    said = sorted(str(w.message) for w in caught if issubclass(w.category, TrackingWarning))
    assert said == [
        "param 'lr' was already logged as '0.1'; the value a rank logged, '0.2', is not logged (MLflow keeps a "
        "param's first value). Log it under another name, or log a value that changes during training as a "
        "metric (spark_dl.log_metrics)",
        "param 'np' was already logged as '-2'; the value a rank logged, '5', is not logged (spark-dl logs this "
        "param itself). Log it under another name, or log a value that changes during training as a metric "
        "(spark_dl.log_metrics)",
    ], said


# -- the tracking store is checked before the launch ------------------------------------------------
def mark_launched(path):
    open(path, "w").close()
    return "ran"


def _all_runs(uri):
    from mlflow.entities import ViewType

    client = MlflowClient(tracking_uri=uri)
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(ids, run_view_type=ViewType.ALL)


@pytest.fixture
def no_experiment_chosen(monkeypatch):
    """MLflow's own state as in a fresh process: no active experiment (set_experiment sets it, and
    MLFLOW_EXPERIMENT_ID, for the rest of the process), no experiment in the environment."""
    from mlflow.tracking import fluent

    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def _refused(tmp_path, match):
    """Run and expect a refusal before the launch: main never ran."""
    marker = tmp_path / "launched"
    started = time.monotonic()
    with pytest.raises(LaunchRefused, match=match) as info:
        HorovodRunner(np=-2, progress=False).run(mark_launched, path=str(marker))
    assert not marker.exists(), "refused, yet main ran"
    assert time.monotonic() - started < 10
    return str(info.value)


def test_an_experiment_id_that_does_not_exist_is_refused_before_the_launch(tracking_uri, tmp_path, monkeypatch,
                                                                          no_experiment_chosen):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "424242")
    text = _refused(tmp_path, r"MLflow experiment id '424242' \(from MLFLOW_EXPERIMENT_ID\) does not exist")
    assert tracking_uri in text and "unset MLFLOW_EXPERIMENT_ID" in text and 'mlflow.set_experiment("name")' in text
    assert "HorovodRunner(..., tracking=False)" in text and "\n" not in text
    assert _all_runs(tracking_uri) == [], "refused before an MLflow run was opened"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "0")  # one that exists: tracked as ever
    assert HorovodRunner(np=-2, progress=False).run(train, steps=3, lr=0.1) == "done"
    assert _only_run().info.status == "FINISHED"


def test_a_set_experiment_from_another_store_or_deleted_is_refused(tracking_uri, tmp_path, monkeypatch,
                                                                    no_experiment_chosen, _template_db):
    import shutil

    exp = mlflow.set_experiment("mine")
    MlflowClient().delete_experiment(exp.experiment_id)
    text = _refused(tmp_path, rf"MLflow experiment 'mine' \(id '{exp.experiment_id}', from the active "
                              r"mlflow.set_experiment\(\)\) .* is deleted")
    assert f"restore_experiment('{exp.experiment_id}')" in text
    MlflowClient().restore_experiment(exp.experiment_id)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(_template_db, other / "mlflow.db")
    uri = f"sqlite:///{other / 'mlflow.db'}"  # the experiment set above is not in this store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    text = _refused(tmp_path, rf"MLflow experiment id '{exp.experiment_id}' \(from the active "
                              r"mlflow.set_experiment\(\)\) does not exist in the tracking store sqlite:///")
    assert 'call mlflow.set_experiment("name") again after mlflow.set_tracking_uri()' in text
    assert _all_runs(uri) == [] and _all_runs(tracking_uri) == []


def test_a_tracking_uri_mlflow_cannot_open_is_refused(tracking_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://x")
    mlflow.set_tracking_uri("foo://x")
    text = _refused(tmp_path, r"MLflow cannot open the tracking URI 'foo://x': it has no tracking store for the "
                              r"scheme 'foo'")
    assert "'sqlite'" in text and 'mlflow.set_tracking_uri("sqlite:///mlflow.db")' in text and "tracking=False" in text


def test_a_file_store_is_refused_unless_mlflow_allows_it(tracking_uri, tmp_path, monkeypatch, no_experiment_chosen):
    """MLflow 3 keeps its file store in maintenance mode: without MLFLOW_ALLOW_FILE_STORE=true it
    refuses to open one, which the writer used to retry until after training."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    if hasattr(mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE"):  # MLflow 3 (2 opens file stores)
        text = _refused(tmp_path, rf"The MLflow tracking URI {re.escape(uri)} is a file store, which MLflow "
                                  rf"{mlflow.__version__} keeps in maintenance mode and refuses to open unless "
                                  r"MLFLOW_ALLOW_FILE_STORE=true")
        assert 'mlflow.set_tracking_uri("sqlite:///mlflow.db")' in text and "mlflow migrate-filestore" in text
        assert not (tmp_path / "mlruns").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the opt-out MLflow offers: tracked there
    assert HorovodRunner(np=-2, progress=False).run(train, steps=3, lr=0.1) == "done"
    (run,) = _all_runs(uri)
    assert run.info.status == "FINISHED" and len(MlflowClient(uri).get_metric_history(run.info.run_id, "loss")) == 3


def _read_only_dir(tmp_path):
    """A directory no one here can create files in: mode 0555 (root ignores modes: then /sys or /proc,
    where the kernel refuses new files to root too)."""
    import os

    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    for candidate in (str(d), "/sys", "/proc"):
        try:
            with open(os.path.join(candidate, "probe"), "w"):
                pass
            os.unlink(os.path.join(candidate, "probe"))
        except OSError:
            return candidate
    raise AssertionError("no directory on this machine refuses new files (a 0555 one, /sys, /proc)")


@pytest.mark.parametrize("kind", ["sqlite under a file", "sqlite in a read-only dir", "file store in a read-only dir"])
def test_a_store_that_cannot_be_written_is_refused(tracking_uri, tmp_path, monkeypatch, no_experiment_chosen, kind):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    if kind == "sqlite under a file":
        (tmp_path / "a-file").write_text("not a directory")
        path = str(tmp_path / "a-file" / "mlflow.db")
        uri, what = f"sqlite:///{path}", rf"{re.escape(str(tmp_path / 'a-file'))} is not a directory"
    else:
        read_only = _read_only_dir(tmp_path)
        if kind.startswith("sqlite"):
            uri, what = f"sqlite:///{read_only}/mlflow.db", rf"{re.escape(read_only)} is not writable"
        else:
            uri = f"file://{read_only}/mlruns"
            what = rf"{re.escape(read_only)}/mlruns does not exist and cannot be created: .* is not writable"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    text = _refused(tmp_path, rf"The MLflow tracking store {re.escape(uri)} cannot be written: .*{what}")
    assert "a place this driver can write" in text and "tracking=False" in text


def test_a_good_sqlite_store_still_tracks_after_the_check(tmp_path, monkeypatch, no_experiment_chosen):
    """A store that does not exist yet, in a directory that does not either: MLflow 3 creates both."""
    from mlflow.store.db import utils

    folder = tmp_path / "new" / "dir" if hasattr(utils, "_make_parent_dirs_if_sqlite") else tmp_path
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    try:
        assert HorovodRunner(np=-2, progress=False).run(train, steps=4, lr=0.1) == "done"
        (run,) = _all_runs(uri)
        assert run.info.status == "FINISHED" and run.info.experiment_id == "0"
        assert len(MlflowClient(uri).get_metric_history(run.info.run_id, "loss")) == 4
        exp = MlflowClient(uri).create_experiment("chosen")
        monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)  # an id that exists goes through the check
        HorovodRunner(np=-2, progress=False).run(train, steps=2, lr=0.1)
        assert [r.info.experiment_id for r in _all_runs(uri)].count(exp) == 1
    finally:
        mlflow.set_tracking_uri(None)


def test_a_tracking_server_refuses_an_unknown_experiment_in_a_moment(server_uri, tmp_path, monkeypatch,
                                                                    no_experiment_chosen):
    before = len(_all_runs(server_uri))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "987654321")
    text = _refused(tmp_path, r"MLflow experiment id '987654321' \(from MLFLOW_EXPERIMENT_ID\) does not exist in "
                              rf"the tracking store {re.escape(server_uri)}")
    assert "No Experiment with id=987654321" in text
    assert len(_all_runs(server_uri)) == before


def test_an_experiment_id_with_the_server_down_never_blocks_training(tmp_path, monkeypatch, no_experiment_chosen):
    """MLflow's own lookup of MLFLOW_EXPERIMENT_ID retried for minutes against a server that is down."""
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "5")
    out, ours, elapsed, _ = _train_with_the_server_down(monkeypatch, 20, tracking=Tracking(grace_s=1.0))
    assert out == "done" and ours and elapsed < 30
