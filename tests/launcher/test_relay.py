"""The relay (barrier task 0 standing in for a driver the executors cannot reach), in one process.

The relay is driven over the real authenticated channel by peers playing a task and its rank, as
the launcher's own code would; its spool is then replayed into a client-side JobMonitor. The same
path through a real Spark Connect server is tested in test_connect.py.
"""
from __future__ import annotations

import os
import pickle
import socket
import threading
import time

import cloudpickle
import pytest

from spark_dl.driver import cluster
from spark_dl.driver.checkpoint_store import CheckpointStore
from spark_dl.driver.monitor import JobMonitor
from spark_dl.errors import LaunchRefused, RankFailed
from spark_dl.task.relay import CHUNK_BYTES, Relay, replay
from spark_dl.transport import channel

SECRET = b"s" * 32


def _client_monitor(store: CheckpointStore | None = None, lines: list | None = None) -> JobMonitor:
    class Lines:
        def on_start(self, job): ...
        def on_message(self, rank, kind, data): ...
        def on_finish(self, error): ...

        def on_log(self, rank, stream, line):
            lines.append((rank, stream, line))

    return JobMonitor(world_size=1, num_tasks=1, verbosity="log_callback_only", on_failure=lambda f: None,
                      observers=[Lines()] if lines is not None else [], checkpoints=store)


def _peers(relay: Relay):
    host, port = relay.address
    task = channel.connect(host, port, SECRET, relay=True)
    task.send("hello", {"role": "task", "partition": 0, "host": "h0", "pid": 1})
    task.send("layout", [{"rank": 0, "host": "h0", "local_rank": 0}])
    rank = channel.connect(host, port, SECRET, relay=True)
    rank.send("hello", {"role": "rank", "rank": 0, "pid": 2})
    return task, rank


def test_a_relayed_attempt_replays_into_the_clients_monitor(tmp_path):
    relay = Relay(SECRET, "job-ok", world_size=1, num_tasks=1, host="127.0.0.1", checkpoint=(b"earlier", 3))
    task, rank = _peers(relay)
    rank.send("checkpoint/load", {"id": 1})  # served by the relay, from the client's checkpoint
    kind, reply = rank.recv()
    assert kind == "reply" and bytes(reply["blob"]) == b"earlier"
    big = os.urandom(3 * CHUNK_BYTES)  # a checkpoint larger than one result row
    rank.send("checkpoint/save", {"id": 2, "blob": pickle.PickleBuffer(big), "step": 9})
    assert "error" not in rank.recv()[1]
    task.send("log", [(0, "stdout", "epoch 1"), (0, "stderr", "warning")])
    rank.send("user_log", "from log_to_driver")
    rank.send("result", pickle.PickleBuffer(cloudpickle.dumps({"acc": 0.97})))  # arrives as a memoryview
    rank.close()
    task.send("exit", {"rank": 0, "code": 0, "host": "h0", "aborted": False})
    task.close()
    relay.finish()
    assert relay.monitor.failure is None

    chunks = list(relay.chunks())
    assert len(chunks) >= 3 and all(len(c) <= CHUNK_BYTES for c in chunks)
    assert not os.path.exists(relay.path)  # the spool is gone once it has been read
    store, lines = CheckpointStore(tmp_path / "client", "job-ok"), []
    monitor = _client_monitor(store, lines)
    replay(chunks, monitor)
    assert monitor.failure is None and monitor.all_exited() and monitor.tasks_gone()
    assert monitor.result(0) == {"acc": 0.97}
    assert store.load() == big and store.info.step == 9  # the client keeps what rank 0 saved
    # in each connection's order (the task's pumped output and the rank's own link are two)
    assert [x for x in lines if x[1] != "log"] == [(0, "stdout", "epoch 1"), (0, "stderr", "warning")]
    assert [x for x in lines if x[1] == "log"] == [(0, "log", "from log_to_driver")]


def test_a_failure_the_relay_decides_is_the_clients_failure():
    relay = Relay(SECRET, "job-fail", world_size=1, num_tasks=1, host="127.0.0.1")
    task, rank = _peers(relay)
    aborted = threading.Event()

    def watch():  # the relay tells the task to stop its ranks, as the driver would
        if task.recv()[0] == "abort":
            aborted.set()

    threading.Thread(target=watch, daemon=True).start()
    rank.send("error", {"exc_type": "builtins.ValueError", "message": "loss is NaN", "traceback": "Traceback ...",
                        "pickled": cloudpickle.dumps(ValueError("loss is NaN"))})
    assert aborted.wait(10)
    rank.close()
    task.send("exit", {"rank": 0, "code": 1, "host": "h0", "aborted": True})
    task.close()
    relay.finish()
    monitor = _client_monitor()
    replay(relay.chunks(), monitor)
    error = monitor.error()
    assert isinstance(error, RankFailed) and error.rank == 0 and "ValueError: loss is NaN" in str(error)
    assert isinstance(error.__cause__, ValueError)


def test_the_relay_enforces_run_timeout_with_each_ranks_last_line():
    relay = Relay(SECRET, "job-hang", world_size=1, num_tasks=1, host="127.0.0.1", run_timeout=1.0)
    task, rank = _peers(relay)
    task.send("log", [(0, "stdout", "waiting for rank 1")])
    assert task.recv()[0] == "abort"  # after about a second
    rank.close()
    task.send("exit", {"rank": 0, "code": -15, "host": "h0", "aborted": True})
    task.close()
    relay.finish()
    monitor = _client_monitor()
    replay(relay.chunks(), monitor)
    text = str(monitor.error())
    assert "exceeded run_timeout=1 s" in text and "[0]<stdout>: waiting for rank 1" in text


def test_an_unpicklable_message_costs_only_itself():
    relay = Relay(SECRET, "job-odd", world_size=1, num_tasks=1, host="127.0.0.1")
    task, _ = _peers(relay)
    task.send("tracking/system", {"lock": _Unpicklable()})  # unpickles on the relay, pickles nowhere
    task.send("log", [(0, "stdout", "still here")])
    task.close()
    deadline = time.monotonic() + 10
    while 0 not in relay.monitor.tails and time.monotonic() < deadline:  # the line has been recorded
        time.sleep(0.01)
    relay.close()
    lines: list = []
    replay(relay.chunks(), _client_monitor(lines=lines))
    assert "could not keep a 'tracking/system' message" in lines[0][2] and lines[1] == (0, "stdout", "still here")


class _Unpicklable:
    """Pickles once (to cross the channel); pickling the object that arrives fails."""

    def __reduce__(self):
        return threading.Lock, ()


def test_a_task_that_cannot_reach_the_relay_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(channel.ChannelError, match="cannot reach barrier task 0's relay .* connect to each other"):
        channel.connect("127.0.0.1", port, SECRET, timeout=5, relay=True)


@pytest.mark.parametrize("host, here", [
    ("127.0.0.1", True), ("localhost", True), (socket.gethostname(), True),
    ("203.0.113.9", False),  # TEST-NET-3: never this machine
    ("no-such-host.invalid", False),  # a name only a cluster's DNS would know
])
def test_whether_the_driver_host_is_this_machine(host, here):
    assert cluster.is_this_host(host) is here


def test_channel_mode_of_a_classic_session_and_a_bad_setting(spark, monkeypatch):
    monkeypatch.setenv(cluster.CHANNEL_ENV, "relay")
    assert cluster.channel_mode(spark) == "direct"  # a classic session is the driver itself
    monkeypatch.setenv(cluster.CHANNEL_ENV, "tunnel")
    with pytest.raises(LaunchRefused, match="SPARK_DL_CHANNEL='tunnel' is not one of .*'relay' when the executors"):
        cluster.channel_mode(spark)
