"""Spark ML-style training: ``TorchEstimator(...).fit(df)`` trains on a DataFrame across ranks and
returns a ``TorchModel`` whose ``transform(df)`` adds a prediction column, in the manner of
Horovod's ``horovod.spark.torch.TorchEstimator``.

``fit`` is one :class:`spark_dl.HorovodRunner` run on :func:`spark_dl.data.shards` (a global shuffle
per epoch, no detour through the driver); ``transform`` is a ``mapInArrow`` over the DataFrame with
the trained model shipped to the executors.
"""
from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .callbacks import EarlyStopping, Trainer
from .errors import LaunchRefused, as_int
from .runner import HorovodRunner, RunInfo
from .tensors import comm_device


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


def _input_shapes(shapes: Any, feature_cols: list[str], what: str = "input_shapes",
                  kind: str = "feature") -> list[tuple[int, ...]] | None:
    """``input_shapes=`` (or ``label_shapes=``) checked: one shape per column, ints, at most one -1 each."""
    if shapes is None:
        return None
    bad = LaunchRefused(f"{what} must be one shape per {kind} column ({len(feature_cols)}: {feature_cols}), "
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


def _reshaped(tensors: list, shapes: list[tuple[int, ...]] | None, cols: list[str],
              what: str = "input_shapes") -> list:
    """The model's inputs in ``input_shapes`` (labels in ``label_shapes``; unchanged without them)."""
    if shapes is None:
        return tensors
    out = []
    for t, shape, col in zip(tensors, shapes, cols):
        try:
            out.append(t.reshape(shape))
        except RuntimeError as e:
            raise ValueError(f"{what} gives column {col!r} the shape {list(shape)}, which its batch of "
                             f"shape {list(t.shape)} cannot take: {e}") from None
    return out


def _losses(loss: Any, constructors: Any, weights: Any, label_cols: list[str]) -> "_Losses":
    """``loss`` / ``loss_constructors`` / ``loss_weights`` checked, as Horovod reads them: a list of
    losses (or weights) means one loss per model output and label column."""
    if (loss is None) == (constructors is None):
        raise LaunchRefused("pass exactly one of loss= (a function (output, *labels) -> tensor, or a list of them) "
                            "and loss_constructors= (functions that build the loss on each rank)")
    given, what = (loss, "loss") if loss is not None else (constructors, "loss_constructors")
    fns = list(given) if isinstance(given, (list, tuple)) else [given]
    n = len(label_cols)
    if not fns or not all(callable(fn) for fn in fns):
        kind = "a function (output, *labels) -> tensor" if loss is not None else "a function () -> loss"
        raise LaunchRefused(f"{what} must be {kind} or a list of them (one per label column), got {given!r}")
    import torch

    classes = [fn for fn in fns if isinstance(fn, type) and issubclass(fn, torch.nn.Module)]
    if loss is not None and classes:
        name = f"{classes[0].__module__}.{classes[0].__qualname__}"
        raise LaunchRefused(f"loss is the class {name}, not a loss: pass an instance, loss={name}(), or the class as "
                            f"loss_constructors=[{name}] (built on each rank)")
    per_output = isinstance(given, (list, tuple)) or weights is not None
    if per_output and len(fns) not in (1, n):
        raise LaunchRefused(f"{what} has {len(fns)} losses for {n} label columns {label_cols}: give one per label "
                            "column (in their order), or one for all")
    if weights is not None:
        if (not isinstance(weights, (list, tuple)) or len(weights) != n
                or any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in weights)):
            raise LaunchRefused(f"loss_weights must be a list of {n} numbers, one per label column {label_cols}, "
                                f"got {weights!r}")
    if not per_output:
        return _Losses(tuple(fns), None, constructors is not None, tuple(label_cols))
    if weights is None:
        weights = [1.0 / n] * n  # Horovod's default: the losses' mean
    return _Losses(tuple(fns * n if len(fns) == 1 else fns), tuple(float(w) for w in weights), constructors is not None,
                   tuple(label_cols))


@dataclass(frozen=True)
class _Losses:
    """How a batch's loss is computed: one ``loss(output, *labels)``, or (``weights`` set) one loss
    per model output and label column, ``sum(w_i * loss_i(output_i, label_i))``."""

    fns: tuple
    weights: tuple[float, ...] | None = None
    constructors: bool = False  # fns build the losses: called once on each rank
    label_cols: tuple[str, ...] = ()  # named by a loss's refusal of a label's dtype

    def built(self) -> "_Losses":
        if not self.constructors:
            return self
        return _Losses(tuple(make() for make in self.fns), self.weights, False, self.label_cols)

    def outputs(self, output: Any, labels: list) -> tuple[Any, list]:
        """Horovod's ``transform_outputs``: per output, the outputs as a list (one per label column)
        and each label reshaped to its output's shape where they hold as many numbers."""
        if self.weights is None:
            return output, labels
        outs = list(output) if isinstance(output, (list, tuple)) else [output]
        if len(outs) != len(labels):
            raise ValueError(f"with a loss per label column the model must return one output per label column "
                             f"({len(labels)}), as a tuple; it returned {len(outs)}")
        labels = [label.reshape(out.shape) if hasattr(out, "shape") and out.shape.numel() == label.numel() else label
                  for out, label in zip(outs, labels)]
        return outs, labels

    def __call__(self, output: Any, labels: list, sample_weights: Any = None) -> Any:
        """The batch's loss; with ``sample_weights`` Horovod's rule for each loss: the mean of
        weight x per-row loss."""
        if self.weights is None:
            return _label_checked(self.fns[0], output, labels, sample_weights, self.label_cols)
        outs, labels = self.outputs(output, labels)
        return sum(w * _label_checked(fn, out, [label], sample_weights, (col,))
                   for fn, w, out, label, col in zip(self.fns, self.weights, outs, labels, self.label_cols))


def _label_checked(loss, output, labels, weights, cols):
    """``_weighted``; a loss's refusal of its target's dtype re-raised naming the label column, its
    dtype and the cast that fixes it (class indices must be integers, BCE/MSE targets floats)."""
    try:
        return _weighted(loss, output, labels, weights)
    except RuntimeError as e:
        import torch

        msg = str(e)
        if not re.search(r"dtype|scalar type|output type", msg):
            raise
        named = list(zip(cols, labels)) if len(cols) == len(labels) else []
        floating = [(c, t) for c, t in named if t.is_floating_point()]
        integer = [(c, t) for c, t in named if not t.is_floating_point() and t.dtype != torch.bool]
        if floating and "Long" in msg:
            (col, t), cast, kind = floating[0], "long", "class indices (cross_entropy, nll_loss) must be integers"
        elif integer and re.search(r"Float|Double|Half", msg):
            (col, t), cast, kind = integer[0], "float", "targets of BCE or MSE losses must be floats"
        else:
            raise
        raise TypeError(f"the loss refused label column {col!r}, read as {t.dtype} ({msg}): {kind}; cast the column "
                        f"first: df.withColumn({col!r}, F.col({col!r}).cast(\"{cast}\"))") from e


def _weighted(loss, output, labels, weights):
    """``loss(output, *labels)``; with per-row ``weights``, the mean of weight x per-row loss."""
    if weights is None:
        return loss(output, *labels)
    try:
        per_row = loss(output, *labels, reduction="none")
    except TypeError as e:
        raise TypeError(f"sample_weight_col needs a loss that takes reduction='none' and returns one loss per "
                        f"row (torch.nn.functional's losses do); calling it that way failed: {e}") from e
    if per_row.dim() == 0 or per_row.shape[0] != weights.shape[0]:
        raise ValueError(f"with sample_weight_col, loss(..., reduction='none') must return one value per row "
                         f"(first dimension {weights.shape[0]}), got shape {tuple(per_row.shape)}")
    return (per_row * weights.view(-1, *[1] * (per_row.dim() - 1))).mean()


# Horovod's Petastorm reader settings: this estimator reads DataFrame shards, so they have no use
_READER_OPTIONS = ("shuffle_buffer_size", "partitions_per_process", "train_reader_num_workers",
                   "val_reader_num_workers", "reader_pool_type", "inmemory_cache_all", "mp_start_method")


def _runner_options(options: dict[str, Any]) -> dict[str, Any]:
    """The constructor's other keyword arguments as :class:`HorovodRunner` options; Horovod's
    ``store``/``run_id``/``backend`` are refused with what to use, its reader settings ignored."""
    import inspect
    import warnings

    options = dict(options)
    if "store" in options or "run_id" in options:
        raise LaunchRefused("store= and run_id= are Horovod's Store, which this estimator does not use: pass "
                            "checkpoint_dir='/dbfs/...' (one directory per estimator and data) for its checkpoints and "
                            "resuming; the trained model is the returned TorchModel's (and the MLflow run's)")
    if "backend" in options:
        raise LaunchRefused("backend= is Horovod's SparkBackend: here the ranks are one barrier stage of num_proc "
                            "tasks; pass num_proc and HorovodRunner's options (max_restarts, env, start_timeout, ...)")
    ignored = [name for name in _READER_OPTIONS if options.pop(name, None) is not None]
    if ignored:
        warnings.warn(f"TorchEstimator: {', '.join(ignored)} tune Horovod's Petastorm reader, which this estimator "
                      "does not use (each rank reads its DataFrame shard): ignored", stacklevel=3)
    known = [n for n in inspect.signature(HorovodRunner.__init__).parameters if n not in ("self", "np")]
    unknown = [n for n in options if n not in known]
    if unknown:
        hint = " (the ranks are num_proc)" if "np" in unknown else ""
        raise LaunchRefused(f"TorchEstimator got unknown options {unknown}{hint}: they are neither its own nor "
                            f"HorovodRunner's ({', '.join(known)})")
    return options


def _names(value: str | Sequence[str], what: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
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
        loss: ``loss(output, *labels) -> tensor`` (``torch.nn.functional.cross_entropy``); or, for
            a model with one output per label column, a list of losses, one per output (Horovod's),
            whose weighted sum (``loss_weights``) is the batch's loss.
        loss_constructors: in place of ``loss``, functions that build the loss(es) on each rank
            (``lambda: torch.nn.CrossEntropyLoss(label_smoothing=0.1)``): one, or a list of them.
        loss_weights: one weight per label column for a per-output loss (default ``1 / len(label_cols)``
            each, Horovod's); given with a single loss, that loss is used for every output.
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
        transformation_fn: ``fn(batch) -> batch`` on each rank for every training and held-out
            batch (a dict of column name -> tensor on the CPU, as read), before the model sees it:
            normalisation, augmentation, label encoding.
        train_minibatch_fn: Horovod's custom step: a function returning ``train_minibatch(model,
            optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs,
            loss)``, which then runs each batch's zero_grad/forward/backward/step itself.
        callbacks: objects with ``on_train_begin`` / ``on_epoch_begin`` / ``on_epoch_end`` /
            ``on_train_end`` hooks run on every rank (:mod:`spark_dl.callbacks`, ``EarlyStopping``).
        train_steps_per_epoch, validation_steps_per_epoch: at most this many batches per rank per
            epoch (default: all of the rank's share).
        runner_options: more :class:`spark_dl.HorovodRunner` options (``max_restarts``, ``tracking``,
            ``checkpoint_dir``, ``min_np``, ``grow_interval``, ...). Every epoch ends with a
            checkpoint, so a restarted or grown fit goes on from the last finished epoch.
    """

    def __init__(self, *, model, optimizer, loss: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
                 feature_cols: str | Sequence[str],
                 label_cols: str | Sequence[str], batch_size: int = 32, epochs: int = 1, num_proc: int = 2,
                 prediction_col: str = "prediction", shuffle: bool = True, seed: int = 0,
                 validation: float | str | None = None, sample_weight_col: str | None = None,
                 input_shapes: Sequence[Sequence[int]] | None = None,
                 metrics: Mapping[str, Callable[..., Any]] | Sequence[Callable[..., Any]] | None = None,
                 gradient_compression: Any = None, backward_passes_per_step: int = 1,
                 val_batch_size: int | None = None, train_steps_per_epoch: int | None = None,
                 validation_steps_per_epoch: int | None = None,
                 loss_constructors: Callable[[], Any] | Sequence[Callable[[], Any]] | None = None,
                 loss_weights: Sequence[float] | None = None, transformation_fn: Callable[[dict], dict] | None = None,
                 train_minibatch_fn: Callable[[], Callable[..., Any]] | None = None,
                 callbacks: Sequence[Any] | None = None, label_shapes: Sequence[Sequence[int]] | None = None,
                 log_model: bool = True, verbose: int = 1, random_seed: int | None = None, use_gpu: bool = True,
                 **runner_options: Any) -> None:
        import torch

        from . import callbacks as _callbacks
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
        if validation is not None and not (isinstance(validation, str) and validation) and not (
                isinstance(validation, float) and 0 < validation < 1):
            raise LaunchRefused(f"validation must be a fraction of the rows in (0, 1) or a column name, got {validation!r}")
        for name, value in (("batch_size", batch_size), ("epochs", epochs), ("num_proc", num_proc),
                            ("backward_passes_per_step", backward_passes_per_step), ("val_batch_size", val_batch_size),
                            ("train_steps_per_epoch", train_steps_per_epoch),
                            ("validation_steps_per_epoch", validation_steps_per_epoch)):
            if value is None and name in _OPTIONAL_SIZES:
                continue
            if as_int(value) is None or value < 1:
                raise LaunchRefused(f"{name} must be an int >= 1, got {value!r}")
        batch_size, epochs, num_proc, backward_passes_per_step = (
            as_int(batch_size), as_int(epochs), as_int(num_proc), as_int(backward_passes_per_step))
        val_batch_size, train_steps_per_epoch, validation_steps_per_epoch = (
            None if v is None else as_int(v) for v in (val_batch_size, train_steps_per_epoch, validation_steps_per_epoch))
        if gradient_compression is not None and not isinstance(gradient_compression, Compressor):
            raise LaunchRefused(f"gradient_compression must be a compressor from spark_dl.compression (FP16(), QSGD(), "
                                f"PowerSGD(), ...) or None, got {type(gradient_compression).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.feature_cols = _names(feature_cols, "feature_cols")
        self.label_cols = _names(label_cols, "label_cols")
        self.loss, self.loss_constructors, self.loss_weights = loss, loss_constructors, loss_weights
        self._losses = _losses(loss, loss_constructors, loss_weights, self.label_cols)
        for name, fn in (("transformation_fn", transformation_fn), ("train_minibatch_fn", train_minibatch_fn)):
            if fn is not None and not callable(fn):
                raise LaunchRefused(f"{name} must be a function, got {type(fn).__name__}")
        if train_minibatch_fn is not None and backward_passes_per_step != 1:
            raise LaunchRefused("train_minibatch_fn runs each batch's optimizer step itself, so "
                                f"backward_passes_per_step={backward_passes_per_step} cannot apply: accumulate "
                                "gradients inside it, or leave backward_passes_per_step at 1")
        self.transformation_fn = transformation_fn
        self.train_minibatch_fn = train_minibatch_fn
        try:
            self.callbacks = _callbacks.check(callbacks)
        except TypeError as e:
            raise LaunchRefused(str(e)) from None
        self.batch_size = batch_size
        self.epochs = epochs
        self.num_proc = num_proc
        self.prediction_col = prediction_col
        self.shuffle = shuffle
        self.validation = validation
        if sample_weight_col is not None and not (isinstance(sample_weight_col, str) and sample_weight_col):
            raise LaunchRefused(f"sample_weight_col must be a column name, got {sample_weight_col!r}")
        self.sample_weight_col = sample_weight_col
        self.input_shapes = _input_shapes(input_shapes, self.feature_cols)
        self.label_shapes = _input_shapes(label_shapes, self.label_cols, "label_shapes", "label")
        if not isinstance(log_model, bool):
            raise LaunchRefused(f"log_model must be True or False, got {log_model!r}")
        self.log_model = log_model
        self.metrics = _metrics(metrics)
        self._check_monitors()
        self.gradient_compression = gradient_compression
        self.backward_passes_per_step = backward_passes_per_step
        self.val_batch_size = val_batch_size
        self.train_steps_per_epoch = train_steps_per_epoch
        self.validation_steps_per_epoch = validation_steps_per_epoch
        if verbose not in (0, 1, 2) or isinstance(verbose, bool):
            raise LaunchRefused(f"verbose must be 0, 1 or 2, got {verbose!r}")
        if random_seed is not None and as_int(random_seed) is None:
            raise LaunchRefused(f"random_seed must be an int or None, got {random_seed!r}")
        random_seed = None if random_seed is None else as_int(random_seed)
        if as_int(seed) is None:
            raise LaunchRefused(f"seed must be an int (the shuffle's and the validation split's), got {seed!r}")
        self.seed = as_int(seed)
        if not isinstance(shuffle, bool):
            raise LaunchRefused(f"shuffle must be True or False, got {shuffle!r}")
        if not (isinstance(prediction_col, str) and prediction_col) and not (
                isinstance(prediction_col, (list, tuple)) and prediction_col
                and all(isinstance(c, str) and c for c in prediction_col)):
            raise LaunchRefused(f"prediction_col must be a column name or a list of them (one per model output), "
                                f"got {prediction_col!r}")
        if not isinstance(use_gpu, bool):
            raise LaunchRefused(f"use_gpu must be True or False, got {use_gpu!r}")
        self.verbose, self.random_seed, self.use_gpu = verbose, random_seed, use_gpu
        runner_options = _runner_options(runner_options)
        if not use_gpu:  # the ranks see no GPU, so they train on the CPU
            runner_options["env"] = {**(runner_options.get("env") or {}), "CUDA_VISIBLE_DEVICES": ""}
        self.runner_options = runner_options
        self._runner = HorovodRunner(np=num_proc, **runner_options)  # bad options are refused now, not at fit()

    def _check_monitors(self) -> None:
        """An ``EarlyStopping`` that watches a history key this fit will not have is refused now,
        not after its first epoch."""
        keys = ["loss"] + list(self.metrics)
        if self.validation is not None:
            keys += ["val_" + k for k in keys]
        for cb in self.callbacks:
            if isinstance(cb, EarlyStopping) and cb.monitor not in keys:
                hint = " (the val_ keys need validation=)" if cb.monitor.startswith("val_") else ""
                raise LaunchRefused(f"EarlyStopping monitors {cb.monitor!r}, which this fit will not log{hint}; "
                                    f"it logs {keys}")

    @property
    def last_run(self) -> RunInfo | None:
        """The latest ``fit()``'s :attr:`spark_dl.HorovodRunner.last_run`."""
        return self._runner.last_run

    def fit(self, df) -> "TorchModel":
        """Train across ``num_proc`` ranks; return the trained model as a :class:`TorchModel`."""
        from .data import check_dataframe, shards

        check_dataframe(df, "TorchEstimator.fit(df)")

        columns = self.feature_cols + self.label_cols
        weights = self.sample_weight_col
        if weights is not None:
            if weights not in df.columns:
                raise LaunchRefused(f"sample_weight_col={weights!r} is not a column of the DataFrame (it has "
                                    f"{list(df.columns)})")
            columns = columns + [weights]
        train, held_out = self._split(df)
        data = shards(train, columns, shuffle=self.shuffle, seed=self.seed)
        data.few_rows_reason = "each rank trains on rows of its own"
        data.few_rows_hint = (f"give it at least num_proc={self.num_proc} rows, or use a smaller num_proc"
                              + (" (or hold fewer rows out with validation=)" if self.validation is not None else ""))
        # every held-out row once per rank's share ("pad" repeats a few when they do not divide evenly;
        # _held_out leaves the repeats out)
        val = shards(held_out, columns, shuffle=False, remainder="pad") if held_out is not None else None
        if val is not None:
            v = self.validation
            val.empty_hint = (
                f": validation={v!r} held out no rows; hold out a larger fraction (validation=0.2), mark the held-out "
                "rows with a column (validation='is_val'), or leave validation=None" if isinstance(v, float) else
                f": no row of column {v!r} is true (or 1); mark some rows, or pass a fraction such as validation=0.1")
        try:
            out = self._runner.run(_fit, data=data, validation=val, model=self.model, optimizer=self.optimizer,
                                   loss=self._losses, feature_cols=self.feature_cols, label_cols=self.label_cols,
                                   batch_size=self.batch_size, epochs=self.epochs, metrics=self.metrics,
                                   weight_col=weights, input_shapes=self.input_shapes,
                                   options=_FitOptions(self.gradient_compression, self.backward_passes_per_step,
                                                       self.val_batch_size or self.batch_size, self.train_steps_per_epoch,
                                                       self.validation_steps_per_epoch, self.transformation_fn,
                                                       self.train_minibatch_fn, tuple(self.callbacks),
                                                       self.label_shapes, self.log_model, self.verbose,
                                                       self.random_seed))
        except LaunchRefused as e:
            raise _in_estimator_terms(e) from e.__cause__
        trained = copy.deepcopy(self.model).cpu()
        trained.load_state_dict(out["state"])
        return TorchModel(trained, self.feature_cols, self.prediction_col, history=out["history"],
                          val_history=out["val_history"], metric_history=out["metric_history"],
                          input_shapes=self.input_shapes, label_cols=list(self.label_cols))

    def _split(self, df):
        """(training rows, held-out rows or None), as ``validation`` says."""
        v = self.validation
        if v is None:
            return df, None
        if isinstance(v, float):
            train, held_out = df.randomSplit([1 - v, v], seed=self.seed)
            return train, held_out
        from pyspark.sql import functions as F

        from .data import quoted

        if v not in df.columns:
            raise LaunchRefused(f"validation={v!r} is not a column of the DataFrame (it has {list(df.columns)}); "
                                "pass a column of booleans or 0/1, or a fraction such as 0.1")
        held = F.coalesce(quoted(v).cast("boolean"), F.lit(False))
        return df.filter(~held), df.filter(held)


def _in_estimator_terms(e: LaunchRefused) -> LaunchRefused:
    """HorovodRunner's refusal as a TorchEstimator user can act on it: the ranks are ``num_proc``
    (>= 1), not ``np``, so its hint to run local processes with ``np=-N`` is left out."""
    msg = re.sub(r",? or (run on the driver|run \d+ processes on this machine without Spark) with np=-\d+", "", str(e))
    msg = re.sub(r"\bnp( ?<=| ?=)", r"num_proc\1", msg.replace("HorovodRunner(np=", "TorchEstimator(num_proc="))
    return e if msg == str(e) else LaunchRefused(msg)


__all__ = ["EarlyStopping", "TorchEstimator", "TorchModel", "Trainer"]
_OPTIONAL_SIZES = ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch")
_CHECKPOINT_KEY = "spark_dl.estimator"


@dataclass(frozen=True)
class _FitOptions:
    compression: Any = None
    passes: int = 1  # backward passes per optimizer step
    val_batch_size: int = 32
    train_steps: int | None = None
    val_steps: int | None = None
    transformation: Callable[[dict], dict] | None = None
    minibatch: Callable[[], Callable[..., Any]] | None = None  # Horovod's train_minibatch_fn
    callbacks: tuple = ()
    label_shapes: list | None = None
    log_model: bool = False
    verbose: int = 0
    random_seed: int | None = None


def _fit(data, validation, model, optimizer, loss: _Losses, feature_cols, label_cols, batch_size, epochs, metrics,
         weight_col=None, input_shapes=None, options: _FitOptions = _FitOptions()):
    """Each rank: DDP over the rank's device, one pass over its shard per epoch; rank 0 returns the
    trained weights, the per-epoch loss averaged over every rank's batches, the metrics averaged
    over every rank's rows and, with ``validation``, the held-out rows' loss and metrics after
    each epoch (averaged over rows). Each epoch ends with a checkpoint, and a restarted attempt
    starts after the last one checkpointed."""
    import itertools

    import torch
    import torch.distributed as dist

    import spark_dl

    from . import callbacks as cbs
    from .prepare import prepare_model

    spark_dl.init()
    if options.random_seed is not None:
        torch.manual_seed(options.random_seed)
    saved = spark_dl.load_checkpoint()
    saved = saved.get(_CHECKPOINT_KEY) if isinstance(saved, dict) else None
    if saved is not None:  # before DDP wraps the model: it broadcasts rank 0's parameters, the same on every rank
        model.load_state_dict(saved["model"])
    # .to(device) moves parameters in place, so an optimizer unpickled with the model still holds them
    ddp = prepare_model(model)
    opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(ddp.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer(params) returned {type(opt).__name__}, not a torch.optim.Optimizer: the function "
                        "must build and return one, e.g. functools.partial(torch.optim.SGD, lr=0.1)")
    if options.compression is not None and isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        from .compression.ddp import make_ddp_hook

        ddp.register_comm_hook(*make_ddp_hook(options.compression))
    loss = loss.built()
    device = spark_dl.get_device()
    dtype = _float_dtype(model)
    history, val_history = [], []
    metric_history: dict[str, list[float]] = {}
    start, stopped = 0, False
    callbacks = list(options.callbacks)
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])  # after the move: its state follows the parameters' device
        history, val_history, metric_history = saved["history"], saved["val_history"], saved["metric_history"]
        start, stopped = saved["epoch"] + 1, saved.get("stopped", False)
        cbs.restore(callbacks, saved.get("callbacks"))
    trainer = cbs.Trainer(model, opt, dist.get_rank(), dist.get_world_size(), start)
    batch_of = _Batches(feature_cols, label_cols, weight_col, input_shapes, device, dtype, options.transformation,
                        options.label_shapes)
    step = _Step(ddp, opt, loss, options.passes, options.minibatch() if options.minibatch is not None else None)
    # the weights on the CPU, as the last checkpoint has them (epochs >= 1: a fresh fit saves one)
    state = saved["model"] if saved is not None else None
    logs: dict[str, float] = {}
    example = None  # a few rows of the model's input, for the logged model's signature
    cbs.call(callbacks, "on_train_begin", trainer)
    for epoch in range(start, epochs if not stopped else start):
        cbs.call(callbacks, "on_epoch_begin", epoch, trainer)
        total = torch.zeros(2, dtype=torch.float64)
        scores = _Scores(metrics)
        batches = itertools.islice(data.batches(batch_size=batch_size, epoch=epoch), options.train_steps)
        upcoming = next(batches, None)
        while upcoming is not None:
            batch, upcoming = upcoming, next(batches, None)
            inputs, labels, weights = batch_of(batch)
            if example is None and len(inputs) == 1:  # MLflow's signature takes one input
                example = inputs[0][:5].detach().cpu()
            # every rank has as many batches, so all agree on which backward pass all-reduces
            output, value = step(inputs, labels, weights, last=upcoming is None)
            total += torch.tensor([float(value), 1.0], dtype=torch.float64)
            scores.add(output.detach() if torch.is_tensor(output) else output, labels, len(labels[0]))
        _all_reduce(total)
        history.append(total[0].item() / max(total[1].item(), 1.0))
        logs = {"loss": history[-1]}
        logged = {"train_loss": history[-1]}
        for name, score in scores.result().items():
            metric_history.setdefault(name, []).append(score)
            logs[name] = logged[f"train_{name}"] = score
        if validation is not None:
            val_loss, val_scores = _held_out(validation, getattr(ddp, "module", ddp), loss, metrics, batch_of,
                                             options.val_batch_size, options.val_steps)
            val_history.append(val_loss)
            logs["val_loss"] = logged["val_loss"] = val_loss
            for name, score in val_scores.items():
                metric_history.setdefault(f"val_{name}", []).append(score)
                logs[f"val_{name}"] = logged[f"val_{name}"] = score
        spark_dl.log_metrics(logged, step=epoch)
        if options.verbose and trainer.rank == 0:
            spark_dl.log_to_driver(f"epoch {epoch + 1}/{epochs}: " + ", ".join(f"{k} {v:.4g}" for k, v in logs.items()))
        cbs.call(callbacks, "on_epoch_end", epoch, dict(logs), trainer)
        if callbacks:  # rank 0's decision holds for every rank, so all leave the loop together
            flag = torch.tensor([float(trainer.stop_training)], device=comm_device())
            dist.broadcast(flag, 0)
            stopped = bool(flag.item())
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        spark_dl.save_checkpoint({_CHECKPOINT_KEY: {
            "epoch": epoch, "model": state, "stopped": stopped, "callbacks": cbs.states(callbacks),
            "optimizer": opt.state_dict(), "history": history, "val_history": val_history,
            "metric_history": metric_history}}, step=epoch)
        if stopped:
            break
    cbs.call(callbacks, "on_train_end", dict(logs), trainer)
    if options.log_model:  # rank 0's, when tracking is on; a no-op otherwise
        try:
            spark_dl.log_model(model, "model", input_example=example)
        except ValueError as e:
            # the CPU copy cannot run on the example (say, a forward that makes CUDA tensors): the
            # trained model is worth more than its signature
            print(f"spark-dl: the model is logged without a signature: {e}", file=sys.stderr, flush=True)
            spark_dl.log_model(model, "model")
    return {"state": state, "history": history,
            "val_history": val_history, "metric_history": metric_history}


class _Batches:
    """A batch of shard rows as ``(inputs, labels, sample_weights)`` on the rank's device, after
    ``transformation_fn``, ``input_shapes`` and ``label_shapes``."""

    def __init__(self, feature_cols, label_cols, weight_col, input_shapes, device, dtype, transformation,
                 label_shapes=None) -> None:
        self.feature_cols, self.label_cols, self.weight_col = feature_cols, label_cols, weight_col
        self.input_shapes, self.device, self.dtype, self.transformation = input_shapes, device, dtype, transformation
        self.label_shapes = label_shapes

    def __call__(self, batch: dict) -> tuple[list, list, Any]:
        if self.transformation is not None:
            batch = self.transformation(batch)
            needed = self.feature_cols + self.label_cols + ([self.weight_col] if self.weight_col else [])
            if not isinstance(batch, Mapping) or any(c not in batch for c in needed):
                got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
                raise TypeError(f"transformation_fn must return the batch as a dict of column -> tensor with the "
                                f"columns {needed}; it returned {got}")
        inputs = _reshaped([_as(batch[c], self.device, self.dtype) for c in self.feature_cols], self.input_shapes,
                           self.feature_cols)
        labels = _reshaped([_widened(_as(batch[c], self.device, self.dtype)) for c in self.label_cols],
                           self.label_shapes, self.label_cols, "label_shapes")
        weights = None if self.weight_col is None else _as(batch[self.weight_col], self.device, self.dtype)
        return inputs, labels, weights


class _Step:
    """One training batch: forward, backward and, every ``passes`` batches (or at the epoch's
    last), the optimizer step over the accumulated mean; or Horovod's ``train_minibatch``."""

    def __init__(self, ddp, opt, loss: _Losses, passes: int, minibatch=None) -> None:
        self.ddp, self.opt, self.loss, self.passes, self.minibatch = ddp, opt, loss, passes, minibatch
        self.accumulated = 0

    def __call__(self, inputs: list, labels: list, weights, last: bool) -> tuple[Any, float]:
        import contextlib

        if self.minibatch is not None:
            output, value = self.minibatch(self.ddp, self.opt, self.loss.outputs, self.loss, inputs, labels, weights)
            return output, value.item() if hasattr(value, "item") else float(value)
        if self.accumulated == 0:
            self.opt.zero_grad()
        self.accumulated += 1
        steps_now = self.accumulated == self.passes or last
        with contextlib.nullcontext() if steps_now or not hasattr(self.ddp, "no_sync") else self.ddp.no_sync():
            output = self.ddp(*inputs)
            value = self.loss(output, labels, weights)
            value.backward()
        if steps_now:
            if self.accumulated > 1:  # the mean of the accumulated batches' gradients
                for p in self.ddp.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.accumulated)
            self.opt.step()
            self.accumulated = 0
        return output, value.item()


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
        if not self.metrics:
            return {}
        _all_reduce(self.sums)
        rows = max(self.sums[-1].item(), 1.0)
        return {name: self.sums[i].item() / rows for i, name in enumerate(self.metrics)}


_PADDING = "__spark_dl_padding"


def _held_out(val, model, loss: _Losses, metrics, batch_of: _Batches, batch_size, steps=None):
    """The loss and metrics over every rank's held-out rows (its first ``steps`` batches), weighted
    by rows (batches may be short). The rows ``remainder="pad"`` repeats to even out the shares
    weigh 0 (they are left out), so each held-out row counts once."""
    import itertools

    import torch

    total = torch.zeros(2, dtype=torch.float64)
    scores = _Scores(metrics)
    model.eval()
    with torch.no_grad():
        for batch in itertools.islice(val.batches(batch_size=batch_size, padding=_PADDING), steps):
            real = ~batch.pop(_PADDING)
            if not real.any():
                continue  # only repeats: no collective runs below, so the ranks need not agree
            if not real.all():
                batch = {c: t[real] for c, t in batch.items()}
            inputs, labels, weights = batch_of(batch)
            output = model(*inputs)
            rows = len(labels[0])
            value = loss(output, labels, weights)
            total += torch.tensor([value.item() * rows, rows], dtype=torch.float64)
            scores.add(output, labels, rows)
    model.train()
    _all_reduce(total)
    return total[0].item() / max(total[1].item(), 1.0), scores.result()


def _all_reduce(t) -> None:
    """Sum a small CPU tensor over the ranks in place, through the default group's device (NCCL
    takes GPU tensors only)."""
    import torch.distributed as dist

    moved = t.to(comm_device())  # itself on Gloo
    dist.all_reduce(moved)
    if moved is not t:
        t.copy_(moved)


def _float_dtype(model):
    """The dtype of the model's floating parameters (float32 unless it was converted)."""
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _features(table, cols, kinds, dtype, input_shapes=None, named=None):
    """The model's inputs from an Arrow table or batch: one CPU tensor per feature column (``cols``,
    the table's names; ``named`` maps them to the DataFrame's where they differ)."""
    from .data import _to_tensor

    named = named or {}
    real = [named.get(c, c) for c in cols]
    return _reshaped([_as(_to_tensor(table.column(c), kinds[name], name, "transform"), "cpu", dtype)
                      for c, name in zip(cols, real)], input_shapes, real)


def _widened(label):
    """An int8/16/32 label as int64: class indices as ``cross_entropy`` and ``nll_loss`` take them."""
    import torch

    return label.long() if label.dtype in (torch.int8, torch.int16, torch.int32) else label


def _as(tensor, device, dtype):
    """A column's tensor on ``device``; floating columns in the model's dtype (a Spark double column
    would otherwise meet float32 weights), integer ones (class labels) as they are."""
    return tensor.to(device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


@dataclass
class TorchModel:
    """A trained model that adds its predictions to a DataFrame: ``transform(df)``."""

    model: Any
    feature_cols: list[str]
    prediction_col: str | list[str] = "prediction"
    history: list[float] = field(default_factory=list)  # per-epoch training loss, averaged over ranks
    val_history: list[float] = field(default_factory=list)  # per-epoch held-out loss (``validation``)
    metric_history: dict[str, list[float]] = field(default_factory=dict)  # ``metrics``: name / val_name -> per epoch
    input_shapes: list | None = None  # the estimator's: each feature column's batch is reshaped so
    label_cols: list[str] = field(default_factory=list)  # names a tuple-returning model's prediction columns

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
        """``df`` with the predictions added, computed on the executors in Arrow batches: for a
        model with one output, ``prediction_col`` holds it per row (a float for one number, else an
        array of floats); a model returning a tuple of outputs gets one column per output, named
        by ``prediction_col`` given as a list, else ``<prediction_col>_<label column>``."""
        import cloudpickle
        from pyspark.sql import types as T

        from .data import check_dataframe, column_kinds, quoted

        check_dataframe(df, "TorchModel.transform(df)")
        kinds = column_kinds(df, self.feature_cols)
        widths, several = self._output_widths(df, kinds)
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
        blob = cloudpickle.dumps(self.model)
        shapes = self.input_shapes
        cols = self.feature_cols if plain else [f"_spark_dl_{real.index(c)}" for c in self.feature_cols]
        named = dict(zip(cols, self.feature_cols))  # the real names, for the errors

        def predict(batches):
            import cloudpickle
            import pyarrow as pa
            import torch

            from spark_dl.estimator import _features, _float_dtype

            model = cloudpickle.loads(blob).eval()
            dtype = _float_dtype(model)
            for batch in batches:
                try:
                    inputs = _features(batch, cols, kinds, dtype, shapes, named)
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
        return out if plain else out.toDF(*real)

    def _prediction_names(self, widths: list[int], several: bool) -> list[str]:
        """The prediction columns' names: one for a single output, one per output of a tuple."""
        col = self.prediction_col
        if not several:
            if not isinstance(col, str):
                raise LaunchRefused(f"the model returns one output, so prediction_col must be one name, got {col!r}")
            return [col]
        if isinstance(col, (list, tuple)):
            if len(col) != len(widths) or not all(isinstance(c, str) and c for c in col):
                raise LaunchRefused(f"the model returns {len(widths)} outputs: prediction_col must name each, got {col!r}")
            return list(col)
        if len(self.label_cols) == len(widths):
            return [f"{col}_{label}" for label in self.label_cols]
        return [f"{col}_{i}" for i in range(len(widths))]

    def _output_widths(self, df, kinds) -> tuple[list[int], bool]:
        """How many numbers each of the model's outputs gives per row, from one row run through it
        on the driver; and whether it returns several (a tuple)."""
        import torch

        from .data import quoted

        # a column the model takes twice is read twice from one copy (Arrow's lookup refuses a name held twice)
        sample = df.select(*[quoted(c) for c in dict.fromkeys(self.feature_cols)]).limit(1).toArrow()
        if sample.num_rows == 0:
            raise LaunchRefused("the DataFrame is empty: nothing to predict")
        features = _features(sample, self.feature_cols, kinds, _float_dtype(self.model), self.input_shapes)
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
