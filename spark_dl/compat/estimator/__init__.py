"""Spark ML training in the manner of Horovod's ``horovod.spark.torch`` / ``horovod.spark.lightning``:
``TorchEstimator(...).fit(df)`` returns a ``TorchModel`` whose ``transform(df)`` adds predictions.
Also importable as ``spark_dl.estimator``."""
from spark_dl.compat.estimator.callbacks import EarlyStopping, Trainer
from spark_dl.compat.estimator.torch_estimator import TorchEstimator, TorchModel

__all__ = ["EarlyStopping", "TorchEstimator", "TorchModel", "Trainer"]
