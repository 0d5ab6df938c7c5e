"""What every benchmark's header says about the machine and code it measured, how local ranks start
and meet, and how they time a run of calls together."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

_HERE = Path(__file__).resolve().parent


def commit() -> str:
    """The short commit of this checkout, with " (with local changes)" when tracked files differ from it
    (a result measured on uncommitted code says so); "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=_HERE, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=_HERE, timeout=10).stdout.strip()
        return (head + (" (with local changes)" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def free_port() -> int:
    """A TCP port free on this host now, for a local process group's rendezvous: the launcher's own
    pick, below the ephemeral range, so no connection takes it before rank 0 binds it."""
    from spark_dl.task.ports import free_port as below_ephemeral

    return below_ephemeral()


def machine() -> str:
    """Host, processor, cores, torch version, UTC time and :func:`commit`, for a header line."""
    import torch

    return (f"{platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} cores, "
            f"torch {torch.__version__}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
            f"commit {commit()}")


def start_ranks(target: Callable[..., None], world: int, *args: Any) -> tuple[list, Any]:
    """``world`` spawned processes running ``target(rank, *args, port, queue)``, started, meeting on a
    free loopback port; returns them and the queue they report on."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, *args, port, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    return procs, queue


def join_loopback(rank: int, world: int, port: int) -> None:
    """Join ``world`` local ranks in one Gloo process group, meeting on 127.0.0.1:``port``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def timed(call: Callable[[int], Any], calls: int) -> tuple[float, float]:
    """(wall-clock, this process's CPU) seconds a call over ``call(0)`` ... ``call(calls - 1)``, every
    rank lined up before and after, so that no rank's time includes another's late start."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(calls):
        call(i)
    c1 = time.process_time()
    dist.barrier()
    return (time.perf_counter() - t0) / calls, (c1 - c0) / calls
