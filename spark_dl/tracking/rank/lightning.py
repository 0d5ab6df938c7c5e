"""A PyTorch Lightning logger that sends ``self.log(...)`` metrics and hyperparameters to the
run's MLflow run, through the job's channel like :func:`spark_dl.log_metrics` (executors need no
route to the tracking server): ``Trainer(logger=SparkDLLogger())``."""
from __future__ import annotations

import os
from argparse import Namespace
from typing import Any, Mapping

from spark_dl import protocol
from spark_dl.compat.lightning_import import lightning_module
from spark_dl.tracking.params import is_plain
from spark_dl.tracking.rank.api import log_metrics, log_params
from spark_dl.tracking.rank.buffer import flush_metrics

Logger = lightning_module("spark_dl.tracking.lightning", "loggers").Logger
rank_zero_only = lightning_module("spark_dl.tracking.lightning", "utilities").rank_zero_only

__all__ = ["SparkDLLogger"]


class SparkDLLogger(Logger):
    """Rank 0's logged metrics (at Lightning's ``global_step``) and ``save_hyperparameters()``
    land in the MLflow run of the ``HorovodRunner``/``TorchDistributor``/``TorchTrainer`` run."""

    @property
    def name(self) -> str:
        return "spark-dl"

    @property
    def version(self) -> str:
        return os.environ.get(protocol.JOB_ID_ENV, "local")

    @rank_zero_only
    def log_hyperparams(self, params: Mapping[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        values = vars(params) if isinstance(params, Namespace) else dict(params)
        log_params({k: v for k, v in values.items() if is_plain(v)})  # modules, tensors, ...: not params

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        log_metrics(metrics, step=step)

    @rank_zero_only
    def save(self) -> None:
        flush_metrics()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        flush_metrics()
