"""Spark ML persistence of :class:`~spark_dl.estimator.TorchEstimator` and
:class:`~spark_dl.estimator.TorchModel`: their ``MLWriter``/``MLReader`` classes (``save(path)``,
``load(path)``, and a ``Pipeline``'s or ``CrossValidatorModel``'s stages) and the pickled blobs
they keep as Parquet rows, written and read by Spark (so DBFS, S3, HDFS... work as for any stage).

A saved stage's metadata names its class by the public path ``spark_dl.estimator.<name>``
(:func:`class_path`), not by the module that defines it: Spark ML's loaders import the class from
that name, so it stays valid when the code moves between modules, and what was saved before (the
same name) loads.
"""
from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, Any

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from spark_dl.driver.serialize import dumps  # cloudpickle's, keeping the model's code's file names

if TYPE_CHECKING:
    from spark_dl.compat.estimator.estimator import TorchEstimator
    from spark_dl.compat.estimator.model import TorchModel

# the module whose classes saved stages are named by: the estimator's public import path
PUBLIC_MODULE = "spark_dl.estimator"


def class_path(cls: type) -> str:
    """The class name a saved stage's metadata records for ``cls``: ``spark_dl.estimator.<name>``
    for a class that module exports, else (a subclass defined elsewhere) its own module's, as
    Spark ML's ``DefaultParamsWriter`` names it."""
    if getattr(importlib.import_module(PUBLIC_MODULE), cls.__name__, None) is cls:
        return f"{PUBLIC_MODULE}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"


def _names_class(name: str, cls: type) -> bool:
    """Whether ``name``, the class a saved stage's metadata records, is ``cls``: by
    :func:`class_path`'s name, the module that defines it, or another of spark-dl's import paths
    that leads to it (an alias such as ``spark_dl.estimator``, a package that exports it)."""
    if name in (class_path(cls), f"{cls.__module__}.{cls.__name__}"):
        return True
    module, _, attr = name.rpartition(".")
    if module.split(".")[0] != "spark_dl":
        return False  # another library's class: not imported only to be refused
    try:
        return getattr(importlib.import_module(module), attr, None) is cls
    except ImportError:
        return False


# a pickled module or settings is saved in rows of at most this many bytes (Spark's 2 GB row limit)
_MODEL_PART = 64 << 20


def _save_blob(spark, blob: bytes, path: str, mode: str | None = None) -> None:
    """``blob`` as Parquet rows of at most ``_MODEL_PART`` bytes, written by Spark (so DBFS, S3,
    HDFS... work as for any stage)."""
    parts = [(i, blob[at:at + _MODEL_PART]) for i, at in enumerate(range(0, max(len(blob), 1), _MODEL_PART))]
    writer = spark.createDataFrame(parts, "part int, data binary").coalesce(1).write
    (writer.mode(mode) if mode else writer).parquet(path)  # no mode: Spark's default, an error if it exists


class _Writer(MLWriter):
    """Spark ML's writer whose ``overwrite()`` works through Spark Connect too: pyspark's own
    deletes the path through the JVM, which a Connect client has not, so there each part
    (``metadata`` and the pickled blob) is written in Spark's overwrite mode instead."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance
        self._mode: str | None = None

    def save(self, path: str) -> None:
        from spark_dl.driver import cluster

        self._mode = None
        if self.shouldOverwrite:
            if cluster.is_connect(self.sparkSession):
                self._mode = "overwrite"
            else:
                self._handleOverwrite(path)
        self.saveImpl(path)

    def _save(self, path: str, blob_name: str, blob: bytes, **metadata: Any) -> None:
        """Spark ML's ``path/metadata`` (as ``DefaultParamsWriter.saveMetadata`` writes it, the class
        named by :func:`class_path`), then the blob."""
        text = DefaultParamsWriter._get_metadata_to_save(self.instance, self.sparkSession, **metadata)
        text = json.dumps({**json.loads(text), "class": class_path(type(self.instance))}, separators=(",", ":"))
        writer = self.sparkSession.createDataFrame([(text,)], schema=["value"]).coalesce(1).write
        (writer.mode(self._mode) if self._mode else writer).text(os.path.join(path, "metadata"))
        _save_blob(self.sparkSession, blob, os.path.join(path, blob_name), self._mode)


def _load_blob(spark, path: str) -> bytes:
    return b"".join(bytes(r["data"]) for r in spark.read.parquet(path).orderBy("part").collect())


def _load_metadata(spark, path: Any, cls: type) -> dict[str, Any]:
    """The Spark ML metadata at ``path``, refused unless it was saved from ``cls`` (named by any
    of its import paths: see :func:`_names_class`)."""
    if not isinstance(path, str):
        raise TypeError(f"{cls.__name__}.load takes a path (str), got {type(path).__name__}")
    meta = DefaultParamsReader.loadMetadata(path, spark)
    if not _names_class(meta["class"], cls):
        raise ValueError(f"{path} holds a {meta['class']}, not a spark-dl {cls.__name__}: load it with that class "
                         "(or pyspark.ml.PipelineModel.load / Pipeline.load for a whole pipeline)")
    return meta


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class TorchEstimatorWriter(_Writer):
    """``path/metadata``: Spark ML's JSON metadata (class, uid, the settings that are plain values,
    for people and tools reading it); ``path/settings``: every setting given and the runner
    options, cloudpickled in one piece (so the optimizer still steps the model's parameters and a
    class or function defined in a notebook loads), as Parquet rows written by Spark."""

    def saveImpl(self, path: str) -> None:  # noqa: N802 - Spark ML's name
        import torch

        est = self.instance
        given = {p.name: v for p, v in est._paramMap.items()}
        state = {"settings": given, "runner_options": est.runner_options, "last_run_id": est.last_run_id}
        try:
            blob = dumps(state)
        except Exception as e:  # noqa: BLE001 - which setting, and what to do, instead of pickle's frames
            culprit = next((name for name, v in {**given, **est.runner_options}.items() if not _picklable(v)), None)
            what = f"its setting {culprit!r}" if culprit else "its settings"
            raise TypeError(f"TorchEstimator cannot be saved: {what} cannot be pickled ({type(e).__name__}: {e}). "
                            "Pass a value cloudpickle can copy (e.g. a function or functools.partial in place of "
                            "an object holding a lock, a file or a connection)") from None
        plain = {name: v for name, v in given.items() if _json_value(v)}
        self._save(path, "settings", blob, paramMap=plain, extraMetadata={"torch_version": torch.__version__})


def _picklable(value: Any) -> bool:
    try:
        dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True


class TorchEstimatorReader(MLReader):
    """Reads back what :class:`TorchEstimatorWriter` saved, as a ``cls`` (``TorchEstimator``)."""

    def __init__(self, cls: type[TorchEstimator]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> TorchEstimator:
        from spark_dl.transport import unpickle

        meta = _load_metadata(self.sparkSession, path, self.cls)
        state = unpickle.loads(_load_blob(self.sparkSession, os.path.join(path, "settings")), unpickle.driver_device)
        est = self.cls(**state["settings"], **state["runner_options"])
        est.last_run_id = state["last_run_id"]
        est._resetUid(meta["uid"])
        return est


class TorchModelWriter(_Writer):
    """``path/metadata``: Spark ML's JSON metadata (class, uid, the columns, the histories);
    ``path/model``: the pickled module (cloudpickle, so a class defined in a notebook loads),
    as Parquet rows, written by Spark (so DBFS, S3, HDFS... work as for any stage)."""

    def saveImpl(self, path: str) -> None:  # noqa: N802 - Spark ML's name
        import torch

        m = self.instance
        extra = {"feature_cols": list(m.feature_cols), "prediction_col": m.prediction_col,
                 "history": list(m.history), "val_history": list(m.val_history),
                 "metric_history": {k: list(v) for k, v in m.metric_history.items()},
                 "input_shapes": None if m.input_shapes is None else [list(s) for s in m.input_shapes],
                 "label_cols": list(m.label_cols), "torch_version": torch.__version__}
        self._save(path, "model", dumps(m.model), extraMetadata=extra)


class TorchModelReader(MLReader):
    """Reads back what :class:`TorchModelWriter` saved, as a ``cls`` (``TorchModel``)."""

    def __init__(self, cls: type[TorchModel]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> TorchModel:
        from spark_dl.transport import unpickle

        meta = _load_metadata(self.sparkSession, path, self.cls)
        module = unpickle.loads(_load_blob(self.sparkSession, os.path.join(path, "model")), unpickle.driver_device)
        shapes = meta["input_shapes"]
        model = self.cls(module, meta["feature_cols"], meta["prediction_col"], history=meta["history"],
                         val_history=meta["val_history"], metric_history=meta["metric_history"],
                         input_shapes=None if shapes is None else [tuple(s) for s in shapes],
                         label_cols=meta["label_cols"])
        model._resetUid(meta["uid"])
        return model
