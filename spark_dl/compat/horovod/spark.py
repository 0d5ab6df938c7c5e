"""``horovod.spark.run`` and ``horovod.spark.run_elastic`` on spark-dl's launcher.

Horovod-on-Spark code switches by changing ``import horovod.spark`` to
``import spark_dl.horovod.spark as horovod_spark`` (and ``horovod.torch`` to ``spark_dl.horovod``).
The ranks form a ``torch.distributed`` group (Gloo, or NCCL on GPUs) instead of MPI or Horovod's
Gloo; what has no counterpart there (``use_mpi=True``, ``extra_mpi_args``, ``executable``) is
refused with the reason.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, TextIO

from spark_dl import HorovodRunner, protocol
from spark_dl.driver import cluster
from spark_dl.errors import LaunchRefused, as_int, env_number

DEFAULT_START_TIMEOUT_S = 600.0  # Horovod's, unless HOROVOD_SPARK_START_TIMEOUT says otherwise
DEFAULT_RESET_LIMIT = 3  # Horovod's reset_limit=None means no limit; a deterministic bug would loop forever
RUN_ELASTIC_GROW_INTERVAL_S = 10.0  # Horovod adds discovered hosts at the next commit; here a grow relaunches the stage


def run(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks in a Spark barrier stage; return every
    rank's result, in rank order.

    ``num_proc`` defaults to ``spark.default.parallelism``; ``env`` adds variables to the ranks'
    environment (those spark-dl sets per rank, ``RANK`` and the like, are the launcher's);
    ``nics`` restricts Gloo and NCCL to those network interfaces; every rank's output goes to
    ``stdout``/``stderr`` (default: the driver's). ``verbose`` is accepted and has no effect.
    """
    kw, pos = _call_args(args, kwargs)
    runner = _runner(num_proc, start_timeout, use_mpi, extra_mpi_args, env, stdout, stderr, nics,
                     prefix_output_with_timestamp, executable, max_restarts=0)
    return runner.run_all(fn, *pos, **kw)


def run_elastic(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """:func:`run` for a function written with ``spark_dl.horovod.elastic`` (``@hvd.elastic.run``
    and a committed state): a failed attempt is restarted, every rank fresh, up to ``reset_limit``
    times (default 3), resuming from the last commit.

    Each attempt runs as many ranks as there are free task slots for, from ``min_num_proc``
    (default ``num_proc``) to ``max_num_proc`` (default ``num_proc``): ``HorovodRunner(min_np=...)``.
    As Horovod adds hosts it discovers, a run on fewer than ``max_num_proc`` ranks looks for free
    task slots every ``RUN_ELASTIC_GROW_INTERVAL_S`` seconds and, when there are, grows at its
    next ``state.commit()``: the attempt stops there and goes on from that commit on more ranks
    (``HorovodRunner(grow_interval=...)``; not counted against ``reset_limit``).
    ``elastic_timeout`` bounds each restart's wait for task slots.
    """
    kw, pos = _call_args(args, kwargs)
    num_proc = _num_proc(num_proc)
    low = min_num_proc if min_np is None else min_np
    high = max_num_proc if max_np is None else max_np
    for name, value in (("min_num_proc", low), ("max_num_proc", high)):
        if value is not None and (as_int(value) is None or value < 1):
            raise LaunchRefused(f"{name} must be an int >= 1, got {value!r}")
    low = num_proc if low is None else as_int(low)
    high = num_proc if high is None else as_int(high)
    if not low <= num_proc <= high:
        raise LaunchRefused(
            f"min_num_proc={low} <= num_proc={num_proc} <= max_num_proc={high} does not hold: num_proc is where "
            "the run starts, between the fewest and the most ranks it may run with"
        )
    limit = DEFAULT_RESET_LIMIT if reset_limit is None else reset_limit
    runner = _runner(high, start_timeout if elastic_timeout is None else elastic_timeout, None, None, env,
                     stdout, stderr, nics, prefix_output_with_timestamp, None, max_restarts=limit,
                     min_np=low if low < high else None,
                     grow_interval=RUN_ELASTIC_GROW_INTERVAL_S if low < high else None)
    return runner.run_all(fn, *pos, **kw)


def _call_args(args: Any, kwargs: Any) -> tuple[dict, tuple]:
    """``(kwargs, args)``, checked: Horovod calls ``fn(*args, **kwargs)``."""
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise LaunchRefused(f"args must be a tuple of fn's positional arguments, got {args!r}: "
                            f"for one argument write args=({args!r},)")
    if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
        raise LaunchRefused(f"kwargs must be a dict of fn's keyword arguments (str keys), got {kwargs!r}")
    return dict(kwargs or {}), tuple(args)


def _num_proc(num_proc: int | None) -> int:
    if num_proc is not None:
        if as_int(num_proc) is None or num_proc < 1:
            raise LaunchRefused(f"num_proc must be an int >= 1, got {num_proc!r}")
        return as_int(num_proc)
    session = cluster.find_session()
    if session is None:
        raise LaunchRefused(
            "horovod.spark.run runs in a Spark barrier stage, but there is no active SparkSession: create one "
            "first, e.g. spark = SparkSession.builder.master('local[4]').getOrCreate(), or pass num_proc and "
            "use a cluster's session"
        )
    if not cluster.is_connect(session):
        return session.sparkContext.defaultParallelism
    # Spark Connect: the setting, else the slots local masters declare (what defaultParallelism is there)
    declared = cluster.conf(session, "spark.default.parallelism")
    n = int(declared) if declared else cluster.declared_slots(session)
    if n is None:
        raise LaunchRefused(
            f"num_proc is unset, and through Spark Connect the cluster's parallelism is unknown here "
            f"(spark.master={cluster.conf(session, 'spark.master')}, no spark.default.parallelism): pass num_proc"
        )
    return n


def _runner(num_proc, start_timeout, use_mpi, extra_mpi_args, env, stdout, stderr, nics,
            prefix_output_with_timestamp, executable, max_restarts: int, min_np: int | None = None,
            grow_interval: float | None = None) -> HorovodRunner:
    if use_mpi:
        raise LaunchRefused("use_mpi=True: spark-dl has no MPI; its ranks use torch.distributed "
                            "(Gloo, or NCCL on GPUs). Leave use_mpi unset.")
    if extra_mpi_args:
        raise LaunchRefused(f"extra_mpi_args={extra_mpi_args!r}: spark-dl has no MPI to pass them to; drop them")
    if executable is not None:
        raise LaunchRefused(f"executable={executable!r}: ranks run the executors' Python (PYSPARK_PYTHON); "
                            "set that instead")
    num_proc = _num_proc(num_proc)
    if start_timeout is None:
        start_timeout = env_number("HOROVOD_SPARK_START_TIMEOUT", DEFAULT_START_TIMEOUT_S, unit=" s")
    if env is not None and not isinstance(env, Mapping):
        raise LaunchRefused(f"env must be a dict of environment variables (str -> str), got {type(env).__name__}")
    rank_env = {k: v for k, v in (env or {}).items() if k not in protocol.RESERVED_ENV}
    if nics:
        names = ",".join(sorted(nics)) if not isinstance(nics, str) else nics
        rank_env.setdefault("GLOO_SOCKET_IFNAME", names)
        rank_env.setdefault("NCCL_SOCKET_IFNAME", names)
    runner = HorovodRunner(np=num_proc, driver_log_verbosity="all", start_timeout=start_timeout,
                           max_restarts=max_restarts, env=rank_env, min_np=min_np, grow_interval=grow_interval)
    if prefix_output_with_timestamp:
        stdout, stderr = _Timestamped(stdout), _Timestamped(stderr, err=True)
    runner.stdout, runner.stderr = stdout, stderr
    return runner


class _Timestamped:
    """A stream that starts every line with the time, as Horovod's prefix_output_with_timestamp."""

    def __init__(self, target: TextIO | None, err: bool = False) -> None:
        self.target = target
        self.err = err

    def _stream(self) -> TextIO:
        import sys

        return self.target or (sys.stderr if self.err else sys.stdout)

    def write(self, text: str) -> int:
        stamp = time.strftime("%a %b %d %H:%M:%S %Y")
        lines = text.splitlines(keepends=True)
        return self._stream().write("".join(f"{stamp}{line}" if line.strip() else line for line in lines))

    def flush(self) -> None:
        self._stream().flush()
