"""Ray Train's ``TorchTrainer`` API (``ray.train``, ``ray.train.torch``) on spark-dl's launcher.

Ray Train code switches by changing imports: ``from spark_dl.ray_train import TorchTrainer,
ScalingConfig, RunConfig, FailureConfig, Checkpoint`` and ``import spark_dl.ray_train as train`` for
``train.report``, ``train.get_context``, ``train.get_checkpoint``, ``train.get_dataset_shard``.
The workers are a barrier stage's ranks (:class:`spark_dl.TorchDistributor`); ``report`` logs to
MLflow, and each report's checkpoint (every worker's files, merged) lands in ``storage_path/name``
as it is reported: written there by the workers when all of them see that folder
(:mod:`spark_dl.ray_train.storage`), else merged on rank 0 and written by the driver. The driver
keeps the latest for a restarted run (``FailureConfig(max_failures=N)``) to resume from.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from spark_dl.rank.checkpoint import load_checkpoint, save_checkpoint
from spark_dl.driver.shards import DataFrameShards, shards
from spark_dl.compat.distributor import TorchDistributor
from spark_dl.errors import JobFailed, LaunchRefused, as_int

TrainingFailedError = JobFailed  # Ray's error for a failed run: RankFailed and JobFailed are of this class
from spark_dl.rank.prepare import get_device, prepare_data_loader, prepare_model
from spark_dl.rank.context import init, scratch_dir
from spark_dl.tracking import Tracking, log_metrics
from spark_dl.compat.ray_train import archive
from spark_dl.compat.ray_train import storage as _storage
from spark_dl.compat.ray_train.resume import Resume, ResumeServer, fetched_directory
from spark_dl.compat.ray_train.storage import Storage, checkpoint_folder, storage_mode

__all__ = [
    "TorchTrainer", "ScalingConfig", "RunConfig", "FailureConfig", "CheckpointConfig", "SyncConfig", "Checkpoint",
    "Result",
    "report", "get_context", "get_checkpoint", "get_dataset_shard", "TrainContext",
    "get_device", "prepare_model", "prepare_data_loader",
]


# -- configuration (Ray's names and defaults) ----------------------------------------------------
@dataclass
class ScalingConfig:
    """``num_workers`` ranks, each with a GPU when ``use_gpu`` (Spark GPU scheduling on executors);
    ``num_workers=(min_workers, max_workers)`` is elastic: each attempt runs as many as there are
    free task slots for, in that range (``HorovodRunner(min_np=...)``), and a run on fewer than
    ``max_workers`` looks for free slots every ``elastic_resize_monitor_interval_s`` seconds: when
    there are, it stops at the next ``train.report(..., checkpoint=...)`` and goes on from that
    checkpoint on more workers (``HorovodRunner(grow_interval=...)``).
    ``resources_per_worker`` may say ``{"CPU": n}`` (Spark's ``spark.task.cpus`` decides; the value is
    not applied) and ``{"GPU": 1}``; ``placement_strategy`` is Spark's to decide and is ignored."""

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict | None = None
    placement_strategy: str = "PACK"
    trainer_resources: dict | None = None
    elastic_resize_monitor_interval_s: float = 60.0


@dataclass
class TorchConfig:
    """Ray's ``ray.train.torch.TorchConfig``: the process group's ``backend`` (None: NCCL on GPUs,
    Gloo otherwise; ``"gloo"`` keeps GPU workers on Gloo) and ``timeout_s``, how long a collective
    waits for the other workers before it fails. ``init_method`` (``"env"`` or ``"tcp"``) is how
    Ray's workers meet; here the launcher's rendezvous serves both."""

    backend: str | None = None
    init_method: str = "env"
    timeout_s: float = 1800


def _check_torch_config(config: Any, use_gpu: bool) -> TorchConfig | None:
    from spark_dl.errors import in_range

    if config is None:
        return None
    if not isinstance(config, TorchConfig):
        raise LaunchRefused(f"torch_config must be a TorchConfig (spark_dl.ray_train.torch.TorchConfig), got "
                            f"{type(config).__name__}")
    if config.backend not in (None, "nccl", "gloo"):
        raise LaunchRefused(f"TorchConfig(backend={config.backend!r}): the backend is 'nccl', 'gloo' or None (NCCL on "
                            "GPUs, Gloo otherwise)")
    if config.backend == "nccl" and not use_gpu:
        raise LaunchRefused("TorchConfig(backend='nccl') needs a GPU per worker: pass ScalingConfig(use_gpu=True), or "
                            "leave backend=None (Gloo on CPU workers)")
    if config.init_method not in ("env", "tcp"):
        raise LaunchRefused(f"TorchConfig(init_method={config.init_method!r}): 'env' or 'tcp' (either way the workers "
                            "meet through the launcher's rendezvous)")
    if not in_range(config.timeout_s, low=0, low_open=True):
        raise LaunchRefused(f"TorchConfig(timeout_s={config.timeout_s!r}) must be a number of seconds > 0")
    return config


@dataclass
class FailureConfig:
    """``max_failures``: restarts of the whole run (``HorovodRunner(max_restarts=...)``)."""

    max_failures: int = 0
    fail_fast: bool = False


@dataclass
class CheckpointConfig:
    """Which reported checkpoints stay in ``storage_path/name``: all (``num_to_keep=None``), else
    the ``num_to_keep`` latest, or the best by ``checkpoint_score_attribute`` (a reported metric;
    ``checkpoint_score_order`` "max" or "min"); the latest is always among them."""

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"


@dataclass
class SyncConfig:
    """Ray's ``SyncConfig``, accepted for its defaults: checkpoints are written straight into
    ``storage_path`` as they are reported, so there is nothing to sync; ``sync_artifacts=True``
    (Ray uploads files the workers write into their trial folder) is refused at construction."""

    sync_period: int = 300
    sync_timeout: int = 1800
    sync_artifacts: bool = False
    sync_artifacts_on_checkpoint: bool = True


@dataclass
class RunConfig:
    """``name`` names the MLflow run and the result folder ``storage_path/name`` (default
    ``~/spark_dl_results``, as Ray's is ``~/ray_results``).

    Ray's other fields are accepted where they change nothing here: ``verbose``, ``sync_config``
    (without ``sync_artifacts``), ``storage_filesystem=pyarrow.fs.LocalFileSystem()``, empty
    ``callbacks``/``worker_runtime_env``; ``TorchTrainer`` refuses the rest with the spark-dl way
    to get their effect (``stop``, ``callbacks``, ``progress_reporter``, ``log_to_file``,
    ``local_dir``, other file systems, ``worker_runtime_env``)."""

    name: str | None = None
    storage_path: str | os.PathLike | None = None
    failure_config: FailureConfig | None = None
    checkpoint_config: CheckpointConfig | None = None
    verbose: int | None = None
    # Ray's, after spark-dl's own (a positional RunConfig(name, path, failure_config) keeps working)
    storage_filesystem: Any = None
    sync_config: SyncConfig | None = None
    stop: Any = None
    callbacks: list | None = None
    progress_reporter: Any = None
    log_to_file: bool | str | tuple = False
    local_dir: str | None = None
    worker_runtime_env: dict | None = None


def _run_config_refusal(config: RunConfig) -> str | None:
    """Why ``config`` asks for something spark-dl does not do (None: nothing): the field, and the
    spark-dl way to its effect."""
    if config.stop is not None:
        return (f"RunConfig(stop={config.stop!r}): stop criteria are not supported; end the loop yourself when a "
                "metric says so, on every worker alike (e.g. decide on rank 0 and share it with "
                "train.collective.broadcast_from_rank_zero), so every worker reports as many times")
    callbacks = config.callbacks or []
    callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    if callbacks:
        names = [type(c).__name__ for c in callbacks]
        if any("mlflow" in n.lower() for n in names):
            return (f"RunConfig(callbacks={names}): MLflow tracking is built in (rank 0's reports are the run's "
                    "metrics, train_loop_config its params): drop the MLflow callback")
        return (f"RunConfig(callbacks={names}): Ray Tune/Train callbacks are not run; reports reach MLflow (built in) "
                "and Result.metrics_dataframe, and code can go in the loop (rank 0) or after fit()")
    if config.progress_reporter is not None:
        return ("RunConfig(progress_reporter=...): no progress tables are printed; rank 0's reports are MLflow "
                "metrics as they come (and train.report's metrics are in Result.metrics_dataframe): drop it")
    if config.log_to_file:
        return (f"RunConfig(log_to_file={config.log_to_file!r}): every rank's stdout/stderr is printed on the driver, "
                "tagged with its rank, and kept in the MLflow run as logs/rank<r>.txt: drop log_to_file")
    if config.local_dir is not None:
        return f"RunConfig(local_dir={config.local_dir!r}): Ray's deprecated name; pass storage_path"
    if config.worker_runtime_env:
        return ("RunConfig(worker_runtime_env=...): the workers are Spark tasks, in the executors' environment; set "
                "it through Spark (spark.executorEnv.<NAME>, --py-files/--archives, the cluster's Python environment)")
    if getattr(config.sync_config, "sync_artifacts", False):
        return ("RunConfig(sync_config=SyncConfig(sync_artifacts=True)): nothing is synced: checkpoints are written "
                "into storage_path as reported; write other files into storage_path/name yourself "
                "(train.get_context().get_trial_dir(), on storage every executor mounts)")
    fs = config.storage_filesystem
    if fs is not None and not _local_filesystem(fs):
        return (f"RunConfig(storage_filesystem={type(fs).__name__}): spark-dl writes checkpoints to a file system "
                "path; drop storage_filesystem and pass the folder where the storage is mounted on the driver and "
                "executors as storage_path")
    return None


def _local_filesystem(fs: Any) -> bool:
    """Whether ``fs`` is pyarrow's local file system: paths on it are file system paths, as spark-dl's are."""
    try:
        from pyarrow.fs import LocalFileSystem
    except ImportError:  # no pyarrow here: then fs cannot be one
        return False
    return isinstance(fs, LocalFileSystem)


# -- checkpoints: directories, packed for the trip to the driver -----------------------------------
class Checkpoint:
    """A directory of files, as Ray's ``Checkpoint``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> "Checkpoint":
        if not os.path.isdir(path):
            raise ValueError(f"Checkpoint.from_directory({os.fspath(path)!r}): not a directory")
        return cls(path)

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """A copy of the files in ``path`` (default: a new temporary directory); returns it."""
        dest = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="checkpoint-")
        shutil.copytree(self.path, dest, dirs_exist_ok=True)
        return dest

    @contextmanager
    def as_directory(self) -> Iterator[str]:
        yield self.path

    # Ray keeps a checkpoint's metadata in a JSON file among its files, so it travels and merges with them
    _METADATA = ".metadata.json"

    def get_metadata(self) -> dict[str, Any]:
        """The metadata stored with this checkpoint (``{}`` if none)."""
        try:
            with open(os.path.join(self.path, self._METADATA)) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Store ``metadata`` (JSON-serialisable) with this checkpoint, replacing what was there."""
        if not isinstance(metadata, Mapping):
            raise TypeError(f"Checkpoint metadata must be a dict, got {type(metadata).__name__}")
        try:
            text = json.dumps(dict(metadata))
        except (TypeError, ValueError) as e:
            raise TypeError(f"Checkpoint metadata must be JSON-serialisable (numbers, strings, lists, dicts): {e}") from e
        with open(os.path.join(self.path, self._METADATA), "w") as f:
            f.write(text)

    def update_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Add ``metadata``'s keys to this checkpoint's metadata."""
        if not isinstance(metadata, Mapping):
            raise TypeError(f"Checkpoint metadata must be a dict, got {type(metadata).__name__}")
        self.set_metadata({**self.get_metadata(), **metadata})

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"


def _pack(directory: str) -> bytes:
    buf = io.BytesIO()
    archive.pack(directory, buf)
    return buf.getvalue()


def _unpack(data: bytes, directory: str) -> Checkpoint:
    archive.unpack(io.BytesIO(data), directory)
    return Checkpoint(directory)


# -- inside the workers ----------------------------------------------------------------------------
@dataclass
class TrainContext:
    """What ``ray.train.get_context()`` answers."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    metadata: dict = field(default_factory=dict)
    trial_dir: str = ""
    trial_id: str = ""

    def get_metadata(self) -> dict:
        """``TorchTrainer(metadata=...)``, as Ray gives it to the workers (a copy)."""
        return json.loads(json.dumps(self.metadata))

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_trial_name(self) -> str:
        return self.experiment_name

    def get_trial_dir(self) -> str:
        """The run's folder, ``storage_path/name`` (``Result.path``), as the driver names it: a path
        on this worker's host, shared with the driver only where ``storage_path`` is mounted on every
        executor."""
        return self.trial_dir

    def get_trial_id(self) -> str:
        """The run's id: made by a fit that starts a run, kept by ``TorchTrainer.restore`` fits."""
        return self.trial_id

    def get_storage(self) -> "StorageContext":
        """Ray's storage context (a developer API there): the run's folder and the file system it
        is on, for files a worker writes beside its checkpoints."""
        w = _current()
        return StorageContext(os.path.dirname(self.trial_dir), os.path.basename(self.trial_dir),
                              shared=w.storage is not None)

    def get_trial_resources(self) -> Any:
        raise NotImplementedError(
            "get_trial_resources() returns a Ray placement group (deprecated in Ray Train V2); spark-dl's workers "
            "are Spark tasks: their CPUs are spark.task.cpus (os.sched_getaffinity(0) on Linux), their GPUs "
            "torch.cuda.device_count() (the task's, as CUDA_VISIBLE_DEVICES shows them)")


@dataclass(frozen=True)
class StorageContext:
    """``get_context().get_storage()``: where the run's files go. Runs are on file system paths
    (``storage_path`` as the driver names it), so the file system is pyarrow's local one, and the
    folder is the same on a worker only where ``storage_path`` is mounted on every executor:
    ``shared`` says whether the workers found it so when the fit started (where they did, they
    write their checkpoints there themselves)."""

    storage_path: str
    experiment_dir_name: str
    shared: bool = False
    trial_dir_name: str = ""  # a run is one trial here: its folder is the experiment's

    @property
    def storage_filesystem(self) -> Any:
        import pyarrow.fs

        return pyarrow.fs.LocalFileSystem()

    @property
    def storage_fs_path(self) -> str:
        return self.storage_path

    @property
    def experiment_fs_path(self) -> str:
        return os.path.join(self.storage_path, self.experiment_dir_name)

    @property
    def trial_fs_path(self) -> str:
        return os.path.join(self.experiment_fs_path, self.trial_dir_name) if self.trial_dir_name \
            else self.experiment_fs_path

    def build_checkpoint_path_from_name(self, checkpoint_dir_name: str) -> str:
        """Where a checkpoint reported with ``checkpoint_dir_name`` is kept (Ray Train V2's)."""
        return os.path.join(self.experiment_fs_path, checkpoint_dir_name)


@dataclass
class _Worker:
    name: str
    # the latest: reported in this attempt, saved before a restart, or resumed from; packed files,
    # the path of a checkpoint in the shared storage (or of the resumed one, seen in place or
    # fetched), or the resumed one not yet looked at
    checkpoint: bytes | str | Resume | None
    datasets: dict[str, Any]
    reports: list[dict] = field(default_factory=list)
    directory: str | None = None  # where get_checkpoint() unpacked ``unpacked``
    unpacked: bytes | None = None
    group: Any = None  # a Gloo group for report()'s checkpoint exchange (the default group on CPU)
    storage: Storage | None = None  # set when every worker sees storage_path: checkpoints are written there
    metadata: dict = field(default_factory=dict)  # TorchTrainer(metadata=...): in every reported checkpoint
    path: str = ""  # storage_path/name, as the driver names it
    trial_id: str = ""
    # checkpoint_dir_name: what the run folder held when the fit started, and the names this fit's
    # reports used (carried over a restart), each refused for a later report
    taken: frozenset = frozenset()
    names: dict = field(default_factory=dict)


_worker: _Worker | None = None


def _current() -> _Worker:
    if _worker is None:
        raise RuntimeError("not inside a TorchTrainer worker: call this from train_loop_per_worker")
    return _worker


def get_context() -> TrainContext:
    """This worker's place in the world."""
    w = _current()
    env = os.environ
    return TrainContext(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                        int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_RANK"]), w.name, w.metadata, w.path, w.trial_id)


def report(metrics: Mapping[str, Any], checkpoint: Checkpoint | None = None,
           checkpoint_dir_name: str | None = None) -> None:
    """Report ``metrics`` (rank 0's land in MLflow, step = the report's index, and in the result)
    and a ``checkpoint``: as in Ray, every worker's checkpoint directory (those that pass one) is
    merged into one ``storage_path/name/checkpoint_<n>`` (or ``checkpoint_dir_name``: the same
    plain folder name on every worker, once per run), kept for a restart and for
    ``Result.checkpoint``: written by the workers when they all see that folder, else sent through
    rank 0 to the driver. Every worker must call it as many times (Ray's rule): the checkpoints
    are exchanged here."""
    w = _current()
    if not isinstance(metrics, Mapping):
        raise TypeError(f"report(metrics): metrics must be a dict, got {type(metrics).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"report(checkpoint=...) takes a Checkpoint, got {type(checkpoint).__name__}: "
                        "Checkpoint.from_directory(path)")
    name = _checkpoint_dir_name(checkpoint_dir_name, w) if checkpoint_dir_name is not None else None
    values = {k: _plain(v) for k, v in metrics.items()}
    step = len(w.reports)
    w.reports.append(values)
    numbers = {k: v for k, v in _flatten(values).items()  # nested ones as "val/loss", as Ray flattens them
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    if numbers:
        log_metrics(numbers, step=step)
    if w.storage is not None:
        _report_to_storage(checkpoint, w, step, name)
        return
    mine = _pack(checkpoint.path) if checkpoint is not None else None
    # the sizes go round first (-1: none), so only the ranks that have a checkpoint send one
    sizes = [len(mine) if mine is not None else -1, _name_code(name)]
    every = _all_gather_ints(sizes, w) if get_context().world_size > 1 else [sizes]
    registered = any(n >= 0 for n, _ in every)
    if registered:
        _agree_on_name(every, name, w, step)
    parts = _gather_checkpoints(mine, [n for n, _ in every], w) if get_context().world_size > 1 else [mine]
    if any(p is not None for p in parts):  # only rank 0 holds the parts
        w.checkpoint = _merge(parts, w.metadata)
        # the driver keeps it for restarts and writes it to storage_path (_CheckpointKeeper)
        save_checkpoint({"ray_train_checkpoint": w.checkpoint, "ray_train_name": name, "reports": w.reports,
                         "names": w.names}, step=step)
    if get_context().world_size > 1 and registered:
        _all_gather_ints([0], w)  # as Ray's report is a barrier: no worker goes on before the checkpoint is kept


REPORT_STALL_S = 60.0  # a worker waiting this long in report() says why it may be stuck


def _checkpoint_dir_name(name: Any, w: "_Worker") -> str:
    """``report(checkpoint_dir_name=...)`` checked on this worker: a plain folder name, new to the run."""
    what = f"train.report(checkpoint_dir_name={name!r})"
    if not isinstance(name, str):
        raise TypeError(f"{what}: give the checkpoint folder's name as a str")
    if (not name or name in (".", "..") or "/" in name or os.sep in name or (os.altsep and os.altsep in name)
            or "\0" in name or len(name.encode("utf-8", "surrogateescape")) > 255):
        raise ValueError(f"{what}: give a plain folder name (no '/', not '.' or '..', at most 255 bytes), "
                         "kept as storage_path/name/<it>")
    if name.startswith("."):
        raise ValueError(f"{what}: names starting with '.' are the run's staging and probe files; drop the dot")
    if re.fullmatch(r"checkpoint_\d+", name):
        raise ValueError(f"{what}: checkpoint_<number> names are the automatic ones (of checkpoints reported "
                         "without a name), which a later report could take; pick another, e.g. 'epoch_3'")
    if name in w.names:
        raise ValueError(f"{what}: report {w.names[name]} of this fit already put a checkpoint under that name; "
                         "name each checkpoint once (e.g. with its epoch), or leave checkpoint_dir_name out")
    if name in w.taken:
        raise ValueError(f"{what}: {w.path} already holds {name!r} (an earlier fit's checkpoint, or the run's own "
                         "file), which this report would overwrite; pick another name")
    return name


def _name_code(name: str | None) -> int:
    """``checkpoint_dir_name`` as one int64 for report()'s all-gather: 0 for none."""
    if name is None:
        return 0
    import hashlib

    return (int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()[:8], "big") >> 2) + 1


def _agree_on_name(every: list[list[int]], name: str | None, w: "_Worker", step: int) -> None:
    """Every worker that passes a checkpoint or a ``checkpoint_dir_name`` must pass the same name
    (a folder per report); if so, it is this run's from now on (refused for a later report)."""
    given = {code for n, code in every if n >= 0 or code != 0}
    if len(given) > 1:
        ranks = [r for r, (n, code) in enumerate(every) if n >= 0 or code != 0]
        raise ValueError(f"train.report(checkpoint_dir_name=...): the workers passing a checkpoint or a name (ranks "
                         f"{ranks}) passed different names (rank {get_context().world_rank}: {name!r}); the report's "
                         "checkpoint is one folder: pass the same name on every worker")
    if name is not None:
        w.names[name] = step


def _report_to_storage(checkpoint: Checkpoint | None, w: "_Worker", step: int, name: str | None = None) -> None:
    """Each worker copies its files into the report's staging folder; once every worker has (the
    all-gather of what each passed), rank 0 merges them into ``checkpoint_<n>`` (or ``name``) and
    sends the driver its path only."""
    rank = get_context().world_rank
    passed = _storage.stage(checkpoint.path if checkpoint is not None else None, w.storage, step, rank)
    code = _name_code(name)
    everyone = _all_gather_ints([passed, code], w) if get_context().world_size > 1 else [[passed, code]]
    if all(p < 0 for p, _ in everyone):
        return
    _agree_on_name(everyone, name, w, step)
    # every rank follows the latest (the one it resumed from may be pruned once this one is kept);
    # rank 0 publishes it now, and get_checkpoint() waits for that
    w.checkpoint = w.storage.final(step, name)
    if rank == 0:
        _storage.publish(w.storage, step, [p for p, _ in everyone], name)
        _stamp(w.checkpoint, w.metadata)
        save_checkpoint({"ray_train_path": w.checkpoint, "reports": w.reports, "names": w.names}, step=step)
    if len(everyone) > 1:
        # as Ray's report is a barrier: no worker goes on (or fails) before the checkpoint is kept,
        # so a restart resumes from it
        _all_gather_ints([0], w)


def _all_gather_ints(values: list[int], w: "_Worker") -> list[list[int]]:
    """A few numbers from every rank (the same count on each), waited for with report()'s stall message."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.int64)
    every = [torch.zeros(len(values), dtype=torch.int64) for _ in range(get_context().world_size)]
    _wait(dist.all_gather(every, mine, group=w.group, async_op=True))
    return [[int(v) for v in t.tolist()] for t in every]


def _gather_checkpoints(mine: bytes | None, sizes: list[int], w: "_Worker") -> list[bytes | None]:
    """Every rank's packed checkpoint (None where it passed none), on rank 0 ([] elsewhere), given
    every rank's size (-1: none), gathered before."""
    import torch
    import torch.distributed as dist

    ctx = get_context()
    if ctx.world_rank != 0:
        if mine:
            # the sizes went round, so rank 0 is in this report too; Gloo's point-to-point work
            # never reads as completed before wait(), so it is not polled
            dist.send(torch.frombuffer(bytearray(mine), dtype=torch.uint8), 0, group=w.group)
        return []
    parts: list[bytes | None] = [mine] + [None] * (ctx.world_size - 1)
    pending = []
    for r in range(1, ctx.world_size):
        n = sizes[r]  # -1: no checkpoint; a packed one is never empty (tar headers)
        if n > 0:
            buf = torch.empty(n, dtype=torch.uint8)
            pending.append((r, buf, dist.irecv(buf, r, group=w.group)))
    for r, buf, work in pending:
        work.wait()
        parts[r] = buf.numpy().tobytes()
    return parts


def _wait(work: Any) -> None:
    """Wait for an exchange of report(); a worker stuck in it long says what Ray's rule is."""
    started, warned = time.monotonic(), False
    while not work.is_completed():
        if not warned and time.monotonic() - started > REPORT_STALL_S:
            warned = True
            sys.stderr.write(f"[spark-dl] rank {get_context().world_rank} has waited {REPORT_STALL_S:g} s in "
                             "train.report() for the other workers' report: every worker must call train.report() "
                             "as many times (Ray's rule), or the run hangs here\n")
            sys.stderr.flush()
        time.sleep(0.002)
    try:
        work.wait()
    except RuntimeError as e:  # a peer that left (its loop ended, or it failed) resets the connection
        raise RuntimeError(f"train.report() on rank {get_context().world_rank} could not meet the other workers' "
                           "report: every worker must call train.report() as many times (Ray's rule), and one has "
                           f"ended or failed without this one ({e})") from e


def _stamp(directory: str, metadata: dict | None) -> None:
    """Ray's ``TorchTrainer(metadata=...)`` in a reported checkpoint: keys the workers set win."""
    if metadata:
        checkpoint = Checkpoint(directory)
        checkpoint.set_metadata({**metadata, **checkpoint.get_metadata()})


def _has_files(part: bytes) -> bool:
    with tarfile.open(fileobj=io.BytesIO(part), mode="r") as tar:
        return any(m.name not in (".", "./") for m in tar.getmembers())


def _merge(parts: list[bytes | None], metadata: dict | None = None) -> bytes:
    """One checkpoint of every part's files, as Ray merges its workers' directories; a file that
    several ranks wrote is the lowest rank's; the trainer's ``metadata`` added."""
    given = [p for p in parts if p is not None]
    # empty directories add nothing (Lightning's callback reports one from every rank but rank 0)
    given = [p for p in given if _has_files(p)] or given[:1]
    if len(given) == 1 and not metadata:
        return given[0]
    directory = tempfile.mkdtemp(prefix="spark-dl-checkpoint-merge-", dir=scratch_dir())
    try:
        for part in reversed(given):  # lower ranks last: theirs overwrite
            _unpack(part, directory)
        _stamp(directory, metadata)
        return _pack(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def get_checkpoint() -> Checkpoint | None:
    """The latest checkpoint: rank 0's last report before a restart, else ``resume_from_checkpoint``."""
    w = _current()
    if w.checkpoint is None:
        return None
    if isinstance(w.checkpoint, Resume):  # resume_from_checkpoint: read in place where it can be
        if w.checkpoint.readable():
            w.checkpoint = w.checkpoint.path
        else:
            if w.directory is not None:
                shutil.rmtree(w.directory, ignore_errors=True)
            w.directory = w.checkpoint = fetched_directory(w.checkpoint)
            w.unpacked = None
    if isinstance(w.checkpoint, str):  # written into the shared storage: read in place, as Ray reads local storage
        deadline = time.monotonic() + REPORT_STALL_S
        while not os.path.isdir(w.checkpoint):  # on ranks other than 0, rank 0 may still be publishing it
            if time.monotonic() > deadline:
                raise RuntimeError(f"train.get_checkpoint(): the latest checkpoint, {w.checkpoint}, is not readable on "
                                   f"rank {get_context().world_rank} after {REPORT_STALL_S:g} s: storage_path must stay "
                                   "mounted on every executor, and its checkpoints be left to the run")
            time.sleep(0.05)
        return Checkpoint(w.checkpoint)
    if w.unpacked is not w.checkpoint:  # first call, or a checkpoint reported since
        if w.directory is not None:
            shutil.rmtree(w.directory, ignore_errors=True)
        w.directory = tempfile.mkdtemp(prefix="spark-dl-checkpoint-", dir=scratch_dir())
        _unpack(w.checkpoint, w.directory)
        w.unpacked = w.checkpoint
    return Checkpoint(w.directory)


class DataShard:
    """``get_dataset_shard(name)``: this rank's share of a Spark DataFrame passed in ``datasets``."""

    def __init__(self, data) -> None:
        self._data = data
        self._epoch = 0

    def iter_torch_batches(self, *, prefetch_batches: int = 1, batch_size: int | None = 256, dtypes: Any = None,
                           device: Any = "auto", collate_fn: Callable | None = None, drop_last: bool = False,
                           local_shuffle_buffer_size: int | None = None, local_shuffle_seed: int | None = None,
                           pin_memory: bool = False) -> Iterator[Any]:
        """Ray's ``DataIterator.iter_torch_batches``: ``{column: tensor}`` batches on ``device``
        (``"auto"``: the worker's), cast to ``dtypes`` (one dtype or ``{column: dtype}``), or
        whatever ``collate_fn`` makes of ``{column: numpy array}``; ``batch_size=None``: all of this
        worker's rows in one batch. Each pass is the next epoch (a new shuffle of the whole
        DataFrame unless ``shards(df, shuffle=False)`` was passed). ``prefetch_batches``: 0 fetches
        each batch when it is asked for; more fetch the next one in the background (one ahead)."""
        import torch

        if collate_fn is not None and dtypes is not None:
            raise ValueError("iter_torch_batches: collate_fn and dtypes cannot be combined (as in Ray): cast in "
                             "collate_fn")
        if local_shuffle_buffer_size is not None or local_shuffle_seed is not None:
            raise ValueError("iter_torch_batches: local_shuffle_buffer_size/local_shuffle_seed are not supported: every "
                             "epoch already shuffles the whole DataFrame across workers (shards(df, shuffle=True), the "
                             "default; seed=... fixes it)")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"iter_torch_batches: batch_size must be an int >= 1 or None (all rows in one batch), "
                             f"got {batch_size!r}")
        if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) or prefetch_batches < 0:
            raise ValueError(f"iter_torch_batches: prefetch_batches must be an int >= 0, got {prefetch_batches!r}")
        cast = _dtype_caster(dtypes)
        epoch, self._epoch = self._epoch, self._epoch + 1
        target = get_device() if device == "auto" else device
        size = batch_size if batch_size is not None else max(1, len(self._data))
        for batch in self._data.batches(size, epoch=epoch, drop_last=drop_last and batch_size is not None,
                                        prefetch=prefetch_batches > 0):
            out = collate_fn({k: v.numpy() for k, v in batch.items()}) if collate_fn is not None else cast(batch)
            if pin_memory and torch.cuda.is_available():
                out = _to_device(out, None, pin=True)
            yield _to_device(out, target) if target is not None else out


    def iter_batches(self, *, batch_size: int | None = 256, batch_format: str = "numpy", drop_last: bool = False,
                     prefetch_batches: int = 1) -> Iterator[Any]:
        """Ray's ``DataIterator.iter_batches``: ``{column: numpy array}`` batches (``batch_format=
        "numpy"``, the default) or pandas DataFrames (``"pandas"``); each pass is the next epoch."""
        if batch_format not in ("numpy", "default", "pandas"):
            raise ValueError(f"iter_batches(batch_format={batch_format!r}): 'numpy' or 'pandas'")
        for batch in self.iter_torch_batches(batch_size=batch_size, drop_last=drop_last, device=None,
                                             prefetch_batches=prefetch_batches):
            arrays = {k: v.numpy() for k, v in batch.items()}
            if batch_format == "pandas":
                import pandas as pd

                yield pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in arrays.items()})
            else:
                yield arrays

    def iter_rows(self) -> Iterator[dict]:
        """Ray's ``DataIterator.iter_rows``: this worker's rows of the next epoch, one dict each."""
        for batch in self.iter_batches():
            names = list(batch)
            for i in range(len(batch[names[0]]) if names else 0):
                yield {k: batch[k][i] for k in names}


def _dtype_caster(dtypes: Any) -> Callable[[dict], dict]:
    import torch

    if dtypes is None:
        return lambda batch: batch
    if isinstance(dtypes, torch.dtype):
        return lambda batch: {k: v.to(dtypes) for k, v in batch.items()}
    if isinstance(dtypes, Mapping) and all(isinstance(d, torch.dtype) for d in dtypes.values()):
        return lambda batch: {k: v.to(dtypes[k]) if k in dtypes else v for k, v in batch.items()}
    raise TypeError(f"iter_torch_batches: dtypes must be a torch.dtype or {{column: torch.dtype}}, got {dtypes!r}")


def _to_device(data: Any, device: Any, pin: bool = False) -> Any:
    """Tensors in ``data`` (a tensor, or dicts, lists and tuples of them) moved to ``device``
    (or pinned); anything else as it is."""
    import torch

    if isinstance(data, torch.Tensor):
        return data.pin_memory() if pin else data.to(device)
    if isinstance(data, Mapping):
        return {k: _to_device(v, device, pin) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(v, device, pin) for v in data)
    return data


def get_dataset_shard(name: str) -> DataShard:
    w = _current()
    if name not in w.datasets:
        raise KeyError(f"no dataset named {name!r}: TorchTrainer(datasets=...) has {sorted(w.datasets)}")
    return w.datasets[name]


def _worker_range(workers: Any) -> tuple[int, int]:
    """``num_workers`` as (fewest, most): an int, or Ray's elastic ``(min_workers, max_workers)``."""
    def whole(n: Any) -> bool:
        return as_int(n) is not None and n >= 1

    if whole(workers):
        return as_int(workers), as_int(workers)
    if isinstance(workers, tuple) and len(workers) == 2 and all(whole(n) for n in workers) and workers[0] <= workers[1]:
        return as_int(workers[0]), as_int(workers[1])
    hint = (" (to train on the driver, as Ray's num_workers=0 does, pass num_workers=1 with "
            "TorchTrainer(local_mode=True))" if workers == 0 and not isinstance(workers, bool) else "")
    raise LaunchRefused(f"ScalingConfig(num_workers={workers!r}): give an int >= 1, the number of ranks, or "
                        f"(min_workers, max_workers) with 1 <= min_workers <= max_workers (elastic){hint}")


def _json_metadata(metadata: Any) -> dict:
    """``TorchTrainer(metadata=...)`` checked: a dict that JSON keeps as it is (Ray's rule)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise LaunchRefused(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as e:
        raise LaunchRefused(f"metadata must be JSON-serialisable (numbers, strings, lists, dicts): {e}") from None


def _required_parameters(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _takes_config(fn: Callable) -> bool:
    """Ray calls ``train_loop_per_worker(config)`` when it has a parameter, else with none."""
    try:
        return len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):  # a builtin or C callable: Ray's rule cannot be read, pass it
        return True


def _local_path(storage_path: str | os.PathLike | None) -> str:
    """``storage_path`` as a file system path: ``file:`` URIs on this host are, other URIs are
    refused (a directory named ``s3:`` would silently take the checkpoints)."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    path = os.path.expanduser(os.fspath(storage_path or "~/spark_dl_results"))
    # a scheme of two letters at least (C:/ is a Windows path) and a slash: "run:1" may name a folder
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):/", path)
    if scheme is None:
        return path
    name = scheme.group(1).lower()
    if name == "file":
        url = urlparse(path)
        if url.netloc not in ("", "localhost"):
            raise LaunchRefused(f"RunConfig(storage_path={path!r}): a file: URI names a path on this machine "
                                f"(file:///path), not on host {url.netloc!r}; pass the folder's path")
        return url2pathname(url.path)
    hint = ""
    if name == "dbfs":
        rest = path[len("dbfs:"):].lstrip("/")
        mount = "/" + rest if rest.startswith("Volumes/") else "/dbfs/" + rest
        hint = f" (Databricks mounts it at {mount})"
    raise LaunchRefused(f"RunConfig(storage_path={path!r}): spark-dl writes checkpoints to a file system path, not "
                        f"to a {scheme.group(1)}: URI; pass the folder where the storage is mounted on the driver and "
                        f"executors{hint}")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):  # nested metrics: {"val": {"loss": tensor}}
        return {k: _plain(v) for k, v in value.items()}
    item = getattr(value, "item", None)  # a one-element tensor or numpy scalar
    return item() if callable(item) and getattr(value, "ndim", 0) == 0 else value


class _Loop:
    """What every rank runs: ``train_loop_per_worker`` in a Ray worker's setting."""

    def __init__(self, fn: Callable, name: str, resume: Resume | None, storage: Storage | None = None,
                 metadata: dict | None = None, path: str = "", trial_id: str = "",
                 taken: frozenset = frozenset(), torch_config: TorchConfig | None = None) -> None:
        self.fn, self.name, self.resume, self.storage = fn, name, resume, storage
        self.metadata = metadata or {}
        self.path, self.trial_id, self.taken = path, trial_id, taken
        self.torch_config = torch_config
        self.__qualname__ = getattr(fn, "__qualname__", "train_loop_per_worker")  # the MLflow run's "main"

    def __call__(self, train_loop_config: dict | None = None, **datasets: Any) -> dict | None:
        global _worker
        # Ray's workers start with the process group up (NCCL on GPUs, Gloo otherwise, or as TorchConfig says)
        config = self.torch_config or TorchConfig(timeout_s=None)
        init(config.backend, config.timeout_s)
        saved = load_checkpoint()  # set when this is a restart and rank 0 had reported a checkpoint
        group = _report_group()
        shared = _storage.agree(self.storage, group)
        latest = (saved.get("ray_train_path") or saved.get("ray_train_checkpoint")) if saved else self.resume
        _worker = _Worker(self.name, latest, {k: DataShard(v) for k, v in datasets.items()},
                          reports=list(saved["reports"]) if saved else [], group=group,
                          storage=self.storage if shared else None, metadata=self.metadata, path=self.path,
                          trial_id=self.trial_id, taken=self.taken, names=dict(saved.get("names", {})) if saved else {})
        try:
            if _takes_config(self.fn):
                self.fn(train_loop_config if train_loop_config is not None else {})
            else:
                self.fn()
            w = _worker
            if get_context().world_rank != 0:
                return None
            return {"reports": w.reports}  # checkpoints reach the driver as reported (_CheckpointKeeper)
        finally:
            if _worker.directory is not None:
                shutil.rmtree(_worker.directory, ignore_errors=True)
            _worker = None


def _report_group() -> Any:
    """The process group report() exchanges checkpoints over: packed bytes live on the CPU, so
    NCCL's default group gets a Gloo twin (made here, at the loop's start, by every rank)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1 or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


# -- the driver ------------------------------------------------------------------------------------


class _CheckpointKeeper:
    """Driver-side observer: writes each checkpoint rank 0 reports into ``path`` as it arrives
    (``checkpoint_<report index>``, or the report's ``checkpoint_dir_name``) and keeps
    ``num_to_keep`` of them: the best by ``checkpoint_score_attribute`` if set, else the latest;
    the latest is always kept."""

    RECORD = "spark_dl_run.json"  # the run's id, reports and kept checkpoints, for restore() and Result.from_path

    def __init__(self, path: str, config: CheckpointConfig, earlier: dict | None = None, trial_id: str = "") -> None:
        self.path = path
        self.config = config
        self.trial_id = trial_id
        # numbering continues after what the folder holds (a restored or repeated run): none overwritten
        self.offset = 1 + max(_checkpoint_indices(path), default=-1)
        # a restored run goes on with its earlier fits' reports and kept checkpoints (num_to_keep counts them)
        self.history: list[dict] = list(earlier["reports"]) if earlier else []
        self.kept: list[tuple[Checkpoint, dict]] = [
            (Checkpoint(os.path.join(path, folder)), metrics) for folder, metrics in (earlier or {}).get("kept", [])
            if os.path.isdir(os.path.join(path, folder))]
        self.latest: Checkpoint | None = self.kept[-1][0] if self.kept else None
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def earlier(cls, path: str) -> dict | None:
        """What the run in ``path`` recorded (None if nothing)."""
        try:
            with open(os.path.join(path, cls.RECORD)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and isinstance(record.get("reports"), list) else None

    def record(self, reports: list[dict]) -> None:
        """Write the run's reports so far (earlier fits' first) and the kept checkpoints."""
        record = {"reports": self.history + list(reports),
                  "kept": [[os.path.basename(c.path), m] for c, m in self.kept], "trial_id": self.trial_id}
        tmp = os.path.join(self.path, f".{self.RECORD}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(record, f, default=repr)  # a report's odd value (an array) as its text
            os.replace(tmp, os.path.join(self.path, self.RECORD))
        except OSError as e:  # restore() then knows less; the run itself is not at stake
            sys.stderr.write(f"[spark-dl] could not record the run in {self.path}: {e}\n")

    def on_start(self, job: dict) -> None:
        pass

    def on_log(self, rank: int, stream: str, line: str) -> None:
        pass

    def on_finish(self, error: BaseException | None) -> None:
        pass

    def on_message(self, rank: int, kind: str, data: Any) -> None:
        pass

    def on_checkpoint(self, blob: Any, step: int | None) -> None:
        """Rank 0's ``report`` stored a checkpoint: ``step`` is the report's index."""
        import cloudpickle

        state = cloudpickle.loads(blob)
        if "ray_train_path" in state:  # the workers wrote it into the storage: only its path came
            checkpoint = Checkpoint(state["ray_train_path"])
        else:
            name = state.get("ray_train_name")
            folder = os.path.join(self.path, name) if name else checkpoint_folder(self.path, self.offset + step)
            checkpoint = _unpack(state["ray_train_checkpoint"], folder)
        metrics = state["reports"][step]
        attr = self.config.checkpoint_score_attribute
        if attr is not None and _score(metrics, attr) is None and not self._warned:
            self._warned = True  # Ray logs it too; once is enough
            sys.stderr.write(f"[spark-dl] CheckpointConfig(checkpoint_score_attribute={attr!r}): report {step} has no "
                             f"number there (its metrics: {sorted(_flatten(metrics))}), so its checkpoint ranks below "
                             "every scored one\n")
        with self._lock:
            self.kept = [(c, m) for c, m in self.kept if c.path != checkpoint.path]  # a restart's redo
            self.kept.append((checkpoint, metrics))
            self.latest = checkpoint
            self._prune()
            self.record(state["reports"])

    def _prune(self) -> None:
        n = self.config.num_to_keep
        if n is None or len(self.kept) <= n:
            return
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            keep = self.kept[-n:]
        else:
            sign = 1 if self.config.checkpoint_score_order == "max" else -1

            def rank(cm: tuple[Checkpoint, dict]) -> tuple[bool, float]:
                value = _score(cm[1], attr)  # a report without a number there ranks below every other, as in Ray
                return (value is not None, sign * value if value is not None else 0.0)

            ranked = sorted(self.kept, key=rank, reverse=True)
            keep = ranked[:n]
            if self.kept[-1] not in keep:  # the latest is what a resumed run needs
                keep = keep[:-1] + [self.kept[-1]] if n > 1 else [self.kept[-1]]
        for c, m in self.kept:
            if (c, m) not in keep:
                shutil.rmtree(c.path, ignore_errors=True)
        self.kept = [cm for cm in self.kept if cm in keep]  # in report order


def _latest_kept(path: str) -> str | None:
    """The latest checkpoint the run in ``path`` kept: its record's (named folders included), else
    (a folder without one) the highest ``checkpoint_<n>``."""
    record = _CheckpointKeeper.earlier(path)
    if record is not None:
        kept = [os.path.join(path, folder) for folder, _ in record.get("kept", [])
                if os.path.isdir(os.path.join(path, folder))]
        return kept[-1] if kept else None
    latest = max(_checkpoint_indices(path), default=None)
    return checkpoint_folder(path, latest) if latest is not None else None


def _checkpoint_indices(path: str) -> list[int]:
    if not os.path.isdir(path):
        return []
    return [int(d[len("checkpoint_"):]) for d in os.listdir(path)
            if d.startswith("checkpoint_") and d[len("checkpoint_"):].isdigit()]


def _flatten(metrics: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested metrics as Ray flattens them: ``{"val": {"loss": 1}}`` -> ``{"val/loss": 1}``."""
    flat: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, Mapping):
            flat.update(_flatten(v, f"{prefix}{k}/"))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _score(metrics: dict, attr: str) -> float | None:
    """The report's number for ``checkpoint_score_attribute`` (``"val/loss"`` reaches into a nested
    dict); None where it has none (missing, not a number, NaN)."""
    value = metrics[attr] if attr in metrics else _flatten(metrics).get(attr)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    return None


@dataclass
class Result:
    """What ``TorchTrainer.fit()`` returns: rank 0's last reported ``metrics``, the latest
    ``checkpoint`` reported in this fit (in ``path``), the kept ``best_checkpoints`` with their
    metrics, ``error`` (always None: a failed run raises)."""

    metrics: dict | None
    checkpoint: Checkpoint | None
    path: str
    reports: list[dict]
    error: BaseException | None = None
    best_checkpoints: list[tuple[Checkpoint, dict]] = field(default_factory=list)  # kept, in report order

    @property
    def metrics_dataframe(self):
        """Every report of rank 0, in order, as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.reports)

    @property
    def filesystem(self) -> Any:
        """Ray's: the file system ``path`` is on; spark-dl's runs are on file system paths (pyarrow's local one)."""
        from pyarrow.fs import LocalFileSystem

        return LocalFileSystem()

    @classmethod
    def from_path(cls, path: str | os.PathLike, storage_filesystem: Any = None) -> "Result":
        """Ray's: the Result of the run in ``path`` (``storage_path/name``, a ``Result.path``), from its
        record: ``metrics`` its last report, ``checkpoint`` its latest kept one, ``best_checkpoints``
        the kept ones, every report (a restored run's earlier fits' first). ``error`` is None: a
        failed run's error is raised by its ``fit()``, not recorded."""
        if storage_filesystem is not None and not _local_filesystem(storage_filesystem):
            raise ValueError(f"Result.from_path(storage_filesystem={type(storage_filesystem).__name__}): spark-dl's "
                             "runs are on file system paths; pass the folder where the storage is mounted")
        path = os.path.abspath(_local_path(os.fspath(path)))
        expected = (f"expected a TorchTrainer run's folder, storage_path/name (Result.path), holding its record "
                    f"{_CheckpointKeeper.RECORD}")
        if not os.path.isdir(path):
            raise ValueError(f"Result.from_path({path!r}): no such folder; {expected}")
        record = _CheckpointKeeper.earlier(path)
        if record is None:
            raise ValueError(f"Result.from_path({path!r}): not a run folder (no readable {_CheckpointKeeper.RECORD}); "
                             f"{expected}")
        kept = [(Checkpoint(os.path.join(path, folder)), metrics) for folder, metrics in record.get("kept", [])
                if os.path.isdir(os.path.join(path, folder))]
        reports = list(record["reports"])
        return cls(reports[-1] if reports else None, kept[-1][0] if kept else None, path, reports,
                   best_checkpoints=kept)

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """Ray's: of the kept checkpoints, the one whose report has the lowest (``mode="min"``) or
        highest (``"max"``) ``metric`` (``"val/loss"`` reaches into nested dicts); those without a
        number there are left out; None if none has one."""
        if mode not in ("min", "max"):
            raise ValueError(f"get_best_checkpoint(mode={mode!r}): 'min' or 'max'")
        scored = [(_score(m, metric), c) for c, m in self.best_checkpoints]
        scored = [(v, c) for v, c in scored if v is not None]
        if not scored:
            return None
        pick = min if mode == "min" else max
        return pick(scored, key=lambda vc: vc[0])[1]


class TorchTrainer:
    """Ray Train's ``TorchTrainer``: ``train_loop_per_worker(train_loop_config)`` on
    ``scaling_config.num_workers`` ranks.

    spark-dl's additions (keyword-only): ``local_mode=True`` runs the workers as processes on the
    driver (no Spark), and ``datasets`` takes Spark DataFrames or
    ``spark_dl.data.shards(df, ...)``.
    """

    def __init__(self, train_loop_per_worker: Callable, *, train_loop_config: dict | None = None,
                 scaling_config: ScalingConfig | None = None, run_config: RunConfig | None = None,
                 datasets: Mapping[str, Any] | None = None, resume_from_checkpoint: Checkpoint | None = None,
                 torch_config: Any = None, metadata: dict | None = None, local_mode: bool = False) -> None:
        if not callable(train_loop_per_worker):
            raise LaunchRefused(f"train_loop_per_worker must be a function, got {type(train_loop_per_worker).__name__}")
        required = _required_parameters(train_loop_per_worker)
        if required > 1:
            raise LaunchRefused(f"train_loop_per_worker takes 0 or 1 arguments (the train_loop_config dict), "
                                f"but {getattr(train_loop_per_worker, '__name__', 'it')} requires {required}")
        if train_loop_config is not None and not isinstance(train_loop_config, Mapping):
            raise LaunchRefused(f"train_loop_config must be a dict, got {type(train_loop_config).__name__}")
        self.torch_config = _check_torch_config(torch_config, (scaling_config or ScalingConfig()).use_gpu)
        if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, Checkpoint):
            raise LaunchRefused("resume_from_checkpoint must be a Checkpoint: Checkpoint.from_directory(path)")
        self.metadata = _json_metadata(metadata)
        self._workers = _worker_range((scaling_config or ScalingConfig()).num_workers)
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config) if train_loop_config is not None else None
        self.scaling = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.resume_from_checkpoint = resume_from_checkpoint
        self.datasets = self._datasets(datasets)
        self.local_mode = local_mode
        if self.datasets and local_mode:
            raise LaunchRefused(f"datasets={sorted(self.datasets)} are Spark DataFrames, read by the barrier stage's "
                                "tasks: drop local_mode=True (local processes have no Spark tasks to read them), or "
                                "pass a DataLoader's data through train_loop_config instead")
        refusal = _run_config_refusal(self.run_config)
        if refusal is not None:
            raise LaunchRefused(refusal)
        self.max_failures = self._max_failures()
        keeping = self.run_config.checkpoint_config or CheckpointConfig()
        if keeping.num_to_keep is not None and (isinstance(keeping.num_to_keep, bool)
                                                or not isinstance(keeping.num_to_keep, int) or keeping.num_to_keep < 1):
            raise LaunchRefused(f"CheckpointConfig(num_to_keep={keeping.num_to_keep!r}): give an int >= 1, or None to keep all")
        if keeping.checkpoint_score_order not in ("max", "min"):
            raise LaunchRefused(f"CheckpointConfig(checkpoint_score_order={keeping.checkpoint_score_order!r}): "
                                "'max' or 'min'")
        self._gpu = self._use_gpu()
        self._restored = False  # set by restore(): the Result goes on from the run's earlier fits
        self.name = self.run_config.name or time.strftime("TorchTrainer_%Y-%m-%d_%H-%M-%S")
        # absolute: the workers (other processes, other working directories) write into it too
        self.path = os.path.abspath(os.path.join(_local_path(self.run_config.storage_path), self.name))
        _storage.storage_mode()  # SPARK_DL_RAY_STORAGE checked now, not at fit()
        self._distributor()  # every option checked now, not at fit()

    def _datasets(self, datasets: Mapping[str, Any] | None) -> dict[str, DataFrameShards]:
        if datasets is None:
            return {}
        if not isinstance(datasets, Mapping):
            raise LaunchRefused(f"datasets must be a dict of Spark DataFrames, e.g. {{'train': df, 'val': df2}}, "
                                f"got {type(datasets).__name__}")
        out = {}
        for name, value in datasets.items():
            if name == "train_loop_config" or not isinstance(name, str) or not name.isidentifier():
                raise LaunchRefused(f"datasets: name the DataFrame with an identifier other than "
                                    f"'train_loop_config', e.g. 'train'; got {name!r}")
            if isinstance(value, DataFrameShards):
                out[name] = value
            elif hasattr(value, "schema") and hasattr(value, "mapInArrow"):
                out[name] = shards(value)
            else:
                raise LaunchRefused(f"datasets[{name!r}] is a {type(value).__name__}; spark-dl shards Spark "
                                    "DataFrames (ray.data Datasets: convert with ds.to_spark(spark) or load with Spark)")
        return out

    def _max_failures(self) -> int:
        failures = (self.run_config.failure_config or FailureConfig()).max_failures
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
            raise LaunchRefused(f"FailureConfig(max_failures={failures!r}): give a number of restarts >= 0 "
                                "(unlimited restarts, -1, are not supported)")
        return failures

    def _use_gpu(self) -> bool:
        resources = dict(self.scaling.resources_per_worker or {})
        unknown = sorted(set(resources) - {"CPU", "GPU"})
        if unknown:
            raise LaunchRefused(f"resources_per_worker: {unknown} are Ray resources; Spark schedules CPUs "
                                "(spark.task.cpus) and GPUs (spark.task.resource.gpu.amount) only")
        gpus = resources.get("GPU", 1 if self.scaling.use_gpu else 0)
        if gpus not in (0, 1) or (gpus and not self.scaling.use_gpu):
            raise LaunchRefused(f"resources_per_worker={{'GPU': {gpus}}} with use_gpu={self.scaling.use_gpu}: "
                                "each worker has one GPU with use_gpu=True and none without")
        return bool(self.scaling.use_gpu)

    def _distributor(self) -> TorchDistributor:
        low, high = self._workers
        interval = self.scaling.elastic_resize_monitor_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise LaunchRefused(f"ScalingConfig(elastic_resize_monitor_interval_s={interval!r}): give the seconds "
                                "between looks for free task slots, a number > 0")
        distributor = TorchDistributor(high, local_mode=self.local_mode, use_gpu=self._gpu,
                                       max_restarts=self.max_failures, tracking=Tracking(run_name=self.name))
        if low < high and not self.local_mode:  # local processes always start max_workers
            distributor._options["min_np"] = low
            distributor._options["grow_interval"] = interval
            distributor._runner(high)  # checked now, not at fit()
        return distributor

    def fit(self) -> Result:
        """Train; returns a :class:`Result`, or raises the failing rank's error
        (:class:`spark_dl.RankFailed`, a ``RuntimeError``) when the restarts run out; the reported
        checkpoints are in ``path`` either way (the error's note names the latest)."""
        resume = (Resume.of(self.resume_from_checkpoint.path, storage_mode())
                  if self.resume_from_checkpoint is not None else None)
        config = {"train_loop_config": self.train_loop_config} if self.train_loop_config is not None else {}
        earlier = _CheckpointKeeper.earlier(self.path)
        if self._restored:  # the same run goes on: its id, reports and kept checkpoints
            trial_id = (earlier or {}).get("trial_id") or uuid.uuid4().hex[:8]
        else:
            trial_id = uuid.uuid4().hex[:8]
            self._say_new_run(earlier)
        keeper = _CheckpointKeeper(self.path, self.run_config.checkpoint_config or CheckpointConfig(),
                                   earlier if self._restored else None, trial_id)
        distributor = self._distributor()
        distributor._observers.append(keeper)
        server = ResumeServer(resume) if resume is not None else None
        if server is not None:  # the workers that cannot read it in place fetch it from here
            distributor._observers.append(server)
        self._save_for_restore()
        keeper.record([])  # the folder's record is this run's from now on (Result.from_path, restore())
        storage = Storage.prepare(self.path, keeper.offset)
        # checkpoint_dir_name must not take a name the folder holds: an earlier fit's checkpoint may be a live Result's
        taken = frozenset(os.listdir(self.path))
        loop = _Loop(self.train_loop_per_worker, self.name, resume, storage, self.metadata, self.path, trial_id, taken,
                     self.torch_config)
        try:
            out = distributor.run(loop, **config, **self.datasets)  # the config's values become MLflow params
        except JobFailed as e:
            if keeper.latest is not None:
                note = (f"the latest reported checkpoint is kept in {keeper.latest.path}: continue with "
                        f"TorchTrainer.restore({self.path!r}).fit()")
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(note)
                sys.stderr.write(f"[spark-dl] {note}\n")
            raise
        finally:
            if storage is not None:
                storage.clean()  # the probe, and what a failed report left staged
            if server is not None:
                server.on_finish(None)  # its packed copy, should the run stop before its observers are told
        keeper.record(out["reports"])
        reports = keeper.history + out["reports"]  # a restored run's earlier fits' too
        return Result(reports[-1] if reports else None, keeper.latest, self.path, reports,
                      best_checkpoints=list(keeper.kept))

    def _say_new_run(self, earlier: dict | None) -> None:
        """A fit (not restored) into a folder that holds a run starts a new one there, as each Ray
        ``fit()`` is a new trial: said on stderr, with what happens to the earlier run's files."""
        indices = _checkpoint_indices(self.path)
        kept = [folder for folder, _ in (earlier or {}).get("kept", [])]
        if earlier is None and not indices:
            return
        count = len(set(kept) | {os.path.basename(checkpoint_folder(self.path, i)) for i in indices})
        sys.stderr.write(f"[spark-dl] {self.path} already holds a run ({count} checkpoint folder"
                         f"{'' if count == 1 else 's'}): this fit starts a new run there (as each Ray fit() is a new "
                         "trial), numbering its checkpoints after them; it never removes or overwrites them, nor "
                         "counts them toward num_to_keep, and the folder's record (Result.from_path, restore()) "
                         f"follows the new run. To go on with the earlier run, use TorchTrainer.restore({self.path!r})"
                         "; for a folder of its own, give RunConfig(name=...) a new name\n")

    # -- restore: Ray's way to continue an experiment that failed or was interrupted -------------
    _STATE = "spark_dl_trainer.pkl"

    def _save_for_restore(self) -> None:
        """What :meth:`restore` needs, in ``path``: the loop, its config and the run's settings
        (not the datasets, which are passed again, as in Ray)."""
        import cloudpickle

        os.makedirs(self.path, exist_ok=True)
        state = {"train_loop_per_worker": self.train_loop_per_worker, "train_loop_config": self.train_loop_config,
                 "metadata": self.metadata, "torch_config": self.torch_config,
                 "scaling_config": self.scaling, "run_config": self.run_config, "local_mode": self.local_mode}
        try:
            blob = cloudpickle.dumps(state)
        except Exception:  # noqa: BLE001 - the run itself says what cannot be sent; restore is then unavailable
            return
        with open(os.path.join(self.path, self._STATE), "wb") as f:
            f.write(blob)

    @classmethod
    def can_restore(cls, path: str | os.PathLike) -> bool:
        """Whether ``path`` holds a ``TorchTrainer`` run that :meth:`restore` can continue."""
        return os.path.isfile(os.path.join(os.fspath(path), cls._STATE))

    @classmethod
    def restore(cls, path: str | os.PathLike, train_loop_per_worker: Callable | None = None,
                train_loop_config: dict | None = None, datasets: Mapping[str, Any] | None = None,
                scaling_config: ScalingConfig | None = None) -> "TorchTrainer":
        """The trainer of the run in ``path`` (``Result.path``), resuming from its latest kept
        checkpoint; arguments given replace the saved ones (datasets must be passed again)."""
        import cloudpickle

        path = os.path.normpath(os.fspath(path))  # "runs/linear/" names the folder "linear" too
        if not cls.can_restore(path):
            raise LaunchRefused(f"{path} holds no TorchTrainer run to restore (no {cls._STATE}): pass a Result.path")
        with open(os.path.join(path, cls._STATE), "rb") as f:
            state = cloudpickle.load(f)
        latest = _latest_kept(path)
        # the same folder: later checkpoints join the earlier ones
        saved = state["run_config"]  # a run saved before a field was added lacks it: its default
        run_config = RunConfig(**{f.name: getattr(saved, f.name, f.default) for f in dataclasses.fields(RunConfig)
                                  if f.name not in ("name", "storage_path")},
                               name=os.path.basename(path), storage_path=os.path.dirname(path))
        if train_loop_config is None:
            train_loop_config = state["train_loop_config"]
        trainer = cls(train_loop_per_worker or state["train_loop_per_worker"], train_loop_config=train_loop_config,
                      scaling_config=scaling_config or state["scaling_config"], run_config=run_config, datasets=datasets,
                      resume_from_checkpoint=Checkpoint(latest) if latest is not None else None,
                      local_mode=state["local_mode"], metadata=state.get("metadata"),
                      torch_config=state.get("torch_config"))
        trainer._restored = True
        return trainer


from spark_dl.compat.ray_train import collective  # noqa: E402 - ray.train.collective; it needs _current, defined above
# ray.train.torch as train.torch; by import_module, so no module-level name here reads as the real
# torch (this package's functions import that locally)
importlib.import_module(f"{__name__}.torch")

__all__ = ["Checkpoint", "CheckpointConfig", "DataShard", "FailureConfig", "REPORT_STALL_S", "Result", "RunConfig",
           "ScalingConfig", "StorageContext", "SyncConfig", "TorchConfig", "TorchTrainer", "TrainContext",
           "TrainingFailedError",
           "collective",
           "get_checkpoint", "get_context", "get_dataset_shard", "get_device", "prepare_data_loader", "prepare_model",
           "report"]
