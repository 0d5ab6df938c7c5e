"""Barrier task 0 as the driver's stand-in, for clients the executors cannot reach.

A Spark Connect client off the cluster (Databricks Connect on a laptop) can reach the Connect
server, but the executors cannot connect back to it. Then barrier task 0 runs the job's control
server instead (a :class:`Relay`): every task and rank reports to it, it detects failures and stops
the others exactly as the driver would, serves ``load_checkpoint``/``save_checkpoint``, and writes
everything it received to a spool file. Task 0 returns that file as rows of the stage's result,
and the client replays it into its own :class:`~spark_dl.driver.JobMonitor` with :func:`replay`:
results, errors, logs, metrics and checkpoints then reach the client's observers as if they had
been streamed, only at the end of the attempt.

Spool: a pickle stream of events, ``("message", conn, kind, data)``, ``("close", conn, error)``
and ``("fail", failure)``, where ``conn`` numbers the relay's connections in accept order.
"""
from __future__ import annotations

import io
import os
import pickle
import tempfile
import threading
import time
from typing import Any, Iterable, Iterator

from spark_dl import protocol
from spark_dl.driver.checkpoint_store import CheckpointStore
from spark_dl.driver.monitor import ABORT_GRACE_S, Failure, JobMonitor
from spark_dl.driver.stalls import run_timeout_message
from spark_dl.transport import channel

CHUNK_BYTES = 1 << 20  # one result row: Spark Connect ships results in Arrow batches of about 4 MiB
SETTLE_S = 5.0  # after a success, how long task 0 waits for the other tasks to close their links


class _Spooler(pickle.Pickler):
    """Pickles what arrived, where the channel's out-of-band buffers are memoryviews: as bytes."""

    def reducer_override(self, obj):
        if isinstance(obj, memoryview):
            return bytes, (obj.tobytes(),)
        return NotImplemented


def _dumps(event: tuple) -> bytes:
    out = io.BytesIO()
    _Spooler(out, protocol=5).dump(event)
    return out.getvalue()


class _Discard:
    """Where the relay's monitor "prints" log lines: the client prints them when it replays."""

    def write(self, _: str) -> None:
        pass

    def flush(self) -> None:
        pass


class Relay:
    """The control server of one attempt, in barrier task 0; the spool of what it received."""

    def __init__(self, secret: bytes, job_id: str, world_size: int, num_tasks: int, host: str,
                 checkpoint: tuple[bytes, int | None, tuple[int, ...] | None] | None = None,
                 run_timeout: float | None = None, observers: tuple = ()) -> None:
        self._lock = threading.Lock()
        self._ids: dict[int, int] = {}
        fd, self.path = tempfile.mkstemp(prefix=f"{job_id}-relay-", suffix=".spool")
        self._spool = os.fdopen(fd, "wb")
        self._closed = False
        self.store = CheckpointStore(None, job_id)
        if checkpoint is not None:  # what load_checkpoint() returns: the client's latest
            self.store.save(*checkpoint)
        self.monitor = JobMonitor(world_size=world_size, num_tasks=num_tasks, verbosity="log_callback_only",
                                  on_failure=self._on_failure, out=_Discard(), err=_Discard(),
                                  checkpoints=self.store, observers=list(observers))
        self.server = channel.ControlServer(secret, self._on_message, self._on_close)
        self.address = (host, self.server.port)
        self._started = time.monotonic()
        self._run_timeout = run_timeout
        # the time-out must fire while this task's own ranks hang: a thread of its own
        self._watcher = threading.Thread(target=self._watch, name="spark-dl-relay-watch", daemon=True)
        self._watcher.start()

    # -- what the control server hands over ------------------------------------------------------
    def _record(self, event: tuple) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._spool.write(_dumps(event))
            except Exception as e:  # noqa: BLE001 - one odd message must not cost the run its record
                what, conn = (event[2], event[1]) if event[0] == "message" else (event[0], -1)
                line = f"[spark-dl] the relay could not keep a {what!r} message: {type(e).__name__}: {e}"
                self._spool.write(_dumps(("message", conn, "log", [(-1, "log", line)])))

    def _id(self, conn: channel.Connection) -> int:
        with self._lock:
            return self._ids.setdefault(id(conn), len(self._ids))

    def _on_message(self, conn: channel.Connection, kind: str, data: Any) -> None:
        # requests are answered here, from the observers' stand-ins, and progress reports serve no replay
        if not kind.startswith(protocol.REQUEST_PREFIX) and kind != protocol.PROGRESS:
            self._record(("message", self._id(conn), kind, data))
        self.monitor.on_message(conn, kind, data)

    def _on_close(self, conn: channel.Connection, error: BaseException | None) -> None:
        self._record(("close", self._id(conn), _portable(error)))
        self.monitor.on_close(conn, error)

    def _on_failure(self, failure: Failure) -> None:
        self._record(("fail", failure))
        threading.Thread(target=self._abort, name="spark-dl-relay-abort", daemon=True).start()

    def _abort(self) -> None:
        for conn in self.server.connections():
            if conn.info.get("role") == "task":
                try:
                    conn.send(protocol.ABORT)
                except OSError:
                    pass

    def _watch(self) -> None:
        """Until every rank has exited or the attempt failed (its time-out included)."""
        m = self.monitor
        while m.failure is None and not m.all_exited() and not self._closed:
            if self._run_timeout is not None and time.monotonic() - self._started > self._run_timeout:
                m.fail(Failure(None, run_timeout_message(self._run_timeout, m)))
                return
            m.wait(0.2)

    # -- the end of the attempt ------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every rank is gone (task 0's own ranks already are), then stop recording."""
        self._watcher.join()
        m = self.monitor
        deadline = time.monotonic() + (ABORT_GRACE_S if m.failure is not None else SETTLE_S)
        while time.monotonic() < deadline and not m.tasks_gone():
            m.wait(0.1)
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._spool.close()
        self.server.close()
        self.store.close()
        self.monitor.poke()

    def discard(self) -> None:
        """The task failed: nothing will be returned."""
        self.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def chunks(self) -> Iterator[bytes]:
        """The spool, in result-row sized pieces; the file is removed once read."""
        try:
            with open(self.path, "rb") as f:
                while True:
                    chunk = f.read(CHUNK_BYTES)
                    if not chunk:
                        return
                    yield chunk
        finally:
            os.unlink(self.path)


def _portable(error: BaseException | None) -> BaseException | None:
    """The error itself where it pickles (socket errors, ChannelError), else its text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return channel.ChannelError(f"{type(error).__name__}: {error}")


class _Replayed:
    """The client's stand-in for one of the relay's connections: it has the peer's ``info``;
    replies to ranks were already sent by the relay."""

    def __init__(self, n: int) -> None:
        self.info: dict[str, Any] = {}
        self.peer = f"relayed connection {n}"

    def send(self, kind: str, data: Any = None) -> None:
        pass


def replay(chunks: Iterable[bytes], monitor: JobMonitor) -> None:
    """Feed a relay's spool to the client's monitor, in the order the relay received it."""
    spool = io.BytesIO(b"".join(chunks))
    conns: dict[int, _Replayed] = {}
    while True:
        try:
            event = pickle.load(spool)
        except EOFError:
            break
        if event[0] == "fail":
            monitor.fail(event[1], final=True)
            continue
        conn = conns.setdefault(event[1], _Replayed(event[1]))
        if event[0] == "message":
            monitor.on_message(conn, event[2], event[3])
        else:
            monitor.on_close(conn, event[2])
    monitor.settle()
