"""Callbacks for :class:`spark_dl.estimator.TorchEstimator`: Keras-style hooks run on every rank
around each epoch, and :class:`EarlyStopping`.

A callback is any object with some of these methods (each optional)::

    on_train_begin(trainer)
    on_epoch_begin(epoch, trainer)
    on_epoch_end(epoch, logs, trainer)     # logs: {"loss": ..., "val_loss": ..., metrics}
    on_train_end(logs, trainer)

``trainer`` is a :class:`Trainer`: the rank's model and optimizer, its rank, and ``stop_training``.
Every rank runs the callbacks with the same ``logs`` (they are averaged over all ranks first); rank
0's ``stop_training`` after ``on_epoch_end`` decides for all. A callback with ``state_dict()`` and
``load_state_dict(state)`` has its state (rank 0's) saved in each epoch's checkpoint and restored
when a restarted fit resumes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HOOKS = ("on_train_begin", "on_epoch_begin", "on_epoch_end", "on_train_end")


@dataclass
class Trainer:
    """What a callback may look at or change on its rank."""

    model: Any  # the torch.nn.Module being trained (not its DDP wrapper)
    optimizer: Any
    rank: int
    world_size: int
    start_epoch: int  # 0, or the epoch a restarted fit resumes at
    stop_training: bool = False  # set it in on_epoch_end to end the fit after this epoch (Keras's name)


class EarlyStopping:
    """Stop the fit once ``monitor`` has not improved by more than ``min_delta`` for ``patience``
    epochs in a row (Keras's ``EarlyStopping``). ``mode`` is ``"min"`` (losses) or ``"max"``
    (accuracies); ``"auto"`` picks ``"max"`` for names containing ``acc``."""

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0,
                 mode: str = "auto") -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStopping: monitor must be a history key such as 'val_loss', got {monitor!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping: patience must be an int >= 0, got {patience!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ValueError(f"EarlyStopping: min_delta must be a number >= 0, got {min_delta!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = ("max" if "acc" in monitor else "min") if mode == "auto" else mode
        self.best = math.inf if self.mode == "min" else -math.inf
        self.wait = 0
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, float], trainer: Trainer) -> None:
        if self.monitor not in logs:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, which this fit's logs do not have (they have "
                           f"{sorted(logs)}); monitor one of those")
        value = logs[self.monitor]
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            trainer.stop_training = True
            self.stopped_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait, self.stopped_epoch = state["best"], state["wait"], state["stopped_epoch"]


def check(callbacks: Any) -> list[Any]:
    """``callbacks=`` as a list of objects that each have at least one hook."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of callback objects, got {type(callbacks).__name__}")
    for cb in callbacks:
        if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
            raise TypeError(f"callback {cb!r} has none of the hooks {', '.join(HOOKS)}: give it at least one")
    return list(callbacks)


def call(callbacks: list[Any], hook: str, *args: Any) -> None:
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if callable(fn):
            fn(*args)


def states(callbacks: list[Any]) -> list[Any]:
    """Each callback's ``state_dict()`` (None for those without one), for the checkpoint."""
    return [cb.state_dict() if callable(getattr(cb, "state_dict", None)) else None for cb in callbacks]


def restore(callbacks: list[Any], saved: list[Any] | None) -> None:
    for cb, state in zip(callbacks, saved or ()):
        if state is not None and callable(getattr(cb, "load_state_dict", None)):
            cb.load_state_dict(state)
