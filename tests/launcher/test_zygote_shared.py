"""One zygote per executor (spark_dl/task/zygote.py): the Python workers of one Spark executor fork
their ranks from one zygote, which outlives the workers Spark ends after a failed run, serves only
its own user, and exits with its executor's daemon or once idle. Real zygote processes, a real
Spark session for the barrier case."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from test_zygote import rank_facts

from spark_dl import HorovodRunner, JobFailed
from spark_dl.task import zygote


def _fail_on_rank_1() -> None:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")


def test_the_workers_of_an_executor_fork_from_one_zygote_that_outlives_a_failed_runs_workers(spark):
    tries = []
    for _ in range(6):  # a first run starts fresh ranks and the executor's zygote; it imports torch
        outs = HorovodRunner(np=2).run_all(rank_facts)
        tries.append([o["forked"] for o in outs])
        if all(tries[-1]):
            break
        time.sleep(3)
    assert all(tries[-1]), f"ranks forked per try: {tries}"
    (first,) = {o["ppid"] for o in outs}
    with pytest.raises(JobFailed, match="rank 1 fails on purpose"):
        HorovodRunner(np=2).run(_fail_on_rank_1)  # Spark ends the Python workers of a failed stage
    outs = HorovodRunner(np=4).run_all(rank_facts)  # four workers: at least two never ran a rank
    assert [o["forked"] for o in outs] == [True] * 4, outs
    assert {o["ppid"] for o in outs} == {first}, "every worker's ranks come from the one zygote"
    assert len({o["task_pid"] for o in outs}) == 4


@pytest.fixture
def anchor():
    """A process for a zygote to live with, as an executor's Python daemon."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


ENV = {**os.environ, "PYTHONHASHSEED": "4711"}  # startup variables of its own: no other test's zygote


def _shared(anchor_pid: int, monkeypatch, idle_s: float = 600.0) -> tuple[zygote.Zygote, str]:
    monkeypatch.setattr(zygote, "IDLE_EXIT_S", idle_s)
    name = zygote.shared_name(anchor_pid, ENV)
    z = zygote.Zygote(ENV, shared=(name, anchor_pid))
    assert z.wait_ready(120), "the shared zygote should be ready within two minutes"
    return z, name


def _exits(z: zygote.Zygote, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while z.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    return not z.alive


def test_a_shared_zygote_serves_other_processes_of_its_user_and_exits_with_its_anchor(anchor, monkeypatch):
    z, name = _shared(anchor.pid, monkeypatch)
    other = zygote.connect(name, ENV)
    assert other is not None and other.wait_ready(10)
    assert zygote.connect(name + "-nobody", ENV) is None  # a name nothing serves: fresh ranks
    z.stop()  # the process that started it is done with it: it stays for the others
    time.sleep(0.5)
    assert other.alive and other.wait_ready(1)
    assert zygote.connect(name, ENV) is not None
    anchor.kill()
    anchor.wait()
    assert _exits(other, 20), "a shared zygote outlived the executor daemon it was started for"


def test_a_shared_zygote_exits_once_idle(anchor, monkeypatch):
    z, name = _shared(anchor.pid, monkeypatch, idle_s=1.0)
    watcher = zygote.connect(name, ENV)
    assert watcher is not None and watcher.wait_ready(10)
    watcher.stop()
    z.stop()
    proc = z._proc
    proc.wait(30)  # idle 1 s with nobody connected, then gone
    assert zygote.connect(name, {}) is None


def test_a_shared_zygote_refuses_another_user(anchor, monkeypatch):
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    z, name = _shared(anchor.pid, monkeypatch)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # nobody, asking for the zygote
        os.close(r)
        try:
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect("\0" + name)
            sock.settimeout(20)
            os.write(w, b"got:" + sock.recv(16))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        said = f.read()
    assert said == b"got:", f"another user's process got {said!r} instead of a closed connection"
    assert z.alive
    z.stop()
