"""Process bookkeeping for the no-orphan checks: ranks record their pids, tests check them."""
from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import psutil


def record_self_and_child(pid_dir: str, wait_for: int = 2) -> None:
    """Called inside a rank: start a long-lived child (like a DataLoader worker), record both
    pids, and wait until ``wait_for`` ranks have recorded theirs, so the test can check that
    none of them outlives the job."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    tmp = os.path.join(pid_dir, f"{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n{child.pid}\n")
    os.rename(tmp, os.path.join(pid_dir, f"{os.getpid()}.pids"))
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(pid_dir) if n.endswith(".pids")]) < wait_for and time.monotonic() < deadline:
        time.sleep(0.05)


def record_then_wait(pid_dir: str) -> None:
    """A rank's ``main`` for the interrupt tests: record the pids, then wait to be stopped."""
    record_self_and_child(pid_dir)
    time.sleep(120)


def recorded_pids(pid_dir: str) -> list[int]:
    pids: list[int] = []
    for name in os.listdir(pid_dir):
        if name.endswith(".pids"):
            with open(os.path.join(pid_dir, name)) as f:
                pids += [int(x) for x in f.read().split()]
    return pids


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_all_dead(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(pids)
    return left


def describe(pids: list[int]) -> str:
    """Each pid's command line, parent and state, for an assertion message: which one outlived its
    job (a rank, its child, the zygote) says which death path was slow."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} (parent {p.ppid()}, {p.status()}): {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            out.append(f"{pid}: gone")
    return "; ".join(out)


def interrupt_main_when_recorded(pid_dir: str, ranks: int = 2) -> None:
    """Ctrl-C for the test's main thread once ``ranks`` ranks have recorded their pids."""
    # interrupt_main() does nothing where SIGINT is not handled by Python (SIG_IGN or SIG_DFL): a
    # process a terminal's Ctrl-C reaches has Python's handler, so this test's process gets it too,
    # whatever an earlier test in the same worker left
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(pid_dir) if n.endswith(".pids")]) < ranks and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
