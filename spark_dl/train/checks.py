"""Argument checks shared by the recipe's pieces: a number of the wrong kind (None, a str, NaN) is
named with the parameter, not left to fail as ``'<' not supported`` or to run as a NaN lr."""
from __future__ import annotations

import numbers
from typing import Any

from ..errors import in_range


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
