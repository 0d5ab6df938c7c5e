"""The checks of a :class:`~spark_dl.estimator.TorchEstimator`'s arguments, done before anything
runs: each setting checked and normalised (:func:`checked_settings`), the constructor's other
keyword arguments as :class:`spark_dl.HorovodRunner` options (:func:`checked_runner_options`), and
the held-out rows cut from the training rows (:func:`split_validation`, also ``prepare_data``'s).
A bad value is refused with what to pass instead. Imports neither ``pyspark.ml`` nor the
estimator's Spark ML classes, so :mod:`spark_dl.horovod.staging` imports it at the top.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from spark_dl.compat.estimator.callbacks import EarlyStopping
from spark_dl.compat.estimator.lightning import FIXED_TRAINER_ARGS, lightning_package
from spark_dl.compat.estimator.rank_loop import Losses
from spark_dl.driver.runner import HorovodRunner
from spark_dl.errors import LaunchRefused, as_int


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


def _losses(loss: Any, constructors: Any, weights: Any, label_cols: list[str]) -> "Losses":
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
        return Losses(tuple(fns), None, constructors is not None, tuple(label_cols))
    if weights is None:
        weights = [1.0 / n] * n  # Horovod's default: the losses' mean
    return Losses(tuple(fns * n if len(fns) == 1 else fns), tuple(float(w) for w in weights), constructors is not None,
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


def checked_runner_options(options: dict[str, Any]) -> dict[str, Any]:
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
        raise LaunchRefused("pass store= (its runs/<run_id>/checkpoint keeps the checkpoints) "
                            "or checkpoint_dir=, not both")
    if not isinstance(store, Store):
        if not isinstance(store, (str, os.PathLike)):
            raise LaunchRefused(f"store must be a Store (horovod.spark.common.store.Store.create(path)) or a path, "
                                f"got {type(store).__name__}")
        store = Store.create(store)
    return store, None if run_id is None else check_run_id(run_id)


def column_list(value: str | Sequence[str], what: str) -> list[str]:
    """``value``, a column name or a non-empty list of them, as a list; refused naming ``what``."""
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    if not names or not all(isinstance(n, str) and n for n in names):
        raise LaunchRefused(f"{what} must be a column name or a non-empty list of them, got {value!r}")
    return names


# the sizes that may be None (then: batch_size, or every batch of the rank's share)
_OPTIONAL_SIZES = ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch")


def checked_settings(v: Mapping[str, Any], runner_options: dict[str, Any]) -> SimpleNamespace:
    """The settings ``v`` checked and normalised (counts as ints, column names as lists, metrics
    as a dict, a store path as a Store): the first bad one is refused with what to pass instead.
    Also ``losses`` (as the ranks use them) and ``runner_kwargs`` (HorovodRunner's options but ``np``)."""
    import torch

    from spark_dl.compat.estimator import callbacks as _callbacks
    from spark_dl.compression import Auto, Compressor

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
    if isinstance(s.gradient_compression, str) and s.gradient_compression.lower() == "auto":
        s.gradient_compression = Auto()
    if s.gradient_compression is not None and not isinstance(s.gradient_compression, Compressor):
        raise LaunchRefused(f"gradient_compression must be a compressor from spark_dl.compression (FP16(), QSGD(), "
                            f"PowerSGD(), ...), 'auto' or None, got {s.gradient_compression!r}")
    s.feature_cols = column_list(s.feature_cols, "feature_cols")
    s.label_cols = column_list(s.label_cols, "label_cols")
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


def split_validation(df, validation: float | str | None, seed: int):
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
