"""Ray Train's ``TorchTrainer`` API (``ray.train``, ``ray.train.torch``) on spark-dl's launcher.

Ray Train code switches by changing imports: ``from spark_dl.ray_train import TorchTrainer,
ScalingConfig, RunConfig, FailureConfig, Checkpoint`` and ``import spark_dl.ray_train as train`` for
``train.report``, ``train.get_context``, ``train.get_checkpoint``, ``train.get_dataset_shard``.
The workers are a barrier stage's ranks (:class:`spark_dl.TorchDistributor`); ``report`` logs to
MLflow, and each report's checkpoint (every worker's files, merged) lands in ``storage_path/name``
as it is reported: written there by the workers when all of them see that folder
(:mod:`spark_dl.ray_train.storage`), else merged on rank 0 and written by the driver. The driver
keeps the latest for a restarted run (``FailureConfig(max_failures=N)``) to resume from.

The modules: :mod:`~spark_dl.ray_train.config` (the ``*Config`` classes),
:mod:`~spark_dl.ray_train.checkpoint` (``Checkpoint``, ``Result``), :mod:`~spark_dl.ray_train.trainer`
(``TorchTrainer``) and :mod:`~spark_dl.ray_train.keeper` on the driver;
:mod:`~spark_dl.ray_train.loop`, :mod:`~spark_dl.ray_train.session` (``report``, ``get_context``, ...)
and :mod:`~spark_dl.ray_train.dataset` in the workers; :mod:`~spark_dl.ray_train.record` (the run
folder's record), :mod:`~spark_dl.ray_train.storage`, :mod:`~spark_dl.ray_train.resume` and
:mod:`~spark_dl.ray_train.archive` between them. This module re-exports their public names.
"""
from __future__ import annotations

from spark_dl import JobFailed, get_device, prepare_data_loader, prepare_model

# ray.train.collective and ray.train.torch, as attributes (train.collective.barrier(), train.torch)
from spark_dl.compat.ray_train import collective as collective
from spark_dl.compat.ray_train import torch as torch
from spark_dl.compat.ray_train.checkpoint import Checkpoint, Result
from spark_dl.compat.ray_train.config import (
                                              CheckpointConfig,
                                              FailureConfig,
                                              RunConfig,
                                              ScalingConfig,
                                              SyncConfig,
                                              TorchConfig,
)
from spark_dl.compat.ray_train.dataset import DataShard

# REPORT_STALL_S: read here; set it where report() reads it, spark_dl.ray_train.session.REPORT_STALL_S
from spark_dl.compat.ray_train.session import (
                                              REPORT_STALL_S,
                                              StorageContext,
                                              TrainContext,
                                              get_checkpoint,
                                              get_context,
                                              get_dataset_shard,
                                              report,
)
from spark_dl.compat.ray_train.trainer import TorchTrainer

TrainingFailedError = JobFailed  # Ray's error for a failed run: RankFailed and JobFailed are of this class

__all__ = ["Checkpoint", "CheckpointConfig", "DataShard", "FailureConfig", "REPORT_STALL_S", "Result", "RunConfig",
           "ScalingConfig", "StorageContext", "SyncConfig", "TorchConfig", "TorchTrainer", "TrainContext",
           "TrainingFailedError",
           "collective",
           "get_checkpoint", "get_context", "get_dataset_shard", "get_device", "prepare_data_loader", "prepare_model",
           "report"]

