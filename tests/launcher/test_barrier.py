"""np > 0: ranks run inside one Spark barrier stage, on local[4] and on a two-executor local cluster."""
from __future__ import annotations

import os
import threading
import time

import pytest
from procs import interrupt_main_when_recorded, record_self_and_child, record_then_wait, recorded_pids, wait_all_dead

import spark_dl
from spark_dl import HorovodRunner, JobFailed, LaunchRefused, RankFailed


def world_main(tag):
    import socket

    import torch
    import torch.distributed as dist

    spark_dl.init()
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
            "OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "TORCH_DIST_INIT_BARRIER")
    return {"tag": tag, "sum": t.item(), "pid": os.getpid(), "task_pid": int(os.environ["SPARK_DL_TASK_PID"]),
            "env": {k: os.environ.get(k) for k in keys}, "host": socket.gethostname()}


def no_active_jobs(spark, timeout=10.0) -> bool:
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + timeout
    while tracker.getActiveJobsIds() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not tracker.getActiveJobsIds()


def test_barrier_stage_runs_np_ranks_with_one_process_group(spark):
    outs = HorovodRunner(np=4).run_all(world_main, tag="x")
    assert [o["env"]["RANK"] for o in outs] == ["0", "1", "2", "3"]
    assert all(o["sum"] == 6.0 and o["tag"] == "x" for o in outs)
    # one host: local ranks are the global ranks, consecutive
    assert [o["env"]["LOCAL_RANK"] for o in outs] == ["0", "1", "2", "3"]
    assert {o["env"]["LOCAL_WORLD_SIZE"] for o in outs} == {"4"}
    assert {o["env"]["CROSS_SIZE"] for o in outs} == {"1"}
    # four ranks share the host's cores instead of each spawning one thread per core
    assert {o["env"]["OMP_NUM_THREADS"] for o in outs} == {str(max(1, len(os.sched_getaffinity(0)) // 4))}
    assert {o["env"]["THP_MEM_ALLOC_ENABLE"] for o in outs} == {"1"}  # huge pages for big CPU tensors
    assert {o["env"]["TORCH_DIST_INIT_BARRIER"] for o in outs} == {"1"}  # no rank leaves a peer connecting
    assert len({o["pid"] for o in outs}) == 4
    assert os.getpid() not in {o["task_pid"] for o in outs}, "ranks must run under Spark tasks, not the driver"


def test_run_returns_rank0_value(spark):
    assert HorovodRunner(np=2).run(world_main, tag="y")["env"]["RANK"] == "0"


def test_large_result_through_barrier_mode(spark):
    def main():
        return b"\x07" * (50 * 1024 * 1024)

    out = HorovodRunner(np=2).run(main)
    assert len(out) == 50 * 1024 * 1024 and out[:3] == b"\x07\x07\x07"


def test_rank_failure_cancels_the_job_and_leaves_no_process(spark, tmp_path):
    def main(pid_dir):
        import time

        record_self_and_child(pid_dir)
        print("step 1 done", flush=True)
        if spark_dl.get_context().rank == 1:
            raise RuntimeError("loss is NaN")
        time.sleep(120)

    t = time.monotonic()
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=2).run(main, pid_dir=str(tmp_path))
    assert time.monotonic() - t < 40
    assert e.value.rank == 1 and "loss is NaN" in str(e.value)
    assert e.value.host not in ("", "?")
    assert any("step 1 done" in line for line in e.value.last_lines)
    pids = recorded_pids(str(tmp_path))
    assert len(pids) == 4
    assert wait_all_dead(pids, timeout=2) == []
    assert no_active_jobs(spark), "the barrier job was not cancelled"


def test_logs_stream_live_before_the_job_ends(spark, capfd):
    def main():
        import time

        print("early line", flush=True)
        time.sleep(4)
        return 1

    result = {}
    th = threading.Thread(target=lambda: result.update(v=HorovodRunner(np=2, driver_log_verbosity="all").run(main)))
    th.start()
    deadline = time.monotonic() + 30
    seen = ""
    while time.monotonic() < deadline and "early line" not in seen:
        time.sleep(0.1)
        seen += capfd.readouterr().out
    assert "[0]<stdout>: early line" in seen or "[1]<stdout>: early line" in seen
    assert th.is_alive(), "the line should arrive while the ranks still run"
    th.join(60)
    assert result["v"] == 1


def test_too_many_ranks_is_refused_in_seconds_with_the_numbers(spark):
    t = time.monotonic()
    with pytest.raises(LaunchRefused) as e:
        HorovodRunner(np=5).run(world_main, tag="z")
    assert time.monotonic() - t < 5
    msg = str(e.value)
    assert "np=5" in msg and "only 4" in msg and "np=-5" in msg


def test_lost_task_is_reported_and_its_rank_does_not_survive(spark, tmp_path):
    def main(pid_dir):
        import os
        import signal
        import time

        record_self_and_child(pid_dir)
        if spark_dl.get_context().rank == 1:
            os.kill(int(os.environ["SPARK_DL_TASK_PID"]), signal.SIGKILL)  # the Spark task's Python worker dies
        time.sleep(120)

    t = time.monotonic()
    with pytest.raises(JobFailed, match="lost contact with the task running rank 1") as e:
        HorovodRunner(np=2).run(main, pid_dir=str(tmp_path))
    assert not isinstance(e.value, RankFailed) or e.value.rank == 1
    assert time.monotonic() - t < 40
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=3) == []
    assert no_active_jobs(spark)


def test_keyboard_interrupt_cancels_the_barrier_job(spark, tmp_path):
    interrupt_main_when_recorded(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        HorovodRunner(np=2).run(record_then_wait, pid_dir=str(tmp_path))
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=2) == []
    assert no_active_jobs(spark)


def test_spark_objects_in_kwargs_are_refused_with_advice(spark):
    df = spark.range(3)
    with pytest.raises(LaunchRefused, match=r"kwarg 'data'.*DataFrame.*only on the driver"):
        HorovodRunner(np=2).run(lambda data: None, data={"train": df})


def test_local_cluster_ranks_in_separate_executors(spark_cluster):
    outs = HorovodRunner(np=2).run_all(world_main, tag="cluster")
    assert [o["env"]["RANK"] for o in outs] == ["0", "1"]
    assert all(o["sum"] == 1.0 for o in outs)
    # both executors run on this machine: one host, so local ranks 0 and 1
    assert sorted(o["env"]["LOCAL_RANK"] for o in outs) == ["0", "1"]
    assert {o["env"]["LOCAL_WORLD_SIZE"] for o in outs} == {"2"}
    assert outs[0]["task_pid"] != outs[1]["task_pid"], "each rank should be started by its own executor's task"


def test_local_cluster_failure_leaves_no_process(spark_cluster, tmp_path):
    def main(pid_dir):
        import time

        record_self_and_child(pid_dir)
        if spark_dl.get_context().rank == 0:
            raise KeyError("missing column 'label'")
        time.sleep(120)

    with pytest.raises(RankFailed, match="missing column") as e:
        HorovodRunner(np=2).run(main, pid_dir=str(tmp_path))
    assert e.value.rank == 0
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=3) == []
    assert no_active_jobs(spark_cluster)


def test_local_cluster_refuses_more_ranks_than_slots(spark_cluster):
    t = time.monotonic()
    with pytest.raises(LaunchRefused, match=r"np=3 .* only 2 .*2 executor"):
        HorovodRunner(np=3).run(world_main, tag="z")
    assert time.monotonic() - t < 5


def test_slots_held_by_another_job_fail_at_start_timeout_naming_them(spark):
    sc = spark.sparkContext

    def hog():
        sc.setJobGroup("hog", "holds 3 of 4 slots", interruptOnCancel=True)
        try:
            sc.parallelize(range(3), 3).foreach(lambda _: __import__("time").sleep(60))
        except Exception:  # noqa: BLE001 - cancelled below
            pass

    th = threading.Thread(target=hog, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while sum(sc.statusTracker().getStageInfo(s).numActiveTasks
                  for s in sc.statusTracker().getActiveStageIds()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        t = time.monotonic()
        with pytest.raises(JobFailed, match=r"only 0 of 2 barrier tasks started within 3 s.*4 task slots, 3 busy"):
            HorovodRunner(np=2, start_timeout=3).run(world_main, tag="never")
        assert time.monotonic() - t < 20
    finally:
        sc.cancelJobGroup("hog")
        th.join(30)
    assert no_active_jobs(spark)


def test_a_task_error_with_a_huge_message_is_cut_in_the_middle_and_one_whose_str_fails_is_still_reported():
    from spark_dl import protocol
    from spark_dl.driver.monitor import _task_failure
    from spark_dl.task.barrier import _task_error

    try:
        raise RuntimeError("head " + "x" * (4 * protocol.MAX_ERROR_TEXT) + " tail")
    except RuntimeError as e:
        report = _task_error(e, 3, "node-7")
    assert len(report["message"]) < protocol.MAX_ERROR_TEXT + 100 and len(report["traceback"]) < 100_000
    assert report["message"].startswith("head ") and report["message"].endswith(" tail")
    assert "characters cut by spark-dl" in report["message"]
    text = _task_failure(report)
    assert text.startswith("barrier task 3 on node-7 failed: RuntimeError: head ") and len(text) < 200_000

    class Unprintable(Exception):
        def __str__(self):
            raise ValueError("no text")

    try:
        raise Unprintable()
    except Unprintable as e:
        report = _task_error(e, 0, "h")
    assert report["exc_type"] == "Unprintable" and "str() of the Unprintable failed" in report["message"]
    assert "raise Unprintable()" in report["traceback"]
