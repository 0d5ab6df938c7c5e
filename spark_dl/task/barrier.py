"""The task side of a run: start rank processes, rendezvous, pump their output to the driver.

The same code runs inside a Spark barrier task (one per executor slot) and, in local mode
(``np < 0``), in a thread on the driver. Rank processes are started before the rendezvous so the
interpreter start overlaps with it; they get their place in the world over stdin afterwards.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from spark_dl import protocol
from spark_dl.task import zygote
from spark_dl.task.layout import RankSpec, TaskInfo, compute_layout, omp_threads
from spark_dl.task.network import slow_reverse_lookup, socket_interface_env
from spark_dl.task.ports import free_port
from spark_dl.task.zygote import ForkedRank
from spark_dl.tracking.system import start_sampler
from spark_dl.transport import channel

KILL_GRACE_S = 2.0
_MAX_LINE = 64 * 1024
_LOG_BATCH = 512
_TRACEBACK_LINES = 40  # of a task's own error, sent to the driver
_STOP = object()


@dataclass(frozen=True)
class JobSpec:
    """What the driver hands every task: where to report, how to prove it, what to run."""

    job_id: str
    driver_host: str
    driver_port: int
    secret: bytes
    payload: bytes
    ranks_per_task: int
    want_all_results: bool
    tracking: bool = False  # ranks buffer and send metrics (the driver has an observer for them)
    system_metrics_s: float = 0.0  # executors sample CPU/memory/GPU this often; 0: not at all
    attempt: int = 0  # restarts so far (HorovodRunner's max_restarts)
    max_restarts: int = 0
    rank_env: dict[str, str] = field(default_factory=dict)  # HorovodRunner(env=...), set last
    task_nodes: bool = False  # each task is a "node" (TorchDistributor), not each host (Horovod)
    relay: bool = False  # barrier task 0 stands in for the driver (a client the executors cannot reach)
    # the driver's latest (blob, step, shard sizes), for the relay to serve
    relay_checkpoint: tuple[bytes, int | None, tuple[int, ...] | None] | None = None
    relay_observers: tuple = ()  # observers' stand-ins that answer the ranks' requests in the relay (for_relay())
    run_timeout: float | None = None  # enforced by the relay (the driver cannot see the ranks' output)
    silence_timeout: float = 0.0  # heartbeats both ways; this long without the driver's: stop the ranks
    progress_s: float = 0.0  # each rank reports where it is this often (the stall inspector); 0: never


# the result rows of a Spark Connect stage: each task's status; with a relay, task 0's spool too
STATUS_SCHEMA = "status string"
RELAY_SCHEMA = "status string, report binary"


PUMP_DRAIN_S = 10.0  # after a rank has exited, how long its output may take to drain


def _spawn_env(rank_env: dict[str, str]) -> dict[str, str]:
    """``HorovodRunner(env=...)`` as the rank process starts with it: variables Python, the loader
    or the allocator read at start-up (``PYTHONHASHSEED``, ``LD_PRELOAD``, ``MALLOC_*``) only work
    there; a ``PYTHONPATH`` goes before the Spark worker's own path (pyspark, ``--py-files``)."""
    env = dict(rank_env)
    worker_path = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (rank_env.get("PYTHONPATH"), worker_path) if p)
    return env


def _rank_process_env(spawn_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a rank process starts with (its place in the world comes later, over stdin)."""
    env = dict(os.environ)
    # the Spark worker's sys.path carries pyspark and files added with addPyFile / --py-files
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    # torch backs CPU allocations of 2 MB+ with transparent huge pages: a fresh 100 MB gradient
    # buffer then costs 50 page faults instead of 25,000 (about 5x faster to first touch). Read
    # once by torch, at its first large allocation, so it must be in the environment at spawn.
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    env.update(spawn_env or {})
    return env


def _start_rank_process(job_id: str, spawn_env: dict[str, str] | None = None) -> subprocess.Popen | ForkedRank:
    env = _rank_process_env(spawn_env)
    forked = zygote.fork_rank(env, job_id)  # from this process's warm interpreter, if one is ready
    if forked is not None:
        return forked
    return subprocess.Popen(
        [sys.executable, "-m", "spark_dl.rank.main", job_id, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # its own process group: one killpg ends it and its children
    )


def _start_zygote_during(procs: list, spawn_env: dict[str, str], ended: threading.Event) -> None:
    """Start this process's zygote once a run of fresh ranks has gone on for
    ``zygote.EARLY_START_S`` (the ranks' own imports are over by then), unless ``ended`` is set
    first: the run after a long one then forks its ranks at once instead of waiting for a zygote
    that only started when this run ended."""
    if all(isinstance(p, ForkedRank) for p in procs):
        return

    def later() -> None:
        if not ended.wait(zygote.EARLY_START_S):
            zygote.prepare(_rank_process_env(spawn_env))

    threading.Thread(target=later, name="spark-dl-zygote-early", daemon=True).start()


def _warn_if_names_are_slow(first: RankSpec, sender: "_Sender") -> None:
    """Tell the driver, in local rank 0's log, if this host's resolver keeps torch's store waiting."""
    warning = slow_reverse_lookup(first.master_addr, first.host)
    if warning is not None:
        sender.q.put((protocol.LOG, (first.rank, "log", warning)))  # shown at every driver_log_verbosity


def _signal_group(proc: subprocess.Popen | ForkedRank, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(procs: list[subprocess.Popen | ForkedRank], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM every rank's process group, then SIGKILL whatever is left after ``grace``."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(p, signal.SIGKILL)


class _Sender:
    """One thread sends everything this task reports, in order, batching log lines."""

    def __init__(self, conn: channel.Connection) -> None:
        self.conn = conn
        self.q: queue.Queue = queue.Queue()
        self.broken = False
        self.thread = threading.Thread(target=self._run, name="spark-dl-task-sender", daemon=True)
        self.thread.start()

    def _send(self, kind, data) -> None:
        if self.broken:
            return
        try:
            self.conn.send(kind, data)
        except OSError:
            self.broken = True

    def _run(self) -> None:
        pending = None
        while True:
            item = pending if pending is not None else self.q.get()
            pending = None
            if item is _STOP:
                return
            kind, data = item
            if kind != protocol.LOG:
                self._send(kind, data)
                continue
            batch = [data]
            while len(batch) < _LOG_BATCH:
                try:
                    nxt = self.q.get_nowait()
                except queue.Empty:
                    break
                if nxt is not _STOP and nxt[0] == "log":
                    batch.append(nxt[1])
                else:
                    pending = nxt
                    break
            self._send(protocol.LOG, batch)

    def stop(self) -> None:
        self.q.put(_STOP)
        self.thread.join()


def _task_error(e: BaseException, partition: int, host: str) -> protocol.TaskError:
    try:
        message = str(e)
        text = "".join(traceback.format_exception(e))
    except Exception as failed:  # noqa: BLE001 - an exception whose __str__ fails is still reported
        message = f"<str() of the {type(e).__name__} failed: {type(failed).__name__}: {failed}>"
        text = "".join(traceback.format_tb(e.__traceback__)) + f"{type(e).__name__}: {message}"
    return {"partition": partition, "host": host, "python": sys.executable, "exc_type": type(e).__name__,
            "message": protocol.clip_error_text(message),
            "traceback": protocol.clip_error_text("\n".join(text.splitlines()[-_TRACEBACK_LINES:]))}


def _pump(stream, rank: int, name: str, sender: _Sender) -> None:
    for raw in iter(lambda: stream.readline(_MAX_LINE), b""):
        sender.q.put((protocol.LOG, (rank, name, raw.decode("utf-8", "replace").rstrip("\r\n"))))
    stream.close()


Gather = Callable[[TaskInfo], "list[TaskInfo] | None"]


def run_task(spec: JobSpec, partition: int, host: str, rendezvous: Callable[[Gather], "list[RankSpec] | None"],
             extra_env: dict[str, str] | None = None) -> list[dict]:
    """Run this task's share of the job and report everything to the driver.

    ``rendezvous(gather)`` returns this task's ranks; ``gather(me)`` sends this task's
    :class:`TaskInfo` to the driver and returns every task's, once all have sent theirs (None: the
    driver ended the run first). Never raises for a rank's failure: the driver learns of it over
    the channel and decides, so Spark does not retry the stage on its own.
    """
    conn = channel.connect(spec.driver_host, spec.driver_port, spec.secret, relay=spec.relay)
    conn.send(protocol.HELLO, {"role": "task", "partition": partition, "host": host, "pid": os.getpid()})
    sender = _Sender(conn)
    spawn_env = _spawn_env(spec.rank_env)
    # filled once the watch and heartbeat threads run: a rank start can wait for a zygote still
    # importing (zygote.READY_WAIT_S), and a task that sent nothing meanwhile looked like a dead host
    procs: list[subprocess.Popen | ForkedRank] = []
    aborted = threading.Event()
    gathered: queue.Queue = queue.Queue()

    heard = [time.monotonic()]  # when the driver was last heard from

    def watch_driver() -> None:
        try:
            while True:
                kind, data = conn.recv()
                heard[0] = time.monotonic()
                if kind == protocol.TASKS:
                    gathered.put(data)
                elif kind == protocol.ABORT:
                    break
        except BaseException:  # noqa: BLE001 - a dead link means the driver is gone: stop the ranks
            pass
        gathered.put(None)  # a rendezvous still waiting ends: the run is over
        if not all_done.is_set():
            aborted.set()
            _terminate(procs)

    def gather(me: TaskInfo) -> list[TaskInfo] | None:
        # through the driver, not BarrierTaskContext.allGather: Spark's barrier calls poll for
        # their answer once a second, which made every launch a second slower
        conn.send(protocol.RENDEZVOUS, dataclasses.asdict(me))
        tasks = gathered.get()
        return None if tasks is None else [TaskInfo(**{**t, "gpus": tuple(t["gpus"])}) for t in tasks]

    def heartbeat() -> None:
        # a driver (or a link to it) that went silent sends no close either: after the bound, stop
        # the ranks as a closed link would, so nothing is left running on this host
        while not all_done.wait(spec.silence_timeout / 6):
            sender.q.put((protocol.HEARTBEAT, None))
            if time.monotonic() - heard[0] > spec.silence_timeout:
                gathered.put(None)
                aborted.set()
                _terminate(procs)
                conn.close()
                return

    all_done = threading.Event()
    threading.Thread(target=watch_driver, name="spark-dl-task-watch", daemon=True).start()
    if spec.silence_timeout > 0:
        threading.Thread(target=heartbeat, name="spark-dl-task-heartbeat", daemon=True).start()

    def stop() -> None:
        _terminate(procs, grace=0)
        all_done.set()
        sender.stop()
        conn.close()

    def report(e: BaseException) -> None:
        # before the link closes: without it the driver sees only a task that went away, and says
        # its executor died. Not once the driver has ended the run: then it is a consequence
        if not aborted.is_set():
            sender.q.put((protocol.TASK_ERROR, _task_error(e, partition, host)))

    try:
        for _ in range(spec.ranks_per_task):
            if aborted.is_set():  # the driver is gone: the rendezvous below ends the task
                break
            procs.append(_start_rank_process(spec.job_id, spawn_env))
        ranks = rendezvous(gather)
    except BaseException as e:
        report(e)
        stop()
        raise
    if ranks is None:  # the driver ended the run before every task had started
        stop()
        return []
    sender.q.put((protocol.LAYOUT, [{"rank": r.rank, "host": r.host, "local_rank": r.local_rank} for r in ranks]))
    sampler = start_sampler(
        host, [r.local_rank for r in ranks], lambda kind, data: sender.q.put((kind, data)), spec.system_metrics_s
    )

    statuses: list[dict] = []
    waiters = []
    ended = threading.Event()  # set once every rank has exited (or the task gave up on them)
    # the ranks' temporary files (unpacked checkpoints...) go here, so a rank killed mid-way leaves
    # nothing behind on the executor's disk: removed below, once every rank has exited
    scratch = tempfile.mkdtemp(prefix=f"{spec.job_id}-ranks-")
    try:
        # the interface of the address Spark reaches this executor by, not the hostname's (often loopback)
        interface = socket_interface_env(ranks[0].host, ranks[0].master_addr, os.environ, spawn_env) if ranks else {}
        first_on_host = [r for r in ranks if r.local_rank == 0]  # one task a host looks
        if first_on_host:
            threading.Thread(target=_warn_if_names_are_slow, args=(first_on_host[0], sender),
                             name="spark-dl-names", daemon=True).start()
        for proc, r in zip(procs, ranks):
            env = {**r.env(), **interface}
            env[protocol.JOB_ID_ENV] = spec.job_id
            env[protocol.SCRATCH_ENV] = scratch
            env[protocol.ATTEMPT_ENV] = str(spec.attempt)
            env[protocol.TASK_PID_ENV] = str(os.getpid())
            env["TORCHELASTIC_RUN_ID"] = spec.job_id
            env["TORCHELASTIC_RESTART_COUNT"] = str(spec.attempt)
            env["TORCHELASTIC_MAX_RESTARTS"] = str(spec.max_restarts)
            env.update(extra_env or {})
            env.update(spawn_env)
            if env.get("CUDA_VISIBLE_DEVICES") == "":  # GPUs hidden on purpose: no device index either
                env.pop(protocol.CUDA_DEVICE_ENV, None)
            env.setdefault("OMP_NUM_THREADS",
                           os.environ.get("OMP_NUM_THREADS") or omp_threads(r.host_size or r.local_size))
            # torch no longer waits for every rank at the end of init_process_group: a rank whose main
            # returns right after it can close its sockets while a peer is still connecting to it, and
            # that peer fails with Gloo's "Connection closed by peer". A store barrier (a few ms) fixes it.
            env.setdefault("TORCH_DIST_INIT_BARRIER", os.environ.get("TORCH_DIST_INIT_BARRIER") or "1")
            boot = {
                "rank": r.rank,
                "env": env,
                "payload": spec.payload,
                "driver_host": spec.driver_host,
                "driver_port": spec.driver_port,
                "secret": spec.secret,
                "want_result": r.rank == 0 or spec.want_all_results,
                "tracking": spec.tracking,
                "progress_s": spec.progress_s,
            }
            try:
                proc.stdin.write(pickle.dumps(boot, protocol=pickle.HIGHEST_PROTOCOL))
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass  # the rank died at start-up; its exit code and stderr tell the driver why
            pumps = [
                threading.Thread(target=_pump, args=(proc.stdout, r.rank, "stdout", sender), daemon=True),
                threading.Thread(target=_pump, args=(proc.stderr, r.rank, "stderr", sender), daemon=True),
            ]
            for t in pumps:
                t.start()
            waiters.append((proc, r, pumps))

        _start_zygote_during(procs, spawn_env, ended)
        for proc, r, pumps in waiters:
            code = proc.wait()
            # children the rank left behind die with it, first: one that inherited its stdout or
            # stderr (a helper started with Popen) would keep the pipe, and this wait, open
            _signal_group(proc, signal.SIGKILL)
            for t in pumps:
                t.join(PUMP_DRAIN_S)  # a child that left the group (setsid) may hold the pipe for ever
            status = {"rank": r.rank, "code": code, "host": r.host, "aborted": aborted.is_set()}
            statuses.append(status)
            sender.q.put((protocol.EXIT, status))
    except BaseException as e:
        report(e)
        if sampler is not None:
            sampler.stop()
        stop()
        raise
    finally:
        ended.set()
        shutil.rmtree(scratch, ignore_errors=True)
    if sampler is not None:
        sampler.stop()
    if not aborted.is_set():
        zygote.prepare(_rank_process_env(spawn_env))  # warm for this process's next run
    all_done.set()
    sender.stop()
    conn.close()
    return statuses


def _in_barrier_task(spec: JobSpec, extra_env: dict[str, str] | None = None):
    """Run this barrier task's ranks: rendezvous with the other tasks through the driver.
    Returns the ranks' statuses and, in task 0 of a relayed run, its finished :class:`Relay`."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    zygote.share_within(os.getppid())  # the executor's Python daemon: its workers share one zygote
    partition = ctx.partitionId()
    host = ctx.getTaskInfos()[partition].address.rsplit(":", 1)[0]
    gpu = ctx.resources().get("gpu")
    gpus = tuple(gpu.addresses) if gpu is not None else ()

    def rendezvous(gather: Gather) -> list[RankSpec] | None:
        tasks = gather(TaskInfo(partition=partition, host=host, gpus=gpus, port=free_port()))
        return None if tasks is None else compute_layout(tasks, spec.ranks_per_task, spec.task_nodes)[partition]

    relay = None
    if spec.relay:
        spec, relay = _join_relay(ctx, spec, partition, host)
    try:
        statuses = run_task(spec, partition, host, rendezvous, extra_env)
    except BaseException:
        if relay is not None:
            relay.discard()
        raise
    if relay is not None:
        relay.finish()
    return statuses, relay


def _join_relay(ctx, spec: JobSpec, partition: int, host: str):
    """Task 0 starts the relay; every task learns its address and reports there instead."""
    from spark_dl.task.relay import Relay

    relay = None
    if partition == 0:
        n = len(ctx.getTaskInfos())
        relay = Relay(spec.secret, spec.job_id, n * spec.ranks_per_task, n, host, spec.relay_checkpoint,
                      spec.run_timeout, spec.relay_observers)
    try:
        addresses = ctx.allGather(json.dumps(relay.address if relay is not None else None))
    except BaseException:
        if relay is not None:
            relay.discard()
        raise
    relay_host, relay_port = json.loads(addresses[0])
    return dataclasses.replace(spec, driver_host=relay_host, driver_port=relay_port, relay_checkpoint=None,
                               relay_observers=()), relay


def _result_batches(spec: JobSpec, statuses: list[dict], relay):
    import pyarrow as pa

    if not spec.relay:
        yield pa.RecordBatch.from_pylist([{"status": json.dumps(statuses)}])
        return
    schema = pa.schema([("status", pa.string()), ("report", pa.binary())])
    yield pa.RecordBatch.from_pylist([{"status": json.dumps(statuses), "report": None}], schema=schema)
    if relay is not None:
        for chunk in relay.chunks():
            yield pa.RecordBatch.from_pylist([{"status": None, "report": chunk}], schema=schema)


def barrier_task(spec: JobSpec, _partition_rows) -> list:
    """``mapPartitions`` body of the barrier stage."""
    statuses, _ = _in_barrier_task(spec)
    return [json.dumps(statuses)]


def range_barrier_task(spec: JobSpec, batches):
    """``mapInArrow`` body of the barrier stage over ``spark.range(num_tasks)`` (Spark Connect,
    which has no RDDs): the rows only give each task its partition."""
    for _ in batches:
        pass
    yield from _result_batches(spec, *_in_barrier_task(spec))


def arrow_barrier_task(spec: JobSpec, schemas, batches):
    """``mapInArrow`` body of the barrier stage of a run that trains on DataFrames: this
    partition's rows go to local Arrow files (one per DataFrame) that this task's rank reads."""
    import shutil
    import tempfile

    from spark_dl.task.partitions import write_partitions

    directory = tempfile.mkdtemp(prefix=f"{spec.job_id}-")
    try:
        write_partitions(batches, directory, schemas)
        statuses, relay = _in_barrier_task(spec, {protocol.SHARD_ENV: directory})
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    yield from _result_batches(spec, statuses, relay)
