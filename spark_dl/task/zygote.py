"""Rank processes forked from a warm interpreter: torch is imported once per task process, not per rank.

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

Lifetimes: the zygote dies with the thread that started it (a daemon thread that lives as long as
it does, so with the task process); a rank forked from it dies with the zygote and with the task
that asked for it (the zygote kills the rank's process group when the task's end of the rank's
socket closes, and the rank watches the task's pid itself, see ``rank_main``).
"""
from __future__ import annotations

import gc
import os
import pickle
import selectors
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
_MAX_REQUEST = 4 << 20
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
# How long the zygote waits for its import thread to finish exiting (see join_fully) before it
# gives up and exits: a thread that slow means cores so busy that fresh ranks are no worse.
THREAD_EXIT_S = 60.0


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

    def __init__(self, env: dict[str, str]) -> None:
        self.startup = startup_env(env)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc: subprocess.Popen | None = None
        self.patience_spent = False  # a run gave up waiting for it once (fork_rank)
        threading.Thread(target=self._keep, args=(env, theirs), name="spark-dl-zygote", daemon=True).start()

    def _keep(self, env: dict[str, str], theirs: socket.socket) -> None:
        # the zygote's parent-death signal fires when the thread that forked it ends: this one,
        # which lives as long as the zygote does
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from spark_dl.task.zygote import main; main()", str(theirs.fileno()),
                 str(os.getpid())],
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
            self._sock.close()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def _usable(env: dict[str, str]) -> bool:
    return enabled(env) and hasattr(socket, "send_fds") and hasattr(os, "pidfd_open") \
        and sys.platform.startswith("linux")


def fork_rank(env: dict[str, str], job_id: str) -> ForkedRank | None:
    """Fork a rank of job ``job_id`` with ``env`` from this process's zygote; None where there
    is none for ``env`` (the caller then starts the rank fresh). A zygote still importing is
    waited for, up to ``READY_WAIT_S`` (once per zygote): a fresh rank would import the same
    modules on the same cores, slowing both, and the zygote started first."""
    z = _zygote
    if z is None or not z.alive or z.startup != startup_env(env) or not _usable(env):
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
    started with other startup variables (the last run's environment wins)."""
    global _zygote
    if not _usable(env):
        return
    with _zygote_lock:
        z = _zygote
        if z is not None and z.alive and z.startup == startup_env(env):
            return
        if z is not None:
            z.stop()
        _zygote = Zygote(env)


def wait_ready(timeout: float) -> bool:
    """Whether this process has a zygote ready, waiting up to ``timeout`` seconds for one."""
    z = _zygote
    return z is not None and z.wait_ready(timeout)


# ---- the zygote process -------------------------------------------------------------------------

def _serve(master: socket.socket) -> None:
    """Fork a rank per request until the task process goes away (or replaces this zygote) and the
    ranks it forked have exited. Single-threaded: a fork copies only the calling thread, so no
    other thread may hold a lock at that moment."""
    sel = selectors.DefaultSelector()
    sel.register(master, selectors.EVENT_READ, "request")
    ranks: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (the task's socket for this rank, pid)
    while ranks or master.fileno() >= 0:
        for key, _ in sel.select():
            if key.data == "request":
                try:
                    msg, fds, _, _ = socket.recv_fds(master, _MAX_REQUEST, 4)
                except OSError:
                    msg, fds = b"", []
                if not msg:  # the task process is gone, or has a newer zygote: no more ranks from here
                    sel.unregister(master)
                    master.close()
                    break
                _start(pickle.loads(msg), fds, sel, ranks, master)
            elif key.data == "task":  # the task closed its end: it died, or gave up on the rank
                sel.unregister(key.fileobj)
                for conn, pid in ranks.values():
                    if conn is key.fileobj:
                        _kill_group(pid)
            else:  # a rank exited
                conn, pid = ranks.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                # what it left in its group dies with it, as its task would have it: the task may be gone.
                # Before the wait: while the rank is unreaped its pid, so its group's id, is not reused
                _kill_group(pid)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass
                if conn.fileno() in sel.get_map():
                    sel.unregister(conn)
                conn.close()


def _start(request: dict, fds: list[int], sel: selectors.BaseSelector, ranks: dict, master: socket.socket) -> None:
    conn = socket.socket(fileno=fds[0])
    try:
        pid = _fork(request, fds, [master, sel, *ranks, *(c for c, _ in ranks.values())])
    except OSError:  # out of processes or memory: the task's recv ends empty and it starts the rank fresh
        conn.close()
        return
    finally:
        for fd in fds[1:]:
            os.close(fd)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        _kill_group(pid)
        os.waitpid(pid, 0)
        conn.close()
        return
    ranks[pidfd] = (conn, pid)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    sel.register(conn, selectors.EVENT_READ, "task")
    try:
        conn.send(str(pid).encode())
    except OSError:
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _fork(request: dict, fds: list[int], inherited: list) -> int:
    """Fork one rank; returns its pid once it leads its own session (so the task's ``killpg``
    reaches it from the first moment). ``inherited``: the zygote's sockets, selector and pidfds,
    which the rank closes."""
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(started_r)
        try:
            os.setsid()
            os.close(started_w)  # the zygote's read returns: this rank leads its own group now
            for obj in inherited:
                os.close(obj) if isinstance(obj, int) else obj.close()
            _run_rank(request, fds)
        except BaseException:  # noqa: BLE001 - the rank's own errors are reported by rank_main
            import traceback

            traceback.print_exc()
        finally:
            os._exit(1)
    os.close(started_w)
    os.read(started_r, 1)  # EOF once the child has called setsid (or died)
    os.close(started_r)
    return pid


def _run_rank(request: dict, fds: list[int]) -> None:
    import importlib
    import io

    conn_fd, stdin_fd, stdout_fd, stderr_fd = fds
    os.close(conn_fd)
    for fd, target in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    # as ``python -u`` would set them up (PYTHONUNBUFFERED is in every rank's environment)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r")))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(request["cwd"])
    except OSError:
        pass
    # what a fresh ``python -m`` would have: the working directory, then PYTHONPATH, then the rest
    path = _pythonpath(env)
    rest = [p for p in _BASE_PATH if p not in path]
    sys.path[:] = [os.getcwd(), *path, *rest]
    importlib.invalidate_caches()  # files written since the zygote looked at a directory are found
    if "numpy" in sys.modules:  # its global generator is not reseeded by a fork (Python's random is)
        sys.modules["numpy"].random.seed()
    from spark_dl.rank import main as rank_main

    sys.argv = [rank_main.__file__, request["job_id"], str(os.getppid())]
    rank_main.run_forked(request["task_pid"])


_BASE_PATH: list[str] = []  # the zygote's sys.path less its PYTHONPATH and working directory


def _pythonpath(env) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _import_rank_side() -> None:
    """What a rank imports first. The one thread these start, numpy's OpenBLAS pool, stops itself
    around a fork (pthread_atfork); no other thread may run in the zygote (pyarrow's allocator would).
    ``torch._dynamo`` too, which DDP's constructor imports (about 2 s of CPU per rank): ranks forked
    with it froze far more often at the end of torchrun's idiom, a torch deadlock that the process
    groups kept by ``spark_dl.rank.works`` now prevent."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401 - DDP's constructor imports it (see above)
        import torch.distributed  # noqa: F401
    except ImportError:
        pass
    import cloudpickle  # noqa: F401

    import spark_dl.compat.horovod_imports  # noqa: F401
    import spark_dl.rank.context  # noqa: F401
    import spark_dl.rank.main  # noqa: F401
    import spark_dl.rank.script  # noqa: F401
    import spark_dl.tracking.rank.lifecycle  # noqa: F401
    import spark_dl.transport.channel  # noqa: F401


def join_fully(thread: threading.Thread, timeout: float) -> bool:
    """Join ``thread`` and wait until its OS thread is gone too; False if it lingers past ``timeout``.

    ``Thread.join`` returns once the thread's Python state is freed, before the OS thread has run
    the libraries' thread-exit destructors. MKL's (in torch) holds MKL's allocator lock while it
    frees the thread's buffers: a rank forked in that window inherits the lock held, by no thread,
    and spins forever in its first matrix multiply. At nice 19 on busy cores the window lasted up
    to 132 ms, so a run right after the zygote became ready hung now and then."""
    native_id = thread.native_id
    thread.join()
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{native_id}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def main() -> None:
    from spark_dl.rank.main import set_death_signal

    master = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the task, which stops its ranks
    parent = int(sys.argv[2])
    set_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the task process died before prctl took effect
        os._exit(0)
    path = _pythonpath(os.environ)
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in path]  # [0]: python -c's working directory
    # at the lowest priority: the imports use only CPU time nothing else wants (the driver's or the
    # next run's work comes first), and a thread's nice value is its own, so the zygote and the
    # ranks it forks run at the task's priority
    importer = threading.Thread(target=_import_rank_side, name="spark-dl-zygote-import")
    importer.start()
    if not join_fully(importer, THREAD_EXIT_S):
        os._exit(0)  # the task's runs start their ranks fresh, as without a zygote
    # what is imported now lives as long as the zygote: out of the collector's sight, so a rank's
    # collections do not write to (and so copy) the pages the zygote shares with every rank
    gc.freeze()

    try:
        master.send(b"ready")
    except OSError:  # replaced before it was ready
        os._exit(0)
    _serve(master)
    os._exit(0)

