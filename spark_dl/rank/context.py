"""What a rank process sees: its place in the world, the process group, and its line to the driver.

Everything here runs inside a rank process started by :class:`spark_dl.HorovodRunner`.
Messages to the driver are queued and sent by a background thread, so calling
``log_to_driver`` or the tracking functions every step costs microseconds.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from spark_dl import protocol
from spark_dl.transport.channel import Connection


def scratch_dir() -> str | None:
    """A folder for this rank's temporary files, removed by its task once the task's ranks have
    exited (killed ones too); None outside a rank process."""
    path = os.environ.get(protocol.SCRATCH_ENV)
    return path if path and os.path.isdir(path) else None


@dataclass(frozen=True)
class RankContext:
    """This rank's place in the world, read from the environment the launcher set."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    job_id: str
    attempt: int = 0  # how many times HorovodRunner(max_restarts=...) has restarted this run


def get_context() -> RankContext:
    """The calling rank's :class:`RankContext`. Raises ``RuntimeError`` outside a rank process."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        raise RuntimeError(
            "not inside a spark-dl rank process: RANK/WORLD_SIZE are unset. "
            "Call this from the function you pass to HorovodRunner(np=...).run(main)."
        )
    return RankContext(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        cross_rank=int(env.get("CROSS_RANK", 0)),
        cross_size=int(env.get("CROSS_SIZE", 1)),
        job_id=env.get(protocol.JOB_ID_ENV, ""),
        attempt=int(env.get(protocol.ATTEMPT_ENV, 0)),
    )


def init(backend: str | None = None, timeout_s: float | None = None) -> str:
    """Initialise the default ``torch.distributed`` process group from the launcher's environment.

    Picks NCCL when this rank has a GPU and Gloo otherwise, and binds the rank to its own GPU.
    Returns the backend name. Calling it again is a no-op.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_backend()
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:  # torch would say only "environment variable RANK expected"
        raise RuntimeError(
            f"spark_dl.init() joins the process group of a rank that HorovodRunner or TorchDistributor started, "
            f"but this process has no {', '.join(missing)}: run the function through them (np=-2 runs it in local "
            "processes), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does"
        )
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if backend is None:
        backend = "nccl" if has_gpu else "gloo"
    if has_gpu:
        count = torch.cuda.device_count()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if backend == "nccl" and protocol.CUDA_DEVICE_ENV not in os.environ and local_size > count:
            # NCCL refuses two ranks on one GPU, but only after a long, cryptic collective setup.
            raise RuntimeError(
                f"{local_size} ranks on this host but only {count} GPU(s) visible: NCCL needs one GPU "
                f"per rank. Use at most {count} rank(s) per host (np), give each task its own GPU "
                "(spark.task.resource.gpu.amount), or call spark_dl.init(backend='gloo')."
            )
        torch.cuda.set_device(cuda_index())
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(**kwargs)
    return backend


def cuda_index() -> int:
    """The index of this rank's GPU among those it sees: the task's assignment, else its local rank."""
    import torch

    index = int(os.environ.get(protocol.CUDA_DEVICE_ENV, os.environ.get("LOCAL_RANK", "0")))
    return index % torch.cuda.device_count()


class _Outbox:
    """Queue of messages to the driver, drained by one daemon thread in order."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pid = os.getpid()  # a forked child (a DataLoader worker) inherits this object, not its thread
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.broken: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="spark-dl-outbox", daemon=True)
        self._thread.start()

    def put(self, kind: str, data: Any) -> None:
        self._q.put((kind, data))

    def flush(self, timeout: float | None = None) -> bool:
        done = threading.Event()
        self._q.put(done)
        return done.wait(timeout)

    def _drain(self) -> None:
        while True:
            item = self._q.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self.broken is not None:
                continue
            try:
                self.conn.send(*item)
            except OSError as e:
                self.broken = e
            except Exception as e:  # noqa: BLE001 - pickling fails before a byte is sent: drop this one only
                sys.stderr.write(f"[spark-dl] could not send a {item[0]!r} message to the driver ({type(e).__name__}: "
                                 f"{e}); it was dropped, the rank's other messages still go\n")


_outbox: _Outbox | None = None
_replies: dict[int, list] = {}  # request id -> [event, reply]; filled by the driver watchdog
_replies_lock = threading.Lock()
_next_request = 0


def _install(conn: Connection) -> _Outbox:
    global _outbox
    _outbox = _Outbox(conn)
    return _outbox


def send_to_driver(kind: str, data: Any) -> None:
    """Queue a message for the driver (used by the tracking API). No-op outside a rank process."""
    if _outbox is not None:
        _outbox.put(kind, data)


def request(kind: str, data: dict) -> dict:
    """Send ``data`` to the driver and wait for its reply (a dict). Only inside a rank process.

    No time-out is needed: a driver that goes away takes this rank with it (see ``rank_main``).
    """
    global _next_request
    if _outbox is None:
        raise RuntimeError("not inside a spark-dl rank process")
    if in_forked_child():  # nothing would ever send the request: fail instead of hanging
        raise RuntimeError(
            f"{kind} was called in a process forked from the rank (pid {os.getpid()}, e.g. a DataLoader "
            "worker), which has no link to the driver: call it in the rank's own process and pass the "
            "worker what it needs"
        )
    with _replies_lock:
        _next_request += 1
        rid = _next_request
        slot = _replies[rid] = [threading.Event(), None]
    _outbox.put(kind, {**data, "id": rid})
    try:
        while not slot[0].wait(1.0):
            if _outbox.broken is not None:
                raise ConnectionError(f"the link to the driver broke: {_outbox.broken}")
    finally:
        with _replies_lock:
            _replies.pop(rid, None)
    return slot[1]


def _deliver(reply: dict) -> None:
    """Hand a driver's reply to the :func:`request` waiting for it (the watchdog thread calls this)."""
    with _replies_lock:
        slot = _replies.get(reply.get("id"))
    if slot is not None:
        slot[1] = reply
        slot[0].set()


def in_rank_process() -> bool:
    return _outbox is not None


def in_forked_child() -> bool:
    """True in a process forked from a rank (a DataLoader worker with ``num_workers > 0``): it
    inherits the rank's outbox but not the thread that sends it, so nothing it sends arrives."""
    return _outbox is not None and _outbox.pid != os.getpid()


def log_to_driver(message: Any) -> None:
    """Show ``message`` on the driver, tagged with this rank, whatever ``driver_log_verbosity`` is.

    Outside a rank process it prints locally, so the same training function runs anywhere.
    """
    text = str(message)
    if _outbox is None or in_forked_child():  # a forked worker: its stdout is the rank's
        print(text, flush=True)
        return
    _outbox.put(protocol.USER_LOG, text)
