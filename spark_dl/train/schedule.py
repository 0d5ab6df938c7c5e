"""Gradual warmup composed with step or cosine decay: a pure function and an ``LRScheduler``.

Steps count optimizer steps (iterations), starting at 0. Goyal et al. (2017, §2.2) warm up per
iteration: "start from a learning rate of eta and increment it by a constant amount at each
iteration such that it reaches eta_hat = k * eta after 5 epochs", then follow the usual schedule.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from spark_dl.train.checks import number

Decay = Literal["none", "step", "cosine"]
DECAYS: tuple[str, ...] = ("none", "step", "cosine")


def lr_at(
    step: int,
    *,
    peak_lr: float,
    warmup_steps: int = 0,
    warmup_start_lr: float | None = None,
    decay: Decay = "none",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    total_steps: int | None = None,
    final_lr: float = 0.0,
) -> float:
    """The learning rate at optimizer step ``step`` (0-based).

    With ``W = warmup_steps``, ``s = warmup_start_lr`` and ``p = peak_lr``:

    - warmup, ``t < W``: ``lr = s + (p - s) * t / W`` (so ``lr(0) = s`` and ``lr(W) = p``);
      Goyal et al. take ``s`` = the single-worker lr ``eta`` and ``p = k * eta``.
    - then ``decay="none"``: ``lr = p``;
      ``decay="step"``: ``lr = p * gamma ** #{m in milestones : m <= t}`` (divide by 10 at each
      milestone with the default ``gamma``; milestones are absolute steps, as in "epochs 30, 60, 80",
      and there must be at least one: without them, ``decay="none"`` says what is meant);
      ``decay="cosine"``: ``lr = f + (p - f) * (1 + cos(pi * (t - W) / (T - W))) / 2`` with
      ``T = total_steps`` and ``f = final_lr``, and ``lr = f`` from ``T`` on.
    """
    _check(peak_lr, warmup_steps, warmup_start_lr, decay, milestones, gamma, total_steps, final_lr)
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()  # as optimizers keep it in their state
    # NaN compares False with everything: unchecked, it would run at peak_lr (or gamma**k of it)
    step = number(step, "step", low=0)
    if step < warmup_steps:
        start = warmup_start_lr if warmup_start_lr is not None else peak_lr
        return start + (peak_lr - start) * step / warmup_steps
    if decay == "step":
        return peak_lr * gamma ** bisect.bisect_right(list(milestones), step)
    if decay == "cosine":
        assert total_steps is not None
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return final_lr + (peak_lr - final_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0
    return peak_lr


def _check(peak_lr: float, warmup_steps: int, warmup_start_lr: float | None, decay: str,
           milestones: Sequence[int], gamma: float, total_steps: int | None, final_lr: float) -> None:
    number(peak_lr, "peak_lr", low=0)
    number(warmup_steps, "warmup_steps", low=0)
    number(gamma, "gamma")
    number(final_lr, "final_lr")
    if total_steps is not None:
        number(total_steps, "total_steps", low=0)
    if warmup_steps > 0 and warmup_start_lr is None:
        raise ValueError(
            "warmup_steps > 0 needs warmup_start_lr: Goyal et al. start the warmup at the "
            "single-worker lr eta (the base_lr of scale_lr) and reach peak_lr = k * eta"
        )
    if warmup_start_lr is not None:
        number(warmup_start_lr, "warmup_start_lr", low=0)
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    if decay == "step":
        if not milestones:  # it would warm up, then stay at peak_lr forever
            raise ValueError(
                "decay='step' needs milestones, the absolute optimizer steps at which the lr is multiplied "
                "by gamma: pass milestones=(...) in steps, e.g. milestones=(3000, 6000), or decay='none' "
                "to stay at peak_lr after the warmup"
            )
        if list(milestones) != sorted(milestones):
            raise ValueError(f"milestones must be increasing, got {list(milestones)}")
        if milestones[0] < warmup_steps:
            raise ValueError(
                f"milestone {milestones[0]} falls inside the warmup ({warmup_steps} steps); "
                "milestones are absolute steps and must come after the warmup"
            )
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    elif milestones:
        raise ValueError(f"milestones are only used with decay='step', got decay={decay!r}")
    if decay == "cosine":
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(
                f"decay='cosine' needs total_steps > warmup_steps, got total_steps={total_steps}, "
                f"warmup_steps={warmup_steps}"
            )
        if not 0 <= final_lr <= peak_lr:
            raise ValueError(f"final_lr must be in [0, peak_lr], got {final_lr}")
    elif final_lr:  # it would be ignored: the step decay ends where gamma and the milestones take it
        raise ValueError(f"final_lr={final_lr} is where decay='cosine' ends; decay={decay!r} does not use it "
                         "(its lr is peak_lr * gamma ** milestones passed): drop it, or use decay='cosine'")


def _whole(value: object, name: str) -> int:
    """A step count as an int: ``3000.0`` is fine, ``2.7`` is refused rather than truncated to 2."""
    value = number(value, name, low=0)
    if value != int(value):
        raise ValueError(f"{name} must be a whole number of optimizer steps, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class LRSchedule:
    """The arguments of :func:`lr_at`, validated once; calling it gives ``lr_at(step, ...)``.

    Picklable, so the driver can build it and pass it to ``HorovodRunner.run``.
    """

    peak_lr: float
    warmup_steps: int = 0
    warmup_start_lr: float | None = None
    decay: Decay = "none"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    total_steps: int | None = None
    final_lr: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.milestones, (str, bytes)) or not isinstance(self.milestones, (list, tuple)):
            raise TypeError(f"milestones must be a tuple of steps, e.g. (3000, 6000), got {self.milestones!r}")
        object.__setattr__(self, "milestones", tuple(_whole(m, "each milestone") for m in self.milestones))
        _check(self.peak_lr, self.warmup_steps, self.warmup_start_lr, self.decay, self.milestones,
               self.gamma, self.total_steps, self.final_lr)

    def __call__(self, step: int) -> float:
        return lr_at(
            step, peak_lr=self.peak_lr, warmup_steps=self.warmup_steps,
            warmup_start_lr=self.warmup_start_lr, decay=self.decay, milestones=self.milestones,
            gamma=self.gamma, total_steps=self.total_steps, final_lr=self.final_lr,
        )


class WarmupScheduler(LRScheduler):
    """An ``LRScheduler`` following an :class:`LRSchedule`: call ``step()`` after each ``optimizer.step()``.

    Optimizer step ``t`` runs with ``lr = schedule(t)``. Each param group's lr is scaled by
    ``group_initial_lr / schedule.peak_lr``, so build the optimizer with ``lr=schedule.peak_lr``
    (groups with another lr keep their ratio to it, as with ``LambdaLR``). Works with any
    ``torch.optim.Optimizer``, including one wrapped by ``spark_dl.horovod.DistributedOptimizer``.

    ``state_dict()`` holds plain Python values (the schedule as a dict), so a checkpoint loads
    with ``torch.load``'s default ``weights_only=True``; ``load_state_dict`` restores the step
    count and the checkpoint's schedule, as torch's schedulers restore their own arguments.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule, last_epoch: int = -1) -> None:
        if not isinstance(schedule, LRSchedule):
            raise TypeError(f"schedule must be an LRSchedule, got {type(schedule).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                            "pass the optimizer (e.g. torch.optim.SGD(model.parameters(), ...)), not the model")
        if schedule.peak_lr <= 0:
            raise ValueError("WarmupScheduler scales groups by lr / peak_lr, so peak_lr must be > 0")
        initial = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        if not any(math.isclose(float(lr), schedule.peak_lr, rel_tol=1e-9) for lr in initial):
            # The usual mistake: the optimizer built with the single-worker lr, which would leave
            # every lr k times too small.
            raise ValueError(
                f"no param group of the optimizer has lr == schedule.peak_lr ({schedule.peak_lr}); "
                f"got {initial}. Build the optimizer with lr=schedule.peak_lr (recipe.peak_lr)."
            )
        self.schedule = schedule
        super().__init__(optimizer, last_epoch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["schedule"] = asdict(self.schedule)  # not the dataclass: weights_only loads refuse it
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        schedule = state.pop("schedule", self.schedule)
        schedule = schedule if isinstance(schedule, LRSchedule) else LRSchedule(**schedule)
        super().load_state_dict(state)
        self.schedule = schedule

    def get_lr(self) -> list[float]:
        factor = self.schedule(self.last_epoch) / self.schedule.peak_lr
        return [float(base) * factor for base in self.base_lrs]
