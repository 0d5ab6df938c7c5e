"""What each rank of a ``TorchEstimator`` fit of a ``LightningModule`` runs (Horovod's
``horovod.spark.lightning.TorchEstimator``): a Lightning ``Trainer`` with DDP over the run's ranks,
fed the rank's DataFrame shard as ``{column: tensor}`` batches, one epoch's shuffle per Lightning
epoch. Every epoch ends with a Lightning checkpoint saved through :func:`spark_dl.save_checkpoint`,
so a restarted attempt resumes with ``trainer.fit(ckpt_path=...)`` after the last finished epoch.
Kept apart from :mod:`spark_dl.estimator` (pyspark.ml) so that ranks start without it.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from spark_dl.compat.estimator.rank_loop import float_dtype, on_device, reshaped, transformed, widened

_CHECKPOINT_KEY = "spark_dl.lightning_estimator"
_PADDING = "__spark_dl_padding__"
# Trainer arguments the estimator sets from its own settings, or that would undo the run's DDP
FIXED_TRAINER_ARGS = {
    "strategy": "the run's DDP over its ranks",
    "plugins": "the run's ranks, from the launcher's variables",
    "num_nodes": "the ranks are num_proc",
    "devices": "one device per rank (its GPU, or the CPU)",
    "max_epochs": "epochs",
    "limit_train_batches": "train_steps_per_epoch",
    "limit_val_batches": "validation_steps_per_epoch",
    "accumulate_grad_batches": "backward_passes_per_step",
    "use_distributed_sampler": "each rank reads its own shard",
    "enable_checkpointing": "every epoch's checkpoint, which restarts resume from",
}


def lightning_package(model: Any) -> str | None:
    """``"lightning"`` or ``"pytorch_lightning"`` when ``model`` is that package's
    ``LightningModule`` (by its classes' modules: neither package is imported here), else None."""
    for cls in type(model).__mro__:
        if cls.__name__ == "LightningModule":
            if cls.__module__.startswith("lightning.pytorch"):
                return "lightning"
            if cls.__module__.startswith("pytorch_lightning"):
                return "pytorch_lightning"
    return None


class _Loader:
    """The rank's shard as Lightning iterates a data loader: each ``iter()`` is the trainer's
    current epoch's batches (the shared shuffle of that epoch), as the model gets them: floating
    columns in its dtype, int labels widened, ``input_shapes``/``label_shapes`` applied after
    ``transformation_fn``."""

    def __init__(self, data, batch_size: int, steps: int | None, feature_cols, label_cols, weight_col,
                 input_shapes, label_shapes, transformation, dtype, held_out: bool = False) -> None:
        self.data, self.batch_size, self.steps = data, batch_size, steps
        self.feature_cols, self.label_cols, self.weight_col = feature_cols, label_cols, weight_col
        self.input_shapes, self.label_shapes, self.transformation = input_shapes, label_shapes, transformation
        self.dtype, self.held_out = dtype, held_out
        self.trainer: Any = None
        self.example = None  # a few rows of the model's input, for the logged model's signature

    def __len__(self) -> int:
        n = -(-len(self.data) // self.batch_size)
        return n if self.steps is None else min(n, self.steps)

    def __iter__(self):
        import itertools

        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        if self.held_out:  # every rank's share, each row once: the repeats that even the shares out are left out
            batches = self.data.batches(batch_size=self.batch_size, padding=_PADDING)
        else:
            batches = self.data.batches(batch_size=self.batch_size, epoch=epoch)
        for batch in itertools.islice(batches, len(self)):
            if self.held_out:
                real = ~batch.pop(_PADDING)
                if real.any() and not real.all():  # a batch of repeats only stays, so every rank has as many
                    batch = {c: t[real] for c, t in batch.items()}
            yield self._prepared(batch)

    def _prepared(self, batch: dict) -> dict:
        batch = dict(transformed(self.transformation, batch, self.feature_cols, self.label_cols, self.weight_col))
        inputs = reshaped([on_device(batch[c], "cpu", self.dtype) for c in self.feature_cols], self.input_shapes,
                          self.feature_cols)
        labels = reshaped([widened(on_device(batch[c], "cpu", self.dtype)) for c in self.label_cols],
                          self.label_shapes, self.label_cols, "label_shapes")
        batch.update(zip(self.feature_cols, inputs))
        batch.update(zip(self.label_cols, labels))
        if self.weight_col is not None:
            batch[self.weight_col] = on_device(batch[self.weight_col], "cpu", self.dtype)
        if self.example is None and len(inputs) == 1:
            self.example = inputs[0][:5].detach().clone()
        return batch


def fit_lightning_on_each_rank(data, validation, model, feature_cols, label_cols, batch_size, epochs,
                               weight_col=None, input_shapes=None, options: Any = None,
                               trainer_args: dict | None = None):
    """Each rank: ``Trainer.fit`` of ``model`` on its shard; rank 0 returns the trained weights and,
    per epoch, every metric the module logged (``trainer.callback_metrics`` at the epoch's end)."""
    import importlib

    import torch

    import spark_dl
    from spark_dl.rank.context import scratch_dir

    spark_dl.init()
    package = lightning_package(model)
    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")
    helpers = importlib.import_module("spark_dl.ray_train." + ("lightning" if package == "lightning"
                                                                else "pytorch_lightning"))
    if options.random_seed is not None:
        torch.manual_seed(options.random_seed)
    saved = spark_dl.load_checkpoint()
    saved = saved.get(_CHECKPOINT_KEY) if isinstance(saved, dict) else None
    history: dict[str, list[float]] = dict(saved["history"]) if saved is not None else {}
    ckpt_path = None
    scratch = tempfile.mkdtemp(prefix="lightning-estimator-", dir=scratch_dir())
    if saved is not None:
        ckpt_path = os.path.join(scratch, "resume.ckpt")
        with open(ckpt_path, "wb") as f:
            f.write(saved["ckpt"])

    dtype = float_dtype(model)
    train = _Loader(data, batch_size, options.train_steps, feature_cols, label_cols, weight_col, input_shapes,
                    options.label_shapes, options.transformation, dtype)
    held = None if validation is None else _Loader(
        validation, options.val_batch_size, options.val_steps, feature_cols, label_cols, weight_col, input_shapes,
        options.label_shapes, options.transformation, dtype, held_out=True)

    class _EpochEnd(pl.callbacks.Checkpoint):
        """Keeps the epoch's logged metrics, logs the verbose line, and checkpoints the epoch. A
        ``Checkpoint`` callback, so Lightning runs it after the module's own epoch-end hook (what
        that logs is kept) and adds no ``ModelCheckpoint`` of its own."""

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            epoch = trainer.current_epoch
            for name, value in trainer.callback_metrics.items():
                history.setdefault(name, []).append(float(value))
            if options.verbose and trainer.global_rank == 0:
                values = {k: v[-1] for k, v in history.items()}
                spark_dl.log_to_driver(f"epoch {epoch + 1}/{epochs}: " +
                                       ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
            path = os.path.join(scratch, f"epoch-{epoch}.ckpt")
            trainer.save_checkpoint(path)  # rank 0 writes it; every rank waits for it
            if trainer.global_rank == 0:
                with open(path, "rb") as f:
                    blob = f.read()
                os.remove(path)
                spark_dl.save_checkpoint({_CHECKPOINT_KEY: {"ckpt": blob, "epoch": epoch, "history": history}},
                                         step=epoch)

    args = dict(trainer_args or {})
    callbacks = list(options.callbacks) + [_EpochEnd()]
    args["callbacks"] = list(args.get("callbacks") or []) + callbacks
    if "logger" not in args:
        args["logger"] = _logger(pl)
    args.setdefault("accelerator", "gpu" if torch.cuda.is_available() else "cpu")
    args.setdefault("enable_progress_bar", options.verbose == 2)
    args.setdefault("enable_model_summary", False)
    if options.compression is not None:
        args["callbacks"].append(_compressed(pl, options.compression))
    trainer = pl.Trainer(max_epochs=epochs, devices="auto", strategy=helpers.RayDDPStrategy(),
                         plugins=[helpers.RayLightningEnvironment()], use_distributed_sampler=False,
                         accumulate_grad_batches=options.passes,
                         limit_train_batches=options.train_steps if options.train_steps is not None else 1.0,
                         limit_val_batches=options.val_steps if options.val_steps is not None else 1.0, **args)
    train.trainer = trainer
    try:
        trainer.fit(model, train_dataloaders=train, val_dataloaders=held, ckpt_path=ckpt_path)
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    model = model.cpu()
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if options.log_model:  # rank 0's, when tracking is on; a no-op otherwise
        try:
            spark_dl.log_model(model, "model", input_example=train.example)
        except ValueError as e:
            print(f"spark-dl: the model is logged without a signature: {e}", file=sys.stderr, flush=True)
            spark_dl.log_model(model, "model")
    return {"state": state, "history": history}


def _logger(pl) -> Any:
    """:class:`spark_dl.tracking.lightning.SparkDLLogger` on the model's Lightning package (a
    Trainer refuses the other package's loggers): ``self.log`` metrics reach the run's MLflow run."""
    from spark_dl.tracking.rank.lightning import SparkDLLogger

    if isinstance(SparkDLLogger(), pl.loggers.Logger):
        return SparkDLLogger()
    methods = ("name", "version", "log_hyperparams", "log_metrics", "save", "finalize")
    twin = type("SparkDLLogger", (pl.loggers.Logger,), {k: vars(SparkDLLogger)[k] for k in methods})
    twin.__module__ = __name__
    return twin()


def _compressed(pl, compressor) -> Any:
    """A callback registering ``compressor``'s DDP communication hook once the Trainer has wrapped
    the model, before its first backward: Lightning's own ``ddp_comm_hook`` is for CUDA only, and
    spark-dl's hooks work on Gloo too. The hook is told the module's (first) optimizer, so error
    feedback follows its lr and compresses the shared velocity under momentum SGD."""
    import torch

    class _Compression(pl.Callback):
        def on_fit_start(self, trainer, pl_module) -> None:
            from spark_dl.compression.ddp import make_ddp_hook

            ddp = trainer.strategy.model
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                optimizers = trainer.optimizers  # set up by now: the strategy's setup comes first
                ddp.register_comm_hook(*make_ddp_hook(compressor, optimizer=optimizers[0] if optimizers else None))

    return _Compression()
