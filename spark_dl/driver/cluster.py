"""Driver-side checks of the Spark cluster, made before anything is launched."""
from __future__ import annotations

import math
import re
import socket
import sys
import time
from dataclasses import dataclass

from spark_dl import protocol
from spark_dl.errors import LaunchRefused, env_choice

EXECUTOR_WAIT_S = 30.0
CHANNEL_ENV = protocol.CHANNEL_ENV
CHANNEL_MODES = ("auto", "direct", "relay")


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


def is_connect(session) -> bool:
    """A Spark Connect session: this process holds no SparkContext, only the DataFrame API."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def channel_mode(session) -> str:
    """How the tasks report: ``"direct"`` to this process, or ``"relay"`` through barrier task 0.

    A classic session is the driver itself: direct. A Spark Connect client is direct where
    ``spark.driver.host`` is this machine (a notebook on the cluster), else relayed (a laptop the
    executors cannot connect to). ``SPARK_DL_CHANNEL=direct|relay`` overrides that guess.
    """
    mode = channel_setting()
    if not is_connect(session):
        return "direct"
    if mode != "auto":
        return mode
    host = conf(session, "spark.driver.host")
    return "direct" if host and is_this_host(host) else "relay"


def channel_setting() -> str:
    """``SPARK_DL_CHANNEL``, checked: one of :data:`CHANNEL_MODES` (unset: ``"auto"``)."""
    return env_choice(CHANNEL_ENV, CHANNEL_MODES,
                      "'relay' when the executors cannot connect to this Spark Connect client, 'direct' when they "
                      "can, 'auto' (default) to tell by spark.driver.host")


def is_this_host(host: str) -> bool:
    """Whether ``host`` names this machine: one of its addresses can be bound here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False  # a name only the cluster's DNS knows
    for family, kind, _, _, address in infos:
        try:
            with socket.socket(family, kind) as s:
                s.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def find_session():
    """This thread's active SparkSession, else the process's (classic, or Spark Connect's default:
    Connect's active session is per thread), else ``None``."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:  # pragma: no cover - pyspark is a dependency
        raise LaunchRefused(f"pyspark is not importable ({e}); pip install pyspark") from e
    session = SparkSession.getActiveSession() or SparkSession._instantiatedSession
    connect = sys.modules.get("pyspark.sql.connect.session")  # loaded once a Connect session was made
    if session is None and connect is not None:
        session = connect.SparkSession._get_default_session()
    return session


def active_session(np: int):
    """The active SparkSession (classic or Spark Connect), or a refusal that says how to get one."""
    session = find_session()
    if session is None:
        raise LaunchRefused(
            f"HorovodRunner(np={np}) runs on Spark, but there is no active SparkSession. Create one "
            "first, e.g. spark = SparkSession.builder.master('local[4]').getOrCreate() "
            f"(or use a cluster), or run {abs(np)} processes on this machine without Spark with np=-{abs(np)}."
        )
    if is_connect(session):
        if session.is_stopped:
            raise LaunchRefused("the active Spark Connect session has been stopped; create a new one with "
                                "SparkSession.builder.remote(...).getOrCreate()")
        return session
    try:
        sc = session.sparkContext
    except Exception as e:  # noqa: BLE001 - a session of a kind this code does not know
        raise LaunchRefused(
            f"this SparkSession ({type(session).__module__}) has no SparkContext and is not a Spark Connect "
            "session: spark-dl needs one or the other"
        ) from e
    if sc._jsc is None:
        raise LaunchRefused("the active SparkSession has been stopped; "
                            "create a new one with SparkSession.builder.getOrCreate()")
    return session


def conf(session, key: str, default: str | None = None) -> str | None:
    """One Spark setting, from the SparkContext's conf, or the server's through Spark Connect."""
    if is_connect(session):
        return session.conf.get(key, default)
    return session.sparkContext.getConf().get(key, default)


def ranks_per_task(session) -> int:
    """One rank per GPU when a task gets several GPUs (spark.task.resource.gpu.amount > 1)."""
    raw = conf(session, "spark.task.resource.gpu.amount", "0")
    amount = float(raw)
    if amount <= 1:
        return 1
    if amount != math.floor(amount):
        raise LaunchRefused(
            f"spark.task.resource.gpu.amount={raw} is fractional and above 1; use a whole number of "
            "GPUs per task (one rank is started per GPU) or a fraction <= 1."
        )
    return int(amount)


def check_dynamic_allocation(session) -> None:
    master = conf(session, "spark.master", "")
    local = master == "local" or master.startswith("local[")
    if (conf(session, "spark.dynamicAllocation.enabled", "false") or "").lower() == "true" and not local:
        raise LaunchRefused(
            "spark.dynamicAllocation.enabled=true, but Spark's barrier execution mode (which "
            "HorovodRunner uses) does not support dynamic allocation. Start the cluster with "
            "spark.dynamicAllocation.enabled=false and a fixed number of executors."
        )


def _expected_executors(settings) -> int | None:
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,.*\]", settings.get("spark.master", ""))
    if m:
        return int(m.group(1))
    inst = settings.get("spark.executor.instances", None)
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
    busy = _running_tasks(jsc)
    if busy is None:
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


def _running_tasks(jsc) -> int | None:
    """Tasks running now, as the task scheduler knows them; None where it cannot be asked. The
    status tracker's count comes from the UI's store, which may show a stage's tasks seconds late."""
    try:
        values = jsc.taskScheduler().runningTasksByExecutors().valuesIterator()
        n = 0
        while values.hasNext():
            n += int(values.next())
        return n
    except Exception:  # noqa: BLE001 - another scheduler, or another Spark: the status tracker's count
        return None


def check_slots(sc, np: int, num_tasks: int, wait_s: float = EXECUTOR_WAIT_S, wait_for_new: bool = False) -> Slots:
    """Refuse in seconds when the cluster cannot run ``num_tasks`` barrier tasks at once.

    Spark itself would retry for about 10 minutes (40 checks, 15 s apart) before failing the stage.
    Executors that are still registering (a just-started cluster) are waited for, briefly;
    ``wait_for_new`` waits up to ``wait_s`` for slots whatever the executor count says (a restart
    after an executor was lost, while the cluster manager replaces it).
    """
    expected = _expected_executors(sc.getConf())
    deadline = time.monotonic() + wait_s
    master = sc.getConf().get("spark.master", "")
    # a cluster manager that does not say how many executors are coming (standalone, YARN, k8s
    # without spark.executor.instances) registers them in the first seconds of an application
    young = not master.startswith("local") and time.time() - sc.startTime / 1000 < wait_s

    def registering(s: Slots) -> bool:
        return wait_for_new or (expected is not None and s.executors < expected) or (
            expected is None and (young or s.executors == 0) and not master.startswith("local"))

    s = slots(sc)
    while s.total < num_tasks and registering(s) and time.monotonic() < deadline:
        time.sleep(0.25)
        s = slots(sc)
    if s.total < num_tasks:
        raise _too_few(np, num_tasks, s.total, f"{s.executors} executor(s), ", s.task_cpus, s.task_gpus,
                       f"; {s.busy} of them are busy now")
    return s


def elastic_size(sc, low: int, high: int, per_task: int = 1, settle_s: float = 0.0) -> int:
    """How many ranks to launch: as many as the free task slots take, from ``low`` to ``high``
    (a multiple of ``per_task``). Waits up to ``settle_s`` for ``high``; fewer than ``low`` free
    gives ``low`` (the barrier stage then waits for slots, up to ``start_timeout``)."""
    deadline = time.monotonic() + settle_s
    while True:
        n = min(high, slots(sc).free * per_task)
        if n >= high or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    n -= n % per_task
    return max(low, n)


def _too_few(np: int, num_tasks: int, total: int, executors: str, task_cpus: int, task_gpus: float,
             busy: str) -> LaunchRefused:
    gpu = f", spark.task.resource.gpu.amount={task_gpus:g}" if task_gpus else ""
    per = f" ({num_tasks} tasks)" if num_tasks != np else ""
    return LaunchRefused(
        f"np={np}{per} needs {num_tasks} task slots at once, but this cluster has only {total} "
        f"({executors}spark.task.cpus={task_cpus}{gpu}){busy}. "
        f"Use np <= {total}, add executors or cores, or run on the driver with np=-{np}."
    )


def declared_slots(session) -> int | None:
    """Task slots as the cluster's settings declare them (Spark Connect, where the scheduler cannot
    be asked); ``None`` where they do not say."""
    return slots_of_master(conf(session, "spark.master", "") or "", int(conf(session, "spark.task.cpus", "1") or 1))


def slots_of_master(master: str, task_cpus: int = 1) -> int | None:
    """``local[N]`` and ``local-cluster[E,C,M]`` say how many tasks run at once; ``local[*]``
    (the server's cores) and cluster managers (their executors) do not."""
    master = master.strip()
    if master == "local":
        return 1 // task_cpus
    if m := re.fullmatch(r"local\[\s*(\d+)\s*(?:,\s*\d+\s*)?\]", master):
        return int(m.group(1)) // task_cpus
    if m := re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,.*\]", master):
        return int(m.group(1)) * (int(m.group(2)) // task_cpus)
    return None


def check_declared_slots(session, np: int, num_tasks: int) -> int | None:
    """:func:`check_slots` for Spark Connect: refuse when the declared slots are too few; when the
    settings do not say, the barrier stage's ``start_timeout`` is the check."""
    total = declared_slots(session)
    if total is not None and total < num_tasks:
        raise _too_few(np, num_tasks, total, f"spark.master={conf(session, 'spark.master')}, ",
                       int(conf(session, "spark.task.cpus", "1") or 1),
                       float(conf(session, "spark.task.resource.gpu.amount", "0") or 0), "")
    return total
