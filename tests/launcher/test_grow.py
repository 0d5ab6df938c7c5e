"""HorovodRunner(min_np=..., grow_interval=...): a healthy run that started on fewer than np ranks
grows when task slots free up, at rank 0's next checkpoint, on a real local[4] session whose slots
another Spark job holds and then releases."""
from __future__ import annotations

import os
import re
import time

import pytest
from slots import OtherJob

import spark_dl
from spark_dl import HorovodRunner, LaunchRefused

STEPS = 60


def steps_with_checkpoints(flags, release_at=3, checkpoints=True, steps=STEPS):
    """Each step is a collective; rank 0 checkpoints after each one the world size it ran with.
    On attempt 0 steps are slow, and after step ``release_at`` the other job lets its slots go."""
    import torch
    import torch.distributed as dist

    spark_dl.init()
    ctx = spark_dl.get_context()
    state = spark_dl.load_checkpoint() or {"step": 0, "worlds": []}
    worlds = list(state["worlds"])
    for step in range(state["step"], steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        worlds.append(int(t.item()))
        if ctx.attempt == 0:
            time.sleep(0.2)
            if step == release_at and ctx.rank == 0:
                open(os.path.join(flags, "release"), "w").close()
        if checkpoints:
            spark_dl.save_checkpoint({"step": step + 1, "worlds": worlds}, step=step + 1)
    return {"world": dist.get_world_size(), "attempt": ctx.attempt, "worlds": worlds, "resumed_at": state["step"]}


def test_a_run_grows_at_its_next_checkpoint_when_slots_free_up(spark, tmp_path, capfd, monkeypatch, sqlite_uri):
    import mlflow

    monkeypatch.setenv("SPARK_DL_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    runner = HorovodRunner(np=4, min_np=2, grow_interval=0.5, progress=False)  # max_restarts=0: a grow is no restart
    with OtherJob(spark.sparkContext, str(tmp_path)) as other:
        other.start()  # two of local[4]'s four slots are taken: the run starts on two ranks
        outs = runner.run_all(steps_with_checkpoints, flags=str(tmp_path))
    err = capfd.readouterr().err
    assert [o["world"] for o in outs] == [4] * 4 and {o["attempt"] for o in outs} == {1}
    worlds, resumed_at = outs[0]["worlds"], outs[0]["resumed_at"]
    # every step ran exactly once (the checkpointed ones never again): on 2 ranks up to the checkpoint
    # the grow stopped at, on 4 after it; the slots freed after step 3, so at least 4 ran on 2
    assert len(worlds) == STEPS and 4 <= resumed_at < STEPS
    assert worlds == [2] * resumed_at + [4] * (STEPS - resumed_at)
    info = runner.last_run
    assert info.world_sizes == (2, 4) and info.grows == 1 and info.attempts == 2
    assert info.failures == () and info.succeeded
    # the other job's two tasks may end one look apart: the grow is armed for 3 first, then for 4,
    # or the checkpoint comes between and the relaunch takes both slots free by then
    announced = re.findall(r"task slots for (\d) more ranks? are free: the run grows to (\d) ranks(.*) at rank 0's",
                           err)
    later = " (or more, if more slots are free by then)"
    assert announced and announced[-1] in {("2", "4", ""), ("1", "3", later)}, err
    assert "[spark-dl] growing from 2 to all 4 ranks (not a restart: max_restarts is untouched)" in err
    assert f"load_checkpoint() returns the one saved at step {resumed_at}" in err
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(info.mlflow_run_id)
    assert run.data.tags["spark_dl.world_sizes"] == "2,4" and run.data.tags["spark_dl.grows"] == "1"
    assert run.info.status == "FINISHED" and "spark_dl.restarts" not in run.data.tags


def test_a_grow_whose_slots_are_taken_meanwhile_goes_on_at_its_size_and_looks_less_often(spark, tmp_path, capfd):
    taker = OtherJob(spark.sparkContext, str(tmp_path / "taker"))
    os.makedirs(tmp_path / "taker")

    class TakeSlotsOnGrow:  # on_grow runs before the relaunch is sized
        def on_start(self, job): ...
        def on_message(self, rank, kind, data): ...
        def on_log(self, rank, stream, line): ...
        def on_finish(self, error): ...

        def on_grow(self, attempt, world_size):
            taker.start()

    runner = HorovodRunner(np=4, min_np=2, grow_interval=0.5)
    runner.observers.append(TakeSlotsOnGrow())
    with OtherJob(spark.sparkContext, str(tmp_path)) as other, taker:
        other.start()
        outs = runner.run_all(steps_with_checkpoints, flags=str(tmp_path))
    assert [o["world"] for o in outs] == [2, 2] and len(outs[0]["worlds"]) == STEPS
    assert runner.last_run.world_sizes == (2, 2) and runner.last_run.grows == 1
    assert ("[spark-dl] growing from 2 to 2 of np=4 ranks (the free slots were taken meanwhile; the next look "
            "is in 1 s)") in capfd.readouterr().err


def test_a_run_that_never_checkpoints_keeps_its_size(spark, tmp_path, capfd):
    runner = HorovodRunner(np=4, min_np=2, grow_interval=0.3)
    with OtherJob(spark.sparkContext, str(tmp_path)) as other:
        other.start()
        outs = runner.run_all(steps_with_checkpoints, flags=str(tmp_path), release_at=0, checkpoints=False, steps=15)
    assert [o["world"] for o in outs] == [2, 2] and outs[0]["worlds"] == [2] * 15
    assert runner.last_run.world_sizes == (2,) and runner.last_run.grows == 0
    # the slots were seen (a grow was armed), but no checkpoint came to stop at
    assert "the run grows to 4 ranks at rank 0's next checkpoint" in capfd.readouterr().err


def fails_after_growing(flags):
    """Grows from 2 to 4 ranks (as above), then rank 3 of the grown attempt fails."""
    import torch
    import torch.distributed as dist

    spark_dl.init()
    ctx = spark_dl.get_context()
    state = spark_dl.load_checkpoint() or {"step": 0}
    for step in range(state["step"], STEPS):
        t = torch.ones(1)
        dist.all_reduce(t)
        if ctx.attempt == 0:
            time.sleep(0.2)
            if step == 2 and ctx.rank == 0:
                open(os.path.join(flags, "release"), "w").close()
        elif ctx.rank == 3:
            raise ValueError("a bug on the grown world")
        spark_dl.save_checkpoint({"step": step + 1}, step=step + 1)
    return dist.get_world_size()


def test_a_failure_after_a_grow_is_the_runs_error(spark, tmp_path, capfd):
    runner = HorovodRunner(np=4, min_np=2, grow_interval=0.5)  # max_restarts=0: the grow did not use it up
    with OtherJob(spark.sparkContext, str(tmp_path)) as other:
        other.start()
        with pytest.raises(spark_dl.RankFailed, match="a bug on the grown world") as e:
            runner.run(fails_after_growing, flags=str(tmp_path))
    assert e.value.rank == 3
    info = runner.last_run
    assert info.world_sizes == (2, 4) and info.grows == 1 and info.attempts == 2
    assert len(info.failures) == 1 and not info.succeeded
    assert "growing from 2 to all 4 ranks" in capfd.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    ({"np": 4, "grow_interval": 5}, r"grow_interval=5 needs min_np: without it every attempt runs all np=4 ranks"),
    ({"np": 4, "min_np": 2, "grow_interval": 0}, r"grow_interval must be a number of seconds > 0, got 0"),
    ({"np": 4, "min_np": 2, "grow_interval": "60"}, r"grow_interval must be a number of seconds > 0, got '60'"),
])
def test_bad_grow_interval_is_refused(kwargs, match):
    with pytest.raises(LaunchRefused, match=match):
        HorovodRunner(**kwargs)
