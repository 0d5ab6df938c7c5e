"""Argument checks shared by the recipe's pieces: a number of the wrong kind (None, a str, NaN) is
named with the parameter, not left to fail as ``'<' not supported`` or to run as a NaN lr."""
from __future__ import annotations

import numbers
from typing import Any

from spark_dl.errors import in_range


def number(value: Any, name: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, integer: bool = False) -> Any:
    """``value`` as a Python number in range (an int when ``integer``; numpy scalars are fine), or a
    TypeError (not a number) / ValueError (NaN, infinite, out of range) that names ``name``."""
    kind = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise TypeError(f"{name} must be {kind}{_span(low, high, low_open, high_open)}, got {value!r}")
    value = int(value) if isinstance(value, numbers.Integral) else float(value)
    if not in_range(value, low=low, high=high, low_open=low_open, high_open=high_open, integer=integer):
        raise ValueError(f"{name} must be {'a finite number' if not integer else kind}"
                         f"{_span(low, high, low_open, high_open)}, got {value!r}")
    return value


def _span(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""


def flag(value: Any, name: str) -> bool:
    """``value`` if it is a bool, else a TypeError naming ``name`` (``"no"`` would count as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def momentum_sgd(group: dict[str, Any], where: str = "") -> dict[str, Any]:
    """A momentum-SGD group's ``lr``, ``momentum`` and ``weight_decay``, checked; ``where`` names
    the param group, if any."""
    return dict(
        lr=number(group["lr"], f"{where}lr", low=0),
        momentum=number(group["momentum"], f"{where}momentum", low=0, high=1, high_open=True),
        weight_decay=number(group["weight_decay"], f"{where}weight_decay", low=0),
    )


class CheckedGroups:
    """Mixed into a ``torch.optim.Optimizer``: each param group (``add_param_group``'s too) gets its
    hyperparameters checked by ``_check_group(group, where)`` like the constructor's defaults."""

    _check_group: Any

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            where = f"param group {len(self.param_groups)}: "  # type: ignore[attr-defined]
            param_group.update(self._check_group({**self.defaults, **param_group}, where))  # type: ignore[attr-defined]
        super().add_param_group(param_group)  # type: ignore[misc]
