"""spark-dl: train PyTorch models across an Apache Spark cluster.

Driver side: :class:`HorovodRunner` (or :class:`TorchDistributor`, PySpark's API). Inside the training
function: :func:`init`,
:func:`log_to_driver`, :func:`get_context`, :func:`log_metrics`, :func:`log_params`, :func:`log_model`,
:func:`save_checkpoint`, :func:`load_checkpoint`, and Ray Train's :func:`get_device`, :func:`prepare_model`,
:func:`prepare_data_loader`. Other launchers' APIs: :mod:`spark_dl.horovod` (``horovod.torch``),
:mod:`spark_dl.horovod.spark`, :mod:`spark_dl.ray_train` (Ray Train's ``TorchTrainer``),
:mod:`spark_dl.estimator` (``TorchEstimator``).
"""
from spark_dl import import_paths
from spark_dl.compat.distributor import TorchDistributor
from spark_dl.driver.runner import HorovodRunner, RunInfo
from spark_dl.errors import JobFailed, LaunchRefused, RankFailed, RankStalled, SparkDLError
from spark_dl.rank.checkpoint import load_checkpoint, save_checkpoint
from spark_dl.rank.context import RankContext, get_context, init, log_to_driver
from spark_dl.rank.prepare import get_device, prepare_data_loader, prepare_model
from spark_dl.tracking import Tracking, log_metrics, log_model, log_params

__version__ = "0.1.0"

# spark_dl.horovod, spark_dl.ray_train, ...: the modules under compat/ and driver/ by their short names
import_paths.install()

__all__ = [
    "HorovodRunner",
    "TorchDistributor",
    "init",
    "log_to_driver",
    "get_context",
    "log_metrics",
    "log_params",
    "log_model",
    "save_checkpoint",
    "load_checkpoint",
    "get_device",
    "prepare_model",
    "prepare_data_loader",
    "Tracking",
    "RankContext",
    "RunInfo",
    "SparkDLError",
    "LaunchRefused",
    "JobFailed",
    "RankFailed",
    "RankStalled",
]
