"""Spark ML training: ``TorchEstimator(...).fit(df)`` trains on a DataFrame across ranks and returns
a ``TorchModel`` whose ``transform(df)`` adds a prediction column, in the manner of Horovod's
``horovod.spark.torch.TorchEstimator``; both are Spark ML stages (``Pipeline``, ``save``/``load``).

``fit`` is one :class:`spark_dl.HorovodRunner` run on :func:`spark_dl.data.shards` (a global shuffle
per epoch, no detour through the driver); ``transform`` is a ``mapInArrow`` over the DataFrame with
the trained model shipped to the executors. A ``LightningModule`` is trained by a Lightning
``Trainer`` on each rank (Horovod's ``horovod.spark.lightning``; :mod:`spark_dl.estimator_lightning`),
and ``fit_on_parquet`` trains on what ``prepare_data`` staged (:mod:`spark_dl.horovod.staging`).
"""
from __future__ import annotations

import copy
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from spark_dl.compat.estimator.callbacks import EarlyStopping, Trainer
from spark_dl.errors import LaunchRefused, as_int
from spark_dl.compat.estimator.lightning import FIXED_TRAINER_ARGS, _fit_lightning, lightning_package
from spark_dl.compat.estimator.rank_loop import _features, _FitOptions, _float_dtype, _Losses
from spark_dl.compat.estimator.rank_loop import _fit as _train_on_each_rank  # the name _fit is Spark ML's method
from spark_dl.driver.runner import HorovodRunner, RunInfo
from spark_dl.driver.serialize import dumps  # cloudpickle's, keeping the model's code's file names


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


# Horovod's Petastorm reader settings: this estimator reads DataFrame shards, so they have no use
_READER_OPTIONS = ("shuffle_buffer_size", "partitions_per_process", "train_reader_num_workers",
                   "val_reader_num_workers", "reader_pool_type", "inmemory_cache_all", "mp_start_method",
                   "transformation_edit_fields", "transformation_removed_fields", "loader_num_epochs",
                   "debug_data_loader", "train_async_data_loader_queue_size", "val_async_data_loader_queue_size")
# Horovod's Lightning estimator's Trainer settings: (Horovod's default, what to pass here instead)
_TRAINER_OPTIONS = {
    "logger": (None, "trainer_args={'logger': ...} (default: the run's MLflow run)"),
    "log_every_n_steps": (50, "trainer_args={'log_every_n_steps': ...}"),
    "profiler": (None, "trainer_args={'profiler': ...}"),
    "num_gpus": (None, "use_gpu (each rank trains on its task's GPU when it has one)"),
    "terminate_on_nan": (False, "trainer_args={'detect_anomaly': True}, or raise in training_step (Lightning 2 "
                                "dropped it)"),
    "data_module": (None, "nothing: the estimator feeds the DataFrame's shards to the Trainer"),
}


def _runner_options(options: dict[str, Any]) -> dict[str, Any]:
    """The constructor's other keyword arguments as :class:`HorovodRunner` options; Horovod's
    ``backend`` is refused with what to use, its reader settings ignored."""
    import inspect
    import warnings

    options = dict(options)
    if "backend" in options:
        raise LaunchRefused("backend= is Horovod's SparkBackend: here the ranks are one barrier stage of num_proc "
                            "tasks; pass num_proc and HorovodRunner's options (max_restarts, env, start_timeout, ...)")
    for name, (default, instead) in _TRAINER_OPTIONS.items():
        if name in options:  # Horovod's default passed as is asks for nothing: dropped
            value = options.pop(name)
            if value is not default and value != default:
                raise LaunchRefused(f"TorchEstimator takes Horovod's Lightning option {name}={value!r} as {instead}")
    ignored = [name for name in _READER_OPTIONS if options.pop(name, None) not in (None, False)]
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


def _store(store: Any, run_id: Any, runner_options: dict[str, Any]) -> tuple[Any, str | None]:
    """Horovod's ``store`` (a :class:`spark_dl.horovod.store.Store`, or a path for one) and ``run_id``, checked."""
    from spark_dl.compat.horovod.store import Store, check_run_id

    if store is None:
        if run_id is not None:
            raise LaunchRefused(f"run_id={run_id!r} names a run in a Store: pass store=Store.create('/dbfs/...') too "
                                "(or checkpoint_dir= alone)")
        return None, None
    if "checkpoint_dir" in runner_options:
        raise LaunchRefused("pass store= (its runs/<run_id>/checkpoint keeps the checkpoints) or checkpoint_dir=, not both")
    if not isinstance(store, Store):
        if not isinstance(store, (str, os.PathLike)):
            raise LaunchRefused(f"store must be a Store (horovod.spark.common.store.Store.create(path)) or a path, "
                                f"got {type(store).__name__}")
        store = Store.create(store)
    return store, None if run_id is None else check_run_id(run_id)


def _names(value: str | Sequence[str], what: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    if not names or not all(isinstance(n, str) and n for n in names):
        raise LaunchRefused(f"{what} must be a column name or a non-empty list of them, got {value!r}")
    return names


# TorchEstimator's settings, Spark ML Params named as Horovod's: name -> (default, doc); _REQUIRED has none
_REQUIRED = object()
_SETTINGS: dict[str, tuple[Any, str]] = {
    "model": (_REQUIRED, "the torch.nn.Module to train"),
    "optimizer": (None, "an optimizer over model.parameters(), or a function params -> optimizer "
                        "(None for a LightningModule: its configure_optimizers)"),
    "loss": (None, "loss(output, *labels) -> tensor, or a list of them (one per model output)"),
    "feature_cols": (_REQUIRED, "feature column names"),
    "label_cols": (_REQUIRED, "label column names"),
    "batch_size": (32, "rows per rank per step"),
    "epochs": (1, "passes over the data"),
    "num_proc": (2, "ranks, in one Spark barrier stage"),
    "prediction_col": ("prediction", "the column(s) TorchModel.transform adds"),
    "shuffle": (True, "a new global shuffle of the rows every epoch"),
    "seed": (0, "the shuffle's and the validation split's seed"),
    "validation": (None, "a fraction of the rows held out, or a column marking them"),
    "sample_weight_col": (None, "a column of per-row loss weights"),
    "input_shapes": (None, "each feature column's batch shape, -1 for the batch"),
    "metrics": (None, "{name: fn(output, *labels) -> number}, averaged each epoch"),
    "gradient_compression": (None, "a compressor from spark_dl.compression for the gradients' all-reduce"),
    "backward_passes_per_step": (1, "batches accumulated per optimizer step"),
    "val_batch_size": (None, "rows per rank per held-out batch (default batch_size)"),
    "train_steps_per_epoch": (None, "at most this many batches per rank per epoch"),
    "validation_steps_per_epoch": (None, "at most this many held-out batches per rank per epoch"),
    "loss_constructors": (None, "functions that build the loss(es) on each rank, in place of loss"),
    "loss_weights": (None, "one weight per label column for per-output losses"),
    "transformation_fn": (None, "fn(batch) -> batch on each rank, before the model sees it"),
    "train_minibatch_fn": (None, "Horovod's custom step: returns train_minibatch(model, optimizer, ...)"),
    "callbacks": (None, "hooks run on every rank (spark_dl.callbacks)"),
    "label_shapes": (None, "each label column's batch shape, -1 for the batch"),
    "log_model": (True, "log the trained model to the MLflow run"),
    "verbose": (1, "0 silent, 1 a line per epoch, 2 a line per step"),
    "random_seed": (None, "torch's seed on every rank"),
    "use_gpu": (True, "train on the ranks' GPUs where they have them"),
    "trainer_args": (None, "a LightningModule's Trainer arguments (Horovod's trainer_args)"),
    "store": (None, "a Store whose runs/<run_id>/checkpoint keeps the fit's checkpoints"),
    "run_id": (None, "the Store's run to resume, or None for a new one"),
}


def _checked(v: Mapping[str, Any], runner_options: dict[str, Any]) -> SimpleNamespace:
    """The settings ``v`` checked and normalised (counts as ints, column names as lists, metrics
    as a dict, a store path as a Store): the first bad one is refused with what to pass instead.
    Also ``losses`` (as the ranks use them) and ``runner_kwargs`` (HorovodRunner's options but ``np``)."""
    import torch

    from spark_dl.compat.estimator import callbacks as _callbacks
    from spark_dl.compression import Compressor

    s = SimpleNamespace(**v)
    model, optimizer = s.model, s.optimizer
    if not isinstance(model, torch.nn.Module):
        raise LaunchRefused(f"model must be a torch.nn.Module, got {type(model).__name__}")
    s.lightning = lightning_package(model) is not None
    if s.lightning:
        _check_lightning(s)
    elif s.trainer_args is not None:
        raise LaunchRefused(f"trainer_args are a LightningModule's Trainer arguments; {type(model).__name__} is a "
                            "plain torch.nn.Module: pass optimizer= and loss= instead, or a LightningModule")
    elif optimizer is None:
        raise LaunchRefused(f"{type(model).__name__} is a plain torch.nn.Module: pass optimizer= (an optimizer over "
                            "model.parameters(), or functools.partial(torch.optim.SGD, lr=0.1)); a LightningModule "
                            "brings its own (configure_optimizers)")
    elif not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise LaunchRefused(
            "optimizer must be a torch.optim.Optimizer over model.parameters() or a function params -> "
            f"optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        own = {id(p) for p in model.parameters()}
        if not all(id(p) in own for g in optimizer.param_groups for p in g["params"]):
            raise LaunchRefused("optimizer was built over parameters that are not model's: build it "
                                "with model.parameters(), or pass a function params -> optimizer")
    validation = s.validation
    if validation is not None and not (isinstance(validation, str) and validation) and not (
            isinstance(validation, float) and 0 < validation < 1):
        raise LaunchRefused(f"validation must be a fraction of the rows in (0, 1) or a column name, got {validation!r}")
    for name in ("batch_size", "epochs", "num_proc", "backward_passes_per_step", "val_batch_size",
                 "train_steps_per_epoch", "validation_steps_per_epoch"):
        value = getattr(s, name)
        if value is None and name in _OPTIONAL_SIZES:
            continue
        if as_int(value) is None or value < 1:
            raise LaunchRefused(f"{name} must be an int >= 1, got {value!r}")
        setattr(s, name, as_int(value))
    if s.gradient_compression is not None and not isinstance(s.gradient_compression, Compressor):
        raise LaunchRefused(f"gradient_compression must be a compressor from spark_dl.compression (FP16(), QSGD(), "
                            f"PowerSGD(), ...) or None, got {type(s.gradient_compression).__name__}")
    s.feature_cols = _names(s.feature_cols, "feature_cols")
    s.label_cols = _names(s.label_cols, "label_cols")
    s.losses = None if s.lightning else _losses(s.loss, s.loss_constructors, s.loss_weights, s.label_cols)
    for name in ("transformation_fn", "train_minibatch_fn"):
        fn = getattr(s, name)
        if fn is not None and not callable(fn):
            raise LaunchRefused(f"{name} must be a function, got {type(fn).__name__}")
    if s.train_minibatch_fn is not None and s.backward_passes_per_step != 1:
        raise LaunchRefused("train_minibatch_fn runs each batch's optimizer step itself, so "
                            f"backward_passes_per_step={s.backward_passes_per_step} cannot apply: accumulate "
                            "gradients inside it, or leave backward_passes_per_step at 1")
    if s.lightning:
        s.callbacks = list(s.callbacks or [])
    else:
        try:
            s.callbacks = _callbacks.check(s.callbacks)
        except TypeError as e:
            raise LaunchRefused(str(e)) from None
    if s.sample_weight_col is not None and not (isinstance(s.sample_weight_col, str) and s.sample_weight_col):
        raise LaunchRefused(f"sample_weight_col must be a column name, got {s.sample_weight_col!r}")
    s.input_shapes = _input_shapes(s.input_shapes, s.feature_cols)
    s.label_shapes = _input_shapes(s.label_shapes, s.label_cols, "label_shapes", "label")
    if not isinstance(s.log_model, bool):
        raise LaunchRefused(f"log_model must be True or False, got {s.log_model!r}")
    s.metrics = _metrics(s.metrics)
    if not s.lightning:
        _check_monitors(s.callbacks, s.metrics, validation)
    if s.verbose not in (0, 1, 2) or isinstance(s.verbose, bool):
        raise LaunchRefused(f"verbose must be 0, 1 or 2, got {s.verbose!r}")
    if s.random_seed is not None and as_int(s.random_seed) is None:
        raise LaunchRefused(f"random_seed must be an int or None, got {s.random_seed!r}")
    s.random_seed = None if s.random_seed is None else as_int(s.random_seed)
    if as_int(s.seed) is None:
        raise LaunchRefused(f"seed must be an int (the shuffle's and the validation split's), got {s.seed!r}")
    s.seed = as_int(s.seed)
    if not isinstance(s.shuffle, bool):
        raise LaunchRefused(f"shuffle must be True or False, got {s.shuffle!r}")
    col = s.prediction_col
    if not (isinstance(col, str) and col) and not (
            isinstance(col, (list, tuple)) and col and all(isinstance(c, str) and c for c in col)):
        raise LaunchRefused(f"prediction_col must be a column name or a list of them (one per model output), "
                            f"got {col!r}")
    if not isinstance(s.use_gpu, bool):
        raise LaunchRefused(f"use_gpu must be True or False, got {s.use_gpu!r}")
    s.store, s.run_id = _store(s.store, s.run_id, runner_options)
    s.runner_kwargs = dict(runner_options)
    if not s.use_gpu:  # the ranks see no GPU, so they train on the CPU
        s.runner_kwargs["env"] = {**(runner_options.get("env") or {}), "CUDA_VISIBLE_DEVICES": ""}
    return s


def _check_lightning(s: SimpleNamespace) -> None:
    """A ``LightningModule`` brings its optimizers (``configure_optimizers``), loss and logged
    metrics (``training_step``/``validation_step``); the settings that would say them otherwise,
    and Trainer arguments the estimator sets itself, are refused with what to do instead."""
    name = type(s.model).__name__
    for setting, instead in (("optimizer", "its configure_optimizers()"), ("loss", "its training_step"),
                             ("loss_constructors", "its training_step"), ("loss_weights", "its training_step"),
                             ("metrics", "self.log(...) in its training_step / validation_step"),
                             ("train_minibatch_fn", "its training_step (manual optimization for a custom step)")):
        if getattr(s, setting) is not None:
            raise LaunchRefused(f"{name} is a LightningModule: {setting}= has no use (it comes from {instead}); "
                                f"leave {setting}=None")
    args = s.trainer_args
    if args is not None:
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise LaunchRefused(f"trainer_args must be a dict of Trainer arguments, got {type(args).__name__}")
        if not isinstance(args.get("callbacks") or [], (list, tuple)):
            raise LaunchRefused("trainer_args={'callbacks': ...} must be a list of Lightning callbacks, got "
                                f"{type(args['callbacks']).__name__}")
        fixed = [k for k in args if k in FIXED_TRAINER_ARGS]
        if fixed:
            raise LaunchRefused(f"trainer_args={{{fixed[0]!r}: ...}}: the estimator sets the Trainer's {fixed[0]} "
                                f"({FIXED_TRAINER_ARGS[fixed[0]]}); leave it out")
        s.trainer_args = dict(args)
    package = "lightning.pytorch" if lightning_package(s.model) == "lightning" else "pytorch_lightning"
    for cb in list(s.callbacks or []) + list((args or {}).get("callbacks") or []):
        if not any(c.__name__ == "Callback" and c.__module__.startswith(package) for c in type(cb).__mro__):
            hint = (f" (spark-dl's EarlyStopping is for plain modules: use {package}.callbacks.EarlyStopping)"
                    if isinstance(cb, EarlyStopping) else "")
            raise LaunchRefused(f"callbacks of a {name} fit are {package} Callbacks (the module's package), got "
                                f"{type(cb).__name__}{hint}")


def _check_monitors(callbacks: list[Any], metrics: dict[str, Any], validation: Any) -> None:
    """An ``EarlyStopping`` that watches a history key this fit will not have is refused now,
    not after its first epoch."""
    keys = ["loss"] + list(metrics)
    if validation is not None:
        keys += ["val_" + k for k in keys]
    for cb in callbacks:
        if isinstance(cb, EarlyStopping) and cb.monitor not in keys:
            hint = " (the val_ keys need validation=)" if cb.monitor.startswith("val_") else ""
            raise LaunchRefused(f"EarlyStopping monitors {cb.monitor!r}, which this fit will not log{hint}; "
                                f"it logs {keys}")


class TorchEstimator(Estimator, MLWritable, MLReadable):
    """Train ``model`` on a DataFrame's ``feature_cols`` against its ``label_cols``: a Spark ML
    ``Estimator``, so it is also a ``pyspark.ml.Pipeline`` stage. Every setting below but
    ``runner_options`` is a Spark ML ``Param`` too (``est.epochs``; Horovod's ``getEpochs()`` /
    ``setEpochs(n)``), so a param map, ``ParamGridBuilder`` and ``CrossValidator`` can set it.
    Saved with ``save(path)`` (alone, in a ``Pipeline`` or a tuned ``CrossValidatorModel``) and read
    back with ``TorchEstimator.load(path)``: every setting, the model's weights at that moment and
    the optimizer's state included.

    Args:
        model: the ``torch.nn.Module`` to train; called as ``model(*features)``, one tensor per
            feature column (numeric columns: 1-D, arrays of numbers: 2-D). Or a Lightning
            ``LightningModule`` (Horovod's ``horovod.spark.lightning.TorchEstimator``): trained by a
            Lightning ``Trainer`` with DDP over the ranks, its ``training_step(batch, batch_idx)``
            given ``{column: tensor}`` batches; its optimizers, loss and metrics are its own.
        optimizer: an optimizer over ``model.parameters()`` (Horovod's style) or a function
            ``params -> optimizer`` (``functools.partial(torch.optim.SGD, lr=0.1)``); None for a
            ``LightningModule``.
        trainer_args: a ``LightningModule``'s further ``Trainer`` arguments (Horovod's), e.g.
            ``{"gradient_clip_val": 1.0, "logger": ...}``.
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
        store, run_id: Horovod's: a :class:`spark_dl.horovod.store.Store` (or a path) whose
            ``runs/<run_id>/checkpoint`` keeps the fit's checkpoints; a fit with an earlier fit's
            ``run_id`` resumes it, one without starts a new run (``last_run_id``).
        runner_options: more :class:`spark_dl.HorovodRunner` options (``max_restarts``, ``tracking``,
            ``checkpoint_dir``, ``min_np``, ``grow_interval``, ...). Every epoch ends with a
            checkpoint, so a restarted or grown fit goes on from the last finished epoch.
    """

    def __init__(self, *, model, optimizer=None, loss: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
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
                 trainer_args: Mapping[str, Any] | None = None,
                 store: Any = None, run_id: str | None = None, **runner_options: Any) -> None:
        super().__init__()  # Spark ML's Params: a uid, this instance's copies of the class's Params
        args = dict(locals())
        self._setDefault(**{name: d for name, (d, _) in _SETTINGS.items() if d is not _REQUIRED})
        self.runner_options = _runner_options(runner_options)
        given = {name: args[name] for name in _SETTINGS}
        s = _checked(given, self.runner_options)
        # what was given (normalised), so explainParams() tells it from the defaults
        self._set(**{name: getattr(s, name) for name, value in given.items() if not _is_default(name, value)})
        self._runner = HorovodRunner(np=s.num_proc, **s.runner_kwargs)  # bad options are refused now, not at fit()
        self.last_run_id: str | None = None  # with a store: the latest fit's run_id

    def _values(self) -> dict[str, Any]:
        return {name: self.getOrDefault(name) for name in _SETTINGS}

    def setParams(self, **values: Any) -> "TorchEstimator":  # noqa: N802 - Spark ML's name
        """Set several settings at once (``est.setParams(epochs=4, batch_size=64)``); checked together,
        as the constructor checks them. Returns self."""
        unknown = [name for name in values if name not in _SETTINGS]
        if unknown:
            raise LaunchRefused(f"TorchEstimator has no setting {unknown[0]!r}; its settings are {', '.join(_SETTINGS)} "
                                "(HorovodRunner's options are constructor arguments)")
        s = _checked({**self._values(), **values}, self.runner_options)
        return self._set(**{name: getattr(s, name) for name in values})

    def write(self) -> "_TorchEstimatorWriter":
        """Spark ML's writer: ``est.write().overwrite().save(path)``; ``est.save(path)`` refuses a
        path that exists."""
        return _TorchEstimatorWriter(self)

    @classmethod
    def read(cls) -> "_TorchEstimatorReader":
        """Spark ML's reader: ``TorchEstimator.read().load(path)``, or ``TorchEstimator.load(path)``."""
        return _TorchEstimatorReader()

    @property
    def last_run(self) -> RunInfo | None:
        """The latest ``fit()``'s :attr:`spark_dl.HorovodRunner.last_run`."""
        return self._runner.last_run

    def fit(self, dataset, params=None) -> "TorchModel":
        """Train across ``num_proc`` ranks; return the trained model as a :class:`TorchModel`.
        ``params``: Spark ML's param map: this estimator's (``{est.epochs: 4}``) apply to this fit
        only, other stages' pass through; a list of maps fits once per map (a list of models)."""
        if isinstance(params, dict) and params:
            that = self.copy(params)  # Spark ML's way; this fit's run is then reported here too
            model = that._fit(dataset)
            self._runner, self.last_run_id = that._runner, that.last_run_id
            return model
        return super().fit(dataset, params)

    def _fit(self, df) -> "TorchModel":
        from spark_dl.driver.shards import check_dataframe

        s = _checked(self._values(), self.runner_options)  # a param map's values are checked here
        check_dataframe(df, "TorchEstimator.fit(df)")
        v = s.validation
        empty_hint = (
            f": validation={v!r} held out no rows; hold out a larger fraction (validation=0.2), mark the held-out "
            "rows with a column (validation='is_val'), or leave validation=None" if isinstance(v, float) else
            f": no row of column {v!r} is true (or 1); mark some rows, or pass a fraction such as validation=0.1")
        train, held_out = _split(df, v, s.seed)
        return self._train(s, train, held_out, empty_hint)

    def fit_on_parquet(self, params=None, dataset_idx: int | None = None) -> "TorchModel":
        """Horovod's: train on the Parquet data that ``prepare_data`` staged in this estimator's
        ``store`` (``store.get_train_data_path(dataset_idx)``; the held-out rows, where staged, from
        ``store.get_val_data_path(dataset_idx)``), without recomputing the DataFrame."""
        if params:
            if not isinstance(params, dict):
                raise LaunchRefused(f"fit_on_parquet(params=) takes one param map (a dict such as "
                                    f"{{est.epochs: 4}}), got {type(params).__name__}")
            that = self.copy(params)
            model = that._fit_on_parquet(dataset_idx)
            self._runner, self.last_run_id = that._runner, that.last_run_id
            return model
        return self._fit_on_parquet(dataset_idx)

    def _fit_on_parquet(self, dataset_idx: Any) -> "TorchModel":
        from spark_dl.driver import cluster
        from spark_dl.compat.horovod.staging import spark_path

        s = _checked(self._values(), self.runner_options)
        if s.store is None:
            raise LaunchRefused("fit_on_parquet reads the Parquet data prepare_data staged in a Store: build the "
                                "estimator with store=Store.create('/dbfs/...'), the store given to prepare_data")
        if dataset_idx is not None and (as_int(dataset_idx) is None or dataset_idx < 0):
            raise LaunchRefused(f"dataset_idx must be the int prepare_data yields (or None), got {dataset_idx!r}")
        train_path, val_path = s.store.get_train_data_path(dataset_idx), s.store.get_val_data_path(dataset_idx)
        if not s.store.exists(train_path):
            raise LaunchRefused(f"fit_on_parquet(dataset_idx={dataset_idx!r}): no staged training data at {train_path}; "
                                "stage it first: with prepare_data(num_proc, store, df, label_columns=..., "
                                "feature_columns=...) as idx: est.fit_on_parquet(dataset_idx=idx)")
        staged_val = s.store.exists(val_path)
        if s.validation is not None and not staged_val:
            raise LaunchRefused(f"validation={s.validation!r}, but data set {dataset_idx!r} has no held-out rows (no "
                                f"{val_path}): stage them with prepare_data(..., validation={s.validation!r}), or "
                                "leave the estimator's validation=None")
        session = cluster.active_session(s.num_proc)
        train = session.read.parquet(spark_path(train_path))
        held_out = session.read.parquet(spark_path(val_path)) if staged_val else None
        wanted = s.feature_cols + s.label_cols + ([s.sample_weight_col] if s.sample_weight_col else [])
        missing = [c for c in wanted if c not in train.columns]
        if missing:
            raise LaunchRefused(f"fit_on_parquet: columns {missing} are not in the staged data at {train_path} (it has "
                                f"{list(train.columns)}); stage them with prepare_data(..., feature_columns=..., "
                                "label_columns=..., sample_weight_col=...)")
        return self._train(s, train, held_out, f": the staged held-out data at {val_path} has no rows; stage again "
                                               "with prepare_data(..., validation=0.1)")

    def _train(self, s: SimpleNamespace, train, held_out, empty_hint: str) -> "TorchModel":
        """Train on ``train`` (and evaluate each epoch on ``held_out``, or not when None)."""
        from spark_dl.driver.shards import shards

        options = s.runner_kwargs
        if s.store is not None:  # Horovod's rule: a fit resumes its run_id's checkpoint; no run_id, a new run
            run_id = s.run_id or f"run_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"
            options = {**options, "checkpoint_dir": s.store.get_checkpoint_path(run_id)}
            self.last_run_id = run_id
        self._runner = HorovodRunner(np=s.num_proc, **options)

        columns = s.feature_cols + s.label_cols
        weights = s.sample_weight_col
        if weights is not None:
            if weights not in train.columns:
                raise LaunchRefused(f"sample_weight_col={weights!r} is not a column of the DataFrame (it has "
                                    f"{list(train.columns)})")
            columns = columns + [weights]
        data = shards(train, columns, shuffle=s.shuffle, seed=s.seed)
        data.few_rows_reason = "each rank trains on rows of its own"
        data.few_rows_hint = (f"give it at least num_proc={s.num_proc} rows, or use a smaller num_proc"
                              + (" (or hold fewer rows out with validation=)" if s.validation is not None else ""))
        # every held-out row once per rank's share ("pad" repeats a few when they do not divide evenly;
        # _held_out leaves the repeats out)
        val = shards(held_out, columns, shuffle=False, remainder="pad") if held_out is not None else None
        if val is not None:
            val.empty_hint = empty_hint
        try:
            options = _FitOptions(s.gradient_compression, s.backward_passes_per_step,
                                  s.val_batch_size or s.batch_size, s.train_steps_per_epoch,
                                  s.validation_steps_per_epoch, s.transformation_fn, s.train_minibatch_fn,
                                  tuple(s.callbacks), s.label_shapes, s.log_model, s.verbose, s.random_seed)
            common = dict(data=data, validation=val, model=s.model, feature_cols=s.feature_cols,
                          label_cols=s.label_cols, batch_size=s.batch_size, epochs=s.epochs, weight_col=weights,
                          input_shapes=s.input_shapes, options=options)
            if s.lightning:
                out = self._runner.run(_fit_lightning, trainer_args=s.trainer_args, **common)
            else:
                out = self._runner.run(_train_on_each_rank, optimizer=s.optimizer, loss=s.losses, metrics=s.metrics,
                                       **common)
        except LaunchRefused as e:
            raise _in_estimator_terms(e) from e.__cause__
        trained = copy.deepcopy(s.model).cpu()
        trained.load_state_dict(out["state"])
        if s.lightning:  # every metric the module logged, per epoch; its (train_)loss and val_loss as the histories
            logged = out["history"]
            history = logged.get("train_loss", logged.get("loss", []))
            out = {"history": history, "val_history": logged.get("val_loss", []), "metric_history": logged}
        return TorchModel(trained, s.feature_cols, s.prediction_col, history=out["history"],
                          val_history=out["val_history"], metric_history=out["metric_history"],
                          input_shapes=s.input_shapes, label_cols=list(s.label_cols))


def _split(df, validation: float | str | None, seed: int):
    """(training rows, held-out rows or None), as ``validation`` says."""
    if validation is None:
        return df, None
    if isinstance(validation, float):
        train, held_out = df.randomSplit([1 - validation, validation], seed=seed)
        return train, held_out
    from pyspark.sql import functions as F

    from spark_dl.driver.shards import quoted

    if validation not in df.columns:
        raise LaunchRefused(f"validation={validation!r} is not a column of the DataFrame (it has {list(df.columns)}); "
                            "pass a column of booleans or 0/1, or a fraction such as 0.1")
    held = F.coalesce(quoted(validation).cast("boolean"), F.lit(False))
    return df.filter(~held), df.filter(held)


def _is_default(name: str, value: Any) -> bool:
    default = _SETTINGS[name][0]
    return value is default or (type(value) is type(default) and value == default)


def _getter(name: str) -> Callable[[TorchEstimator], Any]:
    def get(self: TorchEstimator) -> Any:
        return self.getOrDefault(name)

    get.__doc__ = f"The ``{name}`` setting: {_SETTINGS[name][1]}."
    return get


def _setter(name: str) -> Callable[[TorchEstimator, Any], TorchEstimator]:
    def set_(self: TorchEstimator, value: Any) -> TorchEstimator:
        return self.setParams(**{name: value})

    set_.__doc__ = f"Set ``{name}`` ({_SETTINGS[name][1]}), checked as the constructor checks it; returns self."
    return set_


# Spark ML Params with Horovod's names and accessors (num_proc: getNumProc/setNumProc), so param maps,
# ParamGridBuilder, CrossValidator and TrainValidationSplit can set them
for _name, (_default, _doc) in _SETTINGS.items():
    _camel = "".join(part.capitalize() for part in _name.split("_"))
    setattr(TorchEstimator, _name, Param(Params._dummy(), _name, _doc))
    setattr(TorchEstimator, "get" + _camel, _getter(_name))
    setattr(TorchEstimator, "set" + _camel, _setter(_name))


def _in_estimator_terms(e: LaunchRefused) -> LaunchRefused:
    """HorovodRunner's refusal as a TorchEstimator user can act on it: the ranks are ``num_proc``
    (>= 1), not ``np``, so its hint to run local processes with ``np=-N`` is left out."""
    msg = re.sub(r",? or (run on the driver|run \d+ processes on this machine without Spark) with np=-\d+", "", str(e))
    msg = re.sub(r"\bnp( ?<=| ?=)", r"num_proc\1", msg.replace("HorovodRunner(np=", "TorchEstimator(num_proc="))
    return e if msg == str(e) else LaunchRefused(msg)


__all__ = ["EarlyStopping", "TorchEstimator", "TorchModel", "Trainer"]
_OPTIONAL_SIZES = ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch")


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

    def write(self) -> "_TorchModelWriter":
        """Spark ML's writer: ``model.write().overwrite().save(path)``; ``model.save(path)`` refuses
        a path that exists."""
        return _TorchModelWriter(self)

    @classmethod
    def read(cls) -> "_TorchModelReader":
        """Spark ML's reader: ``TorchModel.read().load(path)``, or ``TorchModel.load(path)``."""
        return _TorchModelReader()

    def getHistory(self) -> dict[str, list[float]]:  # noqa: N802 - Horovod's TorchModel name
        """Keras-style history: ``loss``, ``val_loss`` (with validation) and each metric's lists."""
        out = {"loss": list(self.history)}
        if self.val_history:
            out["val_loss"] = list(self.val_history)
        out.update({name: list(values) for name, values in self.metric_history.items()})
        return out

    def setOutputCols(self, value: str | list[str]) -> "TorchModel":  # noqa: N802 - Horovod's TorchModel name
        """Horovod's name for setting ``prediction_col``: the column(s) ``transform`` adds; returns self."""
        cols = _names(value, "setOutputCols(value)")
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
        # Spark ML Vector columns are read as arrays, from columns of their own dropped at the end
        vectors = {c: f"_spark_dl_vector_{i}" for i, c in enumerate(c for c, k in kinds.items() if k == "vector")}
        if vectors:
            df = df.withColumns({hidden: as_array(c) for c, hidden in vectors.items()})
            kinds = {c: "array" if k == "vector" else k for c, k in kinds.items()}
        source = [vectors.get(c, c) for c in self.feature_cols]  # the columns the features are read from
        widths, several = self._output_widths(df, kinds, source)
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

            from spark_dl.compat.estimator.rank_loop import _features, _float_dtype

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
                raise LaunchRefused(f"the model returns {len(widths)} outputs: prediction_col must name each, got {col!r}")
            return list(col)
        if len(self.label_cols) == len(widths):
            return [f"{col}_{label}" for label in self.label_cols]
        return [f"{col}_{i}" for i in range(len(widths))]

    def _output_widths(self, df, kinds, source: list[str]) -> tuple[list[int], bool]:
        """How many numbers each of the model's outputs gives per row, from one row run through it
        on the driver; and whether it returns several (a tuple)."""
        import torch

        from spark_dl.driver.shards import quoted

        # a column the model takes twice is read twice from one copy (Arrow's lookup refuses a name held twice)
        sample = df.select(*[quoted(c) for c in dict.fromkeys(source)]).limit(1).toArrow()
        if sample.num_rows == 0:
            raise LaunchRefused("the DataFrame is empty: nothing to predict")
        features = _features(sample, source, kinds, _float_dtype(self.model), self.input_shapes,
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


_MODEL_PART = 64 << 20  # a pickled module or settings is saved in rows of at most this many bytes (Spark's 2 GB row limit)


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
        """Spark ML's ``path/metadata`` (as ``DefaultParamsWriter.saveMetadata`` writes it), then the blob."""
        text = DefaultParamsWriter._get_metadata_to_save(self.instance, self.sparkSession, **metadata)
        writer = self.sparkSession.createDataFrame([(text,)], schema=["value"]).coalesce(1).write
        (writer.mode(self._mode) if self._mode else writer).text(os.path.join(path, "metadata"))
        _save_blob(self.sparkSession, blob, os.path.join(path, blob_name), self._mode)


def _load_blob(spark, path: str) -> bytes:
    return b"".join(bytes(r["data"]) for r in spark.read.parquet(path).orderBy("part").collect())


def _load_metadata(spark, path: Any, cls: type) -> dict[str, Any]:
    """The Spark ML metadata at ``path``, refused unless it was saved from ``cls``."""
    if not isinstance(path, str):
        raise TypeError(f"{cls.__name__}.load takes a path (str), got {type(path).__name__}")
    meta = DefaultParamsReader.loadMetadata(path, spark)
    if meta["class"] != f"{cls.__module__}.{cls.__name__}":
        raise ValueError(f"{path} holds a {meta['class']}, not a spark-dl {cls.__name__}: load it with that class "
                         "(or pyspark.ml.PipelineModel.load / Pipeline.load for a whole pipeline)")
    return meta


def _json_value(value: Any) -> bool:
    import json

    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class _TorchEstimatorWriter(_Writer):
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


class _TorchEstimatorReader(MLReader):
    def load(self, path: str) -> TorchEstimator:
        from spark_dl.transport import unpickle

        meta = _load_metadata(self.sparkSession, path, TorchEstimator)
        state = unpickle.loads(_load_blob(self.sparkSession, os.path.join(path, "settings")), unpickle.driver_device)
        est = TorchEstimator(**state["settings"], **state["runner_options"])
        est.last_run_id = state["last_run_id"]
        est._resetUid(meta["uid"])
        return est


class _TorchModelWriter(_Writer):
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


class _TorchModelReader(MLReader):
    def load(self, path: str) -> TorchModel:
        from spark_dl.transport import unpickle

        meta = _load_metadata(self.sparkSession, path, TorchModel)
        module = unpickle.loads(_load_blob(self.sparkSession, os.path.join(path, "model")), unpickle.driver_device)
        shapes = meta["input_shapes"]
        model = TorchModel(module, meta["feature_cols"], meta["prediction_col"], history=meta["history"],
                           val_history=meta["val_history"], metric_history=meta["metric_history"],
                           input_shapes=None if shapes is None else [tuple(s) for s in shapes],
                           label_cols=meta["label_cols"])
        model._resetUid(meta["uid"])
        return model
