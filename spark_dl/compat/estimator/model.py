"""``TorchModel``: what :meth:`TorchEstimator.fit <spark_dl.estimator.TorchEstimator.fit>` returns, a
Spark ML ``Model`` whose ``transform(df)`` adds the trained model's predictions to a DataFrame: a
``mapInArrow`` over it, with the model shipped to the executors (whose batches use
:mod:`spark_dl.compat.estimator.rank_loop`, not ``pyspark.ml``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from spark_dl.compat.estimator.options import column_list
from spark_dl.compat.estimator.persistence import TorchModelReader, TorchModelWriter
from spark_dl.compat.estimator.rank_loop import float_dtype, model_inputs
from spark_dl.driver.serialize import dumps  # cloudpickle's, keeping the model's code's file names
from spark_dl.errors import LaunchRefused


@dataclass(eq=False)  # Spark ML stages are compared (and hashed) by identity
class TorchModel(Model, MLWritable, MLReadable):
    """A trained model that adds its predictions to a DataFrame: ``transform(df)``. A Spark ML
    ``Model``: a ``Pipeline``'s fitted stage, saved with ``save(path)`` (or a ``PipelineModel``'s)
    on any file system Spark writes to, and read back with ``TorchModel.load(path)``."""

    model: Any
    feature_cols: list[str]
    prediction_col: str | list[str] = "prediction"
    history: list[float] = field(default_factory=list)  # per-epoch training loss, averaged over ranks
    val_history: list[float] = field(default_factory=list)  # per-epoch held-out loss (``validation``)
    metric_history: dict[str, list[float]] = field(default_factory=dict)  # ``metrics``: name / val_name -> per epoch
    input_shapes: list | None = None  # the estimator's: each feature column's batch is reshaped so
    label_cols: list[str] = field(default_factory=list)  # names a tuple-returning model's prediction columns

    def __post_init__(self) -> None:
        Model.__init__(self)  # Spark ML's Params: a uid, empty param maps

    def write(self) -> TorchModelWriter:
        """Spark ML's writer: ``model.write().overwrite().save(path)``; ``model.save(path)`` refuses
        a path that exists."""
        return TorchModelWriter(self)

    @classmethod
    def read(cls) -> TorchModelReader:
        """Spark ML's reader: ``TorchModel.read().load(path)``, or ``TorchModel.load(path)``."""
        return TorchModelReader(TorchModel)

    def getHistory(self) -> dict[str, list[float]]:  # noqa: N802 - Horovod's TorchModel name
        """Keras-style history: ``loss``, ``val_loss`` (with validation) and each metric's lists."""
        out = {"loss": list(self.history)}
        if self.val_history:
            out["val_loss"] = list(self.val_history)
        out.update({name: list(values) for name, values in self.metric_history.items()})
        return out

    def setOutputCols(self, value: str | list[str]) -> "TorchModel":  # noqa: N802 - Horovod's TorchModel name
        """Horovod's name for setting ``prediction_col``: the column(s) ``transform`` adds; returns self."""
        cols = column_list(value, "setOutputCols(value)")
        self.prediction_col = cols[0] if len(cols) == 1 else cols
        return self

    def getOutputCols(self) -> list[str]:  # noqa: N802 - Horovod's TorchModel name
        """``prediction_col`` as a list (a model with several outputs names one column each)."""
        return [self.prediction_col] if isinstance(self.prediction_col, str) else list(self.prediction_col)

    def getModel(self):  # noqa: N802 - Horovod's TorchModel name
        """The trained ``torch.nn.Module`` (on the CPU)."""
        return self.model

    def transform(self, dataset, params=None):
        """``dataset`` with the predictions added, computed on the executors in Arrow batches: for
        a model with one output, ``prediction_col`` holds it per row (a float for one number, else
        an array of floats); a model returning a tuple of outputs gets one column per output, named
        by ``prediction_col`` given as a list, else ``<prediction_col>_<label column>``."""
        return super().transform(dataset, params)

    def _transform(self, df):
        from pyspark.sql import types as T

        from spark_dl.driver.shards import as_array, check_dataframe, column_kinds, quoted

        check_dataframe(df, "TorchModel.transform(df)")
        kinds = column_kinds(df, self.feature_cols)
        sizes = _row_sizes(df, self.feature_cols, kinds, self.input_shapes)  # read before vectors become arrays
        # Spark ML Vector columns are read as arrays, from columns of their own dropped at the end
        vectors = {c: f"_spark_dl_vector_{i}" for i, c in enumerate(c for c, k in kinds.items() if k == "vector")}
        if vectors:
            df = df.withColumns({hidden: as_array(c) for c, hidden in vectors.items()})
            kinds = {c: "array" if k == "vector" else k for c, k in kinds.items()}
        source = [vectors.get(c, c) for c in self.feature_cols]  # the columns the features are read from
        widths, several = self._output_widths(df, kinds, source, {vectors.get(c, c): n for c, n in sizes.items()})
        names = self._prediction_names(widths, several)
        taken = [n for n in names if n in df.columns]
        if taken:
            raise LaunchRefused(f"the DataFrame already has a column {taken[0]!r}; pick another prediction_col")
        real = list(df.columns) + names
        fields = df.schema.fields
        plain = not any("." in c or "`" in c for c in real)
        if not plain:
            # mapInArrow resolves each column by its name, reading "a.b" as field b of a: the rows
            # travel under plain names, and the result gets the real ones back
            df = df.select(*[quoted(c).alias(f"_spark_dl_{i}") for i, c in enumerate(df.columns)])
            fields = [T.StructField(f"_spark_dl_{i}", f.dataType, f.nullable, f.metadata) for i, f in enumerate(fields)]
        out_names = names if plain else [f"_spark_dl_{len(fields) + i}" for i in range(len(names))]
        schema = T.StructType(fields + [
            T.StructField(name, T.FloatType() if width == 1 else T.ArrayType(T.FloatType()))
            for name, width in zip(out_names, widths)])
        blob = dumps(self.model)
        shapes = self.input_shapes
        cols = source if plain else [f"_spark_dl_{real.index(c)}" for c in source]
        named = dict(zip(cols, self.feature_cols))  # the real names, for the errors

        def predict(batches):
            import cloudpickle
            import pyarrow as pa
            import torch

            from spark_dl.compat.estimator.rank_loop import float_dtype, model_inputs

            model = cloudpickle.loads(blob).eval()
            dtype = float_dtype(model)
            for batch in batches:
                try:
                    inputs = model_inputs(batch, cols, kinds, dtype, shapes, named)
                except ValueError as e:  # a null: the message, not this frame, is what helps
                    raise ValueError(f"TorchModel.transform: {e}") from None
                with torch.no_grad():
                    outs = model(*inputs)
                columns = []
                for out, width in zip(outs if isinstance(outs, (list, tuple)) else [outs], widths):
                    flat = out.float().reshape(len(batch), -1).numpy()
                    if width == 1:
                        columns.append(pa.array(flat[:, 0], type=pa.float32()))
                    else:
                        offsets = pa.array(range(0, flat.size + 1, width), type=pa.int32())
                        columns.append(pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1), type=pa.float32())))
                yield pa.RecordBatch.from_arrays(list(batch.columns) + columns,
                                                 names=list(batch.schema.names) + out_names)

        out = df.mapInArrow(predict, schema)
        out = out if plain else out.toDF(*real)
        return out.drop(*vectors.values()) if vectors else out

    def _prediction_names(self, widths: list[int], several: bool) -> list[str]:
        """The prediction columns' names: one for a single output, one per output of a tuple."""
        col = self.prediction_col
        if not several:
            if not isinstance(col, str):
                raise LaunchRefused(f"the model returns one output, so prediction_col must be one name, got {col!r}")
            return [col]
        if isinstance(col, (list, tuple)):
            if len(col) != len(widths) or not all(isinstance(c, str) and c for c in col):
                raise LaunchRefused(f"the model returns {len(widths)} outputs: "
                                    f"prediction_col must name each, got {col!r}")
            return list(col)
        if len(self.label_cols) == len(widths):
            return [f"{col}_{label}" for label in self.label_cols]
        return [f"{col}_{i}" for i in range(len(widths))]

    def _output_widths(self, df, kinds, source: list[str], sizes: dict[str, int]) -> tuple[list[int], bool]:
        """How many numbers each of the model's outputs gives per row, and whether it returns several
        (a tuple), from one row run through the model on the driver: a row of zeros where the schema
        gives every column's size per row (``sizes``), so ``transform`` stays lazy as Spark ML's own
        transformers are, and runs no job that would cut short (and so end) the Python workers of
        UDFs upstream, such as another model's predictions; else the DataFrame's first row."""
        from spark_dl.driver.shards import quoted

        zeros = _zero_row(df, dict.fromkeys(source), sizes)
        if zeros is not None:
            try:
                return self._widths_on(zeros, kinds, source)
            except LaunchRefused:
                pass  # a model that refuses zeros is run on a real row, and its error told with that row
        # a column the model takes twice is read twice from one copy (Arrow's lookup refuses a name held twice)
        sample = df.select(*[quoted(c) for c in dict.fromkeys(source)]).limit(1).toArrow()
        if sample.num_rows == 0:
            raise LaunchRefused("the DataFrame is empty: nothing to predict (the model's output size is read off "
                                "its first row; input_shapes= gives the array columns' sizes without one)")
        return self._widths_on(sample, kinds, source)

    def _widths_on(self, sample, kinds, source: list[str]) -> tuple[list[int], bool]:
        import torch

        features = model_inputs(sample, source, kinds, float_dtype(self.model), self.input_shapes,
                                dict(zip(source, self.feature_cols)))
        training = self.model.training
        try:
            with torch.no_grad():
                out = self.model.eval()(*features)
        except Exception as e:  # noqa: BLE001 - the model's own error, with what it was given
            shapes = [tuple(f.shape) for f in features]
            raise LaunchRefused(f"running the model on one row of feature_cols {self.feature_cols} (tensors of shapes "
                                f"{shapes}) failed with {type(e).__name__}: {e}; the model must take one tensor per "
                                "feature column (input_shapes= reshapes them)") from e
        finally:
            self.model.train(training)  # the caller's model, in the mode it was in
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if not outs or not all(torch.is_tensor(o) for o in outs):
            raise LaunchRefused(f"the model must return a tensor or a tuple/list of tensors to predict with, got "
                                f"{type(out).__name__}")
        return [int(o.reshape(1, -1).shape[1]) for o in outs], isinstance(out, (list, tuple))


def _row_sizes(df, cols: list[str], kinds: dict[str, str], input_shapes) -> dict[str, int]:
    """How many numbers each feature column holds per row, where the schema says: 1 for a number, a
    Spark ML vector's size from its ``ml_attr`` metadata (VectorAssembler's, the scalers', PCA's),
    an array's from ``input_shapes`` (the batch dimension -1, the others fixed)."""
    fields = {f.name: f for f in df.schema.fields}
    sizes = {}
    for i, c in enumerate(cols):
        n = None
        if kinds[c] == "scalar":
            n = 1
        elif kinds[c] == "vector":
            n = (fields[c].metadata.get("ml_attr") or {}).get("num_attrs")
        elif input_shapes is not None and i < len(input_shapes):
            shape = list(input_shapes[i])
            if shape and shape[0] == -1 and all(isinstance(d, int) and d > 0 for d in shape[1:]):
                n = int(math.prod(shape[1:]))
        if isinstance(n, int) and n > 0:
            sizes[c] = n
    return sizes


def _zero_row(df, cols, sizes: dict[str, int]):
    """A one-row Arrow table of zeros in ``cols``' own types, or None if a column's size is unknown."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_type

    fields = {f.name: f.dataType for f in df.schema.fields}
    arrays = {}
    for c in cols:
        if c not in sizes:
            return None
        t = to_arrow_type(fields[c])
        element = t.value_type if pa.types.is_list(t) else t
        zero = False if pa.types.is_boolean(element) else 0
        arrays[c] = pa.array([[zero] * sizes[c]] if pa.types.is_list(t) else [zero], type=t)
    return pa.table(arrays)


__all__ = ["TorchModel"]
