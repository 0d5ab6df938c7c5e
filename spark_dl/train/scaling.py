"""Learning rate scaling rules: the lr for a global batch from an lr tuned at a base batch."""
from __future__ import annotations

import math
from typing import Literal

from spark_dl.train.checks import number

Rule = Literal["linear", "sqrt", "none"]
RULES: tuple[str, ...] = ("linear", "sqrt", "none")


def scale_lr(base_lr: float, base_batch: int, global_batch: int, rule: Rule = "linear") -> float:
    """The learning rate for ``global_batch`` given ``base_lr`` tuned at ``base_batch``.

    With ``k = global_batch / base_batch``:

    - ``"linear"`` (Goyal et al. 2017, §2.1): ``lr = base_lr * k``. Motivated by ``k`` small steps
      of size ``eta`` approximating one large step of size ``k * eta`` when the gradients barely
      change over those ``k`` steps. Goyal's ResNet-50: ``0.1 * 8192 / 256 = 3.2``.
    - ``"sqrt"`` (Krizhevsky 2014; Hoffer et al. 2017): ``lr = base_lr * sqrt(k)``, which keeps
      the covariance of the update ``eta^2 / M * cov(g)`` constant across batch sizes ``M``.
    - ``"none"``: ``lr = base_lr``.
    """
    base_lr = number(base_lr, "base_lr", low=0)
    for name, batch in (("base_batch", base_batch), ("global_batch", global_batch)):
        if number(batch, name) <= 0:
            raise ValueError(f"batch sizes must be positive, got base_batch={base_batch}, global_batch={global_batch}")
    k = global_batch / base_batch
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    if rule == "none":
        return base_lr
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
