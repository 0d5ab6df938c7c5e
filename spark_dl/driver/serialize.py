"""Serialize the user's ``main`` and kwargs on the driver, naming the culprit when that fails.

``cloudpickle`` alone says "cannot pickle '_thread.lock' object" and nothing about where the
lock is. We walk into the failing object (containers, instance attributes, a function's closure
and globals) to the innermost part that does not pickle, and name its path.
"""
from __future__ import annotations

import io
import types
from collections import ChainMap
from typing import Any, Callable

import cloudpickle

from spark_dl.errors import LaunchRefused


def _code_reduce(code: types.CodeType) -> tuple:
    """cloudpickle's reduction of a code object, with its file name kept: cloudpickle >= 3.1.2
    writes ``<dynamic-code>`` (for reproducible payloads), which would leave the user's own
    frames of a rank's traceback without their file, and linecache without their lines."""
    constructor, args = cloudpickle.cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    if hasattr(cloudpickle.cloudpickle, "_code_reduce"):  # its private reducer; else cloudpickle's own way
        dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping the file names of functions pickled by value."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()

_MAX_DEPTH = 12
_DRIVER_ONLY = {
    "SparkSession": "the SparkSession",
    "SparkContext": "the SparkContext",
    "DataFrame": "a Spark DataFrame",
    "RDD": "an RDD",
    "Column": "a Spark Column",
}


def _pickle_error(obj: Any) -> Exception | None:
    try:
        cloudpickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure is what we are looking for
        return e
    return None


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"[<element {i}>]", v) for i, v in enumerate(obj)]
    if isinstance(obj, types.FunctionType):
        out: list[tuple[str, Any]] = []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                out.append((f".<closure {name}>", cell.cell_contents))
            except ValueError:  # empty cell
                pass
        for name in _referenced_globals(obj.__code__):
            if name in obj.__globals__:
                out.append((f".<global {name}>", obj.__globals__[name]))
        return out
    if isinstance(obj, types.MethodType):
        return [(".__self__", obj.__self__), (".__func__", obj.__func__)]
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and not isinstance(obj, (type, types.ModuleType)):
        return [(f".{k}", v) for k, v in d.items()]
    return []


def _referenced_globals(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_referenced_globals(const))
    return list(dict.fromkeys(names))


def find_culprit(obj: Any, path: str) -> tuple[str, Any, Exception]:
    """Return ``(path, innermost unpicklable object, its error)``. ``obj`` must fail to pickle."""
    err = _pickle_error(obj)
    assert err is not None
    seen: set[int] = set()
    depth = 0
    while depth < _MAX_DEPTH and id(obj) not in seen and _driver_only(obj) is None:
        seen.add(id(obj))
        for suffix, child in _children(obj):
            child_err = _pickle_error(child)
            if child_err is not None:
                path, obj, err = path + suffix, child, child_err
                break
        else:
            break
        depth += 1
    return path, obj, err


def _describe(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _driver_only(obj: Any) -> str | None:
    """What a driver-only Spark object is called, or None; the walk stops at one."""
    cls = type(obj)
    if not cls.__module__.startswith("pyspark"):
        return None
    return next((_DRIVER_ONLY[c.__name__] for c in cls.__mro__ if c.__name__ in _DRIVER_ONLY), None)


def _advice(obj: Any) -> str:
    what = _driver_only(obj)
    if what:
        return (
            f"{what} exists only on the driver and cannot be used inside a rank. "
            "Pass the data itself (or a path to it), or train on a DataFrame with the data API."
        )
    return "Create it inside main, or pass the plain values it is built from."


def serialize_job(main: Callable[..., Any], kwargs: dict[str, Any], args: tuple[Any, ...] = ()) -> bytes:
    """cloudpickle ``(main, args, kwargs)``; raise :class:`LaunchRefused` naming whatever does not pickle."""
    if not callable(main):
        raise LaunchRefused(
            f"main must be a callable (the training function), got {_describe(main)}: {main!r:.80}. "
            "Pass the function itself: run(main, lr=0.1), not run(main(), lr=0.1)."
        )
    try:
        return dumps((main, tuple(args), kwargs))
    except Exception:  # noqa: BLE001 - find out which part, below
        pass
    for i, value in enumerate(args):
        if _pickle_error(value) is not None:
            path, culprit, err = find_culprit(value, f"args[{i}]")
            raise LaunchRefused(
                f"positional argument {i} cannot be sent to the ranks: {path} is a {_describe(culprit)}, "
                f"which cannot be pickled ({type(err).__name__}: {err}). {_advice(culprit)}"
            )
    for name, value in kwargs.items():
        if _pickle_error(value) is not None:
            path, culprit, err = find_culprit(value, name)
            raise LaunchRefused(
                f"kwarg {name!r} cannot be sent to the ranks: {path} is a {_describe(culprit)}, "
                f"which cannot be pickled ({type(err).__name__}: {err}). {_advice(culprit)}"
            )
    path, culprit, err = find_culprit(main, getattr(main, "__name__", "main"))
    raise LaunchRefused(
        f"main cannot be sent to the ranks: {path} is a {_describe(culprit)}, which cannot be "
        f"pickled ({type(err).__name__}: {err}). {_advice(culprit)}"
    )
