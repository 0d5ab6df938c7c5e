"""Rank processes forked from a warm interpreter: torch is imported once per executor (or driver), not per rank.

A rank in a fresh interpreter spends about 1.2 s of CPU importing torch before it can run a line
of ``main``. The first run in a Spark Python worker (or, in local mode, on the driver) starts its
ranks that way and, once they have exited or ``EARLY_START_S`` into the run if sooner, a *zygote*: a
single-threaded interpreter that imports torch, numpy and spark-dl's rank side once, then waits.
Later runs in the same process ask it to fork their ranks, which start in milliseconds; one that
finds it still importing waits for it.

A fork is only used where it is indistinguishable from a fresh start for the rank's code: the
variables read when an interpreter or a library starts (``PYTHON*``, ``LD_*``, ``MALLOC_*``,
``OMP_*``...) must be the zygote's, otherwise the rank starts fresh as before (e.g.
``HorovodRunner(env={"PYTHONHASHSEED": "0"})``). The child takes the task's environment, working
directory, ``sys.path`` and pipes, starts its own session as a spawned rank does, and reseeds
numpy's global generator (Python's ``random`` reseeds itself after a fork). ``SPARK_DL_ZYGOTE=0``
turns it off.

One zygote per executor: the Python workers of one Spark executor (the children of one
``pyspark.daemon``) share it, found by a name (an abstract Unix socket: the user's id, the
daemon's pid and start time, and the startup variables). A worker's first run forks from the
zygote another worker started, and a zygote outlives the worker that started it: Spark ends the
Python workers of a failed or interrupted run and, after a minute idle, all of them, so a zygote
per worker was lost just before the run that would have used it (the test suite's 186 zygotes
forked no rank in 82 cases).

Lifetimes: a zygote of the driver (local mode) dies with the thread that started it (a daemon
thread that lives as long as it does, so with the driver). A shared one exits with its executor's
daemon, or once no worker has been connected to it and no rank of its has run for ``IDLE_EXIT_S``.
A rank forked from either dies with the zygote and with the task that asked for it (the zygote
kills the rank's process group when the task's end of the rank's socket closes, and the rank
watches the task's pid itself, see ``rank_main``). Only processes of the zygote's own user may
connect to it.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

from spark_dl import protocol

ENV_SWITCH = protocol.ZYGOTE_ENV
# read when an interpreter, the loader, the allocator or a numerics library starts: a forked
# rank would silently run with the zygote's values, so any difference means a fresh start
STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC", "THP_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
                    "JEMALLOC", "TORCH_", "CUBLAS", "CUDA_MODULE_LOADING")
FORK_REPLY_S = 30.0
# How long a run waits for its process's zygote to finish importing. Fresh ranks started beside a
# zygote still importing share the cores with it, and the run after them can find it still not
# ready (benchmarks/launch.py --back-to-back: the third of four back-to-back runs 3.17 s, not 0.79).
READY_WAIT_S = 20.0
# How long a run of fresh ranks goes on before its task starts the zygote beside it (its imports at
# the lowest priority): the ranks' own imports are over by then, and the run after a long one finds
# the zygote ready instead of waiting for it to import (benchmarks/time_to_accuracy.py: the run after
# an 80-100 s one started and returned in 0.7-0.9 s instead of 4.5-4.9 s).
EARLY_START_S = 10.0
# How long a shared zygote waits, with no worker connected and no rank of its running, before it
# exits: a notebook's next run within that time forks warm, however long its workers were idle.
IDLE_EXIT_S = 600.0


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` a process reads as it starts (``PYTHONPATH`` aside: the fork sets
    ``sys.path`` from it)."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k != "PYTHONPATH"}


def enabled(env: dict[str, str]) -> bool:
    """Whether ranks started with ``env`` (the task's environment, ``env=`` applied) may be forked."""
    return not protocol.switched_off(env, ENV_SWITCH)


class ForkedRank:
    """A rank forked by the zygote, with what the task uses of a ``subprocess.Popen``."""

    def __init__(self, conn: socket.socket, pid: int, stdin: int, stdout: int, stderr: int) -> None:
        self.pid = pid
        self.args = ["<forked by the spark-dl zygote>"]
        self.stdin = os.fdopen(stdin, "wb")
        self.stdout = os.fdopen(stdout, "rb")
        self.stderr = os.fdopen(stderr, "rb")
        self.returncode: int | None = None
        self._conn = conn
        self._exited = threading.Event()
        threading.Thread(target=self._read_exit, name=f"spark-dl-rank-{pid}-exit", daemon=True).start()

    def _read_exit(self) -> None:
        try:
            msg = self._conn.recv(64)
        except OSError:
            msg = b""
        # no status: the zygote died, and its ranks with it (their parent-death signal)
        self.returncode = int(msg) if msg else -signal.SIGKILL
        self._conn.close()
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class Zygote:
    """The task side: starts the zygote in the background and asks it for ranks once it is ready."""

    def __init__(self, env: dict[str, str], shared: tuple[str, int] | None = None,
                 sock: socket.socket | None = None) -> None:
        """Start a zygote for ``env``; ``shared``: (name, anchor pid) it is found by and lives with.
        With ``sock``, a connection to a running shared zygote instead (see :func:`connect`)."""
        self.startup = startup_env(env)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._proc: subprocess.Popen | None = None
        self.patience_spent = False  # a run gave up waiting for it once (fork_rank)
        if sock is not None:
            self._sock = sock
            threading.Thread(target=self._follow, name="spark-dl-zygote", daemon=True).start()
            return
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        threading.Thread(target=self._keep, args=(env, theirs, shared), name="spark-dl-zygote", daemon=True).start()

    def _follow(self) -> None:
        # a connection to another worker's zygote: "ready" once it is, then EOF when it exits
        try:
            if self._sock.recv(16) == b"ready" and not self._dead.is_set():
                self._ready.set()
                self._sock.recv(16)
        except OSError:
            pass
        finally:
            self._dead.set()
            self._ready.clear()

    def _keep(self, env: dict[str, str], theirs: socket.socket, shared: tuple[str, int] | None) -> None:
        # a zygote of the driver's: its parent-death signal fires when the thread that forked it
        # ends, this one, which lives as long as the zygote does. A shared one watches its anchor.
        share = [shared[0], str(shared[1]), str(IDLE_EXIT_S)] if shared else []
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from spark_dl.task.zygote_process import main; main()", str(theirs.fileno()),
                 str(os.getpid()), *share],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True,  # a notebook's Ctrl-C (SIGINT to its process group) is not for it
            )
        except OSError:
            self._dead.set()
            return
        finally:
            theirs.close()
        try:
            try:
                ready = self._sock.recv(16) == b"ready"
            except OSError:  # stopped (replaced) while it imported
                ready = False
            if ready and not self._dead.is_set():
                self._ready.set()
            self._proc.wait()
        finally:
            self._dead.set()
            self._ready.clear()

    def wait_ready(self, timeout: float) -> bool:
        """Whether it is ready, waiting up to ``timeout`` seconds; False at once if it dies meanwhile."""
        deadline = time.monotonic() + timeout
        while not self._ready.is_set() and not self._dead.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._ready.wait(min(left, 0.05))
        return self._ready.is_set() and self.alive

    @property
    def alive(self) -> bool:
        return not self._dead.is_set()

    def fork(self, env: dict[str, str], job_id: str) -> ForkedRank | None:
        """A rank forked with ``env`` (the environment a fresh one would get), or None where the
        zygote is not ready (still importing, or gone): the caller then starts the rank fresh."""
        if not self._ready.is_set() or self._dead.is_set():
            return None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        request = pickle.dumps({"env": env, "cwd": os.getcwd(), "task_pid": os.getpid(), "job_id": job_id})
        try:
            with self._lock:
                socket.send_fds(self._sock, [request], [theirs.fileno(), stdin_r, stdout_w, stderr_w])
            mine.settimeout(FORK_REPLY_S)  # a fork takes milliseconds; a zygote that does not answer is skipped
            reply = mine.recv(64)
            mine.settimeout(None)
        except OSError:  # socket.timeout included: the zygote kills a rank whose socket was closed
            reply = b""
        finally:
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
            theirs.close()
        if not reply:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            mine.close()
            return None
        return ForkedRank(mine, int(reply), stdin_w, stdout_r, stderr_r)

    def stop(self) -> None:
        """No more ranks from this zygote: it exits once the ranks it forked have (a run may
        still be using them)."""
        self._ready.clear()
        self._dead.set()
        with self._lock:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread reading it; the zygote sees EOF
            except OSError:
                pass
            self._sock.close()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()
_anchor: int | None = None  # the process a shared zygote lives with (share_within)


def share_within(anchor: int) -> None:
    """Share this process's zygote with the other children of process ``anchor`` (a Spark
    executor's Python daemon, for the workers it forks), and find theirs."""
    global _anchor
    _anchor = anchor


def shared_name(anchor: int, env: dict[str, str]) -> str | None:
    """The name a zygote shared within ``anchor`` for ranks started with ``env`` is found by; None
    where ``anchor`` is gone."""
    try:
        with open(f"/proc/{anchor}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # with the pid: no reused pid matches
    except (OSError, IndexError):
        return None
    key = repr((sys.executable, __file__, sorted(startup_env(env).items())))  # __file__: which spark-dl
    return f"spark-dl-zygote-{os.getuid()}-{anchor}-{started}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def connect(name: str, env: dict[str, str]) -> Zygote | None:
    """A connection to the zygote serving ``name``, or None where none does."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        return None
    return Zygote(env, sock=sock)


def _find_or_start(env: dict[str, str], start: bool) -> Zygote | None:
    """This process's zygote for ``env``: kept, joined (shared within ``_anchor``) or, with
    ``start``, started. Called with ``_zygote_lock`` held."""
    global _zygote
    z = _zygote
    if z is not None and z.alive and z.startup == startup_env(env):
        return z
    name = shared_name(_anchor, env) if _anchor is not None else None
    joined = connect(name, env) if name is not None else None
    if joined is None and not start:
        return None
    if z is not None:
        z.stop()
    _zygote = joined or Zygote(env, shared=(name, _anchor) if name is not None else None)
    return _zygote


def _usable(env: dict[str, str]) -> bool:
    return enabled(env) and hasattr(socket, "send_fds") and hasattr(os, "pidfd_open") \
        and sys.platform.startswith("linux")


def fork_rank(env: dict[str, str], job_id: str) -> ForkedRank | None:
    """Fork a rank of job ``job_id`` with ``env`` from this process's zygote; None where there
    is none for ``env`` (the caller then starts the rank fresh). A zygote still importing is
    waited for, up to ``READY_WAIT_S`` (once per zygote): a fresh rank would import the same
    modules on the same cores, slowing both, and the zygote started first."""
    if not _usable(env):
        return None
    with _zygote_lock:  # this process's, or one another worker of this executor started
        z = _find_or_start(env, start=False)
    if z is None:
        return None
    if not z.patience_spent and not z.wait_ready(READY_WAIT_S):
        z.patience_spent = True  # stuck or far too slow: later runs start fresh until it is ready
        return None
    return z.fork(env, job_id)


def prepare(env: dict[str, str]) -> None:
    """Have a zygote for ``env`` ready for this process's next run. Called once a run's ranks
    have exited, or ``EARLY_START_S`` into a run of fresh ranks, so its imports do not compete with
    theirs for the cores (starting it beside ranks still importing made a first run 7.4 s instead
    of 4.0-4.7 s). Replaces a zygote
    started with other startup variables (the last run's environment wins); in a Spark worker,
    joins the one another worker of its executor started, if there is one."""
    if not _usable(env):
        return
    with _zygote_lock:
        _find_or_start(env, start=True)


def wait_ready(timeout: float) -> bool:
    """Whether this process has a zygote ready, waiting up to ``timeout`` seconds for one."""
    z = _zygote
    return z is not None and z.wait_ready(timeout)
