"""The contract between spark-dl's processes, declared once: message kinds and environment variables.

Three kinds of process talk over the job's authenticated channel (:mod:`spark_dl.transport.channel`):
the **driver** (the user's process), each **barrier task** (a Spark Python worker, or a thread of the
driver with ``np < 0``) and each **rank** process. Every frame is ``(kind, data)``; the kinds, who
sends them and what ``data`` holds are below. A kind is never written as a literal anywhere else.

The task starts each rank with the environment variables below (:data:`RANK_ENV` and
:data:`JOB_ENV`); a user's ``env=`` may not set any of them (:data:`RESERVED_ENV`).
"""
from __future__ import annotations

from typing import Any, TypedDict

# -- message kinds ---------------------------------------------------------------------------------
# task/rank -> driver, first frame of a connection
HELLO = "hello"
# task -> driver: this task's TaskInfo (a dict); the driver answers every task with TASKS
RENDEZVOUS = "rendezvous"
# driver -> task: every task's TaskInfo, in partition order
TASKS = "tasks"
# driver -> task, task -> rank: stop now (another rank failed, Ctrl-C, a time-out)
ABORT = "abort"
# task -> driver and driver -> task, every silence bound / 6: the other side is alive
HEARTBEAT = "heartbeat"
# rank -> driver, every second it changed (else every silence bound / 6): Progress, where the rank is
PROGRESS = "progress"
PROGRESS_INTERVAL_S = 1.0  # how often each rank says where it is (the driver sends it in the rank's bootstrap)
# driver -> rank: {"id"}, asking for every thread's stack; rank -> driver: {"id", "text"}, the answer
STACKS = "stacks"
# task -> driver: [(rank, stream, line), ...], the ranks' stdout/stderr lines
LOG = "log"
# task -> driver: [{"rank", "host", "local_rank"}, ...] of the ranks it started
LAYOUT = "layout"
# task -> driver: {"rank", "code", ...}, a rank process has exited
EXIT = "exit"
# rank -> driver: spark_dl.log_to_driver's text
USER_LOG = "user_log"
# rank -> driver: the pickled return value of main (out of band)
RESULT = "result"
# rank -> driver: a failed rank's error (type, message, traceback)
ERROR = "error"
# task -> driver: the barrier task's own error, before its link closes (TaskError): without it
# the driver sees only a task that went away
TASK_ERROR = "task_error"
# driver -> rank: the answer to a request (a dict; "error" in it when it failed)
REPLY = "reply"
# rank -> driver, answered with REPLY: rank 0's (or every rank's sharded) checkpoint, and reading it back
CHECKPOINT_SAVE = "checkpoint/save"
CHECKPOINT_LOAD = "checkpoint/load"
CHECKPOINT_PREFIX = "checkpoint/"
# rank -> driver, answered with REPLY by the first observer that serves it (a compatibility layer's)
REQUEST_PREFIX = "request/"
# rank/task -> driver: tracking (the driver is the only MLflow client)
TRACKING_PREFIX = "tracking/"
TRACKING_METRICS = "tracking/metrics"
TRACKING_PARAMS = "tracking/params"
TRACKING_TAGS = "tracking/tags"
TRACKING_MODEL = "tracking/model"
TRACKING_ARTIFACT = "tracking/artifact"
TRACKING_SYSTEM = "tracking/system"
TRACKING_RANK_INFO = "tracking/rank_info"


class Hello(TypedDict, total=False):
    role: str  # "task" or "rank"
    partition: int  # a task's
    host: str
    rank: int  # a rank's
    pid: int


# LOG: one line of a rank's output
LogLine = tuple[int, str, str]  # (rank, "stdout" or "stderr", line)
# TRACKING_METRICS: one log_metrics call
MetricRecord = tuple[float, int, dict[str, float], bool]  # (time.time(), step, {name: value}, all_ranks)


class TrackingSystem(TypedDict):
    host: str
    time: float
    step: int | None
    metrics: dict[str, float]


class Artifact(TypedDict):
    path: str
    data: bytes


class ModelChunk(TypedDict):
    id: str
    seq: int
    data: Any
    last: bool
    meta: dict | None


class TaskError(TypedDict):
    partition: int
    host: str
    python: str  # the executor's interpreter (sys.executable): a module it lacks is the usual cause
    exc_type: str
    message: str  # at most MAX_ERROR_TEXT characters (clip_error_text), as the traceback
    traceback: str  # its last lines


MAX_ERROR_TEXT = 64 << 10  # of an ERROR's or TASK_ERROR's message or traceback


def clip_error_text(text: str) -> str:
    """``text``, cut in the middle to MAX_ERROR_TEXT characters: a huge error is reported, not shipped whole."""
    if len(text) <= MAX_ERROR_TEXT:
        return text
    half = MAX_ERROR_TEXT // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut by spark-dl ...]\n{text[-half:]}"


class Progress(TypedDict):
    seq: dict[str, int]  # process group name -> collectives launched on it (torch's sequence number)
    age: float  # seconds since ``seq`` last changed, on the rank's clock when sent
    op: str | None  # the collective the main thread is inside, if any ("all_reduce", "hvd.allreduce")
    site: str | None  # the user's line that called it, or where the main thread is ("train.py:42 in step")


# kind -> (who sends it, what it carries): what the docs and the protocol test read
MESSAGES: dict[str, tuple[str, str]] = {
    HELLO: ("task, rank", "Hello"),
    RENDEZVOUS: ("task", "TaskInfo as a dict"),
    TASKS: ("driver", "list of TaskInfo dicts"),
    ABORT: ("driver, task", "None"),
    HEARTBEAT: ("driver, task", "None"),
    PROGRESS: ("rank", "Progress"),
    STACKS: ("driver, rank", "{id} asked, {id, text} answered"),
    LOG: ("task", "list of LogLine"),
    LAYOUT: ("task", "list of {rank, host, local_rank}"),
    EXIT: ("task", "exit status dict"),
    USER_LOG: ("rank", "str"),
    RESULT: ("rank", "pickle.PickleBuffer"),
    ERROR: ("rank", "error dict"),
    TASK_ERROR: ("task", "TaskError"),
    REPLY: ("driver", "dict"),
    CHECKPOINT_SAVE: ("rank", "checkpoint dict"),
    CHECKPOINT_LOAD: ("rank", "{shard, world}"),
    TRACKING_METRICS: ("rank", "list of MetricRecord"),
    TRACKING_PARAMS: ("rank", "dict"),
    TRACKING_TAGS: ("rank", "dict[str, str]"),
    TRACKING_MODEL: ("rank", "ModelChunk"),
    TRACKING_ARTIFACT: ("rank", "Artifact"),
    TRACKING_SYSTEM: ("task", "TrackingSystem"),
    TRACKING_RANK_INFO: ("rank", "dict"),
}

# -- environment variables: set by the task in every rank ------------------------------------------
JOB_ID_ENV = "SPARK_DL_JOB_ID"
ATTEMPT_ENV = "SPARK_DL_ATTEMPT"
CUDA_DEVICE_ENV = "SPARK_DL_CUDA_DEVICE"  # this rank's GPU among CUDA_VISIBLE_DEVICES
SCRATCH_ENV = "SPARK_DL_SCRATCH"  # the rank's temporary folder, removed by its task
TASK_PID_ENV = "SPARK_DL_TASK_PID"  # the task that started the rank (its parent, if started fresh)
SHARD_ENV = "SPARK_DL_SHARD"  # the folder of the task's DataFrame rows (training on a DataFrame)

# torchrun's per-worker variables and the rank's place in the world (spark_dl.task.layout.RankSpec.env)
RANK_ENV = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "NODE_RANK", "CROSS_RANK", "CROSS_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
)
TORCHELASTIC_ENV = (
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
)
JOB_ENV = (JOB_ID_ENV, ATTEMPT_ENV, CUDA_DEVICE_ENV, SCRATCH_ENV, TASK_PID_ENV, SHARD_ENV)

# what a user's env= may not set: each rank's place in the world and the run's own plumbing
RESERVED_ENV = frozenset(RANK_ENV) | frozenset(TORCHELASTIC_ENV) | frozenset(JOB_ENV)

# -- environment variables: a user's settings, read where they apply -------------------------------
# seconds without a word from a task before the driver fails the attempt naming its host (and without
# one from the driver before a task stops its ranks); 0 turns the bound off
SILENCE_ENV = "SPARK_DL_SILENCE_TIMEOUT"
# Horovod's stall inspector settings, read on the driver (and from env=): seconds before the warning,
# seconds before the attempt fails (0: never), and "1" to turn the inspector off
STALL_WARNING_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
STALL_TIMEOUT_ENV = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
STALL_DISABLE_ENV = "HOROVOD_STALL_CHECK_DISABLE"
CHANNEL_ENV = "SPARK_DL_CHANNEL"  # "relay": a Spark Connect client the executors cannot reach
TRACKING_ENV = "SPARK_DL_TRACKING"  # "0": no MLflow tracking
SYSTEM_METRICS_ENV = "SPARK_DL_SYSTEM_METRICS_INTERVAL"
ZYGOTE_ENV = "SPARK_DL_ZYGOTE"  # "0": no warm rank starts
THREAD_WAIT_ENV = "SPARK_DL_THREAD_WAIT"
HOROVOD_IMPORTS_ENV = "SPARK_DL_HOROVOD_IMPORTS"  # "0": `import horovod` is not redirected in ranks
HVD_CHECKS_ENV = "SPARK_DL_HVD_CHECKS"
HVD_JOIN_ENV = "SPARK_DL_HVD_JOIN"
NATIVE_ENV = "SPARK_DL_NATIVE"
MALLOC_ENV = "SPARK_DL_MALLOC"  # "0": glibc malloc in the ranks as it is (spark_dl.rank.allocator)
RAY_STORAGE_ENV = "SPARK_DL_RAY_STORAGE"

OFF = ("0", "false", "no", "off")  # what turns off a switch whose default is on (any case, spaces ignored)


def switched_off(env: Any, name: str) -> bool:
    """Whether the on-by-default switch ``name`` is set to one of :data:`OFF` in ``env`` (a mapping)."""
    return env.get(name, "1").strip().lower() in OFF
