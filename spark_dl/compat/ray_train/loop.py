"""What every rank of a ``TorchTrainer`` run executes: :class:`TrainLoop`, which starts the process
group as Ray's workers find it, sets up this worker's :class:`~spark_dl.ray_train.session.Worker`
(resumed from a restart's saved state or ``resume_from_checkpoint``) and calls
``train_loop_per_worker`` in it."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from spark_dl import init, load_checkpoint
from spark_dl.compat.ray_train.config import TorchConfig
from spark_dl.compat.ray_train.dataset import DataShard
from spark_dl.compat.ray_train.resume import Resume
from spark_dl.compat.ray_train.session import Worker, get_context, worker_session
from spark_dl.compat.ray_train.storage import Storage, agree


class TrainLoop:
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
        # Ray's workers start with the process group up (NCCL on GPUs, Gloo otherwise, or as TorchConfig says)
        config = self.torch_config or TorchConfig(timeout_s=None)
        init(config.backend, config.timeout_s)
        saved = load_checkpoint()  # set when this is a restart and rank 0 had reported a checkpoint
        group = _report_group()
        shared = agree(self.storage, group)
        latest = (saved.get("ray_train_path") or saved.get("ray_train_checkpoint")) if saved else self.resume
        worker = Worker(self.name, latest, {k: DataShard(v) for k, v in datasets.items()},
                        reports=list(saved["reports"]) if saved else [], group=group,
                        storage=self.storage if shared else None, metadata=self.metadata, path=self.path,
                        trial_id=self.trial_id, taken=self.taken, names=dict(saved.get("names", {})) if saved else {})
        with worker_session(worker) as w:
            if _takes_config(self.fn):
                self.fn(train_loop_config if train_loop_config is not None else {})
            else:
                self.fn()
            if get_context().world_rank != 0:
                return None
            return {"reports": w.reports}  # checkpoints reach the driver as reported (CheckpointKeeper)


def _takes_config(fn: Callable) -> bool:
    """Ray calls ``train_loop_per_worker(config)`` when it has a parameter, else with none."""
    try:
        return len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):  # a builtin or C callable: Ray's rule cannot be read, pass it
        return True


def _report_group() -> Any:
    """The process group report() exchanges checkpoints over: packed bytes live on the CPU, so
    NCCL's default group gets a Gloo twin (made here, at the loop's start, by every rank)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1 or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
