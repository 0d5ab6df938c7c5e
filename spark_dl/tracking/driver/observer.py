"""The driver side: an :class:`spark_dl.driver.Observer` that turns rank messages into one MLflow run.

Callbacks run on the control server's channel threads, so they only translate and enqueue; the
:class:`MlflowWriter` thread does the I/O. The run is the caller's active run if there is one
(left open), else a new run in the current experiment (ended FINISHED or FAILED).
"""
from __future__ import annotations

import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from spark_dl import protocol
from spark_dl.errors import LaunchRefused, TrackingWarning
from spark_dl.tracking.driver.mlflow_writer import MlflowWriter
from spark_dl.tracking.driver.progress import ProgressBar
from spark_dl.tracking.driver.store_check import CheckedStore, check_store
from spark_dl.tracking.params import clean_name, cut_from, cut_warning, flatten, is_plain, param_value, redact
from spark_dl.tracking.settings import tracking_disabled_by_env
from spark_dl.tracking.system import interval_s

MAX_LOG_BYTES = 64 * 1024 * 1024
# the params spark-dl logs itself (the launch's, rank 0's process group, the world's layout): a run()
# kwarg of one of these names is logged as kwargs.<name>, so that neither hides the other
OWN_PARAMS = frozenset({"np", "mode", "world_size", "num_tasks", "ranks_per_task", "main", "backend",
                        "world.hosts", "world.num_hosts", "world.ranks_per_host"})


@dataclass
class Tracking:
    """Options of the MLflow tracking of one ``HorovodRunner``: ``HorovodRunner(np=2, tracking=Tracking(...))``.

    Args:
        all_ranks: also log every rank's metrics as ``<name>/rank<r>`` (rank 0's always land
            under their plain names).
        system_metrics: log the executors' CPU/memory/GPU samples (``system/<host>/...``).
        rank_logs: store every rank's output as ``logs/rank<r>.txt``.
        run_name: name of the run spark-dl creates (when no run is active).
        grace_s: how long the end of ``run()`` waits for an MLflow server that keeps failing.
    """

    all_ranks: bool = False
    system_metrics: bool = True
    rank_logs: bool = True
    run_name: str | None = None
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("all_ranks", "system_metrics", "rank_logs"):
            if not isinstance(getattr(self, name), bool):
                raise LaunchRefused(f"Tracking({name}=...) must be True or False, got {getattr(self, name)!r}")
        if self.run_name is not None and not isinstance(self.run_name, str):
            raise LaunchRefused(f"Tracking(run_name=...) must be a str or None, got {self.run_name!r}")
        g = self.grace_s
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < float("inf"):
            raise LaunchRefused(f"Tracking(grace_s=...) must be a number of seconds >= 0 (how long the end of run() "
                                f"waits for a failing MLflow server), got {g!r}")


def tracking_enabled(tracking: "bool | Tracking | None") -> bool:
    """Tracking is on unless turned off (``tracking=False``, ``SPARK_DL_TRACKING=0``) or mlflow is missing."""

    if tracking is False or tracking_disabled_by_env():
        return False
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


def make_observer(tracking: "bool | Tracking | None", progress: bool | None) -> "TrackingObserver | None":
    """The observer ``HorovodRunner`` adds to a run, or None when neither tracking nor the bar is wanted."""
    on = tracking_enabled(tracking)
    bar = progress is not False
    if not on and not bar:
        return None
    options = tracking if isinstance(tracking, Tracking) else Tracking()
    return TrackingObserver(options if on else None, progress=bar)


class TrackingObserver:
    """Receives what ranks report and writes it to MLflow (``options=None``: progress bar only)."""

    def __init__(self, options: Tracking | None, progress: bool = True) -> None:
        self.options = options
        # how often executors sample their hosts (0: not at all); read here, so a bad
        # SPARK_DL_SYSTEM_METRICS_INTERVAL is refused before the run starts
        self.system_metrics_s = interval_s() if options is not None and options.system_metrics else 0.0
        # the store the run goes to, checked here too: one that can never take the run (an experiment
        # that does not exist, a URI MLflow cannot open, a file store MLflow refuses, a directory that
        # cannot be written) is refused before anything is launched, not retried after training
        self.store: CheckedStore | None = None
        if options is not None:
            import mlflow

            self.store = check_store(mlflow.get_tracking_uri())
        self.progress = ProgressBar() if progress else None
        self.writer: MlflowWriter | None = None
        self.world_size = 0
        self._sizes: list[int] = []  # each attempt's world size, once it changed
        self._grows = 0  # attempts stopped to grow (HorovodRunner(grow_interval=...))
        self.samples_per_step: int | None = None
        self._last: dict[int, tuple[float, int]] = {}  # rank -> (time, step) of its last record
        self._rank_info: dict[int, dict] = {}
        self._logs: dict[int, Any] = {}
        self._log_bytes: dict[int, int] = {}
        self._log_dir: str | None = None
        self._lock = threading.Lock()
        self._cut_keys: set[str] = set()  # params cut to MLflow's limit, warned about once each
        self._param_texts: dict[str, str] = {}  # each param's first value: the one MLflow keeps
        self._changed_keys: set[str] = set()  # params a rank logged again with another value, warned once each


    # -- Observer ------------------------------------------------------------------------------
    def on_start(self, job: dict) -> None:
        self.world_size = job["world_size"]
        batch = job["kwargs"].get("batch_size")
        if isinstance(batch, int) and not isinstance(batch, bool):
            self.samples_per_step = batch * self.world_size
            if self.progress is not None:
                self.progress.samples_per_step = self.samples_per_step
        if self.options is None:
            return
        import mlflow

        active = mlflow.active_run()
        if active is not None:
            self.writer = MlflowWriter(mlflow.get_tracking_uri(), active.info.run_id, grace_s=self.options.grace_s)
        else:
            self.writer = MlflowWriter(
                mlflow.get_tracking_uri(), None, _experiment_for(self.store), self.options.run_name, _context_tags(),
                grace_s=self.options.grace_s,
            )
        params = {
            "np": job["np"], "mode": job["mode"], "world_size": job["world_size"], "num_tasks": job["num_tasks"],
            "ranks_per_task": job["ranks_per_task"], "main": job["main"],
        }
        positional = {f"arg{i}": v for i, v in enumerate(job.get("args", ()))}  # run(train, 1e-3, 64)
        user = flatten({k: v for k, v in {**positional, **job["kwargs"]}.items() if is_plain(v)})
        user = {clean_name(k): v for k, v in redact(user).items()}  # the run's arguments: no credentials
        self._log_params({**params, **{f"kwargs.{k}" if k in OWN_PARAMS else k: v for k, v in user.items()}})
        self.writer.set_tags({"spark_dl.job_id": job["job_id"]})
        if self.options.rank_logs:
            self._log_dir = tempfile.mkdtemp(prefix="spark-dl-logs-")

    def on_message(self, rank: int | None, kind: str, data: Any) -> None:
        if not kind.startswith(protocol.TRACKING_PREFIX):
            return
        if kind == protocol.TRACKING_METRICS:
            self._metrics(rank, data)
            return
        w = self.writer
        if w is None:
            return
        if kind == protocol.TRACKING_PARAMS:
            self._log_params(self._unchanged({clean_name(k): v for k, v in flatten(data).items()}))
        elif kind == protocol.TRACKING_TAGS:
            w.set_tags(data)
        elif kind == protocol.TRACKING_MODEL:
            w.model_chunk(data)
        elif kind == protocol.TRACKING_ARTIFACT:
            w.log_artifact_bytes(data["path"], data["data"])
        elif kind == protocol.TRACKING_SYSTEM:
            if self.options is not None and self.options.system_metrics:
                host = clean_name(data["host"])
                ts = int(data["time"] * 1000)
                w.log_metrics([(f"system/{host}/{k}", v, ts, data["step"]) for k, v in data["metrics"].items()])
        elif kind == protocol.TRACKING_RANK_INFO:
            self._layout(data)

    def on_log(self, rank: int, stream: str, line: str) -> None:
        if self._log_dir is None:
            return
        f = self._logs.get(rank)
        if f is None:
            with self._lock:
                f = self._logs.get(rank)
                if f is None:
                    f = self._logs[rank] = open(os.path.join(self._log_dir, f"rank{rank}.txt"), "w", encoding="utf-8")
                    self._log_bytes[rank] = 0
        if self._log_bytes[rank] < MAX_LOG_BYTES:
            text = f"[{stream}] {line}\n"
            self._log_bytes[rank] += len(text)
            f.write(text)

    def on_restart(self, restart: int, error: BaseException) -> None:
        """A failed attempt is about to be launched again (restart number ``restart``): record
        why, start a fresh bar."""
        self._relaunch(f"---- restart {restart} follows a failure ----")
        text = f"{type(error).__name__}: {error}"
        w = self.writer
        if w is not None:
            w.set_tags({"spark_dl.restarts": str(restart)})
            w.log_artifact_bytes(f"restarts/attempt{restart}_error.txt", text.encode("utf-8"))

    def on_grow(self, attempt: int, world_size: int) -> None:
        """A healthy attempt was stopped at a checkpoint to run on more ranks (``grow_interval``)."""
        self._grows += 1
        self._relaunch(f"---- stopped at a checkpoint to grow to {world_size} ranks ----")
        if self.writer is not None:
            self.writer.set_tags({"spark_dl.grows": str(self._grows)})

    def _relaunch(self, mark: str) -> None:
        if self.progress is not None:
            self.progress.close()
        self._last.clear()  # the next attempt's steps restart from its checkpoint
        with self._lock:
            for f in self._logs.values():
                f.write(f"[spark-dl] {mark}\n")

    def on_resize(self, world_size: int) -> None:
        """The next attempt runs ``world_size`` ranks (``HorovodRunner(min_np=...)``): throughput
        counts its samples; the run's params keep the first attempt's world, a tag lists each."""
        if self.samples_per_step and self.world_size:
            self.samples_per_step = self.samples_per_step // self.world_size * world_size
            if self.progress is not None:
                self.progress.samples_per_step = self.samples_per_step
        self._sizes = [*(self._sizes or [self.world_size]), world_size]
        self.world_size = world_size
        if self.writer is not None:
            self.writer.set_tags({"spark_dl.world_sizes": ",".join(map(str, self._sizes))})

    def on_finish(self, error: BaseException | None) -> None:
        if self.progress is not None:
            self.progress.close()
        w = self.writer
        if w is None:
            return
        with self._lock:
            for rank, f in sorted(self._logs.items()):
                f.close()
                w.log_artifact_file(f.name, "logs")
        if error is not None:
            text = f"{type(error).__name__}: {error}"
            tags = {"spark_dl.error": text, "spark_dl.status": "FAILED"}
            failed_rank = getattr(error, "rank", None)
            if failed_rank is not None:
                tags["spark_dl.failed_rank"] = str(failed_rank)
            w.set_tags(tags)
            w.log_artifact_bytes("spark_dl_error.txt", text.encode("utf-8"))
        w.close("FAILED" if error is not None else "FINISHED")

    # -- helpers ---------------------------------------------------------------------------------
    def _metrics(self, rank: int | None, records: list) -> None:
        if rank is None or not records:
            return
        all_ranks = self.options is not None and self.options.all_ranks
        out: list[tuple[str, float, int, int]] = []
        for t, step, values, rec_all in records:
            ts = int(t * 1000)
            if rank == 0:
                out.extend((clean_name(k), v, ts, step) for k, v in values.items())
            if all_ranks or rec_all:
                out.extend((f"{clean_name(k)}/rank{rank}", v, ts, step) for k, v in values.items())
        # speed over this batch (~50 ms of steps): one point per batch, not per step; the first
        # batch measures from its own first record, so a run that fits in one batch has one too
        t, step, values, _ = records[-1]
        last = self._last.get(rank) or (records[0][0], records[0][1])
        self._last[rank] = (t, step)
        steps_per_s = None
        if last is not None and step > last[1] and t > last[0]:
            dt = (t - last[0]) / (step - last[1])
            steps_per_s = 1.0 / dt
            if rank == 0:
                ts = int(t * 1000)
                out.append(("perf/step_time_s", dt, ts, step))
                out.append(("perf/steps_per_s", steps_per_s, ts, step))
                if self.samples_per_step:
                    out.append(("perf/samples_per_s", steps_per_s * self.samples_per_step, ts, step))
        if rank == 0 and self.progress is not None:
            self.progress.update(step, values, steps_per_s)
        if out and self.writer is not None:
            self.writer.log_metrics(out)

    def _log_params(self, params: dict[str, Any]) -> None:
        """``params`` to the run as MLflow keeps them; a value cut to MLflow's limit (here, or by
        the rank that logged it) is marked so, and warned about once per key."""
        texts = {k: param_value(v) for k, v in params.items()}
        with self._lock:
            for k, text in texts.items():
                self._param_texts.setdefault(k, text)
        for k, text in texts.items():
            length = cut_from(text)
            if length is None:
                continue
            with self._lock:
                first = k not in self._cut_keys
                self._cut_keys.add(k)
            if first:
                warnings.warn(cut_warning(k, length), TrackingWarning, stacklevel=2)
        if self.writer is not None:
            self.writer.log_params(texts)

    def _unchanged(self, params: dict[str, Any]) -> dict[str, Any]:
        """A rank's ``params`` less those already logged with another value (MLflow keeps a
        param's first value; its own ``log_param`` raises on a change), warned about once per key."""
        out = {}
        for k, v in params.items():
            text = param_value(v)
            with self._lock:
                first = self._param_texts.get(k, text)
                warn = first != text and k not in self._changed_keys
                if warn:
                    self._changed_keys.add(k)
            if first == text:
                out[k] = v
            elif warn:
                whose = ("spark-dl logs this param itself" if k in OWN_PARAMS
                         else "MLflow keeps a param's first value")
                warnings.warn(
                    f"param {k!r} was already logged as {_short(first)}; the value a rank logged, {_short(text)}, "
                    f"is not logged ({whose}). Log it under another name, or log a value that changes "
                    "during training as a metric (spark_dl.log_metrics)", TrackingWarning, stacklevel=2)
        return out

    def _layout(self, info: dict) -> None:
        with self._lock:
            self._rank_info[info["rank"]] = info
            complete = len(self._rank_info) == self.world_size
            infos = [self._rank_info[r] for r in sorted(self._rank_info)]
        if complete and self.writer is not None:
            hosts = list(dict.fromkeys(i["host"] for i in infos))
            self._log_params(
                {"world.hosts": ",".join(hosts), "world.num_hosts": len(hosts),
                 "world.ranks_per_host": ",".join(str(sum(i["host"] == h for i in infos)) for h in hosts)}
            )


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _experiment_for(store: CheckedStore | None) -> str | None:
    """The experiment the pre-launch check found (without MLflow's lookup, which retries for
    minutes when an HTTP server is down), else MLflow's own resolution."""
    if store is not None and store.resolved:
        return store.experiment_id
    return _experiment_id()


def _experiment_id() -> str | None:
    """The experiment ``mlflow.start_run()`` would use (``set_experiment``, env, or the default)."""
    try:
        from mlflow.tracking.fluent import _get_experiment_id  # present in MLflow 2.x and 3.x

        return _get_experiment_id()
    except Exception:  # noqa: BLE001 - fall back to what the public environment says
        return os.environ.get("MLFLOW_EXPERIMENT_ID")


def _context_tags() -> dict[str, str]:
    """The tags ``mlflow.start_run()`` adds (user, source, git commit...)."""
    try:
        from mlflow.tracking.context.registry import resolve_tags

        return dict(resolve_tags({}))
    except Exception:  # noqa: BLE001 - context tags are a nicety
        return {}
