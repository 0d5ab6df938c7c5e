"""Launch backends: how one attempt's ranks are started, watched and cancelled.

:class:`LocalLauncher` runs ``-np`` rank processes on the driver (``np < 0``); :class:`SparkLauncher`
one barrier stage on a classic SparkSession's cluster; :class:`ConnectLauncher` the same stage through
Spark Connect. A launcher only creates and stops processes: the controller decides.
"""
from __future__ import annotations

import sys
import threading
from functools import partial

from spark_dl.driver import cluster
from spark_dl.driver.monitor import ABORT_GRACE_S, JobMonitor
from spark_dl.driver.options import ELASTIC_SETTLE_S
from spark_dl.driver.shards import ShardSet
from spark_dl.driver.spark_errors import executor_lost_hint, missing_module_hint, spark_error_summary
from spark_dl.errors import LaunchRefused
from spark_dl.task.barrier import (
    RELAY_SCHEMA,
    STATUS_SCHEMA,
    JobSpec,
    arrow_barrier_task,
    barrier_task,
    free_port,
    range_barrier_task,
    run_task,
)
from spark_dl.task.layout import RankSpec
from spark_dl.task.relay import replay


class Launcher:
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


class LocalLauncher(Launcher):
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


class SparkLauncher(Launcher):
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
                per_task: int | None = None, min_np: int | None = None) -> "SparkLauncher":
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
        return (ConnectLauncher if connect else SparkLauncher)(session, np, per_task, data)

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
                self._error = ("the Spark barrier stage failed: " + summary + executor_lost_hint(summary, self.relay)
                               + missing_module_hint(summary))
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


class ConnectLauncher(SparkLauncher):
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


def make_launcher(np: int, data: ShardSet | None = None, wait_s: float | None = None,
                  per_task: int | None = None, min_np: int | None = None) -> Launcher:
    """The launcher for ``np`` ranks: local processes for ``np < 0``, else a checked Spark stage."""
    if np < 0:
        return LocalLauncher(-np)
    return SparkLauncher.prepare(np, data, wait_s, per_task, min_np)
