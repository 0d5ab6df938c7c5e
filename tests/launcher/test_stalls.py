"""The stall inspector on real ranks and real Gloo: a rank the others wait for is named, with its
stack, within the bound; ranks that compute, slowly or unevenly, are never reported."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from spark_dl import HorovodRunner, JobFailed, RankFailed, RankStalled, TorchDistributor
from spark_dl.driver.stalls import STALL_TIMEOUT_S, STALL_WARNING_S, StallInspector, stall_settings
from spark_dl.errors import LaunchRefused

FAST = {"stall_warning": 2, "stall_timeout": 5, "tracking": False}


def record_pid(pid_dir: str) -> None:
    with open(os.path.join(pid_dir, os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))


def assert_gone(pid_dir: str) -> None:
    pids = [int(open(os.path.join(pid_dir, n)).read()) for n in os.listdir(pid_dir)]
    assert pids
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"ranks left running: {pids}"
        time.sleep(0.1)


def skips_one(pid_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    record_pid(pid_dir)
    t = torch.ones(4)
    for step in range(3):
        if not (dist.get_rank() == 1 and step == 1):
            dist.all_reduce(t)
    dist.barrier()


def test_a_rank_that_skips_an_all_reduce_fails_the_attempt_naming_both_calls(tmp_path, capfd):
    started = time.monotonic()
    with pytest.raises(RankStalled) as e:
        HorovodRunner(np=-2, **FAST).run(skips_one, str(tmp_path))
    took = time.monotonic() - started
    assert took < 5 + 15, took  # the bound, launch and stacks included
    text = str(e.value)
    assert "rank 0 is in dist.all_reduce at test_stalls.py" in text
    assert "rank 1 is in dist.barrier at test_stalls.py" in text
    assert e.value.waiting == (0, 1) and e.value.stalled == ()
    assert set(e.value.stacks) == {0, 1}
    assert "in skips_one" in e.value.stacks[1]
    assert "[spark-dl] stalled: every rank has waited" in capfd.readouterr().err  # the warning came first
    assert_gone(str(tmp_path))


def spins(pid_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    record_pid(pid_dir)
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        x = 0
        while True:
            x += 1  # the culprit's line
    dist.all_reduce(t)


def test_a_rank_in_an_endless_loop_is_named_with_its_line_and_the_waiting_rank_with_its_collective(tmp_path):
    with pytest.raises(RankStalled, match=r"rank 0 \(\S+\) has waited \d+ s in dist.all_reduce at test_stalls.py:\d+ "
                                          r"in spins for rank 1 \(\S+\), which has not joined it: rank 1 is at "
                                          r"test_stalls.py:\d+ in spins") as e:
        HorovodRunner(np=-2, **FAST).run(spins, str(tmp_path))
    assert e.value.waiting == (0,) and e.value.stalled == (1,)
    assert "x += 1" not in e.value.stacks[1]  # faulthandler prints lines, not source
    loop = spins.__code__.co_firstlineno + 11  # `while True:` and the line in it
    assert any(f"line {n} in spins" in e.value.stacks[1] for n in (loop, loop + 1))
    assert "--- rank 1 on" in str(e.value) and "in spins" in str(e.value).split("--- rank 1 on")[1]
    assert_gone(str(tmp_path))


class Stuck:
    """A dataset whose items never come on rank 1: its DataLoader worker deadlocks."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import threading

        import torch

        if os.environ["RANK"] == "1" and i >= 2:
            threading.Event().wait()  # a lock nobody releases
        return torch.ones(2)


def loads(pid_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    record_pid(pid_dir)
    for batch in torch.utils.data.DataLoader(Stuck(), batch_size=2, num_workers=1):
        dist.all_reduce(batch)


def test_a_deadlocked_data_loader_in_one_rank_is_named(tmp_path):
    with pytest.raises(RankStalled, match=r"for rank 1 \(\S+\), which has not joined it: rank 1 is at "
                                          r"test_stalls.py:\d+ in loads") as e:
        HorovodRunner(np=-2, **FAST).run(loads, str(tmp_path))
    assert "dataloader.py" in e.value.stacks[1]
    assert_gone(str(tmp_path))


def stops(pid_dir: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    record_pid(pid_dir)
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        with open(os.path.join(pid_dir, "..", "stopped_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)


def test_a_stopped_rank_is_noticed_from_its_missing_heartbeats(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_DL_SILENCE_TIMEOUT", "4")
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(RankFailed, match=r"rank 1 on \S+ failed: went silent: it has sent nothing for 4 s") as e:
        HorovodRunner(np=-2, stall_warning=None, stall_timeout=None, tracking=False).run(stops, str(pids))
    took = time.time() - float((tmp_path / "stopped_at").read_text())
    assert took < 4 + 3 + 10, took  # the bound, the others' stacks (3 s at most), stopping the ranks
    assert "no answer" in e.value.stacks[1]  # a stopped process cannot answer
    assert "in stops" in e.value.stacks[0]  # the waiting one can
    assert_gone(str(pids))


def long_steps(seconds: float, uneven: bool) -> int:
    import time

    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    t = torch.ones(4)
    for _ in range(3):
        time.sleep(seconds * (dist.get_rank() if uneven else 1))  # computing, on every rank
        dist.all_reduce(t)
    return int(t[0])


@pytest.mark.parametrize("seconds, uneven", [(4.0, False), (1.5, True)], ids=["long-steps", "uneven"])
def test_ranks_that_compute_long_or_unevenly_but_progress_are_not_stalled(seconds, uneven, capfd):
    assert HorovodRunner(np=-2, stall_warning=2, stall_timeout=3, tracking=False).run(
        long_steps, seconds, uneven) == 8
    assert "stalled" not in capfd.readouterr().err


def slow_hvd(pid_dir: str) -> None:
    import time

    import torch

    from spark_dl import horovod as hvd

    hvd.init()
    record_pid(pid_dir)
    if hvd.rank() == 1:
        time.sleep(600)
    hvd.allreduce(torch.ones(2), name="g")


def test_the_horovod_api_names_its_collective(tmp_path):
    with pytest.raises(RankStalled, match=r"rank 0 \(\S+\) has waited \d+ s in hvd.allreduce at test_stalls.py:\d+ "
                                          r"in slow_hvd for rank 1"):
        HorovodRunner(np=-2, **FAST).run(slow_hvd, str(tmp_path))
    assert_gone(str(tmp_path))


def slow_ddp(pid_dir: str) -> None:
    import time

    import torch

    import spark_dl

    spark_dl.init()
    record_pid(pid_dir)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    if torch.distributed.get_rank() == 1:
        time.sleep(600)
    model(torch.ones(2, 4)).sum().backward()  # DDP's all-reduce runs in C++: the sequence numbers tell


def test_a_rank_missing_from_ddp_backward_is_named(tmp_path):
    with pytest.raises(RankStalled, match=r"rank 0 \(\S+\) has waited \d+ s in a collective at test_stalls.py:\d+ "
                                          r"in slow_ddp for rank 1 \(\S+\), which has not joined it: rank 1 is at "
                                          r"test_stalls.py:\d+ in slow_ddp"):
        HorovodRunner(np=-2, **FAST).run(slow_ddp, str(tmp_path))
    assert_gone(str(tmp_path))


def sleeps(pid_dir: str) -> None:
    import time

    import spark_dl

    spark_dl.init()
    record_pid(pid_dir)
    time.sleep(600)


def test_a_live_run_shows_every_ranks_stack_and_goes_on(tmp_path):
    runner = HorovodRunner(np=-2, tracking=False, run_timeout=25)
    seen: dict[int, str] = {}

    def ask() -> None:
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:  # both ranks started, in their sleep
            time.sleep(0.2)
            if len(os.listdir(tmp_path)) == 2:
                seen.update({r: s for r, s in runner.stacks().items() if "in sleeps" in s})

    asker = threading.Thread(target=ask)
    asker.start()
    with pytest.raises(JobFailed, match="run_timeout=25") as e:  # the run went on after stacks()
        runner.run(sleeps, str(tmp_path))
    asker.join()
    assert set(seen) == {0, 1}
    # the run_timeout error carries them too
    assert set(e.value.stacks) == {0, 1} and "in sleeps" in e.value.stacks[1]
    assert "Every rank's stack:" in str(e.value)
    with pytest.raises(RuntimeError, match="no run of this HorovodRunner is in progress"):
        runner.stacks()


def test_stall_settings_come_from_the_options_then_horovods_variables_then_the_defaults(monkeypatch):
    for name in ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                 "HOROVOD_STALL_CHECK_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    from spark_dl.driver.stalls import DEFAULT

    assert stall_settings(DEFAULT, DEFAULT) == (STALL_WARNING_S, STALL_TIMEOUT_S)
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "20")
    assert stall_settings(DEFAULT, DEFAULT) == (20.0, STALL_TIMEOUT_S)
    assert stall_settings(DEFAULT, DEFAULT, {"HOROVOD_STALL_CHECK_TIME_SECONDS": "30"}) == (30.0, STALL_TIMEOUT_S)
    assert stall_settings(10, None) == (10.0, None)
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0")  # Horovod's 0: never
    assert stall_settings(DEFAULT, DEFAULT) == (20.0, None)
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "1")
    assert stall_settings(DEFAULT, DEFAULT) == (None, None)
    assert stall_settings(5, DEFAULT) == (5.0, None)  # given here, it wins


@pytest.mark.parametrize("kwargs, needle", [
    ({"stall_warning": 0}, "stall_warning must be a number of seconds > 0 or None"),
    ({"stall_timeout": "5"}, "stall_timeout must be a number of seconds > 0 or None"),
    ({"env": {"HOROVOD_STALL_CHECK_TIME_SECONDS": "soon"}}, "HOROVOD_STALL_CHECK_TIME_SECONDS='soon' is not"),
])
def test_bad_stall_settings_are_refused_when_the_runner_is_made(kwargs, needle):
    with pytest.raises(LaunchRefused, match=needle):
        HorovodRunner(np=-2, **kwargs)
    with pytest.raises(LaunchRefused, match=needle):  # TorchDistributor takes them too
        TorchDistributor(num_processes=2, use_gpu=False, **kwargs)


def report(seq: dict[str, int], age: float, op: str | None = None, site: str | None = None) -> dict:
    return {"seq": seq, "age": age, "op": op, "site": site}


def inspector(warned: list[str]) -> StallInspector:
    return StallInspector(3, 2.0, 5.0, warned.append)


def test_the_rule_every_rank_in_the_same_collective_from_the_same_line_is_a_slow_transfer_not_a_stall():
    warned: list[str] = []
    s = inspector(warned)
    for r in range(3):
        s.on_progress(r, report({"0": 7}, 10.0, "dist.broadcast", "train.py:3 in main"))
    assert s.check(set(), {}) is None and not warned


def test_the_rule_the_rank_behind_is_named_and_one_warning_comes_per_stall():
    warned: list[str] = []
    s = inspector(warned)
    s.on_progress(0, report({"0": 8}, 3.0, "dist.all_reduce", "train.py:9 in step"))
    s.on_progress(1, report({"0": 8}, 3.0, None, "train.py:9 in step"))  # launched it (DDP), waits in backward
    s.on_progress(2, report({"0": 7}, 3.0, None, "data.py:40 in load"))
    assert s.check(set(), {2: "host-c"}) is None  # warned, not yet past the time-out
    assert s.check(set(), {}) is None
    assert len(warned) == 1 and "for rank 2 (host-c), which has not joined it: rank 2 is at data.py:40" in warned[0]
    s.on_progress(0, report({"0": 8}, 6.0, "dist.all_reduce", "train.py:9 in step"))
    stall = s.check(set(), {})
    assert stall is not None and stall.waiting == (0, 1) and stall.culprits == (2,)


def test_the_rule_a_rank_that_has_returned_is_what_the_others_wait_for():
    warned: list[str] = []
    s = inspector(warned)
    s.on_progress(0, report({"0": 4}, 9.0, "dist.all_reduce", "train.py:9 in step"))
    s.on_progress(1, report({"0": 4}, 9.0, "dist.all_reduce", "train.py:9 in step"))
    s.on_progress(2, report({"0": 3}, 9.0, None, None))
    stall = s.check({2}, {})
    assert stall is not None and stall.culprits == (2,)
    assert "rank 2 has already returned from main or exited" in stall.summary


def stalls_once() -> str:
    import os
    import time

    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    if os.environ["SPARK_DL_ATTEMPT"] == "0" and dist.get_rank() == 1:
        time.sleep(600)  # the first attempt stalls here
    dist.all_reduce(torch.ones(1))
    return os.environ["SPARK_DL_ATTEMPT"]


def test_a_stalled_attempt_is_restarted_with_max_restarts():
    runner = HorovodRunner(np=-2, max_restarts=1, **FAST)
    assert runner.run(stalls_once) == "1"
    assert runner.last_run.attempts == 2
    assert isinstance(runner.last_run.failures[0], RankStalled) and runner.last_run.failures[0].stalled == (1,)
