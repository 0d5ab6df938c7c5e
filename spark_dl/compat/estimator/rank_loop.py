"""What each rank of a ``TorchEstimator`` fit runs (the training loop, held-out batches, metrics)
and what the executors' ``TorchModel.transform`` batches use. Kept apart from :mod:`spark_dl.estimator`,
whose Spark ML classes import ``pyspark.ml`` (0.6 s of pandas and scipy a process), so that ranks and
prediction workers start without it.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from spark_dl.rank.tensors import comm_device


def reshaped(tensors: list, shapes: list[tuple[int, ...]] | None, cols: list[str],
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



@dataclass(frozen=True)
class Losses:
    """How a batch's loss is computed: one ``loss(output, *labels)``, or (``weights`` set) one loss
    per model output and label column, ``sum(w_i * loss_i(output_i, label_i))``."""

    fns: tuple
    weights: tuple[float, ...] | None = None
    constructors: bool = False  # fns build the losses: called once on each rank
    label_cols: tuple[str, ...] = ()  # named by a loss's refusal of a label's dtype

    def built(self) -> "Losses":
        if not self.constructors:
            return self
        return Losses(tuple(make() for make in self.fns), self.weights, False, self.label_cols)

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


_CHECKPOINT_KEY = "spark_dl.estimator"  # where a fit's state sits in its checkpoints (kept across versions)


@dataclass(frozen=True)
class FitOptions:
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


def fit_on_each_rank(data, validation, model, optimizer, loss: Losses, feature_cols, label_cols, batch_size, epochs,
                     metrics, weight_col=None, input_shapes=None, options: FitOptions = FitOptions()):
    """Each rank: DDP over the rank's device, one pass over its shard per epoch; rank 0 returns the
    trained weights, the per-epoch loss averaged over every rank's batches, the metrics averaged
    over every rank's rows and, with ``validation``, the held-out rows' loss and metrics after
    each epoch (averaged over rows). Each epoch ends with a checkpoint, and a restarted attempt
    starts after the last one checkpointed."""
    import itertools

    import torch
    import torch.distributed as dist

    import spark_dl
    from spark_dl.compat.estimator import callbacks as cbs
    from spark_dl.rank.prepare import prepare_model

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
        from spark_dl.compression.ddp import make_ddp_hook

        # the optimizer: error feedback follows its lr and momentum, and "auto" picks what is safe for it
        ddp.register_comm_hook(*make_ddp_hook(options.compression, optimizer=opt))
    loss = loss.built()
    device = spark_dl.get_device()
    dtype = float_dtype(model)
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


def transformed(transformation, batch: dict, feature_cols, label_cols, weight_col) -> Mapping:
    """``transformation_fn(batch)`` (the batch as is without one), refused unless it is a dict with
    the columns the fit reads."""
    if transformation is None:
        return batch
    batch = transformation(batch)
    needed = feature_cols + label_cols + ([weight_col] if weight_col else [])
    if not isinstance(batch, Mapping) or any(c not in batch for c in needed):
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise TypeError(f"transformation_fn must return the batch as a dict of column -> tensor with the "
                        f"columns {needed}; it returned {got}")
    return batch


class _Batches:
    """A batch of shard rows as ``(inputs, labels, sample_weights)`` on the rank's device, after
    ``transformation_fn``, ``input_shapes`` and ``label_shapes``."""

    def __init__(self, feature_cols, label_cols, weight_col, input_shapes, device, dtype, transformation,
                 label_shapes=None) -> None:
        self.feature_cols, self.label_cols, self.weight_col = feature_cols, label_cols, weight_col
        self.input_shapes, self.device, self.dtype, self.transformation = input_shapes, device, dtype, transformation
        self.label_shapes = label_shapes

    def __call__(self, batch: dict) -> tuple[list, list, Any]:
        batch = transformed(self.transformation, batch, self.feature_cols, self.label_cols, self.weight_col)
        inputs = reshaped([on_device(batch[c], self.device, self.dtype) for c in self.feature_cols],
                          self.input_shapes, self.feature_cols)
        labels = reshaped([widened(on_device(batch[c], self.device, self.dtype)) for c in self.label_cols],
                          self.label_shapes, self.label_cols, "label_shapes")
        weights = None if self.weight_col is None else on_device(batch[self.weight_col], self.device, self.dtype)
        return inputs, labels, weights


class _Step:
    """One training batch: forward, backward and, every ``passes`` batches (or at the epoch's
    last), the optimizer step over the accumulated mean; or Horovod's ``train_minibatch``."""

    def __init__(self, ddp, opt, loss: Losses, passes: int, minibatch=None) -> None:
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


def _held_out(val, model, loss: Losses, metrics, batch_of: _Batches, batch_size, steps=None):
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


def float_dtype(model):
    """The dtype of the model's floating parameters (float32 unless it was converted)."""
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def model_inputs(table, cols, kinds, dtype, input_shapes=None, named=None):
    """The model's inputs from an Arrow table or batch: one CPU tensor per feature column (``cols``,
    the table's names; ``named`` maps them to the DataFrame's where they differ)."""
    from spark_dl.rank.shards import column_tensor

    named = named or {}
    real = [named.get(c, c) for c in cols]
    return reshaped([on_device(column_tensor(table.column(c), kinds[name], name, "transform"), "cpu", dtype)
                     for c, name in zip(cols, real)], input_shapes, real)


def widened(label):
    """An int8/16/32 label as int64: class indices as ``cross_entropy`` and ``nll_loss`` take them."""
    import torch

    return label.long() if label.dtype in (torch.int8, torch.int16, torch.int32) else label


def on_device(tensor, device, dtype):
    """A column's tensor on ``device``; floating columns in the model's dtype (a Spark double column
    would otherwise meet float32 weights), integer ones (class labels) as they are."""
    return tensor.to(device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
