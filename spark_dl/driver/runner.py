"""``HorovodRunner``: run one training function on ``np`` ranks, in a Spark barrier stage or locally.

The public class checks its options and hands each ``run()`` to a
:class:`~spark_dl.driver.controller.Controller`, which owns the attempts.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, TextIO

from spark_dl.driver.controller import Controller, RunInfo
from spark_dl.driver.monitor import VERBOSITIES, Observer
from spark_dl.driver.options import NODES, START_TIMEOUT_S, rank_env, seconds
from spark_dl.driver.serialize import serialize_job
from spark_dl.driver.shards import DataFrameShards, ShardSet
from spark_dl.driver.stalls import DEFAULT, Default, stall_settings
from spark_dl.errors import LaunchRefused, as_int
from spark_dl.rank.script import Script, read_script
from spark_dl.tracking.driver.observer import Tracking

__all__ = ["HorovodRunner", "RunInfo", "START_TIMEOUT_S"]


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
        tracking: MLflow tracking of the run (see docs/guide/tracking.md): on by default when
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
        stall_warning: seconds a rank may wait in a collective for ranks that have not joined it
            before the driver warns, naming both sides and their lines (default 60, or Horovod's
            ``HOROVOD_STALL_CHECK_TIME_SECONDS``; None: no warning). See docs/guide/errors.md.
        stall_timeout: seconds of such a wait before the attempt fails with
            :class:`spark_dl.RankStalled`, carrying every rank's stack (default 300, or
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``; None: never). ``HOROVOD_STALL_CHECK_DISABLE=1``
            turns both off unless given here.

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
        stall_warning: float | None | Default = DEFAULT,
        stall_timeout: float | None | Default = DEFAULT,
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
                "max_restarts must be an int >= 0 (how many times a failed run is launched again), "
                f"got {max_restarts!r}"
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
                                f"np={np} ranks and has nothing to grow into; "
                                "set min_np (the fewest ranks to start with)")
        self.grow_interval = None if grow_interval is None else seconds("grow_interval", grow_interval,
                                                                         "growing only at restarts")
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise LaunchRefused(f"checkpoint_dir must be a path (str or os.PathLike), got {checkpoint_dir!r}")
        self.checkpoint_dir = checkpoint_dir
        self.driver_log_verbosity = driver_log_verbosity
        self.start_timeout = seconds("start_timeout", start_timeout)
        self.run_timeout = None if run_timeout is None else seconds("run_timeout", run_timeout, "no limit")
        self.env = rank_env(env)
        stall_settings(stall_warning, stall_timeout, self.env)  # a bad value is refused here, not at run()
        self.stall_warning = stall_warning
        self.stall_timeout = stall_timeout
        if nodes not in NODES:
            raise LaunchRefused(f"nodes must be one of {NODES} (what LOCAL_RANK counts within), got {nodes!r}")
        self.nodes = nodes
        if tracking is not None and not isinstance(tracking, (bool, Tracking)):
            raise LaunchRefused("tracking must be True, False, None or spark_dl.tracking.Tracking(...), "
                                f"got {tracking!r} ({type(tracking).__name__})")
        if progress is not None and not isinstance(progress, bool):
            raise LaunchRefused(f"progress must be True, False or None, got {progress!r}")
        self.tracking = tracking
        self.progress = progress
        self.observers: list[Observer] = []
        # None: one rank per GPU a task gets (PySpark's TorchDistributor counts one process per task)
        self.ranks_per_task: int | None = None
        # where the ranks' output goes (horovod.spark.run's stdout/stderr); None: this process's
        self.stdout: TextIO | None = None
        self.stderr: TextIO | None = None
        self.last_run: RunInfo | None = None  # set by every run(), run_all() and run_script()
        self._controller: Controller | None = None  # the run in progress

    def run(self, main: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``main(*args, **kwargs)`` on every rank; return rank 0's return value.

        Raises :class:`spark_dl.RankFailed` (with the rank, host, remote traceback and last output
        lines) if any rank fails; the other ranks are stopped first.
        """
        return self._run(main, kwargs, all_results=False, args=args)

    def run_all(self, main: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
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

    def _run(self, main: Callable[..., Any], kwargs: dict[str, Any], all_results: bool,
             args: tuple[Any, ...] = ()) -> Any:
        if any(isinstance(a, DataFrameShards) for a in args):
            raise LaunchRefused("pass spark_dl.data.shards(df) as a keyword argument (run(main, data=shards(df))), "
                                "not a positional one: its name is how main receives its rows")
        kwargs, data = take_dataframe(kwargs, self.np)
        payload = serialize_job(main, kwargs, args)
        controller = self._controller = Controller(self)
        try:
            return controller.run(main, payload, kwargs, args, data, all_results)
        finally:
            self._controller = None

    def stacks(self, wait: float = 3.0) -> dict[int, str]:
        """Every rank's threads' stacks, as ``faulthandler`` prints them, from the run in progress
        (call it from another thread, e.g. while ``run()`` seems stuck); the run goes on. A rank
        that does not answer within ``wait`` seconds (stopped, frozen) is said to be so."""
        controller = self._controller
        inspector = controller.inspector if controller is not None else None
        if inspector is None:
            raise RuntimeError("no run of this HorovodRunner is in progress: stacks() asks the ranks of a running "
                               "run() from another thread")
        return inspector.ask_stacks(wait)


def take_dataframe(kwargs: dict[str, Any], np: int) -> tuple[dict[str, Any], ShardSet | None]:
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
