"""HorovodRunner(max_restarts=N): a failed run is launched again and resumes from the checkpoint
rank 0 saved on the driver (locally, in a barrier stage, and after losing an executor JVM)."""
from __future__ import annotations

import os
import re
import time

import psutil
import pytest
from procs import interrupt_main_when_recorded, record_self_and_child, record_then_wait, recorded_pids, wait_all_dead

import spark_dl
from spark_dl import HorovodRunner, JobFailed, LaunchRefused, RankFailed


def resumable(steps, fail_rank=1, fail_step=12, how="exit", every=5, pid_dir=None):
    """Sum a gradient of ones for ``steps`` steps, checkpointing every ``every``; on the first
    attempt ``fail_rank`` dies at ``fail_step`` (``how``: exit code 3, SIGKILL of itself, or
    SIGKILL of its executor's JVM)."""
    import signal

    import torch
    import torch.distributed as dist

    spark_dl.init()
    ctx = spark_dl.get_context()
    if pid_dir is not None and ctx.attempt == 0:
        record_self_and_child(pid_dir)
    state = spark_dl.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    w = torch.zeros(3) if state is None else state["w"]
    saved = []
    for step in range(start, steps):
        g = torch.ones(3)
        dist.all_reduce(g)
        w += g
        if every and step % every == every - 1:
            saved.append(spark_dl.save_checkpoint({"step": step, "w": w.clone()}, step=step))
        if ctx.attempt == 0 and step == fail_step and ctx.rank == fail_rank:
            if how == "exit":
                os._exit(3)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            jvm = next(p for p in psutil.Process().parents() if "java" in p.name())
            jvm.kill()
            time.sleep(60)
        dist.barrier()
    return {"attempt": ctx.attempt, "start": start, "w": w.tolist(), "saved": saved,
            "loaded": None if state is None else state["step"]}


def test_a_failed_rank_restarts_the_run_from_the_last_checkpoint(capfd):
    runner = HorovodRunner(np=-2, max_restarts=1)
    outs = runner.run_all(resumable, steps=20)
    info = runner.last_run
    assert info.succeeded and info.attempts == 2 and len(info.failures) == 1 and info.job_id.startswith("spark-dl-")
    assert isinstance(info.failures[0], RankFailed) and info.mlflow_run_id is None and info.seconds > 0
    # the checkpoint of step 9 was the last before rank 1 died at step 12: both ranks resume there
    assert [o["attempt"] for o in outs] == [1, 1]
    assert [o["loaded"] for o in outs] == [9, 9]
    assert [o["w"] for o in outs] == [[40.0] * 3] * 2  # 20 steps of 2 ranks, none counted twice
    assert outs[0]["saved"] == [True, True] and outs[1]["saved"] == [False, False]  # only rank 0's are kept
    err = capfd.readouterr().err
    # rank 1's exit, or rank 0's error from the collective rank 1 left: whichever reached the driver first
    assert re.search(r"\[spark-dl\] attempt 1 of 2 failed: rank [01] on localhost failed: ", err), err
    assert "restart 1 of max_restarts=1); load_checkpoint() returns the one saved at step 9" in err


def test_without_a_checkpoint_the_restart_starts_over(capfd):
    out = HorovodRunner(np=-2, max_restarts=2).run(resumable, steps=15, every=0)
    assert out["attempt"] == 1 and out["start"] == 0 and out["w"] == [30.0] * 3
    assert "no checkpoint was saved, so it starts over" in capfd.readouterr().err


def always_fails(count_dir):
    import tempfile

    ctx = spark_dl.get_context()
    tempfile.mkstemp(dir=count_dir, prefix=f"attempt{ctx.attempt}-rank{ctx.rank}-")
    if ctx.rank == 1:
        raise ValueError(f"bad batch on attempt {ctx.attempt}")
    time.sleep(60)


def test_when_restarts_run_out_the_last_error_is_raised_naming_the_earlier_ones(tmp_path):
    runner = HorovodRunner(np=-2, max_restarts=2)
    with pytest.raises(RankFailed, match="bad batch on attempt 2") as e:
        runner.run(always_fails, count_dir=str(tmp_path))
    assert not runner.last_run.succeeded and runner.last_run.attempts == 3
    assert runner.last_run.failures == (*e.value.previous_failures, e.value)
    assert sorted(n.split("-")[0] for n in os.listdir(tmp_path) if "rank1" in n) == ["attempt0", "attempt1", "attempt2"]
    earlier = e.value.previous_failures
    assert [type(x) for x in earlier] == [RankFailed, RankFailed]
    assert "bad batch on attempt 0" in str(earlier[0]) and "bad batch on attempt 1" in str(earlier[1])
    note = "\n".join(e.value.__notes__)
    assert "restarted this run 2 time(s) (max_restarts=2)" in note
    assert "attempt 1: RankFailed: rank 1 on localhost failed: builtins.ValueError: bad batch on attempt 0" in note


def test_no_restart_by_default(tmp_path):
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run(always_fails, count_dir=str(tmp_path))
    assert len([n for n in os.listdir(tmp_path) if "rank1" in n]) == 1
    assert e.value.previous_failures == () and not getattr(e.value, "__notes__", None)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_bad_max_restarts_is_refused(bad):
    with pytest.raises(LaunchRefused, match=r"max_restarts must be an int >= 0"):
        HorovodRunner(np=-2, max_restarts=bad)


def test_ctrl_c_is_not_retried(tmp_path):
    interrupt_main_when_recorded(str(tmp_path))
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        HorovodRunner(np=-2, max_restarts=3).run(record_then_wait, pid_dir=str(tmp_path))
    assert time.monotonic() - t < 30
    assert len(recorded_pids(str(tmp_path))) == 4  # one attempt: 2 ranks and their children
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=3) == []


def test_unpicklable_checkpoint_fails_the_rank_with_advice():
    def main():
        import threading

        spark_dl.save_checkpoint({"lock": threading.Lock()})

    with pytest.raises(RankFailed, match=r"save_checkpoint: the state \(dict\) cannot be pickled.*Save plain data"):
        HorovodRunner(np=-1).run(main)


def test_large_checkpoint_survives_the_restart():
    def main():
        import torch

        ctx = spark_dl.get_context()
        state = spark_dl.load_checkpoint()
        if state is None:
            torch.manual_seed(0)
            spark_dl.save_checkpoint({"w": torch.randn(5_000_000)})  # 20 MB
            os._exit(9)
        torch.manual_seed(0)
        return ctx.attempt, bool(torch.equal(state["w"], torch.randn(5_000_000)))

    assert HorovodRunner(np=-1, max_restarts=1).run(main) == (1, True)


def test_a_gpu_saved_checkpoint_loads_on_a_rank_without_a_gpu():
    """A checkpoint of CUDA tensors (rank 0 trained on a GPU) resumed where the rank has none: torch's
    own unpickling raises 'Attempting to deserialize object on a CUDA device'; load_checkpoint puts
    the tensors on the CPU. This machine has no GPU, so rank 0 tags its CPU storages 'cuda:0' as a
    GPU's would be (torch.serialization's documented location taggers)."""

    def main():
        import pickle

        import cloudpickle
        import torch

        state = spark_dl.load_checkpoint()
        if state is None:
            torch.serialization.register_package(0, lambda storage: "cuda:0", lambda storage, location: None)
            state = {"w": torch.arange(4.0), "epoch": 2}
            with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
                pickle.loads(cloudpickle.dumps(state))  # what load_checkpoint did before
            spark_dl.save_checkpoint(state)
            os._exit(9)
        seen = []
        again = spark_dl.load_checkpoint(map_location=lambda storage, location: seen.append(location) or storage)
        on_cpu = spark_dl.load_checkpoint(map_location="cpu")
        return state["w"].device.type, state["w"].tolist(), state["epoch"], seen, again["w"].tolist(), on_cpu["epoch"]

    assert HorovodRunner(np=-1, max_restarts=1).run(main) == ("cpu", [0.0, 1.0, 2.0, 3.0], 2, ["cuda:0"],
                                                               [0.0, 1.0, 2.0, 3.0], 2)


@pytest.mark.parametrize("bad", [5, ["cpu"]])
def test_a_bad_map_location_is_refused_naming_what_it_takes(bad):
    with pytest.raises(TypeError, match=r"map_location must be None \(each rank's own device\), a device such as "
                                        r"'cpu', a dict .* or a function \(storage, location\), "
                                        r"as torch.load takes; got"):
        spark_dl.load_checkpoint(map_location=bad)


def test_checkpoints_outside_a_rank_process_are_no_ops():
    import numpy as np

    assert spark_dl.save_checkpoint({"a": 1}) is False
    assert spark_dl.save_checkpoint({"a": 1}, step=np.int64(3)) is False
    assert spark_dl.load_checkpoint() is None
    with pytest.raises(TypeError, match=r"step must be an int or None, got 2.5"):
        spark_dl.save_checkpoint({"a": 1}, step=2.5)


def test_barrier_stage_restarts_after_a_killed_rank(spark, tmp_path):
    from test_barrier import no_active_jobs

    outs = HorovodRunner(np=2, max_restarts=1).run_all(resumable, steps=20, how="kill", pid_dir=str(tmp_path))
    assert [(o["attempt"], o["loaded"], o["w"]) for o in outs] == [(1, 9, [40.0] * 3)] * 2
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=3) == []  # the first attempt's ranks and children
    assert no_active_jobs(spark)


def test_local_cluster_survives_losing_an_executor(spark_cluster, tmp_path, capfd):
    t = time.monotonic()
    out = HorovodRunner(np=2, max_restarts=1).run(resumable, steps=20, how="jvm", pid_dir=str(tmp_path))
    assert (out["attempt"], out["loaded"], out["w"]) == (1, 9, [40.0] * 3)
    assert time.monotonic() - t < 120
    assert "[spark-dl] attempt 1 of 2 failed: rank " in capfd.readouterr().err
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=3) == []
    # the replacement executor serves the next run
    assert HorovodRunner(np=2).run(resumable, steps=3)["w"] == [6.0] * 3


def test_a_restart_waits_for_slots_then_refuses_naming_them(spark):
    from spark_dl.driver import cluster

    t = time.monotonic()
    with pytest.raises(LaunchRefused, match=r"np=5 needs 5 task slots at once, but this cluster has only 4"):
        cluster.check_slots(spark.sparkContext, 5, 5, wait_s=1.5, wait_for_new=True)
    assert 1.5 <= time.monotonic() - t < 10  # waited for a replacement executor, then said so


def delete_the_data_and_fail(data, path):
    import shutil

    if spark_dl.get_context().rank == 0:
        shutil.rmtree(path)
        raise OSError("lost the input")


def test_a_restart_that_cannot_be_launched_fails_with_the_first_error_as_cause(spark, tmp_path):
    from spark_dl.data import shards

    path = str(tmp_path / "table")
    spark.range(40).selectExpr("id", "cast(id as double) as x").write.parquet(path)
    df = spark.read.parquet(path)
    t = time.monotonic()
    with pytest.raises(JobFailed, match=r"restart 1 of max_restarts=2 could not be launched: ") as e:
        HorovodRunner(np=2, max_restarts=2).run(delete_the_data_and_fail, data=shards(df), path=path)
    assert isinstance(e.value.__cause__, RankFailed) and "lost the input" in str(e.value.__cause__)
    msg = str(e.value)
    assert "FILE_NOT_EXIST" in msg and "An error occurred while calling" not in msg and "\tat " not in msg
    assert len(e.value.previous_failures) == 1
    assert time.monotonic() - t < 60


def test_the_driver_keeps_only_rank_0s_checkpoint_and_a_failed_write_keeps_the_last_one():
    import socket

    from spark_dl.driver.checkpoint_store import CheckpointStore
    from spark_dl.transport.channel import Connection

    a, b = socket.socketpair()
    driver_end, rank_end = Connection(a, b"k" * 32, "rank"), Connection(b, b"k" * 32, "driver")
    store = CheckpointStore()
    try:
        store.handle(driver_end, 0, "checkpoint/load", {"id": 1})
        assert rank_end.recv() == ("reply", {"id": 1, "blob": None})
        store.handle(driver_end, 0, "checkpoint/save", {"id": 2, "blob": b"state-1", "step": 3})
        assert rank_end.recv() == ("reply", {"id": 2})
        store.handle(driver_end, 1, "checkpoint/save", {"id": 3, "blob": b"other", "step": 4})
        assert rank_end.recv() == (
            "reply", {"id": 3, "error": "ValueError: rank 1 sent a checkpoint; only rank 0's are kept"})
        # not bytes: the write fails
        store.handle(driver_end, 0, "checkpoint/save", {"id": 4, "blob": 12345, "step": 5})
        assert "error" in rank_end.recv()[1]
        store.handle(driver_end, 0, "checkpoint/drop", {"id": 5})
        assert rank_end.recv() == ("reply", {"id": 5, "error": "ValueError: unknown request 'checkpoint/drop'"})
        store.handle(driver_end, 1, "checkpoint/load", {"id": 6})
        assert rank_end.recv() == ("reply", {"id": 6, "blob": b"state-1"})
        assert store.info.step == 3 and "saved at step 3 (7 B" in store.describe()
        store.attempt = 1
        store.handle(driver_end, 0, "checkpoint/save", {"id": 7, "blob": b"state-2" * 300, "step": None})
        assert rank_end.recv() == ("reply", {"id": 7})
        assert "returns the one saved in attempt 2 (2.1 KB, 0 s ago)" in store.describe()
        path = store._path()
    finally:
        store.close()
        driver_end.close()
        rank_end.close()
    assert not os.path.exists(path) and store.load() is None


def test_ranks_loading_at_once_are_sent_one_copy_of_the_checkpoint():
    """The driver read the file once per rank's load, so a restart of np ranks held np copies of
    the state at once; now the loads in flight share one, dropped when the last is sent."""
    from spark_dl.driver.checkpoint_store import CheckpointStore

    store = CheckpointStore()
    try:
        store.save(b"state-1" * 1000, step=1)
        first = store.start_sending()
        second = store.start_sending()  # rank 1 asks while rank 0's copy is still being sent
        assert second is first and second[1] == b"state-1" * 1000 and second[0].step == 1
        store.done_sending()
        assert store.start_sending() is first
        store.done_sending()
        store.done_sending()  # the last send ended: the driver holds no copy
        assert store._shared is None
        again = store.start_sending()
        assert again == first and again is not first  # read afresh
        store.save(b"state-2", step=2)  # a new checkpoint while a send is in flight
        assert store.start_sending()[1] == b"state-2"
        store.done_sending()
        store.done_sending()
    finally:
        store.close()


def test_checkpoint_dir_keeps_the_checkpoint_for_a_later_run(tmp_path, capfd):
    from spark_dl.driver.checkpoint_store import CheckpointStore

    d = tmp_path / "ckpt"  # created on first use
    with pytest.raises(RankFailed):  # no restarts: the run fails, its checkpoint of step 9 stays
        HorovodRunner(np=-2, checkpoint_dir=d).run(resumable, steps=20)
    assert sorted(os.listdir(d)) == [".lock", "latest.ckpt"]  # and no half-written file
    capfd.readouterr()
    outs = HorovodRunner(np=-2, checkpoint_dir=str(d)).run_all(resumable, steps=20, fail_rank=-1)
    assert [(o["attempt"], o["loaded"], o["w"]) for o in outs] == [(0, 9, [40.0] * 3)] * 2
    assert f"[spark-dl] resuming from {d}: load_checkpoint() returns the one saved at step 9" in capfd.readouterr().err
    assert CheckpointStore(d).info.step == 19  # what a third run would resume from


def test_unusable_checkpoint_dirs_are_refused_before_launch(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    t = time.monotonic()
    with pytest.raises(LaunchRefused, match=r"checkpoint_dir=.*file/ckpt' cannot hold checkpoints: .*Pass a directory"):
        HorovodRunner(np=-2, checkpoint_dir=a_file / "ckpt").run(resumable, steps=1)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "latest.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(LaunchRefused, match=r"latest.ckpt is not a spark-dl checkpoint .*Delete it to start over"):
        HorovodRunner(np=-2, checkpoint_dir=tmp_path / "d").run(resumable, steps=1)
    with pytest.raises(LaunchRefused, match=r"checkpoint_dir must be a path"):
        HorovodRunner(np=-2, checkpoint_dir=7)
    assert time.monotonic() - t < 5


def test_a_truncated_checkpoint_fails_the_rank_that_loads_it(tmp_path):
    d = tmp_path / "ckpt"
    HorovodRunner(np=-1, checkpoint_dir=d).run(resumable, steps=5, fail_rank=-1)
    data = (d / "latest.ckpt").read_bytes()
    (d / "latest.ckpt").write_bytes(data[:-10])
    with pytest.raises(RankFailed,
                       match=r"the driver could not read the checkpoint: ValueError: .*latest.ckpt is truncated"):
        HorovodRunner(np=-1, checkpoint_dir=d).run(resumable, steps=5, fail_rank=-1)


# a driver of its own, so the test can kill it: rank 0 saves steps 0-4, says so, then trains on
KILLED_DRIVER = """
import os, sys, time
import spark_dl

def main(marker):
    import torch

    for step in range(5):
        spark_dl.save_checkpoint({"step": step, "w": torch.full((3,), float(step + 1))}, step=step)
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

spark_dl.HorovodRunner(np=-1, checkpoint_dir=sys.argv[1]).run(main, marker=sys.argv[2])
"""


def test_a_checkpoint_dir_in_use_is_refused_and_a_killed_drivers_run_resumes(tmp_path):
    import signal
    import subprocess
    import sys

    d, marker = tmp_path / "ckpt", tmp_path / "rank.pid"
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(d), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the first driver's rank 0 never got to step 4"
        t = time.monotonic()
        # a second run (the job retried while its first driver still runs) would overwrite its checkpoints
        with pytest.raises(LaunchRefused, match=rf"checkpoint_dir='{re.escape(str(d))}' is in use by run spark-dl-\w+ "
                                                rf"\(pid {driver.pid} on .+\): two runs writing one checkpoint "
                                                r"overwrite each other's. Wait for that run to end"):
            HorovodRunner(np=-1, checkpoint_dir=d).run(resumable, steps=20, fail_rank=-1)
        assert time.monotonic() - t < 5
        driver.send_signal(signal.SIGKILL)  # the driver dies mid-run: the OS releases the directory
        driver.wait(30)
    finally:
        driver.kill()
    assert wait_all_dead([int(marker.read_text())], timeout=10) == []  # its rank went with it
    out = HorovodRunner(np=-1, checkpoint_dir=d).run(resumable, steps=20, fail_rank=-1)
    assert (out["attempt"], out["loaded"], out["start"], out["w"]) == (0, 4, 5, [20.0] * 3)


class FailsToStart:
    def on_start(self, job):
        raise ConnectionError("the tracking server is down")


def test_a_run_that_fails_to_start_releases_its_checkpoint_dir(tmp_path):
    runner = HorovodRunner(np=-1, checkpoint_dir=tmp_path)
    runner.observers.append(FailsToStart())
    with pytest.raises(ConnectionError) as failed:  # kept, as a notebook keeps the last traceback (and its frames)
        runner.run(resumable, steps=5, fail_rank=-1)
    runner.observers.clear()
    assert runner.run(resumable, steps=5, fail_rank=-1)["w"] == [5.0] * 3
    assert "the tracking server is down" in str(failed.value)


FULL_DISK_DRIVER = """
import os, resource, signal, sys
import spark_dl

def main():
    spark_dl.save_checkpoint({"step": 1}, step=1)
    spark_dl.save_checkpoint({"step": 2, "w": os.urandom(4 << 20)}, step=2)

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
try:
    spark_dl.HorovodRunner(np=-1, checkpoint_dir=sys.argv[1]).run(main)
except spark_dl.RankFailed as e:
    print(e.summary)
"""


def test_a_checkpoint_that_does_not_fit_on_the_disk_keeps_the_last_one_and_leaves_no_part(tmp_path):
    import subprocess
    import sys

    from spark_dl.driver.checkpoint_store import CheckpointStore

    d = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, "-c", FULL_DISK_DRIVER, str(d)], capture_output=True, text=True, timeout=120)
    assert (f"the driver could not store the checkpoint: OSError: writing {d / 'latest.ckpt'} failed (File too large); "
            "the previous checkpoint is kept. Free space on that disk, or pass a checkpoint_dir on a disk with room "
            "for the state") in out.stdout, out.stdout + out.stderr
    assert sorted(os.listdir(d)) == [".lock", "latest.ckpt"]  # the 2 MB written before the failure are freed
    assert CheckpointStore(d).info.step == 1


def test_checkpoint_dir_expands_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    HorovodRunner(np=-1, checkpoint_dir="~/ckpt").run(resumable, steps=5, fail_rank=-1)
    assert (tmp_path / "home" / "ckpt" / "latest.ckpt").exists() and os.listdir(tmp_path / "cwd") == []


def test_checkpoints_in_a_process_the_rank_started_raise_instead_of_doing_nothing():
    def main():
        import subprocess
        import sys

        code = ("import spark_dl\n"
                "for f in (lambda: spark_dl.save_checkpoint({'a': 1}), spark_dl.load_checkpoint):\n"
                "    try:\n"
                "        print(f())\n"
                "    except RuntimeError as e:\n"
                "        print(e)\n")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout

    out = HorovodRunner(np=-1).run(main).splitlines()
    assert len(out) == 2, out
    for line, name in zip(out, ("save_checkpoint", "load_checkpoint")):
        assert line.startswith(f"{name} was called in a process started by a spark-dl rank (pid "), line
        assert "which has no link to the driver: call it in the rank's own process" in line


def hangs_on_first_attempt(pid_dir):
    import torch.distributed as dist

    spark_dl.init()
    ctx = spark_dl.get_context()
    if ctx.attempt > 0:
        return "attempt 2 finished"
    record_self_and_child(pid_dir)
    print(f"rank {ctx.rank} enters the collective", flush=True)
    if ctx.rank == 0:
        dist.barrier()  # rank 1 never joins: a hang (Gloo's own time-out is 30 minutes)
    time.sleep(120)


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
def test_a_hung_run_is_stopped_at_run_timeout_naming_each_ranks_last_line(tmp_path):
    t = time.monotonic()
    with pytest.raises(JobFailed, match=r"the run exceeded run_timeout=10 s and every rank was stopped") as e:
        HorovodRunner(np=-2, run_timeout=10).run(hangs_on_first_attempt, pid_dir=str(tmp_path))
    assert 10 <= time.monotonic() - t < 40
    msg = str(e.value)
    assert "[0]<stdout>: rank 0 enters the collective" in msg and "[1]<stdout>: rank 1 enters the collective" in msg
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=3) == []


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
def test_a_hung_attempt_is_restarted(tmp_path, capfd):
    assert HorovodRunner(np=-2, run_timeout=10, max_restarts=1).run(hangs_on_first_attempt, pid_dir=str(tmp_path)) \
        == "attempt 2 finished"
    assert "attempt 1 of 2 failed: the run exceeded run_timeout=10 s" in capfd.readouterr().err


@pytest.mark.parametrize("name,bad", [("start_timeout", 0), ("start_timeout", "300"), ("start_timeout", True),
                                      ("run_timeout", -1), ("run_timeout", "1h"), ("run_timeout", float("nan"))])
def test_bad_timeouts_are_refused(name, bad):
    with pytest.raises(LaunchRefused, match=rf"{name} must be a number of seconds > 0, got"):
        HorovodRunner(np=-2, **{name: bad})


def test_checkpoints_in_a_forked_worker_fail_at_once_instead_of_hanging(capfd):
    def main():
        import multiprocessing as mp

        def worker(q):
            try:
                spark_dl.load_checkpoint()
                q.put("returned")
            except RuntimeError as e:
                q.put(str(e))
            spark_dl.log_to_driver("hello from the worker")  # printed: the rank's stdout

        q = mp.get_context("fork").Queue()
        p = mp.get_context("fork").Process(target=worker, args=(q,))
        p.start()
        out = q.get(timeout=30)
        p.join(30)
        return out

    out = HorovodRunner(np=-1, driver_log_verbosity="all").run(main)
    assert "checkpoint/load was called in a process forked from the rank" in out and "DataLoader" in out
    assert "[0]<stdout>: hello from the worker" in capfd.readouterr().out


@pytest.mark.parametrize("name,bad,fix", [("run_timeout", float("inf"), ", or None for no limit"),
                                          ("run_timeout", float("-inf"), ", or None for no limit"),
                                          ("start_timeout", float("inf"), "")])
def test_a_timeout_must_be_finite_as_the_runners_flags_require(name, bad, fix):
    with pytest.raises(LaunchRefused) as e:
        HorovodRunner(np=-2, **{name: bad})
    assert str(e.value) == (f"{name} must be a number of seconds > 0, got {bad!r}: pass a finite one such as "
                            f"{3600 if name == 'run_timeout' else 300}{fix}")
    import numpy

    assert HorovodRunner(np=-2, **{name: numpy.float32(2.5)}).__dict__[name] == 2.5  # numpy's numbers still count
