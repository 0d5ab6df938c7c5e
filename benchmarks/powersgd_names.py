"""PowerSGD's settings in a benchmark's list of configurations, one syntax for every script here:
``powersgd`` is ``PowerSGD()`` at its defaults, ``powersgd-r<R>`` ``PowerSGD(rank=R)`` and
``powersgd-r<R>-w<S>`` ``PowerSGD(rank=R, start_iter=S)`` (R >= 1 and S >= 0 uncompressed steps
first): ``powersgd-r4-w10`` is the rank-4 PowerSGD with 10 uncompressed steps."""
from __future__ import annotations

import re

PATTERN = re.compile(r"powersgd(?:-r0*([1-9]\d*)(?:-w(\d+))?)?")
SYNTAX = "powersgd-r<rank >= 1>[-w<start_iter>]"


def settings(name: str) -> dict | None:
    """``PowerSGD``'s keyword arguments for ``name``, or None where it names no PowerSGD."""
    m = PATTERN.fullmatch(name)
    if m is None:
        return None
    out = {}
    if m[1] is not None:
        out["rank"] = int(m[1])
    if m[2] is not None:
        out["start_iter"] = int(m[2])
    return out
