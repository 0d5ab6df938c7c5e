"""One ``run()`` call, attempt by attempt: launch, wait, then restart, grow or finish.

Each attempt ends in one explicit outcome: :class:`Succeeded` (every rank exited cleanly),
:class:`Failed` (a rank or the launch failed; restarted while ``max_restarts`` allows) or
:class:`Grow` (a healthy attempt stopped at rank 0's checkpoint to relaunch on more free task
slots, not counted as a restart). The controller decides; the launchers only start and stop
processes (:mod:`spark_dl.driver.launchers`), and the job monitor holds what the ranks reported.
"""
from __future__ import annotations

import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spark_dl import protocol
from spark_dl.driver.checkpoint_store import CheckpointStore
from spark_dl.driver.launchers import Launcher, make_launcher
from spark_dl.driver.monitor import ABORT_GRACE_S, Failure, JobMonitor, Observer, notify
from spark_dl.driver.shards import ShardSet
from spark_dl.driver.silence import silence_timeout
from spark_dl.driver.silence import silent as silence_check
from spark_dl.driver.spark_errors import spark_error_summary
from spark_dl.driver.stalls import StallInspector, run_timeout_message, stall_settings
from spark_dl.errors import JobFailed, LaunchRefused
from spark_dl.task.barrier import JobSpec
from spark_dl.tracking.driver.observer import TrackingObserver, make_observer
from spark_dl.transport import channel

if TYPE_CHECKING:
    from spark_dl.driver.runner import HorovodRunner


@dataclass(frozen=True)
class Succeeded:
    """Every rank exited and none failed: the results are in the monitor."""


@dataclass(frozen=True)
class Failed:
    """The attempt failed; ``error`` is what ``run()`` raises if no restart is left."""

    error: JobFailed


@dataclass(frozen=True)
class Grow:
    """Not a failure: the attempt stopped at a checkpoint to run again on ``world_size`` ranks."""

    world_size: int


Outcome = Succeeded | Failed | Grow


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


class Controller:
    """Runs one job to its end under ``runner``'s settings and records :class:`RunInfo` on it."""

    def __init__(self, runner: HorovodRunner) -> None:
        self.runner = runner
        self.grow_wait = runner.grow_interval or 0.0  # doubled after each grow that got no more ranks
        self.silence = silence_timeout()  # read before anything starts: a bad value is refused at once
        self.stall_warning, self.stall_timeout = stall_settings(runner.stall_warning, runner.stall_timeout, runner.env)
        self.inspector: StallInspector | None = None  # the running attempt's

    def run(self, main: Any, payload: bytes, kwargs: dict[str, Any], args: tuple[Any, ...],
            data: ShardSet | None, all_results: bool) -> Any:
        r = self.runner
        launcher = self.launcher(data)
        job_id = f"spark-dl-{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        attempt = 0
        sizes = [launcher.world_size]
        store = CheckpointStore(r.checkpoint_dir, job_id)
        try:
            if store.from_earlier_run():
                sys.stderr.write(f"[spark-dl] resuming from {r.checkpoint_dir}: {store.describe()}\n")
                sys.stderr.flush()
            tracker = make_observer(r.tracking, r.progress)
            observers = [*r.observers, *([tracker] if tracker is not None else [])]
            job = {
                "job_id": job_id,
                "np": r.np,
                "mode": "local" if r.np < 0 else "spark",
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
                monitor, ended = self.attempt(launcher, attempt_id, attempt, payload, all_results, tracker,
                                              observers, store)
                attempt += 1
                if isinstance(ended, Grow):
                    grows += 1
                    launcher = self.grow(data, attempt, ended, store, observers, sizes[-1])
                elif isinstance(ended, Succeeded) or len(earlier) == r.max_restarts:
                    outcome = ended.error if isinstance(ended, Failed) else None
                    break
                else:
                    earlier.append(ended.error)
                    launcher = self.relaunch(data, attempt, len(earlier), ended.error, store, observers, sizes[-1])
                sizes.append(launcher.world_size)
            if outcome is None:
                try:  # a result that never came fails the run: the MLflow run and last_run say so too
                    value = ([monitor.result(i) for i in range(launcher.world_size)] if all_results
                             else monitor.result(0))
                except JobFailed as e:
                    outcome = e
        except BaseException as e:  # what the observers (the MLflow run) are told; e itself propagates
            outcome = e if isinstance(e, JobFailed) else JobFailed(driver_failure(e))
            raise
        finally:
            store.close()
            if earlier and isinstance(outcome, JobFailed):
                note_earlier_failures(outcome, earlier, r.max_restarts)
            for o in observers:
                o.on_finish(outcome)
            failed = [*earlier, *([outcome] if isinstance(outcome, JobFailed) else [])]
            writer = tracker.writer if tracker is not None else None
            r.last_run = RunInfo(job_id, len(sizes), tuple(failed), writer.run_id if writer is not None else None,
                                 time.monotonic() - started, tuple(sizes), grows)
        if outcome is not None:
            raise outcome
        return value

    def launcher(self, data: ShardSet | None, wait_s: float | None = None, low: int | None = None) -> Launcher:
        r = self.runner
        return make_launcher(r.np, data, wait_s, r.ranks_per_task, low or r.min_np)

    def attempt(
        self, launcher: Launcher, job_id: str, attempt: int, payload: bytes, all_results: bool,
        tracker: TrackingObserver | None, observers: list[Observer], store: CheckpointStore,
    ) -> tuple[JobMonitor, Outcome]:
        """Launch the job once and wait until every rank is gone."""
        r = self.runner
        secret = channel.new_secret()
        inspector = StallInspector(launcher.world_size, self.stall_warning, self.stall_timeout, say)
        monitor = JobMonitor(
            world_size=launcher.world_size,
            num_tasks=launcher.num_tasks,
            verbosity=r.driver_log_verbosity,
            on_failure=lambda f: threading.Thread(target=abort, args=(f,), daemon=True).start(),
            observers=observers,
            out=r.stdout,
            err=r.stderr,
            checkpoints=store,
            stalls=inspector,
        )
        server = channel.ControlServer(secret, monitor.on_message, monitor.on_close, host=launcher.bind_host)
        inspector.connections = server.connections
        self.inspector = inspector

        def abort(_: Failure) -> None:
            tell_tasks(server, protocol.ABORT)
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
            max_restarts=r.max_restarts,
            rank_env=dict(r.env),
            task_nodes=r.nodes == "tasks",
            relay=launcher.relay,
            relay_checkpoint=relayed,
            relay_observers=relay_observers,
            run_timeout=r.run_timeout if launcher.relay else None,
            # a relay answers the tasks in the driver's place, and sends no heartbeats
            silence_timeout=0.0 if launcher.relay else self.silence,
            # the stall inspector and the ranks' silence bound read them; a relay has neither
            progress_s=0.0 if launcher.relay or not (self.silence or self.stall_warning or self.stall_timeout)
            else protocol.PROGRESS_INTERVAL_S,
        )
        beating = threading.Event()
        if spec.silence_timeout > 0:
            threading.Thread(target=heartbeat, args=(server, spec.silence_timeout / 6, beating),
                             name="spark-dl-heartbeat", daemon=True).start()
        try:
            launcher.start(spec, monitor)
            self.wait(monitor, launcher, spec.silence_timeout)
        except BaseException as e:  # Ctrl-C, or a failure on the driver itself: stop every rank first
            monitor.fail(Failure(None, driver_failure(e)))
            self.finish(monitor, launcher, server)
            raise
        finally:
            beating.set()
            self.inspector = None
        return monitor, self.finish(monitor, launcher, server)

    def relaunch(
        self, data: ShardSet | None, attempt: int, restart: int, error: JobFailed, store: CheckpointStore,
        observers: list[Observer], last_size: int,
    ) -> Launcher:
        """Say why and how the run restarts, then prepare the next attempt's launch."""
        r = self.runner
        sys.stderr.write(f"[spark-dl] attempt {attempt} of {r.max_restarts + 1} failed: {first_line(error)}\n"
                         if attempt == restart else f"[spark-dl] attempt {attempt} failed: {first_line(error)}\n")
        sys.stderr.flush()
        store.attempt = attempt
        notify(observers, "on_restart", restart, error)
        launcher = self.launch_again(data, observers, last_size, error,
                                     f"restart {restart} of max_restarts={r.max_restarts} could not be launched")
        n = launcher.world_size
        ranks = (f"all {n} ranks" if n == abs(r.np)
                 else f"{n} of np={r.np} ranks (the free task slots; min_np={r.min_np})")
        sys.stderr.write(f"[spark-dl] restarting {ranks} (restart {restart} of max_restarts={r.max_restarts}); "
                         f"{store.describe()}\n")
        sys.stderr.flush()
        return launcher

    def grow(
        self, data: ShardSet | None, attempt: int, grow: Grow, store: CheckpointStore,
        observers: list[Observer], last_size: int,
    ) -> Launcher:
        """Launch a healthy attempt stopped at a checkpoint again, on the free slots (at least as
        many ranks as it had: its own slots are free now)."""
        r = self.runner
        store.attempt = attempt
        notify(observers, "on_grow", attempt, grow.world_size)
        launcher = self.launch_again(data, observers, last_size, None,
                                     f"growing the run to {grow.world_size} ranks failed: it could not be launched "
                                     "again", low=last_size)
        n = launcher.world_size
        ranks = f"all {n} ranks" if n == abs(r.np) else f"{n} of np={r.np} ranks"
        if n <= last_size:  # the slots were taken meanwhile: look less often, so this cannot repeat every interval
            self.grow_wait *= 2
            ranks += f" (the free slots were taken meanwhile; the next look is in {self.grow_wait:g} s)"
        sys.stderr.write(f"[spark-dl] growing from {last_size} to {ranks} (not a restart: max_restarts is untouched); "
                         f"{store.describe()}\n")
        sys.stderr.flush()
        return launcher

    def launch_again(self, data: ShardSet | None, observers: list[Observer], last_size: int,
                     cause: BaseException | None, failed: str, low: int | None = None) -> Launcher:
        """The next attempt's launcher; a lost executor may still be replaced, so it waits for
        slots as long as a start may take. ``failed`` leads the error when it cannot be launched."""
        try:
            launcher = self.launcher(data, wait_s=self.runner.start_timeout, low=low)
        except Exception as e:  # noqa: BLE001 - the cluster or the data changed since the first launch
            why = str(e) if isinstance(e, LaunchRefused) else spark_error_summary(e)
            raise JobFailed(f"{failed}: {why}") from (cause or e)
        if launcher.world_size != last_size:
            notify(observers, "on_resize", launcher.world_size)
        return launcher

    def finish(self, monitor: JobMonitor, launcher: Launcher, server: channel.ControlServer) -> Outcome:
        """Wait for every rank to be gone, close the channel; how the attempt ended."""
        drain(monitor, launcher)
        server.close()
        f = monitor.failure
        if f is None:
            return Succeeded()
        if f.grow_to is not None:
            return Succeeded() if monitor.succeeded() else Grow(f.grow_to)
        return Failed(monitor.error())

    def wait(self, monitor: JobMonitor, launcher: Launcher, silence: float = 0.0) -> None:
        r = self.runner
        started = time.monotonic()
        grows = r.grow_interval is not None and launcher.world_size < r.np
        next_look = started + self.grow_wait
        next_check = started + 1.0
        while monitor.failure is None:
            if grows and time.monotonic() >= next_look:
                next_look = time.monotonic() + self.grow_wait
                self.look_for_slots(monitor, launcher)
            if monitor.all_exited() and launcher.finished():
                monitor.settle()  # every rank is gone: a failure held for its root cause is final
                return
            silent = silence_check(monitor, silence) if silence > 0 else None
            if silent is not None:
                monitor.fail(with_stacks(silent, monitor))
                return
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 1.0
                stall = monitor.stalls.check(monitor.done_ranks(), monitor.hosts) if monitor.stalls else None
                if stall is not None:
                    culprit = stall.culprits[0] if stall.culprits else None
                    monitor.fail(with_stacks(Failure(culprit, stall.summary, stall=stall), monitor))
                    return
            launcher_error = launcher.error()
            if launcher_error is not None:
                monitor.fail(Failure(None, launcher_error))
                return
            tasks_started = launcher.tasks_started(monitor)
            if tasks_started < launcher.num_tasks and time.monotonic() - started > r.start_timeout:
                monitor.fail(Failure(None, launcher.start_timeout_message(tasks_started, r.start_timeout)))
                return
            if (r.run_timeout is not None
                    and time.monotonic() - started > r.run_timeout + launcher.run_timeout_slack):
                monitor.fail(with_stacks(Failure(None, run_timeout_message(r.run_timeout, monitor)), monitor))
                return
            monitor.wait(0.2)

    def look_for_slots(self, monitor: JobMonitor, launcher: Launcher) -> None:
        """Arm (or disarm) the stop at rank 0's next checkpoint, by the task slots free now."""
        if launcher.tasks_started(monitor) < launcher.num_tasks:
            return  # tasks still waiting for slots would count as free ones
        target = launcher.grow_target(self.runner.np)
        if target == monitor.grow_to:
            return
        monitor.grow_to = target
        if target is not None:
            more = target - launcher.world_size
            # the relaunch takes the slots free at the checkpoint, which may be more than now
            later = "" if target == self.runner.np else " (or more, if more slots are free by then)"
            sys.stderr.write(f"[spark-dl] task slots for {more} more rank{'s' if more > 1 else ''} are free: the run "
                             f"grows to {target} ranks{later} at rank 0's next checkpoint\n")
            sys.stderr.flush()


def say(text: str) -> None:
    """A line from the driver itself, on its stderr."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def with_stacks(failure: Failure, monitor: JobMonitor) -> Failure:
    """``failure`` with every rank's stacks, asked for before the abort stops the ranks."""
    if monitor.stalls is not None and failure.stacks is None:
        failure.stacks = monitor.stalls.ask_stacks()
    return failure


def tell_tasks(server: channel.ControlServer, kind: str) -> None:
    """Send ``kind`` to every barrier task connected (one gone meanwhile is skipped)."""
    for conn in server.connections():
        if conn.info.get("role") == "task":
            try:
                conn.send(kind)
            except OSError:
                pass


def heartbeat(server: channel.ControlServer, interval: float, done: threading.Event) -> None:
    """Tell every task the driver is alive, every ``interval`` seconds, until ``done``."""
    while not done.wait(interval):
        tell_tasks(server, protocol.HEARTBEAT)


def drain(monitor: JobMonitor, launcher: Launcher) -> None:
    """After a failure, wait (bounded) until every task has reaped its ranks and the Spark job is over."""
    if monitor.failure is None:
        return
    deadline = time.monotonic() + ABORT_GRACE_S
    while time.monotonic() < deadline and not (monitor.tasks_gone() and launcher.finished()):
        monitor.wait(0.1)


def driver_failure(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted on the driver (KeyboardInterrupt)"
    return f"the driver failed: {type(e).__name__}: {e}"


def first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else type(e).__name__


def note_earlier_failures(error: JobFailed, earlier: list[JobFailed], max_restarts: int) -> None:
    """Say on the final error that the run was restarted, and why each earlier attempt failed."""
    error.previous_failures = tuple(earlier)
    lines = [f"spark-dl restarted this run {len(earlier)} time(s) (max_restarts={max_restarts}); the attempts "
             "before failed with:"]
    for i, e in enumerate(earlier, 1):
        lines.append(f"  attempt {i}: {type(e).__name__}: {first_line(e)}")
    error.add_note("\n".join(lines))
