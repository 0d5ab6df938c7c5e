"""``LargeBatchRecipe``: Goyal et al.'s recipe (scaled lr, gradual warmup, then decay) in one object."""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

import torch

from spark_dl.train.checks import number
from spark_dl.train.scaling import Rule, scale_lr
from spark_dl.train.schedule import Decay, LRSchedule, WarmupScheduler

# Goyal et al.'s ImageNet schedule: the lr divided by 10 at epochs 30, 60 and 80 of 90.
GOYAL_MILESTONES: tuple[int, ...] = (30, 60, 80)
GOYAL_EPOCHS = 90


def _goyal_proportions(epochs: float) -> tuple[float, ...]:
    return tuple(epochs * m / GOYAL_EPOCHS for m in GOYAL_MILESTONES)


def _goyal_milestones(epochs: float, warmup_epochs: float) -> tuple[float, ...]:
    """Goyal et al.'s milestones scaled to ``epochs``: ``epochs * (30, 60, 80) / 90``, the first after the warmup."""
    milestones = _goyal_proportions(epochs)
    if milestones[0] <= warmup_epochs:
        raise ValueError(
            f"decay='step' without milestones divides the lr at Goyal et al.'s proportions of epochs={epochs:g} "
            f"(epochs {', '.join(f'{m:g}' for m in milestones)}), but the first does not come after the warmup "
            f"({warmup_epochs:g} epochs): pass milestones=(...) in epochs after the warmup, or fewer warmup_epochs"
        )
    return milestones


@dataclass(frozen=True)
class LargeBatchRecipe:
    """The lr schedule for training at ``global_batch`` with an lr tuned at ``base_batch``.

    ``global_batch = per_rank_batch * world_size * backward_passes_per_step`` (the last for
    gradients accumulated by ``DistributedOptimizer(backward_passes_per_step=...)``);
    ``peak_lr = scale_lr(base_lr, base_batch, global_batch, rule)``. The lr warms up linearly
    from ``base_lr`` to ``peak_lr`` over ``warmup_epochs`` (Goyal et al. §2.2), then decays:
    ``"step"`` multiplies by ``gamma`` at each epoch in ``milestones``; ``"cosine"`` anneals to
    ``final_lr`` at ``epochs``; ``"none"`` stays at ``peak_lr``.

    ``decay="step"`` (the default) without ``milestones`` takes Goyal et al.'s proportions of
    ``epochs``: ``epochs * (30, 60, 80) / 90``, kept in ``milestones`` (``(30.0, 60.0, 80.0)`` for
    ``epochs=90``); the first must come after the warmup. With neither ``milestones`` nor ``epochs``
    it is a ValueError, since the lr would never decay: pass one, or ``decay="none"``. Milestones
    derived this way follow ``epochs`` through ``dataclasses.replace(recipe, epochs=180)``
    (``(60.0, 120.0, 160.0)``); milestones given stay as given.

    ``steps_per_epoch`` counts optimizer steps in one epoch at the global batch (``len(loader)``
    of one rank's sharded loader, divided by ``backward_passes_per_step``). Milestones and the
    warmup length are epochs; they are rounded to whole steps.

    Goyal's ResNet-50: ``LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=256,
    warmup_epochs=5, steps_per_epoch=156, epochs=90)`` gives ``peak_lr == 3.2`` and
    ``milestones == (30.0, 60.0, 80.0)``.
    """

    base_lr: float
    base_batch: int
    per_rank_batch: int
    world_size: int
    _: KW_ONLY
    steps_per_epoch: int
    warmup_epochs: float = 5.0
    decay: Decay = "step"
    milestones: tuple[float, ...] = ()
    epochs: float | None = None
    rule: Rule = "linear"
    gamma: float = 0.1
    final_lr: float = 0.0
    backward_passes_per_step: int = 1
    # the epochs Goyal's milestones were derived from: dataclasses.replace passes every field on,
    # so derived milestones would otherwise stick to the old epochs (epochs=180 keeping 30/60/80)
    _milestones_of_epochs: float | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("per_rank_batch", "world_size", "steps_per_epoch", "backward_passes_per_step", "base_batch"):
            object.__setattr__(self, name, number(getattr(self, name), name, low=1, integer=True))
        object.__setattr__(self, "base_lr", number(self.base_lr, "base_lr", low=0))
        object.__setattr__(self, "warmup_epochs", number(self.warmup_epochs, "warmup_epochs", low=0))
        if self.epochs is not None:
            object.__setattr__(self, "epochs", number(self.epochs, "epochs", low=0, low_open=True))
        if isinstance(self.milestones, (str, bytes)) or not isinstance(self.milestones, (list, tuple)):
            raise TypeError(f"milestones must be a tuple of epochs, e.g. (30, 60, 80), got {self.milestones!r}")
        object.__setattr__(self, "milestones", tuple(number(m, "each milestone", low=0) for m in self.milestones))
        derived_from = self._milestones_of_epochs
        object.__setattr__(self, "_milestones_of_epochs", None)
        if derived_from is not None and self.milestones == _goyal_proportions(derived_from):
            object.__setattr__(self, "milestones", ())  # derived, not given: derive them again for these epochs
        if self.decay == "step" and not self.milestones:  # no milestones would never decay: Goyal's, or refuse
            if self.epochs is None:
                raise ValueError(
                    "decay='step' needs milestones, or epochs to place them: pass milestones=(30, 60, 80) "
                    "(epochs from the start), or epochs= to divide the lr at Goyal et al.'s proportions "
                    "(epochs 30, 60, 80 of 90), or decay='none' to stay at peak_lr after the warmup, "
                    "or decay='cosine' (with epochs=)"
                )
            object.__setattr__(self, "milestones", _goyal_milestones(self.epochs, self.warmup_epochs))
            object.__setattr__(self, "_milestones_of_epochs", self.epochs)
        # the schedule's own checks speak in steps: say the same things in epochs, as given here
        if self.decay == "step" and self.milestones and self.milestones[0] < self.warmup_epochs:
            raise ValueError(f"milestone epoch {self.milestones[0]:g} falls inside the warmup ({self.warmup_epochs:g} "
                             "epochs): milestones are epochs from the start and must come after the warmup")
        # a milestone past the last epoch never fires: most likely milestones given in steps
        if self.decay == "step" and self.milestones and self.epochs is not None and max(self.milestones) > self.epochs:
            raise ValueError(f"milestone epoch {max(self.milestones):g} comes after the last epoch ({self.epochs:g}): "
                             "milestones are epochs, not steps, e.g. milestones=(30, 60, 80) with epochs=90")
        if self.decay == "cosine" and (self.epochs is None or self.epochs <= self.warmup_epochs):
            raise ValueError(f"decay='cosine' anneals until epochs, which must be > warmup_epochs="
                             f"{self.warmup_epochs:g}; got epochs={self.epochs}")
        self.schedule  # validates the rest

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step, over all ranks: ``k * n`` in Goyal et al."""
        return self.per_rank_batch * self.world_size * self.backward_passes_per_step

    @property
    def peak_lr(self) -> float:
        """``scale_lr(base_lr, base_batch, global_batch, rule)``: the lr once warmed up."""
        return scale_lr(self.base_lr, self.base_batch, self.global_batch, self.rule)

    @property
    def warmup_steps(self) -> int:
        """``warmup_epochs`` in optimizer steps; a warmup asked for lasts at least one step (0.01
        epochs of 10 steps would round to none, silently)."""
        steps = round(self.warmup_epochs * self.steps_per_epoch)
        return max(steps, 1) if self.warmup_epochs > 0 else steps

    @property
    def total_steps(self) -> int | None:
        return None if self.epochs is None else math.ceil(self.epochs * self.steps_per_epoch)

    @property
    def schedule(self) -> LRSchedule:
        """The :class:`LRSchedule` in optimizer steps."""
        peak = self.peak_lr
        return LRSchedule(
            peak_lr=peak,
            warmup_steps=self.warmup_steps,
            # Below the base batch the "warmup" would be a ramp down; start at the peak instead.
            warmup_start_lr=min(self.base_lr, peak),
            decay=self.decay,
            milestones=tuple(round(e * self.steps_per_epoch) for e in self.milestones),
            gamma=self.gamma,
            total_steps=self.total_steps,
            final_lr=self.final_lr,
        )

    def lr_at(self, step: int) -> float:
        """The lr of optimizer step ``step`` (0-based)."""
        return self.schedule(step)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> WarmupScheduler:
        """A :class:`WarmupScheduler` for ``optimizer``, which must be built with ``lr=self.peak_lr``."""
        return WarmupScheduler(optimizer, self.schedule)
