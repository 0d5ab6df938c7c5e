"""Inside the workers: ``ray.train``'s ``report``, ``get_context``, ``get_checkpoint`` and
``get_dataset_shard``, answered from this process's :class:`Worker` (set by the rank's
:class:`~spark_dl.ray_train.loop.TrainLoop` for the time ``train_loop_per_worker`` runs).

``report`` logs rank 0's metrics to MLflow and exchanges the workers' checkpoints: every worker's
files, merged, are written into the run's folder by the workers when all of them see it
(:mod:`spark_dl.ray_train.storage`), else gathered on rank 0 and sent to the driver
(:class:`~spark_dl.ray_train.keeper.CheckpointKeeper`), which writes them there.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from spark_dl import log_metrics, save_checkpoint
from spark_dl.compat.ray_train.checkpoint import Checkpoint, pack_checkpoint, unpack_checkpoint
from spark_dl.compat.ray_train.dataset import DataShard
from spark_dl.compat.ray_train.record import flatten
from spark_dl.compat.ray_train.resume import Resume, fetched_directory
from spark_dl.compat.ray_train.storage import Storage, publish, stage
from spark_dl.rank import works
from spark_dl.rank.context import scratch_dir

# a worker waiting this long in report() says why it may be stuck (get_checkpoint() gives up on a
# checkpoint it cannot see after as long); read at each wait, so set it here to change it
REPORT_STALL_S = 60.0


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
        w = current_worker()
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
class Worker:
    """This worker's state while ``train_loop_per_worker`` runs (:func:`worker_session`)."""

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


_worker: Worker | None = None


def current_worker() -> Worker:
    """This process's worker state; raises outside ``train_loop_per_worker``."""
    if _worker is None:
        raise RuntimeError("not inside a TorchTrainer worker: call this from train_loop_per_worker")
    return _worker


@contextmanager
def worker_session(worker: Worker) -> Iterator[Worker]:
    """``worker`` is this process's for the body (what report(), get_context(), ... answer from);
    the folder get_checkpoint() unpacked into is removed at its end."""
    global _worker
    _worker = worker
    try:
        yield worker
    finally:
        if worker.directory is not None:
            shutil.rmtree(worker.directory, ignore_errors=True)
        _worker = None


def get_context() -> TrainContext:
    """This worker's place in the world."""
    w = current_worker()
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
    w = current_worker()
    if not isinstance(metrics, Mapping):
        raise TypeError(f"report(metrics): metrics must be a dict, got {type(metrics).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"report(checkpoint=...) takes a Checkpoint, got {type(checkpoint).__name__}: "
                        "Checkpoint.from_directory(path)")
    name = _checkpoint_dir_name(checkpoint_dir_name, w) if checkpoint_dir_name is not None else None
    values = {k: _plain(v) for k, v in metrics.items()}
    step = len(w.reports)
    w.reports.append(values)
    numbers = {k: v for k, v in flatten(values).items()  # nested ones as "val/loss", as Ray flattens them
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    if numbers:
        log_metrics(numbers, step=step)
    if w.storage is not None:
        _report_to_storage(checkpoint, w, step, name)
        return
    mine = pack_checkpoint(checkpoint.path) if checkpoint is not None else None
    # the sizes go round first (-1: none), so only the ranks that have a checkpoint send one
    sizes = [len(mine) if mine is not None else -1, _name_code(name)]
    every = _all_gather_ints(sizes, w) if get_context().world_size > 1 else [sizes]
    registered = any(n >= 0 for n, _ in every)
    if registered:
        _agree_on_name(every, name, w, step)
    parts = _gather_checkpoints(mine, [n for n, _ in every], w) if get_context().world_size > 1 else [mine]
    if any(p is not None for p in parts):  # only rank 0 holds the parts
        w.checkpoint = _merge(parts, w.metadata)
        # the driver keeps it for restarts and writes it to storage_path (keeper.CheckpointKeeper)
        save_checkpoint({"ray_train_checkpoint": w.checkpoint, "ray_train_name": name, "reports": w.reports,
                         "names": w.names}, step=step)
    if get_context().world_size > 1 and registered:
        _all_gather_ints([0], w)  # as Ray's report is a barrier: no worker goes on before the checkpoint is kept


def _checkpoint_dir_name(name: Any, w: Worker) -> str:
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
    return (int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()[:8], "big") >> 2) + 1


def _agree_on_name(every: list[list[int]], name: str | None, w: Worker, step: int) -> None:
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


def _report_to_storage(checkpoint: Checkpoint | None, w: Worker, step: int, name: str | None = None) -> None:
    """Each worker copies its files into the report's staging folder; once every worker has (the
    all-gather of what each passed), rank 0 merges them into ``checkpoint_<n>`` (or ``name``) and
    sends the driver its path only."""
    rank = get_context().world_rank
    passed = stage(checkpoint.path if checkpoint is not None else None, w.storage, step, rank)
    code = _name_code(name)
    everyone = _all_gather_ints([passed, code], w) if get_context().world_size > 1 else [[passed, code]]
    if all(p < 0 for p, _ in everyone):
        return
    _agree_on_name(everyone, name, w, step)
    # every rank follows the latest (the one it resumed from may be pruned once this one is kept);
    # rank 0 publishes it now, and get_checkpoint() waits for that
    w.checkpoint = w.storage.final(step, name)
    if rank == 0:
        publish(w.storage, step, [p for p, _ in everyone], name)
        _stamp(w.checkpoint, w.metadata)
        save_checkpoint({"ray_train_path": w.checkpoint, "reports": w.reports, "names": w.names}, step=step)
    if len(everyone) > 1:
        # as Ray's report is a barrier: no worker goes on (or fails) before the checkpoint is kept,
        # so a restart resumes from it
        _all_gather_ints([0], w)


def _all_gather_ints(values: list[int], w: Worker) -> list[list[int]]:
    """A few numbers from every rank (the same count on each), waited for with report()'s stall message."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.int64)
    every = [torch.zeros(len(values), dtype=torch.int64) for _ in range(get_context().world_size)]
    _wait(works.hold(dist.all_gather(every, mine, group=w.group, async_op=True)))
    return [[int(v) for v in t.tolist()] for t in every]


def _gather_checkpoints(mine: bytes | None, sizes: list[int], w: Worker) -> list[bytes | None]:
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
            unpack_checkpoint(part, directory)
        _stamp(directory, metadata)
        return pack_checkpoint(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def get_checkpoint() -> Checkpoint | None:
    """The latest checkpoint: rank 0's last report before a restart, else ``resume_from_checkpoint``."""
    w = current_worker()
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
                raise RuntimeError(f"train.get_checkpoint(): the latest checkpoint, {w.checkpoint}, is not readable "
                                   f"on rank {get_context().world_rank} after {REPORT_STALL_S:g} s: storage_path must "
                                   "stay mounted on every executor, and its checkpoints be left to the run")
            time.sleep(0.05)
        return Checkpoint(w.checkpoint)
    if w.unpacked is not w.checkpoint:  # first call, or a checkpoint reported since
        if w.directory is not None:
            shutil.rmtree(w.directory, ignore_errors=True)
        w.directory = tempfile.mkdtemp(prefix="spark-dl-checkpoint-", dir=scratch_dir())
        unpack_checkpoint(w.checkpoint, w.directory)
        w.unpacked = w.checkpoint
    return Checkpoint(w.directory)


def get_dataset_shard(name: str) -> DataShard:
    w = current_worker()
    if name not in w.datasets:
        raise KeyError(f"no dataset named {name!r}: TorchTrainer(datasets=...) has {sorted(w.datasets)}")
    return w.datasets[name]


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):  # nested metrics: {"val": {"loss": tensor}}
        return {k: _plain(v) for k, v in value.items()}
    item = getattr(value, "item", None)  # a one-element tensor or numpy scalar
    return item() if callable(item) and getattr(value, "ndim", 0) == 0 else value
