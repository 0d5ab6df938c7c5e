"""A barrier task that goes silent (its host frozen, down or cut off the network: no close comes)
fails the attempt within the silence bound, naming its rank and host, and its ranks do not outlive
the run once the task can act again."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from spark_dl import HorovodRunner, JobFailed
from spark_dl.driver.silence import SILENCE_TIMEOUT_S, silence_timeout


def busy_main(marker_dir: str) -> None:
    import os
    import time

    import torch

    import spark_dl

    spark_dl.init()
    with open(os.path.join(marker_dir, os.environ["RANK"]), "w") as f:
        f.write(f"{os.getpid()} {os.environ['SPARK_DL_TASK_PID']}")
    while True:
        torch.distributed.all_reduce(torch.ones(1))
        time.sleep(0.05)


def test_a_frozen_task_fails_the_run_naming_its_rank_and_host_and_leaves_no_rank(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_DL_SILENCE_TIMEOUT", "3")
    stopped: dict[str, float | int] = {}

    def freeze_rank1s_task() -> None:
        deadline = time.monotonic() + 120
        while not (tmp_path / "1").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        rank_pid, task_pid = map(int, (tmp_path / "1").read_text().split())
        os.kill(task_pid, signal.SIGSTOP)
        stopped.update(task=task_pid, rank=rank_pid, at=time.monotonic())

    threading.Thread(target=freeze_rank1s_task, daemon=True).start()
    try:
        silent = r"rank 1 on \S+ failed: its barrier task went silent: it has sent nothing for 3 s"
        with pytest.raises(JobFailed, match=silent) as e:
            HorovodRunner(np=2).run(busy_main, str(tmp_path))
        took = time.monotonic() - stopped["at"]
        assert took < 3 + 10, took  # the bound, polling; nobody waits for the frozen task to close
        assert "SPARK_DL_SILENCE_TIMEOUT" in str(e.value)
    finally:
        if "task" in stopped and psutil.pid_exists(stopped["task"]):  # Spark may have killed it meanwhile
            os.kill(stopped["task"], signal.SIGCONT)
    # thawed (or killed by Spark's cancel), the task's ranks go too
    ranks = [int((tmp_path / r).read_text().split()[0]) for r in ("0", "1")]
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks):
        assert time.monotonic() < deadline, "a rank outlived its run"
        time.sleep(0.2)


def test_the_silence_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPARK_DL_SILENCE_TIMEOUT", raising=False)
    assert silence_timeout() == SILENCE_TIMEOUT_S == 30.0
    monkeypatch.setenv("SPARK_DL_SILENCE_TIMEOUT", "0")
    assert silence_timeout() == 0.0
    monkeypatch.setenv("SPARK_DL_SILENCE_TIMEOUT", "soon")
    with pytest.raises(Exception, match="SPARK_DL_SILENCE_TIMEOUT='soon' is not a number"):
        silence_timeout()


def test_a_bad_silence_bound_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("SPARK_DL_SILENCE_TIMEOUT", "-1")
    with pytest.raises(Exception, match="SPARK_DL_SILENCE_TIMEOUT='-1' is not a number >= 0"):
        HorovodRunner(np=-2).run(time.sleep, 0)
