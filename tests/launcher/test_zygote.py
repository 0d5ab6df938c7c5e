"""Ranks forked from a warm interpreter (spark_dl/task/zygote.py): they see what a rank started
fresh would see, a run whose startup variables differ starts fresh, and no failure leaves a rank
behind. Real rank processes, real Gloo groups, a real Spark session for the barrier case."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from procs import describe, recorded_pids, wait_all_dead

from spark_dl import HorovodRunner, JobFailed
from spark_dl.task import zygote, zygote_process


def rank_facts(module_name: str | None = None) -> dict:
    import os
    import sys

    import numpy

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\0", b" ").decode()
    out = {"forked": "spark_dl.task.zygote" in parent, "pid": os.getpid(), "ppid": os.getppid(),
           "task_pid": int(os.environ["SPARK_DL_TASK_PID"]), "cwd": os.getcwd(), "argv0": sys.argv[0],
           "draw": float(numpy.random.rand()), "var": os.environ.get("ZYGOTE_TEST_VAR"),
           "hashseed": os.environ.get("PYTHONHASHSEED"), "hash": hash("spark-dl"),
           "stdout_unbuffered": sys.stdout.write_through}
    if module_name is not None:
        out["module"] = __import__(module_name).VALUE
    return out


def _warm(**runner) -> None:
    """One run, so this process (the driver: local mode) has a zygote; then wait until it is ready."""
    HorovodRunner(np=-2, **runner).run(rank_facts)
    assert zygote.wait_ready(60), "the zygote started after a run should be ready within a minute"


def test_a_warm_run_forks_its_ranks_and_they_see_what_a_fresh_rank_would(tmp_path, monkeypatch):
    _warm()
    # what changed on the driver since the zygote started reaches the forked ranks
    monkeypatch.setenv("ZYGOTE_TEST_VAR", "set after the zygote started")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zygote_test_module.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    outs = HorovodRunner(np=-2).run_all(rank_facts, module_name="zygote_test_module")
    again = HorovodRunner(np=-2).run_all(rank_facts)
    for o in outs:
        assert o["forked"], "a run after the zygote is ready should fork its ranks"
        assert o["task_pid"] == os.getpid() and o["ppid"] != os.getpid()
        assert o["cwd"] == str(tmp_path)
        assert o["var"] == "set after the zygote started"
        assert o["module"] == 7
        assert o["argv0"].endswith(os.path.join("spark_dl", "rank", "main.py"))
        assert o["stdout_unbuffered"]
    draws = [o["draw"] for o in outs + again]
    assert len(set(draws)) == 4, "numpy's global generator must be reseeded in every forked rank"


def test_startup_variables_start_the_ranks_fresh_and_the_zygote_follows_them():
    _warm()
    seeded = HorovodRunner(np=-2, env={"PYTHONHASHSEED": "0"}).run_all(rank_facts)
    assert not any(o["forked"] for o in seeded), "PYTHONHASHSEED is read at start: the zygote's differs"
    assert {o["hashseed"] for o in seeded} == {"0"} and seeded[0]["hash"] == seeded[1]["hash"]
    # the zygote is now started with PYTHONHASHSEED=0: the next such run forks, with that seed
    assert zygote.wait_ready(60)
    forked = HorovodRunner(np=-2, env={"PYTHONHASHSEED": "0"}).run_all(rank_facts)
    assert all(o["forked"] for o in forked)
    assert [o["hash"] for o in forked] == [o["hash"] for o in seeded]
    plain = HorovodRunner(np=-2).run_all(rank_facts)
    assert not any(o["forked"] for o in plain) and plain[0]["hashseed"] is None


def test_spark_dl_zygote_0_starts_every_rank_fresh():
    _warm()
    outs = HorovodRunner(np=-2, env={"SPARK_DL_ZYGOTE": "0"}).run_all(rank_facts)
    assert not any(o["forked"] for o in outs)
    assert all(o["ppid"] == os.getpid() for o in outs)


def test_a_zygote_killed_between_runs_means_fresh_ranks_then_a_new_zygote():
    _warm()
    z = zygote._zygote
    os.kill(z._proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while z.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    outs = HorovodRunner(np=-2).run_all(rank_facts)
    assert not any(o["forked"] for o in outs)
    assert zygote.wait_ready(60) and zygote._zygote is not z
    assert all(o["forked"] for o in HorovodRunner(np=-2).run_all(rank_facts))


# a zygote that takes ZYGOTE_TEST_SLOW_IMPORT more seconds to start (ranks started fresh do not)
SLOW_ZYGOTE_SITE = """
import os, time
if os.environ.get("ZYGOTE_TEST_SLOW_IMPORT"):
    with open("/proc/self/cmdline", "rb") as f:
        if b"spark_dl.task.zygote" in f.read():
            time.sleep(float(os.environ["ZYGOTE_TEST_SLOW_IMPORT"]))
"""


def _slow_zygote_env(tmp_path, seconds: float, seed: str) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(SLOW_ZYGOTE_SITE)
    # PYTHONHASHSEED of its own: a zygote for these runs alone, not one an earlier test started
    return {"PYTHONPATH": str(tmp_path), "ZYGOTE_TEST_SLOW_IMPORT": str(seconds), "PYTHONHASHSEED": seed}


def _patient(monkeypatch) -> None:
    """Wait for the zygote as long as it takes: its imports run at the lowest priority, and on a
    machine whose cores other tests keep busy they outlasted READY_WAIT_S (20 s) once in CI, when the
    run rightly started fresh ranks. In local mode the task that waits is a thread of this process."""
    monkeypatch.setattr(zygote, "READY_WAIT_S", 300.0)


def test_a_run_right_after_the_first_waits_for_the_zygote_still_importing(tmp_path, monkeypatch):
    env = _slow_zygote_env(tmp_path, 3, "4711")
    _patient(monkeypatch)
    first = HorovodRunner(np=-2, env=env).run_all(rank_facts)
    assert not any(o["forked"] for o in first)
    # the zygote is still in its 3 s: started fresh, the ranks would import beside it on the same cores
    assert not zygote.wait_ready(0)
    second = HorovodRunner(np=-2, env=env).run_all(rank_facts)
    assert all(o["forked"] for o in second), "a run should wait for a zygote that is still importing"


def test_a_task_waiting_for_its_zygote_is_not_taken_for_a_silent_host(tmp_path, monkeypatch):
    # the wait for the zygote (6 s) outlasts the silence bound (2 s): the task's heartbeats go on meanwhile
    monkeypatch.setenv("SPARK_DL_SILENCE_TIMEOUT", "2")
    env = _slow_zygote_env(tmp_path, 6, "4713")
    _patient(monkeypatch)
    HorovodRunner(np=-2, env=env).run_all(rank_facts)
    assert not zygote.wait_ready(0)
    started = time.monotonic()
    second = HorovodRunner(np=-2, env=env).run_all(rank_facts)
    assert all(o["forked"] for o in second)
    assert time.monotonic() - started > 2, "the run should have waited past the silence bound"


def zygote_of_my_task(seed: str, within: float = 60.0) -> bool:
    """Whether, within ``within`` seconds, the task that started this rank has a zygote started
    with ``PYTHONHASHSEED=seed`` (in local mode the task is the driver, the zygote its child).
    The ranks leave together: in local mode each rank has a task of its own, and a task whose
    rank has exited starts its zygote."""
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    try:
        return _zygote_of_my_task(seed, within)
    finally:
        dist.barrier()


def _zygote_of_my_task(seed: str, within: float) -> bool:
    import os
    import time

    task = os.environ["SPARK_DL_TASK_PID"]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{pid}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if b"spark_dl.task.zygote" in cmd and ppid == task and f"PYTHONHASHSEED={seed}".encode() in env:
                return True
        time.sleep(0.2)
    return False


def test_a_long_run_of_fresh_ranks_starts_the_zygote_while_it_runs(monkeypatch):
    """The run after a long one should not wait for a zygote that starts importing only when the
    long one ends: it starts EARLY_START_S into a run of fresh ranks."""
    monkeypatch.setattr(zygote, "EARLY_START_S", 1.0)
    started = time.monotonic()
    found = HorovodRunner(np=-2, env={"PYTHONHASHSEED": "4714"}).run_all(zygote_of_my_task, seed="4714")
    assert all(found), "no zygote for this run's environment appeared while it ran"
    assert time.monotonic() - started < 60
    assert zygote.wait_ready(60)
    assert all(o["forked"] for o in HorovodRunner(np=-2, env={"PYTHONHASHSEED": "4714"}).run_all(rank_facts))


def test_a_short_run_starts_the_zygote_only_when_it_ends(monkeypatch):
    monkeypatch.setattr(zygote, "EARLY_START_S", 30.0)
    found = HorovodRunner(np=-2, env={"PYTHONHASHSEED": "4715"}).run_all(zygote_of_my_task, seed="4715", within=2.0)
    assert not any(found)
    assert zygote.wait_ready(60)  # started when it ended


def test_a_zygote_dying_while_a_run_waits_for_it_means_fresh_ranks_at_once(tmp_path):
    env = _slow_zygote_env(tmp_path, 60, "4712")
    HorovodRunner(np=-2, env=env).run_all(rank_facts)
    z = zygote._zygote
    deadline = time.monotonic() + 10
    while z._proc is None and time.monotonic() < deadline:
        time.sleep(0.05)

    def kill_soon():
        time.sleep(1)
        os.kill(z._proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    started = time.monotonic()
    outs = HorovodRunner(np=-2, env=env).run_all(rank_facts)
    killer.join()
    assert not any(o["forked"] for o in outs)
    # the wait ended with the zygote, not at READY_WAIT_S
    assert time.monotonic() - started < zygote.READY_WAIT_S, time.monotonic() - started


def test_a_zygote_killed_during_a_run_fails_it_clearly_and_leaves_nothing(tmp_path):
    def main(pid_dir):
        import os
        import signal
        import time

        from procs import record_self_and_child

        import spark_dl

        record_self_and_child(pid_dir)
        if spark_dl.get_context().rank == 1:
            os.kill(os.getppid(), signal.SIGKILL)  # the zygote that forked this rank
        time.sleep(120)

    _warm()
    t = time.monotonic()
    with pytest.raises(JobFailed, match=r"rank [01] on localhost failed: .*killed by SIG"):
        HorovodRunner(np=-2).run(main, pid_dir=str(tmp_path))
    assert time.monotonic() - t < 30
    assert wait_all_dead(recorded_pids(str(tmp_path)), timeout=5) == []


DRIVER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from procs import record_self_and_child
    from spark_dl import HorovodRunner
    from spark_dl.task import zygote

    def main(pid_dir):
        import os, time
        from procs import record_self_and_child
        with open(f"/proc/{{os.getppid()}}/cmdline", "rb") as f:
            assert (b"spark_dl.task.zygote" in f.read()) == {forked!r}, "forked or fresh, as the test asked"
        record_self_and_child(pid_dir)
        print("recorded", flush=True)
        if {writing!r}:
            while True:
                print("a line for the driver", flush=True)
                time.sleep(0.001)
        time.sleep(120)

    if {forked!r}:
        HorovodRunner(np=-2).run(lambda: 0)
        assert zygote.wait_ready(60)
        print("zygote", zygote._zygote._proc.pid, flush=True)
    else:
        print("zygote -", flush=True)
    HorovodRunner(np=-2, env={{}} if {forked!r} else {{"SPARK_DL_ZYGOTE": "0"}}).run(main, pid_dir={pid_dir!r})
""")


# writing: a rank's print meets the pipe the dead driver closed, and ends the rank in an error, often
# before the parent-death signal or the watchdog does (1 run in 8 left both ranks' children running)
@pytest.mark.parametrize("writing", [False, True], ids=["sleeping", "writing"])
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_ranks_die_with_a_killed_driver(tmp_path, forked, writing):
    """Local mode: the driver is the task. Killed outright, it cannot stop its ranks itself."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=os.path.dirname(__file__), pid_dir=str(pid_dir), forked=forked,
                                    writing=writing))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "SPARK_HOME": "/nonexistent/spark"})
    try:
        deadline = time.monotonic() + 120
        while len(recorded_pids(str(pid_dir))) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        line = next(line for line in proc.stdout if line.startswith("zygote "))
        zygote_pids = [int(line.split()[1])] if forked else []
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
    left = wait_all_dead(recorded_pids(str(pid_dir)) + zygote_pids, timeout=5)
    assert left == [], f"zygote {zygote_pids}; outlived the driver: {describe(left)}"


def test_barrier_tasks_fork_ranks_from_their_python_workers_zygote(spark):
    tries = []
    for _ in range(4):  # a Python worker has a zygote after its first run: which worker runs a task is Spark's choice
        outs = HorovodRunner(np=2).run_all(rank_facts)
        tries.append([o["forked"] for o in outs])
        if all(tries[-1]):
            break
        time.sleep(3)  # the zygotes import torch
    assert all(tries[-1]), f"ranks forked per try: {tries}"
    assert os.getpid() not in {o["task_pid"] for o in outs}, "the tasks are Spark's Python workers"
    assert all(o["ppid"] != o["task_pid"] for o in outs)


def _thread_with_a_slow_exit(seconds: float) -> threading.Thread:
    """A thread whose OS thread outlives its Python part by ``seconds``: a thread-specific key whose
    destructor is libc's usleep, as MKL's thread-exit destructor runs after Thread.join returns."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = ctypes.c_uint()
    assert libc.pthread_key_create(ctypes.byref(key), ctypes.cast(libc.usleep, ctypes.c_void_p)) == 0
    # usleep(microseconds): the value stored under the key is its argument
    t = threading.Thread(target=lambda: libc.pthread_setspecific(key, ctypes.c_void_p(int(seconds * 1e6))))
    t.start()
    return t


def test_join_fully_waits_for_the_os_thread_not_only_its_python_part():
    t = _thread_with_a_slow_exit(1.5)  # long enough that a loaded machine's scheduling does not hide it
    native_id = t.native_id
    t.join()
    assert os.path.exists(f"/proc/self/task/{native_id}"), "Thread.join returned after the OS thread was gone"
    started = time.monotonic()
    t2 = _thread_with_a_slow_exit(0.5)
    assert zygote_process.join_fully(t2, timeout=10)
    assert time.monotonic() - started >= 0.45
    assert not os.path.exists(f"/proc/self/task/{t2.native_id}")


def test_join_fully_gives_up_on_a_thread_that_lingers():
    t = _thread_with_a_slow_exit(2.0)
    started = time.monotonic()
    assert not zygote_process.join_fully(t, timeout=0.3)
    assert time.monotonic() - started < 1.5

