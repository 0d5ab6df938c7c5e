"""What a rank tells the driver about where it is, once a second: the stall inspector's input.

Every second a daemon thread reads, without touching the training loop, the sequence number of
each process group (torch counts the collectives launched on a group; Gloo and NCCL both keep
it) and the main thread's innermost frames: whether it is inside a collective, which one, and
the user's line that called it. It sends a :class:`~spark_dl.protocol.Progress` to the driver,
which compares the ranks (:mod:`spark_dl.driver.stalls`). The same report is the rank's
heartbeat. On the driver's request the rank answers with every thread's stack, as
``faulthandler`` prints them.
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import re
import sys
import sysconfig
import tempfile
import threading
import time
from types import FrameType
from typing import Callable

from spark_dl import protocol

_SPARK_DL = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_EXAMPLES = os.path.join(_SPARK_DL, "examples") + os.sep
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
# frames of start-up and teardown: waiting there is the start time-out's business, not a stall
_STARTUP = frozenset({"init_process_group", "rendezvous", "_store_based_barrier", "destroy_process_group",
                      "_new_process_group_helper", "_env_rendezvous_handler", "_create_c10d_store"})
_DECORATORS = frozenset({"wrapper", "inner", "_fn", "decorate_context"})
_THREAD = re.compile(r"(?:Current thread|Thread) (0x[0-9a-f]+)")
_WAITS = (".wait(", "wait_all(", ".synchronize(", "synchronize(")


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    path = getattr(torch, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def _library(path: str, torch_dir: str | None) -> str | None:
    """Which library ``path`` belongs to ("torch", "spark_dl", "python"), or None for the user's code."""
    if torch_dir is not None and path.startswith(torch_dir):
        return "torch"
    if path.startswith(_SPARK_DL) and not path.startswith(_EXAMPLES):
        return "spark_dl"
    if path.startswith(_STDLIB) and "site-packages" not in path:
        return "python"
    return None


def sequence_numbers() -> dict[str, int]:
    """Collectives launched so far on each process group this rank belongs to, by group name."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {}
    try:
        world = dist.distributed_c10d._world
        groups = list(world.pg_names.items())
    except Exception:  # noqa: BLE001 - another torch's internals, or a group being created right now
        return {}
    out: dict[str, int] = {}
    for group, name in groups:
        try:
            out[str(name)] = int(group._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - a backend without sequence numbers, or a group torn down
            continue
    return out


def where(frame: FrameType | None) -> tuple[str | None, str | None]:
    """``(op, site)`` of a thread's stack: the collective it waits in (None if it is not waiting
    in one) and the user's innermost line (``"train.py:42 in step"``)."""
    torch_dir = _torch_dir()
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)  # innermost first
        frame = frame.f_back
    if not frames:
        return None, None
    if any(f.f_code.co_name in _STARTUP and _library(f.f_code.co_filename, torch_dir) for f in frames):
        return None, None
    top = frames[0].f_code.co_filename
    in_comm = (top.startswith(torch_dir + "distributed" + os.sep) if torch_dir else False) or (
        top.startswith(torch_dir + "futures" + os.sep) if torch_dir else False)
    if not in_comm and _library(top, torch_dir) == "spark_dl":
        line = linecache.getline(top, frames[0].f_lineno)
        in_comm = any(w in line for w in _WAITS)
    entry = None  # the library function the user called: the outermost frame of the library block on top
    site = None
    for f in frames:
        lib = _library(f.f_code.co_filename, torch_dir)
        if lib is None:
            site = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"
            break
        if f.f_code.co_name not in _DECORATORS:
            entry = f
    op = None
    if in_comm and entry is not None:
        path = entry.f_code.co_filename
        prefix = ("hvd." if os.sep + "horovod" + os.sep in path
                  else "dist." if torch_dir and path.startswith(torch_dir + "distributed") else "")
        op = prefix + entry.f_code.co_name
    elif in_comm:
        op = frames[0].f_code.co_name
    return op, site


def stacks() -> str:
    """Every thread's stack as ``faulthandler`` prints it, each thread's name added."""
    names = {t.ident: t.name for t in threading.enumerate()}
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read()
    lines = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        name = names.get(int(m.group(1), 16)) if m else None
        lines.append(f"{line[:-1]} [{name}]:" if name is not None and line.endswith(":") else line)
    return "\n".join(lines) + "\n"


class Reporter:
    """The rank's reporting thread: a :class:`~spark_dl.protocol.Progress` every ``interval``."""

    def __init__(self, send: Callable[[str, object], None], interval: float = protocol.PROGRESS_INTERVAL_S) -> None:
        self._send = send
        self._interval = interval
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._seq: dict[str, int] = {}
        self._changed = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="spark-dl-progress", daemon=True)

    def start(self) -> "Reporter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def report(self) -> protocol.Progress:
        seq = sequence_numbers()
        now = time.monotonic()
        if seq != self._seq:
            self._seq, self._changed = seq, now
        op, site = where(sys._current_frames().get(self._main))
        return {"seq": seq, "age": now - self._changed, "op": op, "site": site}

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._send(protocol.PROGRESS, self.report())
            except Exception:  # noqa: BLE001 - a report is never worth the rank; the next one comes
                pass
