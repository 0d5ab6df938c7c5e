"""Spark ML-style training: ``TorchEstimator(...).fit(df)`` trains on a DataFrame across ranks and
returns a ``TorchModel`` whose ``transform(df)`` adds a prediction column, in the manner of
Horovod's ``horovod.spark.torch.TorchEstimator``.

``fit`` is one :class:`spark_dl.HorovodRunner` run on :func:`spark_dl.data.shards` (a global shuffle
per epoch, no detour through the driver); ``transform`` is a ``mapInArrow`` over the DataFrame with
the trained model shipped to the executors.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .errors import LaunchRefused
from .runner import HorovodRunner, RunInfo


def _metrics(metrics: Any) -> dict[str, Callable[..., Any]]:
    """``metrics=`` as {name: function}: a mapping, or a list of functions named by ``__name__``."""
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        named = dict(metrics)
    elif isinstance(metrics, (list, tuple)):
        named = {}
        for fn in metrics:
            name = getattr(fn, "__name__", None)
            if not name or name == "<lambda>" or name in named:
                raise LaunchRefused("metrics given as a list need distinct function names; pass a dict "
                                    "{'accuracy': fn, ...} for lambdas, partials or repeated names")
            named[name] = fn
    else:
        raise LaunchRefused(f"metrics must be a dict {{name: fn(output, *labels)}} or a list of functions, "
                            f"got {type(metrics).__name__}")
    for name, fn in named.items():
        if not isinstance(name, str) or not name or name == "loss" or name.startswith("val_"):
            raise LaunchRefused(f"metric name {name!r}: use a non-empty name other than 'loss' not starting "
                                "with 'val_' (the history keys are the name and val_ + the name)")
        if not callable(fn):
            raise LaunchRefused(f"metric {name!r} must be a function (output, *labels) -> number, got "
                                f"{type(fn).__name__}")
    return named


def _input_shapes(shapes: Any, feature_cols: list[str]) -> list[tuple[int, ...]] | None:
    """``input_shapes=`` checked: one shape per feature column, ints, at most one -1 each."""
    if shapes is None:
        return None
    bad = LaunchRefused(f"input_shapes must be one shape per feature column ({len(feature_cols)}: {feature_cols}), "
                        f"each a list of ints with -1 for the batch, such as [[-1, 1, 8, 8]]; got {shapes!r}")
    if not isinstance(shapes, (list, tuple)) or len(shapes) != len(feature_cols):
        raise bad
    out = []
    for shape in shapes:
        if (not isinstance(shape, (list, tuple)) or not shape
                or any(isinstance(d, bool) or not isinstance(d, int) or d == 0 or d < -1 for d in shape)
                or list(shape).count(-1) > 1):
            raise bad
        out.append(tuple(shape))
    return out


def _reshaped(tensors: list, shapes: list[tuple[int, ...]] | None, cols: list[str]) -> list:
    """The model's inputs in ``input_shapes`` (unchanged without them)."""
    if shapes is None:
        return tensors
    out = []
    for t, shape, col in zip(tensors, shapes, cols):
        try:
            out.append(t.reshape(shape))
        except RuntimeError as e:
            raise ValueError(f"input_shapes gives column {col!r} the shape {list(shape)}, which its batch of "
                             f"shape {list(t.shape)} cannot take: {e}") from None
    return out


def _names(value: str | Sequence[str], what: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise LaunchRefused(f"{what} must be a column name or a non-empty list of them, got {value!r}")
    return names


class TorchEstimator:
    """Train ``model`` on a DataFrame's ``feature_cols`` against its ``label_cols``.

    Args:
        model: the ``torch.nn.Module`` to train; called as ``model(*features)``, one tensor per
            feature column (numeric columns: 1-D, arrays of numbers: 2-D).
        optimizer: an optimizer over ``model.parameters()`` (Horovod's style) or a function
            ``params -> optimizer`` (``functools.partial(torch.optim.SGD, lr=0.1)``).
        loss: ``loss(output, *labels) -> tensor`` (``torch.nn.functional.cross_entropy``).
        feature_cols, label_cols: column names (a str for one).
        batch_size: rows per rank per step; epochs: passes over the data.
        num_proc: ranks, in one Spark barrier stage.
        prediction_col: the column ``TorchModel.transform`` adds.
        shuffle, seed: a new global shuffle of the rows every epoch, from ``seed``.
        validation: as Horovod's: a fraction of the rows held out at random (``0.1``), or the name of
            a column whose true (or 1) rows are held out; their loss after each epoch is
            ``TorchModel.val_history``.
        input_shapes: as Horovod's, the shape each feature column's batch is given before the
            model sees it (one per feature column, -1 for the batch: ``[[-1, 1, 8, 8]]`` turns a
            64-number array column into images); used by ``fit`` and ``transform`` alike.
        sample_weight_col: a numeric column of per-row weights. As in Horovod, ``loss`` is then
            called with ``reduction="none"`` and the batch's loss is the mean of the weighted
            per-row losses (training and held-out rows alike).
        metrics: ``{name: fn(output, *labels) -> number}`` (or a list of named functions),
            computed on every batch without gradients and averaged over all ranks' rows each epoch:
            ``TorchModel.metric_history[name]``, and ``["val_" + name]`` on the held-out rows.
        gradient_compression: a compressor from :mod:`spark_dl.compression` (``FP16()``, ``QSGD()``,
            ``PowerSGD()``, ...; Horovod's ``hvd.Compression.fp16``) for the gradients' all-reduce,
            as a DDP communication hook.
        backward_passes_per_step: batches whose gradients are accumulated (averaged) before each
            optimizer step and all-reduce (Horovod's); 1 steps every batch.
        val_batch_size: rows per rank per held-out batch (default ``batch_size``).
        train_steps_per_epoch, validation_steps_per_epoch: at most this many batches per rank per
            epoch (default: all of the rank's share).
        runner_options: more :class:`spark_dl.HorovodRunner` options (``max_restarts``, ``tracking``,
            ``checkpoint_dir``, ``min_np``, ``grow_interval``, ...). Every epoch ends with a
            checkpoint, so a restarted or grown fit goes on from the last finished epoch.
    """

    def __init__(self, *, model, optimizer, loss: Callable[..., Any], feature_cols: str | Sequence[str],
                 label_cols: str | Sequence[str], batch_size: int = 32, epochs: int = 1, num_proc: int = 2,
                 prediction_col: str = "prediction", shuffle: bool = True, seed: int = 0,
                 validation: float | str | None = None, sample_weight_col: str | None = None,
                 input_shapes: Sequence[Sequence[int]] | None = None,
                 metrics: Mapping[str, Callable[..., Any]] | Sequence[Callable[..., Any]] | None = None,
                 gradient_compression: Any = None, backward_passes_per_step: int = 1,
                 val_batch_size: int | None = None, train_steps_per_epoch: int | None = None,
                 validation_steps_per_epoch: int | None = None, **runner_options: Any) -> None:
        import torch

        from .compression import Compressor

        if not isinstance(model, torch.nn.Module):
            raise LaunchRefused(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
            raise LaunchRefused(
                "optimizer must be a torch.optim.Optimizer over model.parameters() or a function params -> "
                f"optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, torch.optim.Optimizer):
            own = {id(p) for p in model.parameters()}
            if not all(id(p) in own for g in optimizer.param_groups for p in g["params"]):
                raise LaunchRefused("optimizer was built over parameters that are not model's: build it "
                                    "with model.parameters(), or pass a function params -> optimizer")
        if not callable(loss):
            raise LaunchRefused(f"loss must be a function (output, *labels) -> tensor, got {type(loss).__name__}")
        if validation is not None and not (isinstance(validation, str) and validation) and not (
                isinstance(validation, float) and 0 < validation < 1):
            raise LaunchRefused(f"validation must be a fraction of the rows in (0, 1) or a column name, got {validation!r}")
        for name, value in (("batch_size", batch_size), ("epochs", epochs), ("num_proc", num_proc),
                            ("backward_passes_per_step", backward_passes_per_step), ("val_batch_size", val_batch_size),
                            ("train_steps_per_epoch", train_steps_per_epoch),
                            ("validation_steps_per_epoch", validation_steps_per_epoch)):
            if value is None and name in _OPTIONAL_SIZES:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LaunchRefused(f"{name} must be an int >= 1, got {value!r}")
        if gradient_compression is not None and not isinstance(gradient_compression, Compressor):
            raise LaunchRefused(f"gradient_compression must be a compressor from spark_dl.compression (FP16(), QSGD(), "
                                f"PowerSGD(), ...) or None, got {type(gradient_compression).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.feature_cols = _names(feature_cols, "feature_cols")
        self.label_cols = _names(label_cols, "label_cols")
        self.batch_size = batch_size
        self.epochs = epochs
        self.num_proc = num_proc
        self.prediction_col = prediction_col
        self.shuffle = shuffle
        self.seed = seed
        self.validation = validation
        if sample_weight_col is not None and not (isinstance(sample_weight_col, str) and sample_weight_col):
            raise LaunchRefused(f"sample_weight_col must be a column name, got {sample_weight_col!r}")
        self.sample_weight_col = sample_weight_col
        self.input_shapes = _input_shapes(input_shapes, self.feature_cols)
        self.metrics = _metrics(metrics)
        self.gradient_compression = gradient_compression
        self.backward_passes_per_step = backward_passes_per_step
        self.val_batch_size = val_batch_size
        self.train_steps_per_epoch = train_steps_per_epoch
        self.validation_steps_per_epoch = validation_steps_per_epoch
        self.runner_options = runner_options
        self._runner = HorovodRunner(np=num_proc, **runner_options)  # bad options are refused now, not at fit()

    @property
    def last_run(self) -> RunInfo | None:
        """The latest ``fit()``'s :attr:`spark_dl.HorovodRunner.last_run`."""
        return self._runner.last_run

    def fit(self, df) -> "TorchModel":
        """Train across ``num_proc`` ranks; return the trained model as a :class:`TorchModel`."""
        from .data import shards

        columns = self.feature_cols + self.label_cols
        weights = self.sample_weight_col
        if weights is not None:
            if weights not in df.columns:
                raise LaunchRefused(f"sample_weight_col={weights!r} is not a column of the DataFrame (it has "
                                    f"{list(df.columns)})")
            columns = columns + [weights]
        train, held_out = self._split(df)
        data = shards(train, columns, shuffle=self.shuffle, seed=self.seed)
        # every held-out row once per rank's share ("pad" repeats a few when they do not divide evenly)
        val = shards(held_out, columns, shuffle=False, remainder="pad") if held_out is not None else None
        out = self._runner.run(_fit, data=data, validation=val, model=self.model, optimizer=self.optimizer, loss=self.loss,
                               feature_cols=self.feature_cols, label_cols=self.label_cols,
                               batch_size=self.batch_size, epochs=self.epochs, metrics=self.metrics,
                               weight_col=weights, input_shapes=self.input_shapes,
                               options=_FitOptions(self.gradient_compression, self.backward_passes_per_step,
                                                   self.val_batch_size or self.batch_size, self.train_steps_per_epoch,
                                                   self.validation_steps_per_epoch))
        trained = copy.deepcopy(self.model).cpu()
        trained.load_state_dict(out["state"])
        return TorchModel(trained, self.feature_cols, self.prediction_col, history=out["history"],
                          val_history=out["val_history"], metric_history=out["metric_history"],
                          input_shapes=self.input_shapes)

    def _split(self, df):
        """(training rows, held-out rows or None), as ``validation`` says."""
        v = self.validation
        if v is None:
            return df, None
        if isinstance(v, float):
            train, held_out = df.randomSplit([1 - v, v], seed=self.seed)
            return train, held_out
        from pyspark.sql import functions as F

        if v not in df.columns:
            raise LaunchRefused(f"validation={v!r} is not a column of the DataFrame (it has {list(df.columns)}); "
                                "pass a column of booleans or 0/1, or a fraction such as 0.1")
        held = F.coalesce(F.col(v).cast("boolean"), F.lit(False))
        return df.filter(~held), df.filter(held)


_OPTIONAL_SIZES = ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch")
_CHECKPOINT_KEY = "spark_dl.estimator"


@dataclass(frozen=True)
class _FitOptions:
    compression: Any = None
    passes: int = 1  # backward passes per optimizer step
    val_batch_size: int = 32
    train_steps: int | None = None
    val_steps: int | None = None


def _fit(data, validation, model, optimizer, loss, feature_cols, label_cols, batch_size, epochs, metrics,
         weight_col=None, input_shapes=None, options: _FitOptions = _FitOptions()):
    """Each rank: DDP over the rank's device, one pass over its shard per epoch; rank 0 returns the
    trained weights, the per-epoch loss averaged over every rank's batches, the metrics averaged
    over every rank's rows and, with ``validation``, the held-out rows' loss and metrics after
    each epoch (averaged over rows). Each epoch ends with a checkpoint, and a restarted attempt
    starts after the last one checkpointed."""
    import contextlib
    import itertools

    import torch
    import torch.distributed as dist

    import spark_dl

    from .prepare import prepare_model

    spark_dl.init()
    saved = spark_dl.load_checkpoint()
    saved = saved.get(_CHECKPOINT_KEY) if isinstance(saved, dict) else None
    if saved is not None:  # before DDP wraps the model: it broadcasts rank 0's parameters, the same on every rank
        model.load_state_dict(saved["model"])
    # .to(device) moves parameters in place, so an optimizer unpickled with the model still holds them
    ddp = prepare_model(model)
    opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(ddp.parameters())
    if options.compression is not None and isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        from .compression.ddp import make_ddp_hook

        ddp.register_comm_hook(*make_ddp_hook(options.compression))
    device = spark_dl.get_device()
    dtype = _float_dtype(model)
    history, val_history = [], []
    metric_history: dict[str, list[float]] = {}
    start = 0
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])  # after the move: its state follows the parameters' device
        history, val_history, metric_history = saved["history"], saved["val_history"], saved["metric_history"]
        start = saved["epoch"] + 1
    passes = options.passes
    # the weights on the CPU, as the last checkpoint has them (epochs >= 1: a fresh fit saves one)
    state = saved["model"] if saved is not None else None
    for epoch in range(start, epochs):
        total = torch.zeros(2, dtype=torch.float64)
        scores = _Scores(metrics)
        batches = itertools.islice(data.batches(batch_size=batch_size, epoch=epoch), options.train_steps)
        upcoming = next(batches, None)
        accumulated = 0
        opt.zero_grad()
        while upcoming is not None:
            batch, upcoming = upcoming, next(batches, None)
            accumulated += 1
            # every rank has as many batches, so all agree on which backward pass all-reduces
            steps_now = accumulated == passes or upcoming is None
            with contextlib.nullcontext() if steps_now or not hasattr(ddp, "no_sync") else ddp.no_sync():
                output, labels = _forward(ddp, batch, feature_cols, label_cols, device, dtype, input_shapes)
                value = _loss(loss, output, labels, batch, weight_col, device, dtype)
                value.backward()
            if steps_now:
                if accumulated > 1:  # the mean of the accumulated batches' gradients
                    for p in ddp.parameters():
                        if p.grad is not None:
                            p.grad.div_(accumulated)
                opt.step()
                opt.zero_grad()
                accumulated = 0
            total += torch.tensor([value.item(), 1.0], dtype=torch.float64)
            scores.add(output.detach(), labels, len(batch[feature_cols[0]]))
        dist.all_reduce(total)
        history.append(total[0].item() / max(total[1].item(), 1.0))
        logged = {"train_loss": history[-1]}
        for name, score in scores.result().items():
            metric_history.setdefault(name, []).append(score)
            logged[f"train_{name}"] = score
        if validation is not None:
            val_loss, val_scores = _held_out(validation, getattr(ddp, "module", ddp), loss, metrics, feature_cols,
                                             label_cols, options.val_batch_size, device, dtype, weight_col,
                                             input_shapes, options.val_steps)
            val_history.append(val_loss)
            logged["val_loss"] = val_loss
            for name, score in val_scores.items():
                metric_history.setdefault(f"val_{name}", []).append(score)
                logged[f"val_{name}"] = score
        spark_dl.log_metrics(logged, step=epoch)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        spark_dl.save_checkpoint({_CHECKPOINT_KEY: {
            "epoch": epoch, "model": state,
            "optimizer": opt.state_dict(), "history": history, "val_history": val_history,
            "metric_history": metric_history}}, step=epoch)
    return {"state": state, "history": history,
            "val_history": val_history, "metric_history": metric_history}


class _Scores:
    """Row-weighted sums of each metric over an epoch's batches, averaged over every rank's rows."""

    def __init__(self, metrics) -> None:
        import torch

        self.metrics = metrics
        self.sums = torch.zeros(len(metrics) + 1, dtype=torch.float64)  # the last one counts rows

    def add(self, output, labels, rows: int) -> None:
        import torch

        if not self.metrics:
            return
        with torch.no_grad():
            for i, (name, fn) in enumerate(self.metrics.items()):
                value = fn(output, *labels)
                value = value.item() if torch.is_tensor(value) else float(value)
                self.sums[i] += value * rows
        self.sums[-1] += rows

    def result(self) -> dict[str, float]:
        import torch.distributed as dist

        if not self.metrics:
            return {}
        dist.all_reduce(self.sums)
        rows = max(self.sums[-1].item(), 1.0)
        return {name: self.sums[i].item() / rows for i, name in enumerate(self.metrics)}


def _held_out(val, model, loss, metrics, feature_cols, label_cols, batch_size, device, dtype, weight_col=None,
              input_shapes=None, steps=None):
    """The loss and metrics over every rank's held-out rows (its first ``steps`` batches), weighted
    by rows (batches may be short)."""
    import itertools

    import torch
    import torch.distributed as dist

    total = torch.zeros(2, dtype=torch.float64)
    scores = _Scores(metrics)
    model.eval()
    with torch.no_grad():
        for batch in itertools.islice(val.batches(batch_size=batch_size), steps):
            output, labels = _forward(model, batch, feature_cols, label_cols, device, dtype, input_shapes)
            rows = len(batch[feature_cols[0]])
            value = _loss(loss, output, labels, batch, weight_col, device, dtype)
            total += torch.tensor([value.item() * rows, rows], dtype=torch.float64)
            scores.add(output, labels, rows)
    model.train()
    dist.all_reduce(total)
    return total[0].item() / max(total[1].item(), 1.0), scores.result()


def _float_dtype(model):
    """The dtype of the model's floating parameters (float32 unless it was converted)."""
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _features(table, cols, kinds, dtype, input_shapes=None):
    """The model's inputs from an Arrow table or batch: one CPU tensor per feature column."""
    from .data import _to_tensor

    return _reshaped([_as(_to_tensor(table.column(c), kinds[c], c), "cpu", dtype) for c in cols], input_shapes, cols)


def _loss(loss, output, labels, batch, weight_col, device, dtype):
    """The batch's loss; with a weight column, Horovod's rule: mean of weight * per-row loss."""
    if weight_col is None:
        return loss(output, *labels)
    try:
        per_row = loss(output, *labels, reduction="none")
    except TypeError as e:
        raise TypeError(f"sample_weight_col needs a loss that takes reduction='none' and returns one loss per "
                        f"row (torch.nn.functional's losses do); calling it that way failed: {e}") from e
    weights = _as(batch[weight_col], device, dtype)
    if per_row.dim() == 0 or per_row.shape[0] != weights.shape[0]:
        raise ValueError(f"with sample_weight_col, loss(..., reduction='none') must return one value per row "
                         f"(first dimension {weights.shape[0]}), got shape {tuple(per_row.shape)}")
    return (per_row * weights.view(-1, *[1] * (per_row.dim() - 1))).mean()


def _forward(model, batch, feature_cols, label_cols, device, dtype, input_shapes=None):
    """``(model(*features), labels)`` for one batch of shard rows."""
    features = _reshaped([_as(batch[c], device, dtype) for c in feature_cols], input_shapes, feature_cols)
    return model(*features), [_as(batch[c], device, dtype) for c in label_cols]


def _as(tensor, device, dtype):
    """A column's tensor on ``device``; floating columns in the model's dtype (a Spark double column
    would otherwise meet float32 weights), integer ones (class labels) as they are."""
    return tensor.to(device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


@dataclass
class TorchModel:
    """A trained model that adds its predictions to a DataFrame: ``transform(df)``."""

    model: Any
    feature_cols: list[str]
    prediction_col: str = "prediction"
    history: list[float] = field(default_factory=list)  # per-epoch training loss, averaged over ranks
    val_history: list[float] = field(default_factory=list)  # per-epoch held-out loss (``validation``)
    metric_history: dict[str, list[float]] = field(default_factory=dict)  # ``metrics``: name / val_name -> per epoch
    input_shapes: list | None = None  # the estimator's: each feature column's batch is reshaped so

    def getHistory(self) -> dict[str, list[float]]:  # noqa: N802 - Horovod's TorchModel name
        """Keras-style history: ``loss``, ``val_loss`` (with validation) and each metric's lists."""
        out = {"loss": list(self.history)}
        if self.val_history:
            out["val_loss"] = list(self.val_history)
        out.update({name: list(values) for name, values in self.metric_history.items()})
        return out

    def getModel(self):  # noqa: N802 - Horovod's TorchModel name
        """The trained ``torch.nn.Module`` (on the CPU)."""
        return self.model

    def transform(self, df):
        """``df`` with ``prediction_col`` added: the model's output per row (a float for one output,
        else an array of floats), computed on the executors in Arrow batches."""
        import cloudpickle
        from pyspark.sql import types as T

        from .data import column_kinds

        if self.prediction_col in df.columns:
            raise LaunchRefused(f"the DataFrame already has a column {self.prediction_col!r}; "
                                "pick another prediction_col")
        kinds = column_kinds(df, self.feature_cols)
        width = self._output_width(df, kinds)
        out_type = T.FloatType() if width == 1 else T.ArrayType(T.FloatType())
        schema = T.StructType(df.schema.fields + [T.StructField(self.prediction_col, out_type)])
        blob = cloudpickle.dumps(self.model)
        cols, name, shapes = self.feature_cols, self.prediction_col, self.input_shapes

        def predict(batches):
            import cloudpickle
            import pyarrow as pa
            import torch

            from spark_dl.estimator import _features, _float_dtype

            model = cloudpickle.loads(blob).eval()
            dtype = _float_dtype(model)
            for batch in batches:
                with torch.no_grad():
                    out = model(*_features(batch, cols, kinds, dtype, shapes)).float()
                flat = out.reshape(len(batch), -1).numpy()
                if width == 1:
                    column = pa.array(flat[:, 0], type=pa.float32())
                else:
                    offsets = pa.array(range(0, flat.size + 1, width), type=pa.int32())
                    column = pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1), type=pa.float32()))
                yield pa.RecordBatch.from_arrays(list(batch.columns) + [column],
                                                 names=list(batch.schema.names) + [name])

        return df.mapInArrow(predict, schema)

    def _output_width(self, df, kinds) -> int:
        """How many numbers the model gives per row, from one row run through it on the driver."""
        import torch

        sample = df.select(*self.feature_cols).limit(1).toArrow()
        if sample.num_rows == 0:
            raise LaunchRefused("the DataFrame is empty: nothing to predict")
        with torch.no_grad():
            out = self.model.eval()(*_features(sample, self.feature_cols, kinds, _float_dtype(self.model),
                                               self.input_shapes))
        return int(out.reshape(1, -1).shape[1])
