"""Argument checks shared by the recipe's pieces: a number of the wrong kind (None, a str, NaN) is
named with the parameter, not left to fail as ``'<' not supported`` or to run as a NaN lr."""
from __future__ import annotations

import math
import numbers
from typing import Any


def number(value: Any, name: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, integer: bool = False) -> Any:
    """``value`` as a Python number in range (an int when ``integer``; numpy scalars are fine), or a
    TypeError (not a number) / ValueError (NaN, infinite, out of range) that names ``name``."""
    kind = "an int" if integer else "a number"
    ok_type = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    if not ok_type:
        raise TypeError(f"{name} must be {kind}{_span(low, high, low_open, high_open)}, got {value!r}")
    value = int(value) if integer else float(value) if not isinstance(value, numbers.Integral) else int(value)
    finite = integer or math.isfinite(value)
    in_range = finite and (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high))
    if not in_range:
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
