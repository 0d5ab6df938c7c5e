"""The zygote process itself (started by :class:`spark_dl.task.zygote.Zygote`): imports the rank
side once, at the lowest priority, then forks a rank per request from the task processes
connected to it, each with the task's environment, working directory, ``sys.path`` and pipes.
A shared zygote also listens on its name for the other Python workers of its executor."""
from __future__ import annotations

import gc
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import threading
import time

_MAX_REQUEST = 4 << 20
# How long the zygote waits for its import thread to finish exiting (see join_fully) before it
# gives up and exits: a thread that slow means cores so busy that fresh ranks are no worse.
THREAD_EXIT_S = 60.0


def _serve(master: socket.socket | None, listener: socket.socket | None = None, anchor: int | None = None,
           idle_s: float = 0.0) -> None:
    """Fork a rank per request until no task process is connected (each went away, or replaced
    this zygote) and the ranks it forked have exited. A shared zygote (``listener``) also takes
    connections from other processes of its user, and exits once ``anchor`` (a pidfd) ends, or
    once it has been ``idle_s`` seconds with no connection and no rank. Single-threaded: a fork
    copies only the calling thread, so no other thread may hold a lock at that moment."""
    sel = selectors.DefaultSelector()
    masters = set()
    if master is not None:
        sel.register(master, selectors.EVENT_READ, "request")
        masters.add(master)
    if listener is not None:
        sel.register(listener, selectors.EVENT_READ, "accept")
        sel.register(anchor, selectors.EVENT_READ, "anchor")
    ranks: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (the task's socket for this rank, pid)

    def closing(*socks: socket.socket) -> None:
        for sock in socks:
            sel.unregister(sock)
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its task sees EOF: this zygote is gone for it
            except OSError:
                pass
            sock.close()

    while ranks or masters or listener is not None:
        idle = listener is not None and not ranks and not masters
        events = sel.select(idle_s if idle else None)
        if not events:  # idle for idle_s: nothing to keep warm for
            closing(listener)
            listener = None
        for key, _ in events:
            if key.data == "accept":
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                if not _same_user(conn):
                    conn.close()
                    continue
                try:
                    conn.send(b"ready")
                except OSError:
                    conn.close()
                    continue
                masters.add(conn)
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "anchor":  # the executor's daemon ended: its workers did too
                sel.unregister(anchor)
                os.close(anchor)
                closing(listener, *masters)
                listener = None
                masters.clear()
            elif key.data == "request":
                try:
                    msg, fds, _, _ = socket.recv_fds(key.fileobj, _MAX_REQUEST, 4)
                except OSError:
                    msg, fds = b"", []
                if not msg:  # the task process is gone, or has a newer zygote: no more ranks for it
                    masters.discard(key.fileobj)
                    closing(key.fileobj)
                    continue
                inherited = [*masters, sel, *([listener, anchor] if listener is not None else [])]
                _start(pickle.loads(msg), fds, sel, ranks, inherited)
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


def _same_user(conn: socket.socket) -> bool:
    """Whether the peer of ``conn`` runs as this process's user (a fork runs as the zygote's)."""
    try:
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return False
    return uid == os.getuid()


def _listen(name: str, anchor: int) -> tuple[socket.socket, int] | None:
    """The listening socket found by ``name`` and a pidfd of ``anchor``; None where another zygote
    has the name (it started first) or ``anchor`` is gone."""
    try:
        pidfd = os.pidfd_open(anchor)
    except OSError:
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + name)
        listener.listen(64)
    except OSError:
        listener.close()
        os.close(pidfd)
        return None
    return listener, pidfd


def _start(request: dict, fds: list[int], sel: selectors.BaseSelector, ranks: dict, inherited: list) -> None:
    conn = socket.socket(fileno=fds[0])
    try:
        pid = _fork(request, fds, [*inherited, *ranks, *(c for c, _ in ranks.values())])
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
    # bound before the imports: a worker starting its first run meanwhile waits for this one
    shared = None
    if len(sys.argv) > 4:
        shared = _listen(sys.argv[3], int(sys.argv[4]))
        if shared is None:  # another worker's zygote has the name (its task joins that one) or the daemon ended
            os._exit(0)
    idle_s = float(sys.argv[5]) if shared is not None else 0.0
    if shared is None:  # it lives as long as the thread that started it
        set_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the task process died before prctl took effect (or before the bind)
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
    except OSError:  # replaced before it was ready (or its task ended): a shared one serves the others
        if shared is None:
            os._exit(0)
        master.close()
        master = None
    _serve(master, *(shared or ()), idle_s=idle_s)
    os._exit(0)

