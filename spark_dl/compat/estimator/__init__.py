"""Spark ML training in the manner of Horovod's ``horovod.spark.torch`` / ``horovod.spark.lightning``:
``TorchEstimator(...).fit(df)`` returns a ``TorchModel`` whose ``transform(df)`` adds predictions.
Also importable as ``spark_dl.estimator``.

Modules: :mod:`~spark_dl.compat.estimator.estimator` (``TorchEstimator`` and its Params),
:mod:`~spark_dl.compat.estimator.model` (``TorchModel``), :mod:`~spark_dl.compat.estimator.options`
(the checks of the estimator's arguments), :mod:`~spark_dl.compat.estimator.persistence` (Spark ML
``save``/``load``), :mod:`~spark_dl.compat.estimator.rank_loop` and
:mod:`~spark_dl.compat.estimator.lightning` (what each rank runs), :mod:`~spark_dl.compat.estimator.callbacks`.
"""
from __future__ import annotations

import importlib
from typing import Any

from spark_dl.compat.estimator.callbacks import EarlyStopping, Trainer

# The Spark ML classes import pyspark.ml (0.6 s of pandas and scipy a process), so they are imported
# when first asked for: the ranks and the prediction workers import this package (for rank_loop,
# lightning and callbacks) and start without it
_LAZY = {"TorchEstimator": "spark_dl.compat.estimator.estimator", "TorchModel": "spark_dl.compat.estimator.model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["EarlyStopping", "TorchEstimator", "TorchModel", "Trainer"]
