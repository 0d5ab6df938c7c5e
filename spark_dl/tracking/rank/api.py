"""The tracking functions training code calls in a rank: ``log_metrics``, ``log_params``,
``set_tags``, ``log_artifact_bytes``, ``log_model``; buffered and sent to the driver, the only MLflow
client (:mod:`spark_dl.tracking.rank.buffer`). Outside a rank process they go to the active MLflow
run, if any.

Message kinds sent to the driver (see ``tracking/driver/observer.py`` for their handling):

- ``tracking/metrics``: ``[(time_s, step, {name: float}, all_ranks), ...]`` in call order
- ``tracking/params``, ``tracking/tags``: flat ``{key: value}``
- ``tracking/model``: one chunk of a serialized model (``id``, ``seq``, ``data``, ``last``, ``meta``)
- ``tracking/artifact``: ``{"path": artifact path in the run, "data": bytes}``
- ``tracking/rank_info``: this rank's place in the world and its torch.distributed backend
"""
from __future__ import annotations

import io
import os
import threading
import uuid
from typing import Any, Mapping

from spark_dl import protocol
from spark_dl.rank import context as rank_api
from spark_dl.tracking.rank import buffer

MODEL_CHUNK = 4 * 1024 * 1024

def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *, all_ranks: bool = False) -> None:
    """Log ``{name: number}`` for ``step`` (default: one more than this rank's previous step).

    Costs a few microseconds: the values are buffered and sent to the driver every 50 ms. Rank 0's
    metrics land in the run under their names; with ``all_ranks=True`` (or
    ``HorovodRunner(tracking=Tracking(all_ranks=True))``) every rank's also land as ``name/rank<r>``.
    Values may be Python numbers or one-element tensors. Outside a rank process they go to the
    active MLflow run, if any.
    """
    if buffer.active():
        if not buffer.forked("log_metrics"):
            buffer.add(metrics, step, all_ranks)
    elif not rank_api.in_rank_process():
        _local("log_metrics", buffer.numbers(metrics), step=None if step is None else buffer.as_step(step))


def log_metric(key: str, value: Any, step: int | None = None, *, all_ranks: bool = False) -> None:
    """Log one metric; see :func:`log_metrics`."""
    log_metrics({key: value}, step, all_ranks=all_ranks)


def log_params(params: Mapping[str, Any]) -> None:
    """Log parameters to the run (nested dicts become ``a.b.c``). Only rank 0's are kept."""
    if not isinstance(params, Mapping):
        raise TypeError(f"log_params takes a dict {{name: value}}, got {type(params).__name__}")
    if buffer.active():
        if buffer.rank() == 0 and not buffer.forked("log_params"):
            # as text here: a value that cannot be pickled (a function, a lock) must not stop the
            # rank's messages to the driver; MLflow keeps params as text anyway
            rank_api.send_to_driver(protocol.TRACKING_PARAMS, _as_text(params))
    elif not rank_api.in_rank_process():
        from spark_dl.tracking.params import flatten

        _local("log_params", flatten(params))


def _as_text(params: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts kept (they become ``a.b.c``), every other value as MLflow will show it."""
    from spark_dl.tracking.params import param_value

    return {str(k): _as_text(v) if isinstance(v, Mapping) else param_value(v) for k, v in params.items()}


def set_tags(tags: Mapping[str, Any]) -> None:
    """Set tags on the run. Only rank 0's are kept."""
    if buffer.active():
        if buffer.rank() == 0 and not buffer.forked("set_tags"):
            rank_api.send_to_driver(protocol.TRACKING_TAGS, {str(k): str(v) for k, v in tags.items()})
    elif not rank_api.in_rank_process():
        _local("set_tags", dict(tags))


def log_artifact_bytes(data: bytes, artifact_file: str) -> None:
    """Store ``data`` as ``artifact_file`` in the run (files from ranks other than 0 go under ``rank<r>/``)."""
    if not buffer.active():
        return
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"log_artifact_bytes takes bytes, got {type(data).__name__} (text: .encode('utf-8'))")
    _check_artifact_path(artifact_file)
    if buffer.forked("log_artifact_bytes"):
        return
    path = artifact_file if buffer.rank() == 0 else f"rank{buffer.rank()}/{artifact_file}"
    rank_api.send_to_driver(protocol.TRACKING_ARTIFACT, {"path": path, "data": bytes(data)})


def _check_artifact_path(artifact_file: Any, what: str = "artifact path", kind: str = "a file's path",
                         example: str = "'reports/summary.txt'") -> None:
    """Refused at the call: MLflow refuses such a path only at the end of the run, where its error
    read as a server failure held back the writes behind it (the run was left RUNNING)."""
    if not isinstance(artifact_file, str):
        raise TypeError(f"{what} must be a non-empty str, got {artifact_file!r} ({type(artifact_file).__name__}), "
                        f"e.g. {example}")
    norm = os.path.normpath(artifact_file) if artifact_file else ""
    if (not artifact_file or os.path.isabs(artifact_file) or norm in (".", "..") or norm.startswith(".." + os.sep)
            or artifact_file.endswith("/")):
        raise ValueError(f"{what} {artifact_file!r} must be {kind} relative to the run's artifacts, inside them "
                         f"(not empty, no leading '/', no '..' out of them), e.g. {example}")


def _check_model_name(name: Any) -> None:
    _check_artifact_path(name, "log_model: name", "a folder's path", "'model' or 'models/final'")


def _check_example(model: Any, input_example: Any, name: str) -> None:
    """Run ``model`` (the CPU snapshot, in eval mode) on ``input_example`` as the driver will to
    infer the signature: an example the model cannot take fails here, at the call, not on the
    driver at the end of the run (where the model was dropped)."""
    from spark_dl.tracking.models import run_on_example

    try:
        run_on_example(model, _to_numpy(input_example))
    except Exception as e:  # noqa: BLE001 - whatever the model raises, said with the fix
        raise ValueError(
            f"log_model({name!r}): the model cannot take its input_example ({_describe(input_example)}): "
            f"{type(e).__name__}: {e}. Pass an input_example the model takes (e.g. one batch of its inputs: "
            "model(input_example) must work), or no input_example (the model is then logged without a signature)"
        ) from e


def _describe(example: Any) -> str:
    shape, dtype = getattr(example, "shape", None), getattr(example, "dtype", None)
    if shape is None or dtype is None:
        try:
            import numpy as np

            array = np.asarray(example)
            shape, dtype = array.shape, array.dtype
        except Exception:  # noqa: BLE001 - described by its type alone
            return f"a {type(example).__name__}"
    return f"a {type(example).__name__} of shape {tuple(shape)}, dtype {dtype}"


def log_model(model: Any, name: str = "model", *, input_example: Any = None) -> None:
    """Log a ``torch.nn.Module`` (or a ``state_dict``) from rank 0 as an MLflow PyTorch model.

    The model is copied to CPU memory and serialized on the calling thread (so training may go on
    changing its weights right after), then streamed to the driver in the background; the driver
    logs it with ``mlflow.pytorch.log_model``, with a signature inferred from ``input_example``
    when one is given. Calls on other ranks do nothing.

    Checked at the call: ``name`` must be a relative path inside the run's artifacts (else
    ``ValueError``/``TypeError``), the module must be copyable and picklable (else ``TypeError``: log
    its ``state_dict()``), and the copy must run on ``input_example`` (else ``ValueError``).
    """
    _check_model_name(name)
    if not buffer.active():
        if not rank_api.in_rank_process():
            import mlflow.pytorch

            if mlflow.active_run() is not None:
                from spark_dl.tracking.models import log_torch_model

                snapshot = _snapshot(model, name, input_example)
                log_torch_model(snapshot, name, input_example, run_id=mlflow.active_run().info.run_id)
        return
    if buffer.rank() != 0 or buffer.forked("log_model"):
        return
    snapshot = _snapshot(model, name, input_example)
    data = _serialize(snapshot)  # here, not on the sender thread: a model that cannot be pickled fails the call
    meta = {"name": name, "input_example": _to_numpy(input_example), "state_dict": isinstance(snapshot, Mapping),
            "bytes": len(data)}
    del snapshot
    t = threading.Thread(target=_send_model, args=(data, meta), name="spark-dl-model", daemon=True)
    buffer.track_model_thread(t)
    t.start()


def _snapshot(model: Any, name: str, input_example: Any) -> Any:
    """The CPU copy of ``model`` to log, checked on ``input_example``."""
    import torch

    snapshot = _cpu_copy(model)
    if input_example is not None and isinstance(snapshot, torch.nn.Module):
        snapshot.eval()  # as the driver logs it (and so that a BatchNorm's statistics stay as they were)
        _check_example(snapshot, input_example, name)
    return snapshot


def _cpu_copy(model: Any) -> Any:
    import torch

    if isinstance(model, torch.nn.Module):
        params = list(model.parameters()) + list(model.buffers())
        if all(p.device.type == "cpu" for p in params):
            return _deepcopy(model)
        # copy tensor by tensor to host memory instead of duplicating the module on the GPU
        memo: dict[int, Any] = {}
        for p in params:
            host = p.detach().to("cpu", copy=True)
            memo[id(p)] = torch.nn.Parameter(host, p.requires_grad) if isinstance(p, torch.nn.Parameter) else host
        return _deepcopy(model, memo)
    if isinstance(model, Mapping):
        return {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else _deepcopy(v, key=k))
                for k, v in model.items()}
    raise TypeError(f"log_model takes a torch.nn.Module or a state_dict, got {type(model).__name__}")


def _deepcopy(obj: Any, memo: dict[int, Any] | None = None, key: Any = None) -> Any:
    """``copy.deepcopy``, or a ``TypeError`` saying what to log instead (a module holding a lock, a
    generator or an open file cannot be copied, nor pickled to the driver)."""
    import copy

    try:
        return copy.deepcopy(obj, memo)
    except Exception as e:  # noqa: BLE001 - deepcopy raises whatever the object's __reduce_ex__ does
        if key is not None:
            raise TypeError(
                f"log_model could not copy the entry {key!r} of the state_dict ({type(e).__name__}: {e}): "
                "remove it from the dict, or keep only tensors and plain values in it") from e
        raise TypeError(
            f"log_model could not copy the module {type(obj).__name__} ({type(e).__name__}: {e}). Log its "
            "state_dict() instead (spark_dl.log_model(model.state_dict(), name)), or remove the attribute "
            "that cannot be copied (a lock, a generator, an open file) from the module") from e


def _to_numpy(example: Any) -> Any:
    if example is None:
        return None
    try:
        import torch

        if isinstance(example, torch.Tensor):
            return example.detach().cpu().numpy()
    except ImportError:
        pass
    return example


def _serialize(model: Any) -> memoryview:
    """``model`` as ``torch.save`` bytes (cloudpickle: classes defined in a notebook travel by value),
    or a ``TypeError`` saying what to log instead."""
    import cloudpickle
    import torch

    buf = io.BytesIO()
    try:
        torch.save(model, buf, pickle_module=cloudpickle)
    except Exception as e:  # noqa: BLE001 - pickling raises whatever an attribute's __reduce_ex__ does
        what = "state_dict" if isinstance(model, Mapping) else f"module {type(model).__name__}"
        raise TypeError(
            f"log_model could not pickle the {what} to send it to the driver ({type(e).__name__}: {e}). "
            "Log its state_dict() instead (spark_dl.log_model(model.state_dict(), name)), or remove the "
            "attribute that cannot be pickled (a weakref, a function closing over a lock or a file)") from e
    return buf.getbuffer()


def _send_model(data: memoryview, meta: dict) -> None:
    model_id = uuid.uuid4().hex
    n = max(1, -(-len(data) // MODEL_CHUNK))
    outbox = rank_api._outbox
    for i in range(n):
        chunk = bytes(data[i * MODEL_CHUNK:(i + 1) * MODEL_CHUNK])
        rank_api.send_to_driver(
            protocol.TRACKING_MODEL,
            {"id": model_id, "seq": i, "data": chunk, "last": i == n - 1, "meta": meta if i == 0 else None}
        )
        if outbox is not None and n > 1:
            outbox.flush()  # one chunk in the queue at a time: metrics keep flowing between chunks


def _local(fn: str, *args: Any, **kwargs: Any) -> None:
    """Outside a rank process: write to the active MLflow run, if there is one."""
    import sys

    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        getattr(mlflow, fn)(*args, **kwargs)
