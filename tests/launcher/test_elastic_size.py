"""HorovodRunner(min_np=...): an attempt runs with as many ranks as there are free task slots for,
from min_np to np, on a real local[4] session whose slots another Spark job takes."""
from __future__ import annotations

import os
import time

import pytest
from slots import OtherJob

import spark_dl
from spark_dl import HorovodRunner, LaunchRefused
from spark_dl.driver import cluster


def fails_on_attempt_0(flags):
    """Attempt 0 saves a checkpoint, then its last rank fails; attempt 1 reports its world."""
    import torch
    import torch.distributed as dist

    spark_dl.init()
    ctx = spark_dl.get_context()
    state = spark_dl.load_checkpoint()
    if ctx.attempt == 0:
        spark_dl.save_checkpoint({"samples_seen": 96}, step=3)
        dist.barrier()  # the checkpoint is stored before anyone fails
        if ctx.rank == ctx.world_size - 1:
            open(os.path.join(flags, "release"), "w").close()  # the other job may end now
            raise RuntimeError("executor preempted (pretend)")
        time.sleep(120)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"world": dist.get_world_size(), "sum": t.item(), "resumed": state}


def test_a_restart_runs_on_the_free_slots_down_to_min_np(spark, tmp_path, capfd):
    flags = str(tmp_path)

    class TakeSlotsOnRestart:  # an observer's on_restart runs before the restart is sized
        def on_start(self, job): ...
        def on_message(self, rank, kind, data): ...
        def on_log(self, rank, stream, line): ...
        def on_finish(self, error): ...

        def on_restart(self, attempt, error):
            os.unlink(other.release)  # attempt 0's failing rank made it
            other.start()

    runner = HorovodRunner(np=4, min_np=2, max_restarts=1)
    runner.observers.append(TakeSlotsOnRestart())
    with OtherJob(spark.sparkContext, flags) as other:
        outs = runner.run_all(fails_on_attempt_0, flags=flags)
    assert outs == [{"world": 2, "sum": 2.0, "resumed": {"samples_seen": 96}}] * 2
    assert runner.last_run.world_sizes == (4, 2)
    assert "[spark-dl] restarting 2 of np=4 ranks (the free task slots; min_np=2)" in capfd.readouterr().err


def test_a_run_starts_on_the_free_slots_and_a_restart_grows_back_to_np(spark, tmp_path, capfd, monkeypatch, sqlite_uri):
    import mlflow

    monkeypatch.setenv("SPARK_DL_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    flags = str(tmp_path)
    runner = HorovodRunner(np=4, min_np=2, max_restarts=1, progress=False)
    with OtherJob(spark.sparkContext, flags) as other:
        other.start()  # two of local[4]'s slots are taken before the run
        outs = runner.run_all(fails_on_attempt_0, flags=flags)  # attempt 0's failing rank ends the other job
    assert outs == [{"world": 4, "sum": 4.0, "resumed": {"samples_seen": 96}}] * 4
    assert runner.last_run.world_sizes == (2, 4)
    assert "[spark-dl] restarting all 4 ranks" in capfd.readouterr().err
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(runner.last_run.mlflow_run_id)
    assert run.data.tags["spark_dl.world_sizes"] == "2,4" and run.data.params["np"] == "4"


def test_the_free_slots_decide_the_size(spark):
    sc = spark.sparkContext  # local[4], idle
    assert cluster.elastic_size(sc, 1, 4) == 4
    assert cluster.elastic_size(sc, 1, 8) == 4  # no more than are free
    assert cluster.elastic_size(sc, 6, 8) == 6  # fewer than min_np free: min_np, and the stage waits
    assert cluster.elastic_size(sc, 2, 8, per_task=2) == 8  # two ranks per task slot
    assert cluster.elastic_size(sc, 2, 7, per_task=2) == 6  # whole tasks only


@pytest.mark.parametrize("kwargs, match", [
    ({"np": 4, "min_np": 0}, r"min_np must be an int from 1 to np=4 .*got 0"),
    ({"np": 4, "min_np": 5}, r"min_np must be an int from 1 to np=4 .*got 5"),
    ({"np": 4, "min_np": True}, r"min_np must be an int from 1 to np=4 .*got True"),
    ({"np": -2, "min_np": 1}, r"min_np=1 with np=-2: local processes always start all 2"),
])
def test_bad_min_np_is_refused(kwargs, match):
    with pytest.raises(LaunchRefused, match=match):
        HorovodRunner(**kwargs)
