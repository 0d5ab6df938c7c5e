"""The tasks' rendezvous through the driver's control channel (not Spark's ``allGather``, whose
answer is polled once a second): real channels, a real JobMonitor, real rank processes."""
from __future__ import annotations

import os
import threading
import time

import cloudpickle
import psutil

from spark_dl.driver.monitor import JobMonitor
from spark_dl.task.barrier import JobSpec, run_task
from spark_dl.task.layout import TaskInfo, compute_layout
from spark_dl.transport import channel


def _monitor(num_tasks: int) -> tuple[JobMonitor, channel.ControlServer, bytes]:
    secret = channel.new_secret()
    monitor = JobMonitor(world_size=num_tasks, num_tasks=num_tasks, verbosity="all", on_failure=lambda f: None)
    return monitor, channel.ControlServer(secret, monitor.on_message, monitor.on_close, host="127.0.0.1"), secret


def test_every_task_gets_every_description_in_partition_order_once_all_have_sent_theirs():
    monitor, server, secret = _monitor(2)
    try:
        links = {p: channel.connect("127.0.0.1", server.port, secret) for p in (0, 1)}
        infos = {p: TaskInfo(partition=p, host=f"host-{p}", gpus=(str(p),), port=4000 + p) for p in (0, 1)}
        for p in (1, 0):  # the last partition first: the answer is still in partition order
            links[p].send("hello", {"role": "task", "partition": p, "host": infos[p].host, "pid": 1})
            links[p].send("rendezvous", infos[p].__dict__)
        got = {p: links[p].recv() for p in (0, 1)}
        for kind, data in got.values():
            assert kind == "tasks"
            assert [TaskInfo(**{**t, "gpus": tuple(t["gpus"])}) for t in data] == [infos[0], infos[1]]
        layout = compute_layout([infos[0], infos[1]])
        assert [r.rank for r in layout[1]] == [1] and layout[1][0].master_port == 4000
        assert monitor.tasks_started == 2
    finally:
        server.close()


def test_a_task_waiting_for_the_others_stops_its_ranks_and_returns_when_the_driver_aborts():
    """One task of two has started; the driver gives up (a start time-out, a failed stage): the
    waiting task ends at once, with no rank process left, instead of waiting for Spark to kill it."""
    monitor, server, secret = _monitor(2)
    job_id = f"spark-dl-test-rendezvous-{os.getpid()}"
    spec = JobSpec(job_id=job_id, driver_host="127.0.0.1", driver_port=server.port, secret=secret,
                   payload=cloudpickle.dumps((print, (), {})), ranks_per_task=1, want_all_results=False,
                   rank_env={"SPARK_DL_ZYGOTE": "0"})  # a fresh rank process, found by its command line
    out: dict = {}

    def task() -> None:
        def rendezvous(gather):
            out["gathered"] = gather(TaskInfo(partition=0, host="127.0.0.1", port=1))
            return None if out["gathered"] is None else compute_layout(out["gathered"])[0]

        out["statuses"] = run_task(spec, 0, "127.0.0.1", rendezvous)

    def ranks() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if job_id in (p.info["cmdline"] or [])]

    thread = threading.Thread(target=task, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not (monitor.task_infos and ranks()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert monitor.task_infos and ranks(), "the task should have sent its description and started its rank"
        started = time.monotonic()
        monitor.task_conns[0].send("abort")
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 5
        assert out == {"gathered": None, "statuses": []}
        deadline = time.monotonic() + 5
        while ranks() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ranks() == []
    finally:
        server.close()
        thread.join(10)
