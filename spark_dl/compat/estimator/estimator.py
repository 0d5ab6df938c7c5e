"""Spark ML training: ``TorchEstimator(...).fit(df)`` trains on a DataFrame across ranks and returns
a ``TorchModel`` whose ``transform(df)`` adds a prediction column, in the manner of Horovod's
``horovod.spark.torch.TorchEstimator``; both are Spark ML stages (``Pipeline``, ``save``/``load``).

``fit`` is one :class:`spark_dl.HorovodRunner` run on :func:`spark_dl.data.shards` (a global shuffle
per epoch, no detour through the driver); ``transform`` is a ``mapInArrow`` over the DataFrame with
the trained model shipped to the executors. A ``LightningModule`` is trained by a Lightning
``Trainer`` on each rank (Horovod's ``horovod.spark.lightning``; :mod:`spark_dl.compat.estimator.lightning`),
and ``fit_on_parquet`` trains on what ``prepare_data`` staged (:mod:`spark_dl.horovod.staging`).

This module holds ``TorchEstimator`` and its Params; the checks of its arguments are in
:mod:`~spark_dl.compat.estimator.options`, ``TorchModel`` in :mod:`~spark_dl.compat.estimator.model`,
their ``save``/``load`` in :mod:`~spark_dl.compat.estimator.persistence`, and what each rank runs in
:mod:`~spark_dl.compat.estimator.rank_loop` (plain modules) and :mod:`~spark_dl.compat.estimator.lightning`.
"""
from __future__ import annotations

import copy
import re
import time
import uuid
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from pyspark.ml import Estimator
from pyspark.ml.param import Param, Params
from pyspark.ml.util import MLReadable, MLWritable

from spark_dl.compat.estimator.lightning import fit_lightning_on_each_rank
from spark_dl.compat.estimator.model import TorchModel
from spark_dl.compat.estimator.options import checked_runner_options, checked_settings, split_validation
from spark_dl.compat.estimator.persistence import TorchEstimatorReader, TorchEstimatorWriter
from spark_dl.compat.estimator.rank_loop import FitOptions, fit_on_each_rank
from spark_dl.compat.horovod.staging import spark_path
from spark_dl.driver.runner import HorovodRunner, RunInfo
from spark_dl.errors import LaunchRefused, as_int

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
    "gradient_compression": (None, "a compressor from spark_dl.compression for the gradients' all-reduce, or 'auto'"),
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
            as a DDP communication hook; ``"auto"`` picks one per bucket on the measured link
            (:class:`spark_dl.compression.Auto`).
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
        self.runner_options = checked_runner_options(runner_options)
        given = {name: args[name] for name in _SETTINGS}
        s = checked_settings(given, self.runner_options)
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
            raise LaunchRefused(f"TorchEstimator has no setting {unknown[0]!r}; "
                                f"its settings are {', '.join(_SETTINGS)} "
                                "(HorovodRunner's options are constructor arguments)")
        s = checked_settings({**self._values(), **values}, self.runner_options)
        return self._set(**{name: getattr(s, name) for name in values})

    def write(self) -> TorchEstimatorWriter:
        """Spark ML's writer: ``est.write().overwrite().save(path)``; ``est.save(path)`` refuses a
        path that exists."""
        return TorchEstimatorWriter(self)

    @classmethod
    def read(cls) -> TorchEstimatorReader:
        """Spark ML's reader: ``TorchEstimator.read().load(path)``, or ``TorchEstimator.load(path)``."""
        return TorchEstimatorReader(TorchEstimator)

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

        s = checked_settings(self._values(), self.runner_options)  # a param map's values are checked here
        check_dataframe(df, "TorchEstimator.fit(df)")
        v = s.validation
        empty_hint = (
            f": validation={v!r} held out no rows; hold out a larger fraction (validation=0.2), mark the held-out "
            "rows with a column (validation='is_val'), or leave validation=None" if isinstance(v, float) else
            f": no row of column {v!r} is true (or 1); mark some rows, or pass a fraction such as validation=0.1")
        train, held_out = split_validation(df, v, s.seed)
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

        s = checked_settings(self._values(), self.runner_options)
        if s.store is None:
            raise LaunchRefused("fit_on_parquet reads the Parquet data prepare_data staged in a Store: build the "
                                "estimator with store=Store.create('/dbfs/...'), the store given to prepare_data")
        if dataset_idx is not None and (as_int(dataset_idx) is None or dataset_idx < 0):
            raise LaunchRefused(f"dataset_idx must be the int prepare_data yields (or None), got {dataset_idx!r}")
        train_path, val_path = s.store.get_train_data_path(dataset_idx), s.store.get_val_data_path(dataset_idx)
        if not s.store.exists(train_path):
            raise LaunchRefused(f"fit_on_parquet(dataset_idx={dataset_idx!r}): "
                                f"no staged training data at {train_path}; "
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
            options = FitOptions(s.gradient_compression, s.backward_passes_per_step,
                                 s.val_batch_size or s.batch_size, s.train_steps_per_epoch,
                                 s.validation_steps_per_epoch, s.transformation_fn, s.train_minibatch_fn,
                                 tuple(s.callbacks), s.label_shapes, s.log_model, s.verbose, s.random_seed)
            common = dict(data=data, validation=val, model=s.model, feature_cols=s.feature_cols,
                          label_cols=s.label_cols, batch_size=s.batch_size, epochs=s.epochs, weight_col=weights,
                          input_shapes=s.input_shapes, options=options)
            if s.lightning:
                out = self._runner.run(fit_lightning_on_each_rank, trainer_args=s.trainer_args, **common)
            else:
                out = self._runner.run(fit_on_each_rank, optimizer=s.optimizer, loss=s.losses, metrics=s.metrics,
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


__all__ = ["TorchEstimator"]
