"""Entry point of a rank process: ``python -m spark_dl.rank.main JOB_ID PARENT_PID``.

Started by a task (barrier or local) before the rendezvous finishes, so the interpreter start and
the ``torch`` import overlap with it. The task then writes the bootstrap (rank environment,
payload, driver address and secret) to stdin. The rank connects to the driver, runs
``main(*args, **kwargs)``, and reports the result or the error. If the driver goes away, the rank kills
its own process group: no orphans.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback

from spark_dl import protocol
from spark_dl.rank import works

PR_SET_PDEATHSIG = 1


def _kill_own_group(*_: object) -> None:
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(137)


def _never() -> bool:
    return False


_task_gone = _never  # set by _die_with_parent: whether the task that started this rank has died


def _readers_gone() -> bool:
    """Whether the reader of this rank's stdout or stderr, its task, has closed it: a pipe without
    readers polls as an error. The task holds them until the rank exits, so only its death closes them."""
    poll = select.poll()
    for fd in (1, 2):
        poll.register(fd, select.POLLOUT)
    return any(ev & select.POLLERR for _, ev in poll.poll(0))


def set_death_signal(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when the thread that started it ends (Linux;
    elsewhere nothing: the callers also poll their parent)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        except (OSError, AttributeError):
            pass


def _die_with_parent(parent_pid: int, task_pid: int | None = None) -> None:
    """End this rank and everything it started (its process group) when the task that started
    it dies, e.g. when Spark kills the task. SIGKILL as the death signal would kill only this
    process and orphan its children, so the death signal is SIGTERM, handled by killing the
    group, and a watchdog thread polls the parent in case user code replaced the handler.
    A rank forked by the zygote (``task_pid`` given) also polls the task, which is not its parent.
    """
    signal.signal(signal.SIGTERM, _kill_own_group)
    set_death_signal(signal.SIGTERM)
    task = None
    if task_pid is not None:
        try:
            task = os.pidfd_open(task_pid)
        except ProcessLookupError:
            _kill_own_group()

    def gone() -> bool:
        if os.getppid() != parent_pid:
            return True
        return task is not None and bool(select.select([task], [], [], 0)[0])  # a pidfd reads when it exits

    global _task_gone
    _task_gone = gone
    if gone():  # the parent died before prctl took effect
        _kill_own_group()

    def poll_parent() -> None:
        while not gone():
            time.sleep(0.2)
        _kill_own_group()

    threading.Thread(target=poll_parent, name="spark-dl-parent-watch", daemon=True).start()


def _watch_driver(conn, finishing: threading.Event) -> None:
    """Reader of the driver connection: an abort or a vanished driver ends this rank at once;
    replies to the rank's requests (checkpoints) go to the thread waiting for them."""
    from spark_dl.rank import context as rank_api

    try:
        while True:
            kind, data = conn.recv()
            if kind == protocol.ABORT:
                break
            if kind == protocol.REPLY:
                rank_api._deliver(data)
            elif kind == protocol.STACKS:  # answered from this thread: the main one may be stuck
                from spark_dl.rank.progress import stacks

                conn.send(protocol.STACKS, {"id": data["id"], "text": stacks()})
    except BaseException:  # noqa: BLE001 - any failure of the link means the driver is gone
        pass
    if not finishing.is_set():
        _kill_own_group()


def _destroy_process_group() -> None:
    """Tear down a group main left open, so the rank exits promptly and cleanly."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown must not turn a success into a failure
        pass


THREAD_WAIT_S = 600.0  # how long a rank whose main returned waits for the threads main left running
THREAD_NOTICE_S = 5.0  # then says which threads it waits for


def _thread_wait_s() -> float:
    from spark_dl.errors import env_number

    return env_number(protocol.THREAD_WAIT_ENV, THREAD_WAIT_S, unit=" s")


def _wait_for_threads(rank: int, limit: float) -> None:
    """What python does when ``main`` ends: run threading's exit hooks (a ``concurrent.futures``
    executor finishes its queued work, e.g. torch's ``dcp.async_save``), then wait for the
    non-daemon threads still running (a checkpoint upload), while the process group is still up.
    Bounded: after ``limit`` seconds the rank exits without them, saying so."""
    start = time.monotonic()
    hooks = list(getattr(threading, "_threading_atexits", ()))
    if hooks:
        def run_hooks() -> None:
            for hook in reversed(hooks):
                try:
                    hook()
                except Exception:  # noqa: BLE001 - as python: one failing hook does not stop the others
                    traceback.print_exc()
        waiter = threading.Thread(target=run_hooks, name="spark-dl-thread-exit", daemon=True)
        waiter.start()
        _join([waiter], start, limit, rank)
    me = threading.current_thread()
    _join([t for t in threading.enumerate() if t is not me and not t.daemon], start, limit, rank)


def _join(threads: list[threading.Thread], start: float, limit: float, rank: int) -> None:
    told = False
    for t in threads:
        while t.is_alive():
            left = limit - (time.monotonic() - start)
            if left <= 0:
                names = ", ".join(repr(x.name) for x in threads if x.is_alive())
                sys.stderr.write(f"spark-dl: rank {rank} exits without waiting more for the threads main left running "
                                 f"({names}): they ran {limit:g} s after main returned (SPARK_DL_THREAD_WAIT)\n")
                return
            t.join(min(left, THREAD_NOTICE_S) if not told else left)
            if t.is_alive() and not told:
                told = True
                names = ", ".join(repr(x.name) for x in threads if x.is_alive())
                sys.stderr.write(f"spark-dl: rank {rank}'s main returned; waiting, as python does, for the threads it "
                                 f"left running: {names} (at most {limit:g} s in all, SPARK_DL_THREAD_WAIT; a thread "
                                 "started with daemon=True is not waited for)\n")
                sys.stderr.flush()


def _flush_open_files() -> None:
    """Flush the files user code left open, as the interpreter's teardown would (os._exit skips it):
    a log file a script opened at module level keeps its last writes."""
    import gc
    import io

    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if type(obj) in kinds:  # type(), not isinstance: ABC checks on arbitrary objects have side effects
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken pipe or a full disk: as python, exit regardless
                pass


# the calls into main (or the script) are ours: rank/main.py and rank/script.py
_CALLERS = (__file__, os.path.join(os.path.dirname(__file__), "script.py"))


def _error_info(exc: BaseException) -> dict:
    try:
        message = str(exc)
    except Exception as e:  # noqa: BLE001 - an exception whose __str__ fails is still reported
        message = f"<str() of the {type(exc).__name__} failed: {type(e).__name__}: {e}>"
    tb_top = exc.__traceback__
    while tb_top is not None and tb_top.tb_next is not None and tb_top.tb_frame.f_code.co_filename in _CALLERS:
        tb_top = tb_top.tb_next  # the calls into main (or the script) are ours: the user's frames start below
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, tb_top))
    except Exception:  # noqa: BLE001 - as above: the frames without the message
        tb = "".join(traceback.format_tb(tb_top)) + f"{type(exc).__name__}: {message}\n"
    try:
        import cloudpickle

        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # only ship it if the driver will be able to rebuild it
        str(pickle.loads(pickled))  # and print it
    except Exception:  # noqa: BLE001 - an unpicklable exception is still reported as text
        pickled = None
    if len(message) > protocol.MAX_ERROR_TEXT:
        pickled = None  # its text would be the huge one again
    return {
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": protocol.clip_error_text(message),
        "traceback": protocol.clip_error_text(tb),
        "pickled": pickled,
    }


def _flush_std() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # its reader, the task, is gone; or main closed it
            pass


def _say(text: str) -> None:
    """To stderr, for the task to pass on; a failure to write it does not stop the report."""
    try:
        sys.stderr.write(text)
    except (OSError, ValueError):
        pass
    _flush_std()


def _exit_fork() -> None:
    """End a process forked inside main as Python would have ended it, without touching the
    rank's link to the driver (its sender thread was not forked: a send would wait for ever)."""
    error = sys.exc_info()[1]
    code = 0
    if isinstance(error, SystemExit):
        if isinstance(error.code, int):
            code = error.code
        elif error.code is not None:
            print(error.code, file=sys.stderr)
            code = 1
    elif error is not None:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(task_pid: int | None = None) -> int:
    _die_with_parent(int(sys.argv[2]), task_pid)
    try:  # prewarm while the rendezvous runs; main() almost always imports it
        import torch.distributed  # noqa: F401
    except ImportError:
        pass
    else:
        works.keep_destroyed_groups()
    import cloudpickle

    from spark_dl.errors import ResultNotPicklable
    from spark_dl.rank import context as rank_api
    from spark_dl.rank.script import ExitStatus
    from spark_dl.tracking.rank import lifecycle as tracking
    from spark_dl.transport import channel

    boot = pickle.load(sys.stdin.buffer)  # written by our parent task over a private pipe
    sys.stdin.close()
    sys.stdin = open(os.devnull)
    os.environ.update(boot["env"])
    from spark_dl.rank import allocator

    allocator.tune()  # before main allocates anything large
    from spark_dl.compat.horovod_imports import install_in_rank

    install_in_rank()  # before the payload is unpickled: it may name horovod.torch
    if "torch" in sys.modules:  # imported before OMP_NUM_THREADS was known
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    r = boot["rank"]

    conn = channel.connect(boot["driver_host"], boot["driver_port"], boot["secret"])
    conn.send(protocol.HELLO, {"role": "rank", "rank": r, "pid": os.getpid()})
    outbox = rank_api._install(conn)
    tracking.install(boot["tracking"])
    finishing = threading.Event()
    threading.Thread(target=_watch_driver, args=(conn, finishing), name="spark-dl-watchdog", daemon=True).start()
    from spark_dl.rank.progress import Reporter

    reporter = Reporter(outbox.put, boot.get("progress_s") or 0.0)  # the stall inspector's input, and a heartbeat
    if boot.get("progress_s"):
        reporter.start()

    code = 0
    me = os.getpid()
    try:
        thread_wait_s = _thread_wait_s()  # a bad value fails the rank now, not after main's work
        fn, args, kwargs = cloudpickle.loads(boot["payload"])
        try:
            try:
                result = fn(*args, **kwargs)
            finally:
                if os.getpid() != me:  # a child main forked (os.fork) left main: it is not the rank
                    _exit_fork()
                works.release_groups()  # main's frame, and the DDP models in it, are gone
        except SystemExit as e:
            if e.code not in (None, 0):
                raise ExitStatus(f"main called sys.exit({e.code!r})", e.code) from None
            result = None
            _wait_for_threads(r, thread_wait_s)
        else:
            _wait_for_threads(r, thread_wait_s)
        finally:
            tracking.finish()  # before the error goes out: the driver stops this rank once it has it
        if boot["want_result"]:
            try:
                blob = cloudpickle.dumps(result)
            except Exception as e:  # noqa: BLE001
                raise ResultNotPicklable(
                    f"rank {r}'s return value ({type(result).__name__}) cannot be pickled: {e}. "
                    "Return plain data (numbers, dicts, numpy arrays, a model's state_dict)."
                ) from None
            outbox.put(protocol.RESULT, pickle.PickleBuffer(blob))  # out of band: never copied into a frame
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the rank exits 1
        info = _error_info(e)
        if isinstance(e, ExitStatus):  # sys.exit(3): one line, as python says nothing but the status
            info["traceback"] = ""
            info["exit_code"] = e.exit_code
            _say(info["message"] + "\n")
        elif isinstance(e, ResultNotPicklable):  # its frames are spark-dl's and pickle's: the message says it all
            info["traceback"] = ""
            _say(f"{info['exc_type']}: {info['message']}\n")
        else:
            _say(info["traceback"])  # clipped, as the report is: its last lines travel with it
        outbox.put(protocol.ERROR, info)
        code = 1
    _flush_std()
    reporter.stop()
    finishing.set()
    outbox.flush(timeout=60)
    if code == 0:
        _destroy_process_group()
    conn.close()
    return code


def _exit(code: int) -> None:
    """Skip the interpreter's teardown: it costs seconds with torch loaded. What of it user code
    counts on still happens: main's threads were waited for (bounded, so a thread that never
    ends cannot keep the job alive for ever), exit handlers run, open files are flushed.

    The task kills what the rank leaves in its process group once the rank has exited. A task
    that died first cannot: a rank whose print met the dead task's closed pipe ended in an error
    before its parent-death signal or watchdog fired, and its children outlived the job."""
    atexit._run_exitfuncs()
    _flush_open_files()
    _flush_std()
    if _task_gone() or _readers_gone():
        _kill_own_group()
    os._exit(code)


def _run(task_pid: int | None = None) -> None:
    try:
        code = main(task_pid)
    except BaseException:  # noqa: BLE001 - before main's report could start, or the report failed (the task gone)
        try:
            traceback.print_exc()  # the task passes it on, as python's own exit would have printed it
        except Exception:  # noqa: BLE001
            pass
        code = 1
    _exit(code)


def run_forked(task_pid: int) -> None:
    """The rank's life in a process forked by the zygote (``spark_dl.task.zygote``)."""
    _run(task_pid)


if __name__ == "__main__":
    _run()
