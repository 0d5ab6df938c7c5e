"""``HorovodRunner``: run one training function on ``np`` ranks, in a Spark barrier stage or locally."""
from __future__ import annotations

import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, TextIO

from spark_dl.transport import channel
from spark_dl.driver import cluster
from spark_dl.rank.checkpoint import CheckpointStore
from spark_dl.driver.shards import DataFrameShards, ShardSet
from spark_dl.driver.monitor import ABORT_GRACE_S, VERBOSITIES, Failure, JobMonitor, Observer, notify, run_timeout_message
from spark_dl.errors import JobFailed, LaunchRefused, as_int, in_range
from spark_dl.task.layout import RankSpec
from spark_dl.task.relay import replay
from spark_dl.task.barrier import (
    RELAY_SCHEMA, STATUS_SCHEMA, JobSpec, arrow_barrier_task, barrier_task, free_port, range_barrier_task, run_task,
)
from spark_dl.rank.script import Script, read_script
from spark_dl.driver.serialize import serialize_job
from spark_dl.tracking.driver.observer import Tracking, TrackingObserver, make_observer
from spark_dl import protocol

@dataclass(frozen=True)
class RunInfo:
    """What :attr:`HorovodRunner.last_run` says of the latest ``run()``, whether it succeeded or raised."""

    job_id: str
    attempts: int  # launches: 1 + restarts + grows
    failures: tuple[JobFailed, ...]  # the failed attempts' errors, oldest first (the raised one last)
    mlflow_run_id: str | None  # the MLflow run it logged to (None without tracking)
    seconds: float
    world_sizes: tuple[int, ...] = ()  # ranks of each attempt (they differ with min_np)
    grows: int = 0  # healthy attempts stopped at a checkpoint to run on more ranks (grow_interval)

    @property
    def succeeded(self) -> bool:
        return len(self.failures) + self.grows < self.attempts


@dataclass(frozen=True)
class _Grow:
    """An attempt's outcome that is not a failure: stopped at a checkpoint to run on more ranks."""

    world_size: int


START_TIMEOUT_S = 300.0
ELASTIC_SETTLE_S = 5.0  # min_np: how long a restart waits for all np slots before taking fewer
NODES = ("hosts", "tasks")


class HorovodRunner:
    """Run a training function on ``np`` ranks with one ``torch.distributed`` process group.

    Args:
        np: number of rank processes. ``np > 0`` runs them in one Spark barrier stage on the
            active SparkSession's cluster; ``np < 0`` runs ``-np`` processes on the driver
            (no Spark needed), for debugging.
        driver_log_verbosity: ``"log_callback_only"`` (default) shows only what ranks send with
            :func:`spark_dl.log_to_driver`; ``"all"`` also streams every rank's stdout/stderr.
        start_timeout: seconds to wait for all barrier tasks to start before failing (tasks wait
            for free slots when other jobs hold them).
        tracking: MLflow tracking of the run (see the README's "Tracking with MLflow"): on by default when
            mlflow is importable; ``False`` (or env ``SPARK_DL_TRACKING=0``) turns it off; a
            :class:`spark_dl.tracking.Tracking` sets its options.
        progress: the driver's progress bar (step, loss, throughput of rank 0); ``False`` hides it.
        max_restarts: how many times a failed run is launched again (every rank, fresh processes)
            before its error is raised; ranks resume from :func:`spark_dl.load_checkpoint`.
        run_timeout: seconds an attempt may run, from its launch, before every rank is stopped and
            it fails with :class:`spark_dl.JobFailed` (a hung collective; retried with
            ``max_restarts``). None (default): no limit.
        checkpoint_dir: a directory on the driver where rank 0's latest checkpoint is kept after
            ``run()`` returns; a later run given the same directory resumes from it (a job
            retried by its scheduler, a notebook re-run). None: a temporary one per ``run()``.
        env: environment variables set in every rank process (``{"NCCL_DEBUG": "INFO"}``), on top
            of the executor's; the variables spark-dl sets itself (``RANK``, ``MASTER_ADDR``, ...)
            are refused.
        min_np: let an attempt run with fewer ranks, down to ``min_np``, when fewer task slots are
            free (an executor lost and not replaced, slots held by other jobs): each attempt takes
            as many as are free, up to ``np``; a restart first waits a few seconds for them
            (classic sessions only: Spark Connect cannot show free slots). None: always ``np``.
        grow_interval: with ``min_np``, seconds between looks for free task slots while an attempt
            runs on fewer than ``np`` ranks; when there are, the attempt is stopped at rank 0's next
            :func:`spark_dl.save_checkpoint` (``hvd.elastic``'s ``commit()``, Ray's
            ``train.report(checkpoint=...)``) and launched again on more ranks from it, not
            counted against ``max_restarts``. None (default): a run grows only when it restarts.
        nodes: what a "node" is for ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK`` and the GPUs a
            rank sees: ``"hosts"`` (default, Horovod's local ranks) or ``"tasks"`` (one torchrun-style
            node per Spark task, as PySpark's TorchDistributor: each task sees only its own GPUs).

    The signature matches Databricks' ``sparkdl.HorovodRunner``, so notebooks switch by
    changing one import.
    """

    def __init__(
        self,
        *,
        np: int,
        driver_log_verbosity: str = "log_callback_only",
        start_timeout: float = START_TIMEOUT_S,
        tracking: bool | Tracking | None = None,
        progress: bool | None = None,
        max_restarts: int = 0,
        checkpoint_dir: str | os.PathLike | None = None,
        run_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        nodes: str = "hosts",
        min_np: int | None = None,
        grow_interval: float | None = None,
    ) -> None:
        if as_int(np) is None:
            raise LaunchRefused(f"np must be an int (ranks on Spark if > 0, local processes if < 0), got {np!r}")
        np = as_int(np)
        if np == 0:
            raise LaunchRefused(
                "np=0 (on Databricks, deprecated there: every task slot of the cluster) is not taken: use np=N "
                "(> 0) for N ranks on the Spark cluster, e.g. np=spark.sparkContext.defaultParallelism for every "
                "task slot, or np=-N for N local processes on the driver"
            )
        if driver_log_verbosity not in VERBOSITIES:
            raise LaunchRefused(f"driver_log_verbosity must be one of {VERBOSITIES}, got {driver_log_verbosity!r}")
        self.np = np
        if as_int(max_restarts) is None or max_restarts < 0:
            raise LaunchRefused(
                f"max_restarts must be an int >= 0 (how many times a failed run is launched again), got {max_restarts!r}"
            )
        self.max_restarts = as_int(max_restarts)
        if min_np is not None:
            if as_int(min_np) is None or not 1 <= min_np <= abs(np):
                raise LaunchRefused(f"min_np must be an int from 1 to np={np} (the fewest ranks an attempt may run "
                                    f"with), got {min_np!r}")
            if np < 0:
                raise LaunchRefused(f"min_np={min_np} with np={np}: local processes always start all {-np}; "
                                    "min_np applies to runs on Spark (np > 0)")
        self.min_np = None if min_np is None else as_int(min_np)
        if grow_interval is not None and min_np is None:
            raise LaunchRefused(f"grow_interval={grow_interval!r} needs min_np: without it every attempt runs all "
                                f"np={np} ranks and has nothing to grow into; set min_np (the fewest ranks to start with)")
        self.grow_interval = None if grow_interval is None else _seconds("grow_interval", grow_interval,
                                                                          "growing only at restarts")
        self._grow_wait = self.grow_interval or 0.0  # doubled after each grow that got no more ranks
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise LaunchRefused(f"checkpoint_dir must be a path (str or os.PathLike), got {checkpoint_dir!r}")
        self.checkpoint_dir = checkpoint_dir
        self.driver_log_verbosity = driver_log_verbosity
        self.start_timeout = _seconds("start_timeout", start_timeout)
        self.run_timeout = None if run_timeout is None else _seconds("run_timeout", run_timeout, "no limit")
        self.env = _rank_env(env)
        if nodes not in NODES:
            raise LaunchRefused(f"nodes must be one of {NODES} (what LOCAL_RANK counts within), got {nodes!r}")
        self.nodes = nodes
        if tracking is not None and not isinstance(tracking, (bool, Tracking)):
            raise LaunchRefused(f"tracking must be True, False, None or spark_dl.tracking.Tracking(...), got {tracking!r} "
                                f"({type(tracking).__name__})")
        if progress is not None and not isinstance(progress, bool):
            raise LaunchRefused(f"progress must be True, False or None, got {progress!r}")
        self.tracking = tracking
        self.progress = progress
        self.observers: list[Observer] = []
        self._ranks_per_task: int | None = None  # None: one per GPU a task gets (TorchDistributor sets 1)
        self._out: TextIO | None = None  # where rank output goes (horovod.spark.run's stdout/stderr)
        self._err: TextIO | None = None
        self.last_run: RunInfo | None = None  # set by every run(), run_all() and run_script()

    def run(self, main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``main(*args, **kwargs)`` on every rank; return rank 0's return value.

        Raises :class:`spark_dl.RankFailed` (with the rank, host, remote traceback and last output
        lines) if any rank fails; the other ranks are stopped first.
        """
        return self._run(main, kwargs, all_results=False, args=args)

    def run_all(self, main: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, but return every rank's return value, in rank order."""
        return self._run(main, kwargs, all_results=True, args=args)

    def run_script(self, path: str | os.PathLike, *args: str) -> None:
        """Run a training script on every rank, as ``python path *args`` would.

        The script's source is read here and shipped with the job. A script that raises or
        exits with a non-zero status fails the run with :class:`spark_dl.RankFailed`.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise LaunchRefused(f"run_script takes the script's path (str or os.PathLike), got {path!r}")
        bad = [a for a in args if not isinstance(a, (str, os.PathLike))]
        if bad:
            hint = ": unpack it, run_script(path, *args)" if isinstance(bad[0], (list, tuple)) else \
                f": pass its text, e.g. {str(bad[0])!r}"
            raise LaunchRefused(f"run_script's arguments are the script's command line, so each must be a str (or "
                                f"os.PathLike); got {type(bad[0]).__name__} {bad[0]!r}{hint}")
        full, source = read_script(path)
        self._run(Script(full, source), {"script": full, "argv": [os.fspath(a) for a in args]}, all_results=False)

    # ------------------------------------------------------------------------------------------
    def _run(self, main: Callable[..., Any], kwargs: dict[str, Any], all_results: bool,
             args: tuple[Any, ...] = ()) -> Any:
        if any(isinstance(a, DataFrameShards) for a in args):
            raise LaunchRefused("pass spark_dl.data.shards(df) as a keyword argument (run(main, data=shards(df))), "
                                "not a positional one: its name is how main receives its rows")
        kwargs, data = _take_dataframe(kwargs, self.np)
        payload = serialize_job(main, kwargs, args)
        launcher = self._launcher(data)
        job_id = f"spark-dl-{uuid.uuid4().hex[:12]}"
        self._grow_wait = self.grow_interval or 0.0
        started = time.monotonic()
        attempt = 0
        sizes = [launcher.world_size]
        store = CheckpointStore(self.checkpoint_dir, job_id)
        try:
            if store.from_earlier_run():
                sys.stderr.write(f"[spark-dl] resuming from {self.checkpoint_dir}: {store.describe()}\n")
                sys.stderr.flush()
            tracker = make_observer(self.tracking, self.progress)
            observers = [*self.observers, *([tracker] if tracker is not None else [])]
            job = {
                "job_id": job_id,
                "np": self.np,
                "mode": "local" if self.np < 0 else "spark",
                "world_size": launcher.world_size,
                "num_tasks": launcher.num_tasks,
                "ranks_per_task": launcher.ranks_per_task,
                "main": getattr(main, "__qualname__", repr(main)),
                "kwargs": dict(kwargs),
                "args": tuple(args),
            }
            for o in observers:
                o.on_start(job)
        except BaseException:  # e.g. MLflow unreachable: the run that follows the fix needs checkpoint_dir free
            store.close()
            raise
        earlier: list[JobFailed] = []
        grows = 0
        outcome: BaseException | None = None
        monitor: JobMonitor | None = None
        try:
            while True:
                attempt_id = job_id if attempt == 0 else f"{job_id}-restart{attempt}"
                monitor, ended = self._attempt(
                    launcher, attempt_id, attempt, payload, all_results, tracker, observers, store
                )
                attempt += 1
                if isinstance(ended, _Grow):
                    grows += 1
                    launcher = self._grow(data, attempt, ended, store, observers, sizes[-1])
                elif ended is None or len(earlier) == self.max_restarts:
                    outcome = ended
                    break
                else:
                    earlier.append(ended)
                    launcher = self._relaunch(data, attempt, len(earlier), ended, store, observers, sizes[-1])
                sizes.append(launcher.world_size)
            if outcome is None:
                try:  # a result that never came fails the run: the MLflow run and last_run say so too
                    value = ([monitor.result(r) for r in range(launcher.world_size)] if all_results
                             else monitor.result(0))
                except JobFailed as e:
                    outcome = e
        except BaseException as e:  # what the observers (the MLflow run) are told; e itself propagates
            outcome = e if isinstance(e, JobFailed) else JobFailed(_driver_failure(e))
            raise
        finally:
            store.close()
            if earlier and isinstance(outcome, JobFailed):
                _note_earlier_failures(outcome, earlier, self.max_restarts)
            for o in observers:
                o.on_finish(outcome)
            failed = [*earlier, *([outcome] if isinstance(outcome, JobFailed) else [])]
            writer = tracker.writer if tracker is not None else None
            self.last_run = RunInfo(job_id, len(sizes), tuple(failed), writer.run_id if writer is not None else None,
                                    time.monotonic() - started, tuple(sizes), grows)
        if outcome is not None:
            raise outcome
        return value

    def _launcher(self, data: ShardSet | None, wait_s: float | None = None, low: int | None = None) -> "_Launcher":
        if self.np < 0:
            return _LocalLauncher(-self.np)
        return _SparkLauncher.prepare(self.np, data, wait_s, self._ranks_per_task, low or self.min_np)

    def _attempt(
        self, launcher: "_Launcher", job_id: str, attempt: int, payload: bytes, all_results: bool,
        tracker: TrackingObserver | None, observers: list[Observer], store: CheckpointStore,
    ) -> tuple[JobMonitor, JobFailed | _Grow | None]:
        """Launch the job once and wait until every rank is gone; returns the failure, if any, or
        the size to grow to."""
        secret = channel.new_secret()
        monitor = JobMonitor(
            world_size=launcher.world_size,
            num_tasks=launcher.num_tasks,
            verbosity=self.driver_log_verbosity,
            on_failure=lambda f: threading.Thread(target=abort, args=(f,), daemon=True).start(),
            observers=observers,
            out=self._out,
            err=self._err,
            checkpoints=store,
        )
        server = channel.ControlServer(secret, monitor.on_message, monitor.on_close, host=launcher.bind_host)

        def abort(_: Failure) -> None:
            for conn in server.connections():
                if conn.info.get("role") == "task":
                    try:
                        conn.send(protocol.ABORT)
                    except OSError:
                        pass
            launcher.cancel()

        relayed, relay_observers = None, ()
        if launcher.relay:
            if store.info is not None:  # the relay serves load_checkpoint() from it
                relayed = (store.load(), store.info.step, store.info.shards)
            # and answers the ranks' requests as these observers would on the driver
            relay_observers = tuple(o.for_relay() for o in observers if hasattr(o, "for_relay"))
        spec = JobSpec(
            job_id=job_id,
            driver_host=launcher.driver_host,
            driver_port=server.port,
            secret=secret,
            payload=payload,
            ranks_per_task=launcher.ranks_per_task,
            want_all_results=all_results,
            tracking=tracker is not None,
            system_metrics_s=tracker.system_metrics_s if tracker is not None else 0.0,
            attempt=attempt,
            max_restarts=self.max_restarts,
            rank_env=dict(self.env),
            task_nodes=self.nodes == "tasks",
            relay=launcher.relay,
            relay_checkpoint=relayed,
            relay_observers=relay_observers,
            run_timeout=self.run_timeout if launcher.relay else None,
        )
        try:
            launcher.start(spec, monitor)
            self._wait(monitor, launcher)
        except BaseException as e:  # Ctrl-C, or a failure on the driver itself: stop every rank first
            monitor.fail(Failure(None, _driver_failure(e)))
            self._finish(monitor, launcher, server)
            raise
        return monitor, self._finish(monitor, launcher, server)

    def _relaunch(
        self, data: ShardSet | None, attempt: int, restart: int, error: JobFailed, store: CheckpointStore,
        observers: list[Observer], last_size: int,
    ) -> "_Launcher":
        """Say why and how the run restarts, then prepare the next attempt's launch."""
        sys.stderr.write(f"[spark-dl] attempt {attempt} of {self.max_restarts + 1} failed: {_first_line(error)}\n"
                         if attempt == restart else f"[spark-dl] attempt {attempt} failed: {_first_line(error)}\n")
        sys.stderr.flush()
        store.attempt = attempt
        notify(observers, "on_restart", restart, error)
        launcher = self._launch_again(data, observers, last_size, error,
                                      f"restart {restart} of max_restarts={self.max_restarts} could not be launched")
        n = launcher.world_size
        ranks = f"all {n} ranks" if n == abs(self.np) else f"{n} of np={self.np} ranks (the free task slots; min_np={self.min_np})"
        sys.stderr.write(f"[spark-dl] restarting {ranks} (restart {restart} of max_restarts={self.max_restarts}); "
                         f"{store.describe()}\n")
        sys.stderr.flush()
        return launcher

    def _grow(
        self, data: ShardSet | None, attempt: int, grow: _Grow, store: CheckpointStore,
        observers: list[Observer], last_size: int,
    ) -> "_Launcher":
        """Launch a healthy attempt stopped at a checkpoint again, on the free slots (at least as
        many ranks as it had: its own slots are free now)."""
        store.attempt = attempt
        notify(observers, "on_grow", attempt, grow.world_size)
        launcher = self._launch_again(data, observers, last_size, None,
                                      f"growing the run to {grow.world_size} ranks failed: it could not be launched again",
                                      low=last_size)
        n = launcher.world_size
        ranks = f"all {n} ranks" if n == abs(self.np) else f"{n} of np={self.np} ranks"
        if n <= last_size:  # the slots were taken meanwhile: look less often, so this cannot repeat every interval
            self._grow_wait *= 2
            ranks += f" (the free slots were taken meanwhile; the next look is in {self._grow_wait:g} s)"
        sys.stderr.write(f"[spark-dl] growing from {last_size} to {ranks} (not a restart: max_restarts is untouched); "
                         f"{store.describe()}\n")
        sys.stderr.flush()
        return launcher

    def _launch_again(self, data: ShardSet | None, observers: list[Observer], last_size: int,
                      cause: BaseException | None, failed: str, low: int | None = None) -> "_Launcher":
        """The next attempt's launcher; a lost executor may still be replaced, so it waits for
        slots as long as a start may take. ``failed`` leads the error when it cannot be launched."""
        try:
            launcher = self._launcher(data, wait_s=self.start_timeout, low=low)
        except Exception as e:  # noqa: BLE001 - the cluster or the data changed since the first launch
            why = str(e) if isinstance(e, LaunchRefused) else spark_error_summary(e)
            raise JobFailed(f"{failed}: {why}") from (cause or e)
        if launcher.world_size != last_size:
            notify(observers, "on_resize", launcher.world_size)
        return launcher

    def _finish(self, monitor: JobMonitor, launcher: "_Launcher",
                server: channel.ControlServer) -> JobFailed | _Grow | None:
        """Wait for every rank to be gone, close the channel; the attempt's error, if it failed."""
        self._drain(monitor, launcher)
        server.close()
        f = monitor.failure
        if f is None:
            return None
        if f.grow_to is not None:
            return None if monitor.succeeded() else _Grow(f.grow_to)
        return monitor.error()

    def _wait(self, monitor: JobMonitor, launcher: "_Launcher") -> None:
        started = time.monotonic()
        grows = self.grow_interval is not None and launcher.world_size < self.np
        next_look = started + self._grow_wait
        while monitor.failure is None:
            if grows and time.monotonic() >= next_look:
                next_look = time.monotonic() + self._grow_wait
                self._look_for_slots(monitor, launcher)
            if monitor.all_exited() and launcher.finished():
                monitor.settle()  # every rank is gone: a failure held for its root cause is final
                return
            launcher_error = launcher.error()
            if launcher_error is not None:
                monitor.fail(Failure(None, launcher_error))
                return
            tasks_started = launcher.tasks_started(monitor)
            if tasks_started < launcher.num_tasks and time.monotonic() - started > self.start_timeout:
                monitor.fail(Failure(None, launcher.start_timeout_message(tasks_started, self.start_timeout)))
                return
            if (self.run_timeout is not None
                    and time.monotonic() - started > self.run_timeout + launcher.run_timeout_slack):
                monitor.fail(Failure(None, run_timeout_message(self.run_timeout, monitor)))
                return
            monitor.wait(0.2)

    def _look_for_slots(self, monitor: JobMonitor, launcher: "_Launcher") -> None:
        """Arm (or disarm) the stop at rank 0's next checkpoint, by the task slots free now."""
        if launcher.tasks_started(monitor) < launcher.num_tasks:
            return  # tasks still waiting for slots would count as free ones
        target = launcher.grow_target(self.np)
        if target == monitor.grow_to:
            return
        monitor.grow_to = target
        if target is not None:
            sys.stderr.write(f"[spark-dl] task slots for {target - launcher.world_size} more ranks are free: the run "
                             f"grows to {target} ranks at rank 0's next checkpoint\n")
            sys.stderr.flush()

    @staticmethod
    def _drain(monitor: JobMonitor, launcher: "_Launcher") -> None:
        """After a failure, wait (bounded) until every task has reaped its ranks and the Spark job is over."""
        if monitor.failure is None:
            return
        deadline = time.monotonic() + ABORT_GRACE_S
        while time.monotonic() < deadline and not (monitor.tasks_gone() and launcher.finished()):
            monitor.wait(0.1)


class _Launcher:
    world_size: int
    num_tasks: int
    ranks_per_task: int = 1
    bind_host: str
    driver_host: str
    relay = False  # barrier task 0 stands in for this process (see launch/relay.py)
    run_timeout_slack = 0.0  # the relay enforces run_timeout; the driver's check is the backstop

    def tasks_started(self, monitor: JobMonitor) -> int:
        return monitor.tasks_started

    def start(self, spec: JobSpec, monitor: JobMonitor) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def finished(self) -> bool:
        raise NotImplementedError

    def error(self) -> str | None:
        raise NotImplementedError

    def start_timeout_message(self, started: int, timeout: float) -> str:
        raise NotImplementedError

    def grow_target(self, np: int) -> int | None:
        """How many ranks the free task slots would let this run have, if more than now."""
        return None


class _LocalLauncher(_Launcher):
    """``np < 0``: ``-np`` rank processes on the driver, each watched by a thread playing the task."""

    bind_host = "127.0.0.1"
    driver_host = "127.0.0.1"

    def __init__(self, n: int) -> None:
        self.world_size = self.num_tasks = n
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []
        self._done = 0  # task threads past their last step: the wait loop wakes to see it
        self._done_lock = threading.Lock()

    def start(self, spec: JobSpec, monitor: JobMonitor) -> None:
        port = free_port()
        n = self.world_size
        for r in range(n):
            rs = RankSpec(
                rank=r, world_size=n, local_rank=r, local_size=n, cross_rank=0, cross_size=1,
                host="localhost", master_addr="127.0.0.1", master_port=port, partition=r,
            )
            t = threading.Thread(target=self._task, args=(spec, rs, monitor), name=f"spark-dl-local-{r}", daemon=True)
            t.start()
            self._threads.append(t)

    def _task(self, spec: JobSpec, rs: RankSpec, monitor: JobMonitor) -> None:
        try:
            run_task(spec, rs.partition, rs.host, lambda _: [rs])
        except Exception as e:  # noqa: BLE001 - surfaced by the wait loop
            self._errors.append(f"local task for rank {rs.rank} failed: {type(e).__name__}: {e}")
        finally:
            with self._done_lock:
                self._done += 1
            monitor.poke()

    def cancel(self) -> None:
        pass  # the abort message to each task thread stops its rank

    def finished(self) -> bool:
        # counted, not is_alive(): a thread's poke wakes the wait loop before the thread has ended,
        # which then slept another poll interval
        with self._done_lock:
            return self._done == len(self._threads)

    def error(self) -> str | None:
        return self._errors[0] if self._errors else None

    def start_timeout_message(self, started: int, timeout: float) -> str:
        return f"only {started} of {self.num_tasks} local rank processes started within {timeout:.0f} s"


class _SparkLauncher(_Launcher):
    """``np > 0``: one Spark barrier stage of ``np / ranks_per_task`` tasks."""

    bind_host = "0.0.0.0"

    def __init__(self, session, np: int, ranks_per_task: int, data: ShardSet | None = None) -> None:
        self.session = session
        self.data = data
        self.world_size = np
        self.ranks_per_task = ranks_per_task
        self.num_tasks = np // ranks_per_task
        # the tasks call back to this process there (with Spark Connect: a client on the driver's host)
        self.driver_host = cluster.conf(session, "spark.driver.host")
        self.job_group = ""
        self._thread: threading.Thread | None = None
        self._over = threading.Event()  # the stage's thread is past its last step (see finished)
        self._error: str | None = None
        self._cancelled = False

    @staticmethod
    def prepare(np: int, data: ShardSet | None = None, wait_s: float | None = None,
                per_task: int | None = None, min_np: int | None = None) -> "_SparkLauncher":
        """Check the cluster and build the launcher; ``wait_s``: wait that long for enough task
        slots (a restart, while a lost executor is replaced) instead of refusing at once;
        ``per_task``: ranks per task (default: one per GPU a task gets); ``min_np``: launch as
        many ranks as there are free slots for, from ``min_np`` to ``np``."""
        session = cluster.active_session(np)
        connect = cluster.is_connect(session)
        cluster.check_dynamic_allocation(session)
        if per_task is None:
            per_task = cluster.ranks_per_task(session)
        if min_np is not None:
            if connect:
                raise LaunchRefused(
                    f"min_np={min_np}: Spark Connect cannot show how many task slots are free, so every attempt "
                    f"runs np={np} ranks; leave min_np unset (or use a classic SparkSession)"
                )
            settle = ELASTIC_SETTLE_S if wait_s is not None else 0.0  # a restart: let the failed stage's slots free
            np = cluster.elastic_size(session.sparkContext, min_np, np, per_task, settle)
        if np % per_task:
            raise LaunchRefused(
                f"np={np} is not a multiple of spark.task.resource.gpu.amount={per_task} "
                f"(one rank per GPU, {per_task} GPUs per task): use np={np - np % per_task or per_task}"
            )
        if connect:
            cluster.check_declared_slots(session, np, np // per_task)
        elif wait_s is None:
            cluster.check_slots(session.sparkContext, np, np // per_task)
        else:
            cluster.check_slots(session.sparkContext, np, np // per_task, wait_s=wait_s, wait_for_new=True)
        if data is not None:
            if per_task > 1:
                raise LaunchRefused(
                    "training on a DataFrame needs one rank per task; with several GPUs per task, "
                    "set spark.task.resource.gpu.amount=1"
                )
            data.check_rows(np)
        return (_ConnectLauncher if connect else _SparkLauncher)(session, np, per_task, data)

    def start(self, spec: JobSpec, monitor: JobMonitor) -> None:
        from pyspark import InheritableThread

        self.job_group = spec.job_id
        # the stage's thread keeps this one's job properties (Spark Connect: its operation tags)
        connect = {"session": self.session} if cluster.is_connect(self.session) else {}
        self._thread = InheritableThread(
            target=self._run_stage, args=(spec, monitor), name="spark-dl-stage", daemon=True, **connect
        )
        self._thread.start()

    def _run_stage(self, spec: JobSpec, monitor: JobMonitor) -> None:
        try:
            self._collect(spec, monitor)
        except Exception as e:  # noqa: BLE001 - reported by the wait loop, unless we cancelled it
            if not self._cancelled:
                summary = spark_error_summary(e)
                self._error = "the Spark barrier stage failed: " + summary + executor_lost_hint(summary, self.relay)
        finally:
            self._over.set()
            monitor.poke()

    def _collect(self, spec: JobSpec, monitor: JobMonitor) -> None:
        sc = self.session.sparkContext
        sc.setJobGroup(spec.job_id, f"spark-dl: {self.world_size} ranks", interruptOnCancel=True)
        if self.data is None:
            rdd = sc.parallelize(range(self.num_tasks), self.num_tasks)
            rdd.barrier().mapPartitions(partial(barrier_task, spec)).collect()
        else:
            self._collect_shards(spec)

    def _collect_shards(self, spec: JobSpec) -> list:
        # each task's partition holds its share of the rows, as Arrow batches
        assert self.data is not None
        df = self.data.dataframe().repartition(self.num_tasks)
        task = partial(arrow_barrier_task, spec, self.data.schemas())
        return df.mapInArrow(task, RELAY_SCHEMA if spec.relay else STATUS_SCHEMA, barrier=True).collect()

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self.session.sparkContext.cancelJobGroup(self.job_group)
        except Exception:  # noqa: BLE001 - a stopped context has nothing left to cancel
            pass

    def finished(self) -> bool:
        return self._over.is_set()

    def error(self) -> str | None:
        return self._error

    def grow_target(self, np: int) -> int | None:
        try:
            free = cluster.slots(self.session.sparkContext).free
        except Exception:  # noqa: BLE001 - a context going away: the wait loop learns of it from the stage
            return None
        target = min(np, self.world_size + free * self.ranks_per_task)
        target -= target % self.ranks_per_task
        return target if target > self.world_size else None

    def start_timeout_message(self, started: int, timeout: float) -> str:
        s = cluster.slots(self.session.sparkContext)
        return (
            f"only {started} of {self.num_tasks} barrier tasks started within {timeout:.0f} s: the cluster has "
            f"{s.total} task slots, {s.busy} busy with other jobs. Free slots, lower np, or raise start_timeout."
        )


class _ConnectLauncher(_SparkLauncher):
    """The barrier stage through Spark Connect: a DataFrame's ``mapInArrow(barrier=True)``, the
    job tagged so that it can be interrupted. Where the executors cannot connect back to this
    client (``cluster.channel_mode``), barrier task 0 relays the run and returns what it received
    with the stage's result; the server's progress reports say when the tasks have started."""

    def __init__(self, session, np: int, ranks_per_task: int, data: ShardSet | None = None) -> None:
        super().__init__(session, np, ranks_per_task, data)
        self.relay = cluster.channel_mode(session) == "relay"
        self.run_timeout_slack = ABORT_GRACE_S + 15.0 if self.relay else 0.0
        self._running = 0  # most tasks the server has reported running at once (relayed runs)
        self._progress = False  # whether the server reports progress at all

    def start(self, spec: JobSpec, monitor: JobMonitor) -> None:
        if self.relay and spec.attempt == 0:
            why = (f"{cluster.CHANNEL_ENV}=relay" if cluster.channel_setting() == "relay" else
                   f"spark.driver.host={self.driver_host} is another machine")
            sys.stderr.write(
                f"[spark-dl] the executors report to barrier task 0, not to this client ({why}): the ranks' "
                "output, metrics and result arrive when the run ends\n"
            )
            sys.stderr.flush()
        super().start(spec, monitor)

    def _collect(self, spec: JobSpec, monitor: JobMonitor) -> None:
        self.session.addTag(self._tag)  # tags are per thread: this one runs the stage
        if self.relay:
            self.session.registerProgressHandler(self._on_progress)
        try:
            if self.data is None:
                df = self.session.range(0, self.num_tasks, 1, self.num_tasks)
                schema = RELAY_SCHEMA if self.relay else STATUS_SCHEMA
                rows = df.mapInArrow(partial(range_barrier_task, spec), schema, barrier=True).collect()
            else:
                rows = self._collect_shards(spec)
        finally:
            self.session.removeTag(self._tag)
            if self.relay:
                self.session.removeProgressHandler(self._on_progress)
        if self.relay:
            replay((r["report"] for r in rows if r["report"] is not None), monitor)

    def _on_progress(self, stages, inflight_tasks: int, operation_id, done: bool) -> None:
        # the handler sees every operation of the session, on the thread that runs it
        if threading.current_thread() is self._thread:
            self._progress = True
            self._running = max(self._running, inflight_tasks)

    def tasks_started(self, monitor: JobMonitor) -> int:
        if not self.relay:
            return monitor.tasks_started
        # a server that sends no progress reports cannot be watched: run_timeout is then the limit
        return max(self._running, monitor.tasks_started) if self._progress else self.num_tasks

    @property
    def _tag(self) -> str:
        return f"spark-dl-{self.job_group}"

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self.session.interruptTag(self._tag)
        except Exception:  # noqa: BLE001 - a closed session has nothing left to interrupt
            pass

    def start_timeout_message(self, started: int, timeout: float) -> str:
        total = cluster.declared_slots(self.session)
        slots = (f"its settings declare {total} task slots" if total is not None
                 else "Spark Connect cannot say how many task slots it has")
        channel_note = (
            "" if self.relay else
            f" The tasks call back to this Python process at {self.driver_host} (spark.driver.host): a Spark "
            "Connect client off the driver's host must set SPARK_DL_CHANNEL=relay."
        )
        return (
            f"only {started} of {self.num_tasks} barrier tasks started within {timeout:.0f} s: {slots}, and "
            f"other jobs may hold some.{channel_note} Free slots, lower np, or raise start_timeout."
        )


def _seconds(name: str, value: Any, unset: str = "") -> float:
    """``value`` as seconds: a finite number > 0 (numpy's included; ``inf``, ``nan``, bools and text
    refused, as the runners' ``--run-timeout``/``--start-timeout`` refuse them). ``unset``: what
    None means for ``name``, said in the refusal."""
    if not in_range(value, low=0, low_open=True):
        raise LaunchRefused(f"{name} must be a number of seconds > 0, got {value!r}: pass a finite one such as "
                            f"{_SECONDS_EXAMPLE.get(name, 60)}{f', or None for {unset}' if unset else ''}")
    return float(value)


_SECONDS_EXAMPLE = {"start_timeout": 300, "run_timeout": 3600, "grow_interval": 60}


def _rank_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env=`` checked: string names and values that the OS accepts, none of spark-dl's own."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise LaunchRefused(f"env must be a dict of environment variables (str -> str), got {type(env).__name__}")
    out: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise LaunchRefused(f"env: {key!r} is not an environment variable name (a non-empty str without '=')")
        if not isinstance(value, str) or "\0" in value:
            raise LaunchRefused(
                f"env[{key!r}] must be a str without NUL characters, got {value!r} ({type(value).__name__}): "
                f"write env={{{key!r}: {str(value)!r}}}"
            )
        if key in protocol.RESERVED_ENV:
            raise LaunchRefused(
                f"env sets {key}, which spark-dl sets in every rank itself (its place in the world or the run's "
                f"plumbing); remove it. Variables spark-dl sets: {', '.join(sorted(protocol.RESERVED_ENV))}"
            )
        out[key] = value
    return out


def _driver_failure(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted on the driver (KeyboardInterrupt)"
    return f"the driver failed: {type(e).__name__}: {e}"


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else type(e).__name__


def _note_earlier_failures(error: JobFailed, earlier: list[JobFailed], max_restarts: int) -> None:
    """Say on the final error that the run was restarted, and why each earlier attempt failed."""
    error.previous_failures = tuple(earlier)
    lines = [f"spark-dl restarted this run {len(earlier)} time(s) (max_restarts={max_restarts}); the attempts "
             "before failed with:"]
    for i, e in enumerate(earlier, 1):
        lines.append(f"  attempt {i}: {type(e).__name__}: {_first_line(e)}")
    error.add_note("\n".join(lines))


def _take_dataframe(kwargs: dict[str, Any], np: int) -> tuple[dict[str, Any], ShardSet | None]:
    """Swap each :func:`spark_dl.data.shards` kwarg for what its rank reads."""
    found = {k: v for k, v in kwargs.items() if isinstance(v, DataFrameShards)}
    if not found:
        return kwargs, None
    if np < 0:
        raise LaunchRefused(
            "training on a DataFrame reads each rank's rows in its Spark task: use np > 0 "
            f"(np=-{-np} runs local processes that have no partitions to read)"
        )
    if len({id(v) for v in found.values()}) < len(found):
        raise LaunchRefused(f"kwargs {sorted(found)} pass the same shards(df) twice: call shards() once per kwarg")
    data = ShardSet(found)
    return {**kwargs, **{k: v.spec for k, v in found.items()}}, data


def executor_lost_hint(summary: str, relayed: bool) -> str:
    """What to do about a stage that failed because an executor JVM went away ("" for other failures)."""
    if "ExecutorLostFailure" not in summary:
        return ""
    hint = "\nAn executor was lost during the run"
    # Standalone says "exited with code 137", YARN "Exit status: 137" or "killed by YARN for exceeding ... memory"
    if re.search(r"exit(?:ed)? (?:with )?(?:code|status):? 137\b|exceeding .*memory", summary, re.IGNORECASE):
        hint += (" (exit code 137: killed with SIGKILL, usually by the OS or the cluster manager for using more "
                 "memory than the executor's container was given; the ranks' memory counts against it: raise "
                 "spark.executor.memoryOverhead, or lower the batch size)")
    if relayed:
        hint += ("; Spark does not rerun a failed barrier stage, and barrier task 0 relayed this attempt, so what "
                 "it held (output, metrics, checkpoints saved in it) is lost")
    return hint + (". Restarts launch the run again after such a loss: HorovodRunner(max_restarts=N), "
                   "TorchDistributor(max_restarts=N), TorchTrainer's FailureConfig(max_failures=N).")


def spark_error_summary(e: BaseException, max_lines: int = 30) -> str:
    """The useful part of a Py4J error: the Python traceback from the executor, or the first lines."""
    # Py4J prefixes "An error occurred while calling o43.isEmpty.\n: " to the Java exception
    text = re.sub(r"^An error occurred while calling [\w.]+\.\s*\n?:?\s*", "", str(e))
    text = text.split("\nJVM stacktrace:")[0]  # Spark Connect appends the server's Java stack
    start = text.rfind("Traceback (most recent call last)")
    if start >= 0:
        lines = []
        for line in text[start:].splitlines():
            if line.startswith("\tat ") or line.startswith("\tat"):
                break
            lines.append(line)
        return "\n".join(lines[-max_lines:])
    return "\n".join([line for line in text.strip().splitlines() if not line.startswith("\tat")][:5])
