"""Driver-side checks of the Spark cluster, made before anything is launched."""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from .errors import LaunchRefused

EXECUTOR_WAIT_S = 30.0


@dataclass(frozen=True)
class Slots:
    total: int
    busy: int
    executors: int
    task_cpus: int
    task_gpus: float

    @property
    def free(self) -> int:
        return max(0, self.total - self.busy)


def active_session(np: int):
    """The active SparkSession, or a refusal that says how to get one."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:  # pragma: no cover - pyspark is a dependency
        raise LaunchRefused(f"pyspark is not importable ({e}); pip install pyspark") from e
    session = SparkSession.getActiveSession() or SparkSession._instantiatedSession
    if session is None:
        raise LaunchRefused(
            f"HorovodRunner(np={np}) runs on Spark, but there is no active SparkSession. Create one "
            "first, e.g. spark = SparkSession.builder.master('local[4]').getOrCreate() "
            f"(or use a cluster), or run {abs(np)} processes on this machine without Spark with np=-{abs(np)}."
        )
    try:
        sc = session.sparkContext
    except Exception as e:  # noqa: BLE001 - Spark Connect sessions have no SparkContext
        raise LaunchRefused(
            "this SparkSession has no SparkContext (Spark Connect / a shared-access cluster): barrier "
            "mode needs a classic SparkSession on a single-user cluster."
        ) from e
    if sc._jsc is None:
        raise LaunchRefused("the active SparkSession has been stopped; create a new one with SparkSession.builder.getOrCreate()")
    return session


def ranks_per_task(sc) -> int:
    """One rank per GPU when a task gets several GPUs (spark.task.resource.gpu.amount > 1)."""
    raw = sc.getConf().get("spark.task.resource.gpu.amount", "0")
    amount = float(raw)
    if amount <= 1:
        return 1
    if amount != math.floor(amount):
        raise LaunchRefused(
            f"spark.task.resource.gpu.amount={raw} is fractional and above 1; use a whole number of "
            "GPUs per task (one rank is started per GPU) or a fraction <= 1."
        )
    return int(amount)


def check_dynamic_allocation(sc) -> None:
    conf = sc.getConf()
    master = conf.get("spark.master", "")
    local = master == "local" or master.startswith("local[")
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true" and not local:
        raise LaunchRefused(
            "spark.dynamicAllocation.enabled=true, but Spark's barrier execution mode (which "
            "HorovodRunner uses) does not support dynamic allocation. Start the cluster with "
            "spark.dynamicAllocation.enabled=false and a fixed number of executors."
        )


def _expected_executors(conf) -> int | None:
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,.*\]", conf.get("spark.master", ""))
    if m:
        return int(m.group(1))
    inst = conf.get("spark.executor.instances", None)
    return int(inst) if inst else None


def _executors(sc) -> int:
    # block manager ids include the driver's, except in local mode where driver == executor
    n = sc._jsc.sc().getExecutorMemoryStatus().size()
    master = sc.getConf().get("spark.master", "")
    return n if master.startswith("local[") or master == "local" else max(0, n - 1)


def slots(sc) -> Slots:
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    total = int(jsc.maxNumConcurrentTasks(profile))
    tracker = sc.statusTracker()
    busy = 0
    for sid in tracker.getActiveStageIds():
        info = tracker.getStageInfo(sid)
        if info is not None:
            busy += info.numActiveTasks
    conf = sc.getConf()
    return Slots(
        total=total,
        busy=busy,
        executors=_executors(sc),
        task_cpus=int(conf.get("spark.task.cpus", "1")),
        task_gpus=float(conf.get("spark.task.resource.gpu.amount", "0")),
    )


def check_slots(sc, np: int, num_tasks: int, wait_s: float = EXECUTOR_WAIT_S, wait_for_new: bool = False) -> Slots:
    """Refuse in seconds when the cluster cannot run ``num_tasks`` barrier tasks at once.

    Spark itself would retry for about 10 minutes (40 checks, 15 s apart) before failing the stage.
    Executors that are still registering (a just-started cluster) are waited for, briefly;
    ``wait_for_new`` waits up to ``wait_s`` for slots whatever the executor count says (a restart
    after an executor was lost, while the cluster manager replaces it).
    """
    expected = _expected_executors(sc.getConf())
    deadline = time.monotonic() + wait_s

    def registering(s: Slots) -> bool:
        return wait_for_new or (expected is not None and s.executors < expected)

    s = slots(sc)
    while s.total < num_tasks and registering(s) and time.monotonic() < deadline:
        time.sleep(0.25)
        s = slots(sc)
    if s.total < num_tasks:
        gpu = f", spark.task.resource.gpu.amount={s.task_gpus:g}" if s.task_gpus else ""
        per = f" ({num_tasks} tasks)" if num_tasks != np else ""
        raise LaunchRefused(
            f"np={np}{per} needs {num_tasks} task slots at once, but this cluster has only {s.total} "
            f"({s.executors} executor(s), spark.task.cpus={s.task_cpus}{gpu}); {s.busy} of them are busy now. "
            f"Use np <= {s.total}, add executors or cores, or run on the driver with np=-{np}."
        )
    return s
