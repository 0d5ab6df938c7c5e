"""np < 0: ranks run as local processes on the driver. No Spark involved, real Gloo groups."""
from __future__ import annotations

import os
import re
import threading
import time

import numpy
import pytest
from procs import interrupt_main_when_recorded, record_self_and_child, record_then_wait, recorded_pids, wait_all_dead

import spark_dl
from spark_dl import HorovodRunner, JobFailed, LaunchRefused, RankFailed


def allreduce_main(scale):
    import torch
    import torch.distributed as dist

    backend = spark_dl.init()
    t = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(t)
    env = {k: os.environ[k]
           for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {"sum": t.item(), "backend": backend, "env": env, "ctx": spark_dl.get_context()}


def test_returns_rank0_result_and_sets_the_torch_env():
    out = HorovodRunner(np=-2).run(allreduce_main, scale=10.0)
    assert out["sum"] == 30.0  # (1 + 2) * 10, summed across both ranks
    assert out["backend"] == "gloo"
    assert out["env"]["RANK"] == "0" and out["env"]["WORLD_SIZE"] == "2"
    assert out["env"]["LOCAL_RANK"] == "0" and out["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert out["env"]["MASTER_ADDR"] == "127.0.0.1" and int(out["env"]["MASTER_PORT"]) > 0
    assert out["ctx"].rank == 0 and out["ctx"].world_size == 2 and out["ctx"].job_id.startswith("spark-dl-")


def test_run_all_returns_every_rank_in_order():
    outs = HorovodRunner(np=-3).run_all(allreduce_main, scale=1.0)
    assert [o["ctx"].rank for o in outs] == [0, 1, 2]
    assert [o["sum"] for o in outs] == [6.0, 6.0, 6.0]
    assert [o["env"]["LOCAL_RANK"] for o in outs] == ["0", "1", "2"]


def test_dist_init_process_group_with_no_arguments():
    def main():
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// from MASTER_ADDR/PORT, RANK, WORLD_SIZE
        return dist.get_world_size()

    assert HorovodRunner(np=-2).run(main) == 2


def test_large_result_arrives_intact():
    def main():
        import numpy as np

        return np.arange(50 * 1024 * 1024 // 8, dtype=np.int64)  # 50 MB

    out = HorovodRunner(np=-2).run(main)
    assert out.nbytes == 50 * 1024 * 1024
    assert out[-1] == 50 * 1024 * 1024 // 8 - 1


def test_main_that_calls_sys_exit_zero_returns_none():
    import sys

    assert HorovodRunner(np=-2).run(lambda: sys.exit(0)) is None


@pytest.mark.parametrize("np", [0, "2", 2.0, True, None, numpy.bool_(True), numpy.float64(2.0)])
def test_bad_np_is_refused(np):
    t = time.monotonic()
    with pytest.raises(LaunchRefused, match="np"):
        HorovodRunner(np=np)
    assert time.monotonic() - t < 1


def test_np_zero_names_the_count_for_every_task_slot():
    """Databricks' np=0 (every task slot, deprecated there) is refused with the count to pass."""
    with pytest.raises(LaunchRefused, match=r"np=0 \(on Databricks, deprecated there: every task slot of the "
                                            r"cluster\) is not taken: .*np=spark.sparkContext.defaultParallelism"):
        HorovodRunner(np=0)


def test_numpy_integers_count_as_ints():
    """Counts computed with numpy (np.int64) are taken, and kept as Python ints."""
    runner = HorovodRunner(np=numpy.int64(-2), max_restarts=numpy.int32(1))
    assert (runner.np, runner.max_restarts) == (-2, 1) and type(runner.np) is int
    assert [o["sum"] for o in runner.run_all(allreduce_main, 1.0)] == [3.0, 3.0]
    assert HorovodRunner(np=numpy.int64(4), min_np=numpy.int8(2)).min_np == 2


def test_bad_verbosity_is_refused():
    with pytest.raises(LaunchRefused, match="driver_log_verbosity"):
        HorovodRunner(np=-2, driver_log_verbosity="loud")


def test_main_not_callable_is_refused():
    with pytest.raises(LaunchRefused, match="callable"):
        HorovodRunner(np=-2).run(42)


class Holder:
    def __init__(self):
        self.settings = {"lr": 0.1, "guard": [1, threading.Lock()]}


def test_unpicklable_kwarg_names_the_kwarg_and_the_object_inside():
    t = time.monotonic()
    with pytest.raises(LaunchRefused) as e:
        HorovodRunner(np=-2).run(lambda cfg, lr: None, cfg=Holder(), lr=0.1)
    msg = str(e.value)
    assert "kwarg 'cfg'" in msg
    assert "cfg.settings['guard'][1]" in msg and "lock" in msg
    assert time.monotonic() - t < 2


def test_main_closing_over_an_unpicklable_object_is_named():
    lock = threading.Lock()

    def main():
        with lock:
            return 1

    with pytest.raises(LaunchRefused, match=r"main cannot be sent.*<closure lock>.*lock"):
        HorovodRunner(np=-2).run(main)


def fail_on_rank_1(pid_dir):
    import sys
    import time

    record_self_and_child(pid_dir)
    print("about to fail", flush=True)
    print("a warning on stderr", file=sys.stderr, flush=True)
    if spark_dl.get_context().rank == 1:
        raise ValueError("bad batch 17")
    time.sleep(120)  # rank 0 would wait forever for a peer that died


def test_rank_error_is_raised_with_context_and_nothing_survives(tmp_path):
    t = time.monotonic()
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run(fail_on_rank_1, pid_dir=str(tmp_path))
    elapsed = time.monotonic() - t
    err = e.value
    assert err.rank == 1 and err.host == "localhost" and err.exit_code == 1  # not the abort's SIGKILL (-9)
    assert err.exc_type.endswith("ValueError") and "bad batch 17" in str(err)
    assert "fail_on_rank_1" in err.remote_traceback
    assert err.remote_traceback.splitlines()[1].strip().startswith(f'File "{__file__}"')  # the user's frame first
    assert any("about to fail" in line for line in err.last_lines)
    assert any("<stderr>" in line and "a warning on stderr" in line for line in err.last_lines)
    assert not any("bad batch 17" in line or "Traceback" in line for line in err.last_lines)  # shown once, above
    assert str(err).count("ValueError: bad batch 17") == 2  # the summary line and the traceback's last line
    assert isinstance(err.__cause__, ValueError)
    assert elapsed < 30, "the sleeping rank 0 was not stopped promptly"
    pids = recorded_pids(str(tmp_path))
    assert len(pids) == 4  # two ranks, one child each
    assert wait_all_dead(pids, timeout=2) == []


def test_hard_exit_without_exception_is_reported_with_the_exit_code():
    def main():
        import os

        print("last words", flush=True)
        os._exit(3)

    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run(main)
    assert e.value.exit_code == 3
    assert "exited with code 3" in str(e.value)
    assert any("last words" in line for line in e.value.last_lines)


def starts_a_helper_that_keeps_stdout():
    import subprocess

    helper = subprocess.Popen(["sleep", "120"])  # inherits the rank's stdout and stderr pipes
    return helper.pid


def test_a_helper_process_holding_the_ranks_output_does_not_keep_the_run_alive():
    started = time.monotonic()
    pid = HorovodRunner(np=-1).run(starts_a_helper_that_keeps_stdout)
    assert time.monotonic() - started < 30  # it waited for the helper (120 s) before
    assert wait_all_dead([pid], timeout=5) == []


def forks_a_child_that_exits():
    import os
    import sys

    child = os.fork()
    if child == 0:  # the child leaves main as a plain script's child would: it must not act as the rank
        sys.exit(0)
    os.waitpid(child, 0)
    return "parent's result"


def test_a_child_forked_in_main_that_exits_does_not_stall_or_kill_the_rank():
    started = time.monotonic()
    assert HorovodRunner(np=-2).run(forks_a_child_that_exits) == "parent's result"
    assert time.monotonic() - started < 30  # the child's exit went through the rank's reporting (60 s, then SIGKILL)


def prints_what_the_driver_cannot_encode():
    import spark_dl

    spark_dl.log_to_driver("caf\u00e9 \u2713")
    return "done"


def test_driver_output_it_cannot_encode_or_write_does_not_fail_the_run(monkeypatch, capfd):
    import io
    import sys

    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert HorovodRunner(np=-1).run(prints_what_the_driver_cannot_encode) == "done"
    ascii_out.flush()
    assert "caf\\xe9 \\u2713" in ascii_out.buffer.getvalue().decode()
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdout", closed)
    assert HorovodRunner(np=-1).run(prints_what_the_driver_cannot_encode) == "done"
    assert "cannot print the ranks' output" in capfd.readouterr().err


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def raises_odd_errors(kind):
    if kind == "unprintable":
        raise Unprintable()
    raise ValueError("x" * 1_000_000)


def test_an_error_that_cannot_be_printed_or_is_huge_is_still_reported():
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-1).run(raises_odd_errors, kind="unprintable")
    assert e.value.exc_type.endswith("Unprintable") and "str() of the Unprintable failed" in str(e.value)
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-1).run(raises_odd_errors, kind="huge")
    assert e.value.exc_type.endswith("ValueError") and "characters cut by spark-dl" in str(e.value)
    assert len(str(e.value)) < 300_000


def writes_scratch(die_on_rank):
    import tempfile

    from spark_dl.rank.context import get_context, scratch_dir

    scratch = scratch_dir()
    with open(os.path.join(scratch, f"rank-{get_context().rank}.bin"), "wb") as f:  # e.g. an unpacked checkpoint
        f.write(b"x" * 100_000)
    if get_context().rank == die_on_rank:
        os._exit(3)
    return scratch, tempfile.gettempdir()


def test_the_ranks_scratch_folder_is_removed_when_they_exit_even_killed_ones():
    scratch, tmp = HorovodRunner(np=-2).run(writes_scratch, die_on_rank=None)
    assert os.path.dirname(scratch) == tmp and not os.path.exists(scratch)
    runner = HorovodRunner(np=-2)
    with pytest.raises(RankFailed, match="exited with code 3"):
        runner.run(writes_scratch, die_on_rank=1)
    # this job's only: the temporary folder is shared with whatever else runs on the machine
    assert not [d for d in os.listdir(tmp) if d.startswith(f"{runner.last_run.job_id}-ranks-")]


def breaks_the_collective_then(exit_after):
    """Rank 1 closes its Gloo connections (rank 0's collective fails: "Connection closed by
    peer"), then exits with code 3 after ``exit_after`` seconds, or never."""
    import torch
    import torch.distributed as dist

    spark_dl.init()
    g = torch.ones(4)
    dist.all_reduce(g)
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        time.sleep(exit_after if exit_after is not None else 120)
        os._exit(3)
    dist.all_reduce(g)
    time.sleep(120)


def test_the_root_cause_is_reported_not_the_peers_broken_collective():
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run(breaks_the_collective_then, exit_after=0.5)
    assert (e.value.rank, e.value.summary) == (1, "exited with code 3")


def test_a_broken_collective_with_no_cause_in_sight_is_reported_after_a_grace():
    from spark_dl.driver.monitor import CONSEQUENCE_GRACE_S

    t = time.monotonic()
    with pytest.raises(RankFailed, match=r"Connection (closed|reset) by peer") as e:
        HorovodRunner(np=-2).run(breaks_the_collective_then, exit_after=None)
    assert e.value.rank == 0
    assert time.monotonic() - t < CONSEQUENCE_GRACE_S + 15


def test_unpicklable_return_value_is_a_clear_error():
    def main():
        import threading

        return threading.Lock()

    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run(main)
    err = e.value
    assert err.summary.startswith("spark_dl.errors.ResultNotPicklable: rank ")
    assert ("'s return value (lock) cannot be pickled: cannot pickle '_thread.lock' object. "
            "Return plain data") in str(err)
    assert err.remote_traceback == "" and "Traceback" not in str(err)  # its frames were spark-dl's and pickle's
    assert err.last_lines == []  # the one line the rank printed is the summary
    assert isinstance(err.__cause__, TypeError)


def uneven_steps():
    import torch
    import torch.distributed as dist

    spark_dl.init()
    for _ in range(3 + dist.get_rank()):  # rank 1 has one batch more than rank 0
        dist.all_reduce(torch.ones(2))
    return "done"


def test_a_rank_left_in_a_collective_by_a_finished_one_is_told_why():
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run(uneven_steps)
    # Gloo says "Connection closed by peer" when the peer's socket closed cleanly, "Read error ...:
    # Connection reset by peer" when it was reset first (under load): either is the peer gone
    assert e.value.rank == 1 and re.search(r"Connection (closed|reset) by peer", e.value.summary)
    assert e.value.hint.startswith("rank 0 had already returned from main (exit code 0) while rank 1 was still in a "
                                   "collective: the ranks did not issue the same collectives. One ran more steps")
    assert "HorovodRunner(env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'})" in e.value.hint
    assert str(e.value).split("\n\n")[1] == e.value.hint


@pytest.mark.parametrize("text", [
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5329",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:45021: "
    "Connection reset by peer",
])
def test_both_texts_gloo_gives_for_a_departed_peer_read_as_a_consequence(text):
    from spark_dl.driver.monitor import PEER_LOST

    assert PEER_LOST.search(text)


def test_torch_names_the_mismatched_collective_under_its_debug_setting():
    """The fix the hint above gives, as it works: torch checks every collective's shape first."""

    def main():
        import torch
        import torch.distributed as dist

        spark_dl.init()
        dist.all_reduce(torch.ones(3 + dist.get_rank()))

    with pytest.raises(RankFailed, match=r"Detected mismatch between collectives on ranks\. Rank \d is running "
                                         r"collective: CollectiveFingerPrint\(SequenceNumber=0, OpType=ALLREDUCE, "
                                         r"TensorShape=\[[34]\]"):
        HorovodRunner(np=-2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).run(main)


def test_a_gpu_ranks_tensors_come_back_on_a_cpu_driver():
    """A rank on a GPU returning CUDA tensors (its state_dict) to a driver without CUDA gets them on
    the CPU, not torch's "Attempting to deserialize object on a CUDA device". No GPU here: the rank
    tags its storages 'cuda:0' as a GPU's would be (torch.serialization's location taggers)."""

    def main():
        import torch

        torch.serialization.register_package(0, lambda storage: "cuda:0", lambda storage, location: None)
        return {"w": torch.arange(3.0), "step": 7}

    out = HorovodRunner(np=-1).run(main)
    assert out["w"].device.type == "cpu" and out["w"].tolist() == [0.0, 1.0, 2.0] and out["step"] == 7


def test_a_return_value_the_driver_cannot_import_is_a_clear_error(tmp_path):
    (tmp_path / "rank_only.py").write_text("class Box:\n    pass\n")

    def main(where):
        import sys

        sys.path.insert(0, where)
        import rank_only

        return rank_only.Box()

    with pytest.raises(JobFailed, match=r"rank 0's return value could not be unpickled on the driver "
                                        r"\(ModuleNotFoundError: No module named 'rank_only'\); return types the "
                                        r"driver can import"):
        HorovodRunner(np=-1).run(main, where=str(tmp_path))


def test_keyboard_interrupt_stops_every_rank(tmp_path):
    interrupt_main_when_recorded(str(tmp_path))
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        HorovodRunner(np=-2).run(record_then_wait, pid_dir=str(tmp_path))
    assert time.monotonic() - t < 60
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=2) == []


def chatty(n):
    import sys

    spark_dl.log_to_driver(f"callback from {spark_dl.get_context().rank}")
    for i in range(n):
        print(f"out line {i}")
        print(f"err line {i}", file=sys.stderr)
    return n


def test_verbosity_all_streams_every_line_tagged_with_its_rank(capfd):
    HorovodRunner(np=-2, driver_log_verbosity="all").run(chatty, n=200)
    out, err = capfd.readouterr()
    for r in (0, 1):
        assert f"[{r}]<log>: callback from {r}" in out
        assert f"[{r}]<stdout>: out line 199" in out
        assert f"[{r}]<stderr>: err line 199" in err
        assert sum(line.startswith(f"[{r}]<stdout>: out line") for line in out.splitlines()) == 200


def test_log_callback_only_shows_only_log_to_driver(capfd):
    HorovodRunner(np=-2).run(chatty, n=5)
    out, err = capfd.readouterr()
    assert "[0]<log>: callback from 0" in out and "[1]<log>: callback from 1" in out
    assert "out line" not in out and "err line" not in err


def test_log_to_driver_outside_a_rank_prints_locally(capsys):
    spark_dl.log_to_driver("plain")
    assert capsys.readouterr().out == "plain\n"


def test_get_context_outside_a_rank_explains_itself(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="HorovodRunner"):
        spark_dl.get_context()


def test_init_outside_a_rank_explains_itself(monkeypatch):
    for var in ("RANK", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"no RANK, .*MASTER_PORT: run the function through them \(np=-2"):
        spark_dl.init()


def test_rank_that_cannot_import_mains_module_fails_clearly(tmp_path, monkeypatch):
    (tmp_path / "only_on_driver.py").write_text("def main():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_on_driver

    # the rank inherits the driver's sys.path in local mode; hide the module from it
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p != str(tmp_path)])
    with pytest.raises(RankFailed, match="only_on_driver"):
        HorovodRunner(np=-1).run(only_on_driver.main)
    assert isinstance(RankFailed(0, "h", "s"), JobFailed)


def test_sys_exit_in_main_is_reported_by_its_status_in_one_line_without_a_traceback(capfd):
    def main():
        import sys

        print("last words", flush=True)
        if spark_dl.get_context().rank == 1:
            sys.exit(4)

    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2, driver_log_verbosity="all").run(main)
    err = e.value
    assert err.rank == 1 and err.exit_code == 4 and err.remote_traceback == ""
    assert str(err).startswith("rank 1 on localhost failed: main called sys.exit(4)") and "Traceback" not in str(err)
    assert err.__cause__.code == 4  # spark_dl.script.ExitStatus, rebuilt on the driver
    assert any("last words" in line for line in err.last_lines)
    printed = capfd.readouterr().err
    assert printed.count("[1]<stderr>: main called sys.exit(4)\n") == 1 and "Traceback" not in printed


def leaves_work_running(out):
    """Returns while a thread, an executor's task and an open file still hold its work."""
    import concurrent.futures
    import os
    import threading
    import time

    rank = spark_dl.get_context().rank

    def upload(name):
        time.sleep(1.0)
        with open(os.path.join(out, f"{name}{rank}.txt"), "w") as f:
            f.write("uploaded")

    threading.Thread(target=upload, args=("thread",)).start()  # not a daemon: python waits for it
    pool = concurrent.futures.ThreadPoolExecutor(1)  # e.g. torch's dcp.async_save: never waited for in main
    pool.submit(upload, "pool")
    global _LOG
    _LOG = open(os.path.join(out, f"log{rank}.txt"), "w")  # never closed: python's teardown flushes it
    _LOG.write("trained")
    return "returned"


def test_work_main_leaves_running_is_finished_as_under_python(tmp_path):
    """The rank ended with os._exit right after main: the thread's and the executor's files were
    never written, the open file's buffer was lost, and the run reported success."""
    assert HorovodRunner(np=-2).run(leaves_work_running, out=str(tmp_path)) == "returned"
    for r in (0, 1):
        for name in ("thread", "pool"):
            assert (tmp_path / f"{name}{r}.txt").read_text() == "uploaded"
        assert (tmp_path / f"log{r}.txt").read_text() == "trained"


def leaves_a_thread_that_never_ends():
    import threading

    threading.Thread(target=threading.Event().wait, name="forever").start()
    return "returned"


def test_a_thread_that_never_ends_holds_the_rank_only_for_the_limit(monkeypatch, capfd):
    """Waited for as python would, but not for ever: the job ends."""
    monkeypatch.setenv("SPARK_DL_THREAD_WAIT", "6")  # it says what it waits for after 5 s
    t = time.monotonic()
    assert HorovodRunner(np=-2, driver_log_verbosity="all").run(leaves_a_thread_that_never_ends) == "returned"
    assert time.monotonic() - t < 30
    err = capfd.readouterr().err
    for r in (0, 1):
        assert (f"[{r}]<stderr>: spark-dl: rank {r}'s main returned; waiting, as python does, for the threads it left "
                "running: 'forever' (at most 6 s in all, SPARK_DL_THREAD_WAIT; a thread started with daemon=True is "
                "not waited for)") in err, err
        assert (f"[{r}]<stderr>: spark-dl: rank {r} exits without waiting more for the threads main left running "
                "('forever'): they ran 6 s after main returned (SPARK_DL_THREAD_WAIT)") in err, err


def test_a_bad_thread_wait_fails_the_ranks_before_main(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARK_DL_THREAD_WAIT", "forever")
    with pytest.raises(RankFailed, match=r"SPARK_DL_THREAD_WAIT='forever' is not a number >= 0 s"):
        HorovodRunner(np=-1).run(mark_ran, path=str(tmp_path / "ran"))
    assert not (tmp_path / "ran").exists()


def mark_ran(path):
    open(path, "w").close()
