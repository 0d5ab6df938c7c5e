"""Route MLflow's fluent API, called inside a rank, into the driver's run.

A rank must never open its own run (one ``run()`` = one MLflow run) nor talk to the tracking
server (the driver is the only client). So in a rank process, ``mlflow.log_metric(s)``,
``log_param(s)``, ``set_tag(s)``, ``log_text``, ``log_dict``, ``log_artifact`` and
``mlflow.pytorch.log_model`` go through the spark-dl channel; ``start_run``/``end_run`` become
no-ops standing for the driver's run; calls that would need the server from the rank
(``set_experiment``, ``log_artifacts``, ``log_figure``, ``autolog``...) raise an error that says
what to do instead.

MLflow takes about a second to import, so it is not imported here: an import hook patches
``mlflow`` (and ``mlflow.pytorch``) the moment user code imports them.
"""
from __future__ import annotations

import importlib.abc
import json
import os
import sys
from types import ModuleType
from typing import Any

from spark_dl.tracking.rank import api as trk

_ROUTED_NOTE = "spark-dl routes it to the driver's MLflow run"
_UNSUPPORTED = (
    "set_experiment", "create_experiment", "delete_experiment", "delete_run", "log_artifacts", "log_figure",
    "log_image", "log_table", "log_input", "autolog", "set_tracking_uri", "register_model",
)


class _RunInfo:
    run_id = None
    status = "RUNNING"


class RoutedRun:
    """What ``mlflow.start_run()``/``active_run()`` return in a rank: the driver's run, by proxy."""

    info = _RunInfo()

    def __enter__(self) -> "RoutedRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_run = RoutedRun()
_started = False


def _log_metric(key: str, value: float, step: int | None = None, *args: Any, **kwargs: Any) -> None:
    trk.log_metrics({key: value}, step)


def _log_metrics(metrics: dict, step: int | None = None, *args: Any, **kwargs: Any) -> None:
    trk.log_metrics(metrics, step)


def _log_param(key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    trk.log_params({key: value})
    return value


def _log_params(params: dict, *args: Any, **kwargs: Any) -> None:
    trk.log_params(params)


def _set_tag(key: str, value: Any, *args: Any, **kwargs: Any) -> None:
    trk.set_tags({key: value})


def _set_tags(tags: dict, *args: Any, **kwargs: Any) -> None:
    trk.set_tags(tags)


def _log_text(text: str, artifact_file: str, *args: Any, **kwargs: Any) -> None:
    trk.log_artifact_bytes(text.encode("utf-8"), artifact_file)


def _log_dict(dictionary: Any, artifact_file: str, *args: Any, **kwargs: Any) -> None:
    trk.log_artifact_bytes(json.dumps(dictionary, indent=2, default=str).encode("utf-8"), artifact_file)


def _log_artifact(local_path: str, artifact_path: str | None = None, *args: Any, **kwargs: Any) -> None:
    with open(local_path, "rb") as f:
        data = f.read()
    name = os.path.basename(local_path)
    trk.log_artifact_bytes(data, f"{artifact_path.rstrip('/')}/{name}" if artifact_path else name)


def _start_run(*args: Any, **kwargs: Any) -> RoutedRun:
    global _started
    _started = True
    return _run


def _end_run(*args: Any, **kwargs: Any) -> None:
    global _started
    _started = False


def _active_run() -> RoutedRun | None:
    return _run if _started else None


def _unsupported(name: str):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"mlflow.{name}() cannot run inside a spark-dl rank: the driver is the only MLflow client. "
            f"Call it on the driver before HorovodRunner.run(), or log from the rank with "
            f"mlflow.log_metric/log_param/log_text/log_artifact or spark_dl.log_model ({_ROUTED_NOTE})."
        )

    refuse.__name__ = name
    return refuse


def _torch_log_model(pytorch_model: Any, artifact_path: str | None = None, *args: Any,
                     name: str | None = None, input_example: Any = None, **kwargs: Any) -> None:
    trk.log_model(pytorch_model, name or artifact_path or "model", input_example=input_example)


_ROUTES = {
    "log_metric": _log_metric, "log_metrics": _log_metrics, "log_param": _log_param, "log_params": _log_params,
    "set_tag": _set_tag, "set_tags": _set_tags, "log_text": _log_text, "log_dict": _log_dict,
    "log_artifact": _log_artifact, "start_run": _start_run, "end_run": _end_run, "active_run": _active_run,
}


def _patch(name: str, module: ModuleType) -> None:
    if name == "mlflow":
        fluent = sys.modules.get("mlflow.tracking.fluent")
        for attr, fn in _ROUTES.items():
            for m in (module, fluent):
                if m is not None and hasattr(m, attr):
                    setattr(m, attr, fn)
        for attr in _UNSUPPORTED:
            if hasattr(module, attr):
                setattr(module, attr, _unsupported(attr))
    elif name == "mlflow.pytorch":
        module.log_model = _torch_log_model


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``mlflow``/``mlflow.pytorch`` right after they are executed, once."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname not in ("mlflow", "mlflow.pytorch"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _patch(fullname, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Route the fluent API in this process (already imported modules are patched at once)."""
    for name in ("mlflow", "mlflow.pytorch"):
        if name in sys.modules:
            _patch(name, sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
