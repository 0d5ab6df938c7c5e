"""The driver's view of a running job: what every task and rank reported, and the first failure.

Fed by the control server's reader threads; read by the runner's wait loop. Log lines are shown
(tagged with their rank) or kept, per ``driver_log_verbosity``, and the last lines of every rank are
kept to attach to its error.
"""
from __future__ import annotations

import re
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TextIO

import cloudpickle

from spark_dl import protocol
from spark_dl.driver.checkpoint_store import CheckpointStore
from spark_dl.driver.spark_errors import missing_module_hint
from spark_dl.driver.stalls import Stall, StallInspector, format_stacks
from spark_dl.errors import JobFailed, RankFailed, RankStalled
from spark_dl.transport import unpickle
from spark_dl.transport.channel import Connection, send_reply

TAIL_LINES = 50
ABORT_GRACE_S = 15.0  # after a failure, how long every task gets to reap its ranks and close its link
VERBOSITIES = ("all", "log_callback_only")
# A rank whose collective broke because a peer went away reports that first, often before the
# peer's own exit or error reaches the driver. Such an error waits this long for the root cause.
CONSEQUENCE_GRACE_S = 2.0
PEER_LOST = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote process exited|communicator was aborted"
    r"|NCCL Error \d+: remote|Socket Timeout",
    re.IGNORECASE,
)


class Observer(Protocol):
    """Receives what ranks report, on the driver (the tracking layer implements it).

    ``on_start`` runs before anything is launched, ``on_message`` for every message kind the
    launcher itself does not handle (metrics, params, models, system metrics...), ``on_log`` for
    every output line, and ``on_finish`` once, after every rank has exited, with the error that
    ``run`` is about to raise (None on success). Callbacks run on channel threads: keep them cheap.
    An observer may also define ``on_restart(restart, error)``, called on the driver's thread
    before a failed attempt is launched again as restart number ``restart``
    (``HorovodRunner(max_restarts=...)``),
    ``on_checkpoint(blob, step)``, called once rank 0's checkpoint (the pickled state) is stored
    (not for sharded ones: no one blob holds their state),
    ``on_grow(attempt, world_size)``, called before a healthy attempt stopped at a checkpoint is
    launched again on more ranks (``HorovodRunner(grow_interval=...)``), and
    ``on_resize(world_size)``, called before any relaunch that runs another number of ranks
    (``HorovodRunner(min_np=...)``), and ``on_request(rank, kind, data)``, which answers a rank's
    ``spark_dl.rank.request("request/...", data)`` with a dict (None: not its request).
    """

    def on_start(self, job: dict) -> None: ...

    def on_message(self, rank: int, kind: str, data: Any) -> None: ...

    def on_log(self, rank: int, stream: str, line: str) -> None: ...

    def on_finish(self, error: BaseException | None) -> None: ...


def notify(observers: list[Observer], hook: str, *args: Any) -> None:
    """Call the optional ``hook`` (``on_checkpoint``, ``on_restart``, ``on_grow``, ``on_resize``) of each
    observer that has it."""
    for o in observers:
        method = getattr(o, hook, None)
        if method is not None:
            method(*args)


_unwritable: "weakref.WeakSet[TextIO]" = weakref.WeakSet()  # streams that failed once: said once, then skipped


def _write(target: TextIO, text: str) -> None:
    """Print a rank's line on the driver: characters the stream cannot encode escaped; a stream
    that cannot be written at all (closed) said once on the real stderr, then skipped: the run,
    and the lines' copy in the failure report, go on."""
    try:
        if target in _unwritable:
            return
    except TypeError:  # a stream that takes no weak reference: tried every time
        pass
    try:
        try:
            target.write(text)
        except UnicodeEncodeError:
            encoding = getattr(target, "encoding", None) or "ascii"
            target.write(text.encode(encoding, "backslashreplace").decode(encoding))
        target.flush()
    except (OSError, ValueError) as e:
        try:
            _unwritable.add(target)
        except TypeError:
            pass
        print(f"[spark-dl] cannot print the ranks' output on {target!r} ({type(e).__name__}: {e}); "
              "it is no longer shown there", file=sys.__stderr__, flush=True)


@dataclass
class Failure:
    rank: int | None
    summary: str
    info: dict | None = None
    grow_to: int | None = None  # not a failure: a healthy attempt stopped at a checkpoint to run on more ranks
    # seen by the driver itself (a silent task): what the rank reports afterwards is a consequence
    observed: bool = False
    stacks: dict[int, str] | None = None  # every rank's, asked for before the ranks were stopped
    stall: Stall | None = None  # a stall past stall_timeout


def _task_failure(e: protocol.TaskError) -> str:
    head = f"{e['exc_type']}: {e['message']}"
    return (f"barrier task {e['partition']} on {e['host']} failed: {head}"
            f"{missing_module_hint(head, e['python'])}\n\nThe task's traceback (its last lines):\n{e['traceback']}")


class JobMonitor:
    def __init__(
        self,
        world_size: int,
        num_tasks: int,
        verbosity: str,
        on_failure: Callable[[Failure], None],
        observers: list[Observer] | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        checkpoints: "CheckpointStore | None" = None,
        stalls: StallInspector | None = None,
    ) -> None:
        self.world_size = world_size
        self.num_tasks = num_tasks
        self.verbosity = verbosity
        self._on_failure = on_failure
        self.observers = list(observers or [])
        self._out = out
        self._err = err
        self.checkpoints = checkpoints
        self.stalls = stalls
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.task_conns: dict[int, Connection] = {}
        self.tasks_closed = 0
        self.ranks_connected: set[int] = set()
        self.ranks_closed: set[int] = set()
        self.hosts: dict[int, str] = {}
        self.task_ranks: dict[int, list[int]] = {}
        self.task_infos: dict[int, tuple[Connection, dict]] = {}  # the rendezvous: partition -> (link, TaskInfo)
        self._gathered = False
        self.exits: dict[int, dict] = {}
        self.results: dict[int, bytes] = {}
        self.errors: dict[int, dict] = {}
        self.failure: Failure | None = None
        # set by the runner while more task slots are free: rank 0's next checkpoint stops the attempt
        self.grow_to: int | None = None
        self._pending: Failure | None = None  # a consequence, waiting CONSEQUENCE_GRACE_S for its cause
        self.tails: dict[int, deque[str]] = {}
        self._print_lock = threading.Lock()

    # -- state -------------------------------------------------------------------------------
    @property
    def tasks_started(self) -> int:
        with self.lock:
            return len(self.task_conns)

    def tasks_gone(self) -> bool:
        """Every task and rank that connected has closed its link, and everything it sent has
        been handled (a task closes its link after reaping its ranks)."""
        with self.lock:
            silent = [c for c in self.task_conns.values() if c.info.get("silent") and not c.info.get("closed")]
            return (self.tasks_closed + len(silent) >= len(self.task_conns)
                    and self.ranks_closed >= self.ranks_connected - self._ranks_of(silent))

    def _ranks_of(self, conns: list[Connection]) -> set[int]:
        partitions = {c.info.get("partition") for c in conns}
        return {r for p, ranks in self.task_ranks.items() if p in partitions for r in ranks}

    def all_exited(self) -> bool:
        """Every rank has exited, and the ones that succeeded have had all their messages (the
        result among them) handled: results and exit codes travel on different links."""
        with self.lock:
            if len(self.exits) < self.world_size:
                return False
            return all(e["code"] != 0 or r in self.ranks_closed for r, e in self.exits.items())

    def fail(self, failure: Failure, final: bool = False) -> None:
        """Record the first failure and start the abort; later failures are consequences.

        A rank's error that only says a peer went away ("Connection closed by peer") is held for
        up to ``CONSEQUENCE_GRACE_S``: if the peer's own exit, error or lost task arrives in that
        time, that is the failure reported, not the symptom. ``final``: a failure already decided
        (by a relay), never held.
        """
        with self.changed:
            if self.failure is not None:
                return
            if not final and self._is_consequence(failure):
                if self._pending is None:
                    self._pending = failure
                    timer = threading.Timer(CONSEQUENCE_GRACE_S, self.settle)
                    timer.daemon = True
                    timer.start()
                return
            self.failure = failure
            self.changed.notify_all()
        self._on_failure(failure)

    def settle(self) -> None:
        """No root cause came: the held failure (if any) is the failure."""
        with self.changed:
            failure = self._pending
            if self.failure is not None or failure is None:
                return
            self.failure = failure
            self.changed.notify_all()
        self._on_failure(failure)

    def _is_consequence(self, failure: Failure) -> bool:
        if failure.rank is None:
            return False
        if failure.info is not None:
            return bool(PEER_LOST.search(str(failure.info.get("message", ""))))
        return failure.rank in self.errors  # the exit of a rank that has already reported its error

    def poke(self) -> None:
        """Wake the runner's wait loop: something it polls (the Spark job) has changed."""
        with self.changed:
            self.changed.notify_all()

    def wait(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    # -- control server callbacks ----------------------------------------------------------------
    def on_message(self, conn: Connection, kind: str, data: Any) -> None:
        if kind == protocol.HEARTBEAT:
            return
        if kind in (protocol.PROGRESS, protocol.STACKS):
            if self.stalls is not None:
                take = self.stalls.on_progress if kind == protocol.PROGRESS else self.stalls.on_stacks
                take(conn.info["rank"], data)
            return
        if kind == protocol.LOG:
            for rank, stream, line in data:
                self._line(rank, stream, line)
            return
        if kind == protocol.HELLO:
            conn.info.update(data)
            if data["role"] == "task":
                conn.info["connected"] = time.monotonic()
                with self.changed:
                    self.task_conns[data["partition"]] = conn
                    self.changed.notify_all()
            else:
                with self.lock:
                    self.ranks_connected.add(data["rank"])
            return
        if kind == protocol.RENDEZVOUS:
            self._rendezvous(conn, data)
            return
        if kind == protocol.TASK_ERROR:
            self.fail(Failure(None, _task_failure(data)))
            return
        rank = conn.info.get("rank")
        if kind == protocol.USER_LOG:
            self._line(rank, "log", data)
        elif kind == protocol.LAYOUT:
            with self.changed:
                self.task_ranks[conn.info["partition"]] = [r["rank"] for r in data]
                for r in data:
                    self.hosts[r["rank"]] = r["host"]
                self.changed.notify_all()
        elif kind == protocol.EXIT:
            with self.changed:
                self.exits[data["rank"]] = data
                self.changed.notify_all()
            if data["code"] != 0 and not data["aborted"]:
                self.fail(Failure(data["rank"], f"exited with code {data['code']}{_signal_name(data['code'])}"))
        elif kind == protocol.RESULT:
            with self.changed:
                self.results[rank] = data
                self.changed.notify_all()
        elif kind == protocol.ERROR:
            with self.changed:
                self.errors[rank] = data
                self.changed.notify_all()
            self.fail(Failure(rank, f"{data['exc_type']}: {data['message']}", data))
        elif kind.startswith(protocol.CHECKPOINT_PREFIX) and self.checkpoints is not None:
            if self.checkpoints.handle(conn, rank, kind, data) and kind == protocol.CHECKPOINT_SAVE:
                # a checkpoint just became the latest (a sharded save's: with its last shard)
                if not data.get("sharded"):
                    notify(self.observers, "on_checkpoint", data["blob"], data.get("step"))
                grow_to = self.grow_to
                # the relaunch resumes from the state just stored, so little is redone; never while
                # a rank's error waits for its cause (that failure must count against max_restarts)
                if grow_to is not None and self._pending is None and not self.errors:
                    self.fail(Failure(None, f"stopped at rank 0's checkpoint to restart on {grow_to} ranks",
                                      grow_to=grow_to), final=True)
        elif kind.startswith(protocol.REQUEST_PREFIX):
            self._serve_request(conn, rank, kind, data)
        else:
            for o in self.observers:
                o.on_message(rank, kind, data)

    def _rendezvous(self, conn: Connection, info: dict) -> None:
        """A task's description; once every task has sent its own, each gets all of them, in
        partition order (what ``BarrierTaskContext.allGather`` returns, without its 1 s polls)."""
        with self.changed:
            self.task_infos[conn.info["partition"]] = (conn, info)
            if len(self.task_infos) < self.num_tasks or self._gathered:
                return
            self._gathered = True
            gathered = [self.task_infos[p] for p in sorted(self.task_infos)]
        infos = [i for _, i in gathered]
        for c, _ in gathered:
            try:
                c.send(protocol.TASKS, infos)
            except OSError:
                pass  # that task is gone: its closed link tells the wait loop

    def _serve_request(self, conn: Connection, rank: int | None, kind: str, data: dict) -> None:
        """A rank's ``rank.request("request/...")``: the first observer whose ``on_request``
        answers (not None) makes the reply; its exception becomes the rank's error."""
        reply: dict[str, Any] = {"id": data.get("id")}
        try:
            for o in self.observers:
                handler = getattr(o, "on_request", None)
                answer = handler(rank, kind, data) if handler is not None else None
                if answer is not None:
                    reply.update(answer)
                    break
            else:
                reply["error"] = f"nothing on the driver serves {kind!r} in this run"
        except Exception as e:  # noqa: BLE001 - the rank raises it, with this text
            reply["error"] = f"{type(e).__name__}: {e}"
        send_reply(conn, reply)

    def done_ranks(self) -> set[int]:
        """Ranks that returned, failed or exited: no longer expected in a collective."""
        with self.lock:
            return set(self.exits) | set(self.results) | set(self.errors) | self.ranks_closed

    def on_close(self, conn: Connection, error: BaseException | None) -> None:
        conn.info["closed"] = True
        if conn.info.get("role") == "rank":
            with self.changed:
                self.ranks_closed.add(conn.info["rank"])
                self.changed.notify_all()
        if conn.info.get("role") != "task":
            return
        partition = conn.info["partition"]
        with self.changed:
            self.tasks_closed += 1
            self.changed.notify_all()
            ranks = self.task_ranks.get(partition)
            missing = [r for r in (ranks or []) if r not in self.exits]
            done = ranks is not None and not missing
        if done or self.failure is not None:
            return
        who = f"rank {missing[0]}" if missing else f"barrier task {partition}"
        host = conn.info.get("host", "?")
        why = f" ({type(error).__name__}: {error})" if error else ""
        self.fail(
            Failure(
                missing[0] if missing else None,
                f"lost contact with the task running {who} on {host}{why}: its Spark task or "
                "executor died (see the executor's log for why, e.g. out of memory)",
            )
        )

    # -- output --------------------------------------------------------------------------------
    def _line(self, rank: int, stream: str, line: str) -> None:
        tagged = f"[{rank}]<{stream}>: {line}"
        with self.lock:
            tail = self.tails.get(rank)
            if tail is None:
                tail = self.tails[rank] = deque(maxlen=TAIL_LINES)
            tail.append(tagged)
        for o in self.observers:
            o.on_log(rank, stream, line)
        if self.verbosity == "all" or stream == "log":
            target = (self._err or sys.stderr) if stream == "stderr" else (self._out or sys.stdout)
            with self._print_lock:
                _write(target, tagged + "\n")

    # -- outcome -------------------------------------------------------------------------------
    def succeeded(self) -> bool:
        """Every rank returned (exit code 0, its messages handled): an attempt stopped to grow may
        have finished before the stop reached it (a stopped rank is killed, never exits with 0)."""
        with self.lock:
            return len(self.exits) >= self.world_size and all(
                e["code"] == 0 and r in self.ranks_closed for r, e in self.exits.items())

    def error(self) -> JobFailed:
        """The error to raise for the recorded failure."""
        f = self.failure
        assert f is not None
        shown = format_stacks(f.stacks, self.hosts) if f.stacks else ""
        if f.stall is not None:
            return RankStalled(f.summary, f.stall.waiting, f.stall.culprits, f.stacks, shown)
        if f.rank is None:
            err = JobFailed(f"{f.summary}\n\nEvery rank's stack:\n{shown}" if shown else f.summary)
            err.stacks = dict(f.stacks or {})
            return err
        info = f.info or (None if f.observed else self.errors.get(f.rank))
        host = self.hosts.get(f.rank, "?")
        tail = list(self.tails.get(f.rank, ()))
        code = self.exits.get(f.rank, {}).get("code")
        if info is None:
            err = RankFailed(f.rank, host, f.summary, "", tail, code,
                             hint=f"Every rank's stack:\n{shown}" if shown else "")
            err.stacks = dict(f.stacks or {})
            return err
        if code is None or code < 0:  # a rank that reported its error exits 1 (the abort may kill it first)
            code = 1
        summary = f"{info['exc_type']}: {info['message']}"
        if info.get("exit_code") is not None:  # main or the script called sys.exit(N): its status, no traceback
            code, summary = info["exit_code"], info["message"]
        if info["traceback"]:
            tail = _without_traceback(tail, f.rank, info["traceback"])  # the rank printed what the report holds
        else:  # the rank printed one line, the summary's
            tail = [line for line in tail if line != f"[{f.rank}]<stderr>: {summary}"]
        err = RankFailed(f.rank, host, summary, info["traceback"], tail, code, info["exc_type"],
                         self._left_early_hint(f.rank, summary))
        if info.get("pickled") is not None:
            try:
                err.__cause__ = cloudpickle.loads(info["pickled"])
            except Exception:  # noqa: BLE001 - the text is already in the error
                pass
        return err

    def _left_early_hint(self, rank: int, summary: str) -> str:
        """Why a peer was lost when it was not lost at all: it returned from main while this rank
        was still in a collective."""
        done = sorted(r for r, e in self.exits.items() if e.get("code") == 0 and r != rank)
        if not done or not PEER_LOST.search(summary):
            return ""
        who = f"rank {done[0]}" if len(done) == 1 else "ranks " + ", ".join(map(str, done))
        return (f"{who} had already returned from main (exit code 0) while rank {rank} was still in a collective: "
                "the ranks did not issue the same collectives. One ran more steps than another (uneven data: "
                "give every rank the same number of batches, or use hvd.join()), or their order or shapes differed; "
                "rerun with HorovodRunner(env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}) and torch names the first "
                "mismatched collective on every rank.")

    def result(self, rank: int) -> Any:
        blob = self.results.get(rank)
        if blob is None:
            raise JobFailed(f"rank {rank} finished without sending its return value: its process ended with status 0 "
                            "before main returned (os._exit(0) in main or in a script?)")
        try:
            return unpickle.loads(blob, unpickle.driver_device)  # a GPU rank's tensors on a CPU driver: CPU
        except Exception as e:  # noqa: BLE001
            raise JobFailed(
                f"rank {rank}'s return value could not be unpickled on the driver ({type(e).__name__}: {e}); "
                "return types the driver can import (plain data, numpy, torch tensors)."
            ) from e


def _signal_name(code: int) -> str:
    if code >= 0:
        return ""
    import signal

    try:
        return f" (killed by {signal.Signals(-code).name})"
    except ValueError:
        return ""


def _without_traceback(tail: list[str], rank: int, tb: str) -> list[str]:
    """``tail`` less the traceback the rank wrote to stderr as it failed (the error shows it once).

    Matched from the end, as the rank writes it last; stdout lines between are kept (the two
    streams interleave), and any other stderr line ends the match."""
    expected = [f"[{rank}]<stderr>: {line}" for line in tb.rstrip("\n").split("\n")]
    drop = set()
    j = len(expected) - 1
    for i in range(len(tail) - 1, -1, -1):
        if j < 0:
            break
        if tail[i] == expected[j]:
            drop.add(i)
            j -= 1
        elif tail[i].startswith(f"[{rank}]<stderr>: "):
            break
    return [line for i, line in enumerate(tail) if i not in drop]
