"""Turning arbitrary values into what MLflow accepts: flat string params and valid metric names."""
from __future__ import annotations

import functools
import re
from typing import Any, Mapping

MAX_PARAM_VALUE = 6000
MAX_KEY = 250
_BAD_NAME_CHARS = re.compile(r"[^\w\-. /:]")
_PLAIN = (str, int, float, bool, type(None))


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": {"c": 1}}}`` -> ``{"a.b.c": 1}``."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def is_plain(value: Any) -> bool:
    """Values worth recording as a parameter: scalars, and lists/tuples/dicts of them."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) <= 64 and all(isinstance(v, _PLAIN) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def param_value(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value) if isinstance(value, (list, tuple)) else str(value)
    return text[:MAX_PARAM_VALUE]


@functools.lru_cache(maxsize=4096)
def clean_name(name: str) -> str:
    """An MLflow-valid metric/param key: unsupported characters become ``_``."""
    return _BAD_NAME_CHARS.sub("_", str(name))[:MAX_KEY] or "_"
