"""Rank side of tracking: the functions training code calls, and the buffer behind them.

Nothing here talks to MLflow. ``log_metrics`` appends one record to an in-process buffer
(microseconds); a daemon thread hands the buffer to the rank's outbox every ``FLUSH_S`` as one
``tracking/metrics`` message, and the driver writes it to MLflow. :func:`finish` (called by the
rank's entry point before its last outbox flush) sends whatever is still buffered, so every metric
logged before a rank returns or raises reaches the driver.

Message kinds sent to the driver (see ``observer.py`` for their handling):

- ``tracking/metrics``: ``[(time_s, step, {name: float}, all_ranks), ...]`` in call order
- ``tracking/params``, ``tracking/tags``: flat ``{key: value}``
- ``tracking/model``: one chunk of a serialized model (``id``, ``seq``, ``data``, ``last``, ``meta``)
- ``tracking/artifact``: ``{"path": artifact path in the run, "data": bytes}``
- ``tracking/rank_info``: this rank's place in the world and its torch.distributed backend
"""
from __future__ import annotations

import io
import operator
import os
import threading
import time
import uuid
import warnings
from typing import Any, Mapping

from spark_dl.rank import context as rank_api
from spark_dl.tracking.driver.mlflow_writer import TrackingWarning
from spark_dl import protocol

FLUSH_S = 0.05
MODEL_CHUNK = 4 * 1024 * 1024


def tracking_disabled_by_env() -> bool:
    return os.environ.get(protocol.TRACKING_ENV, "1").strip().lower() in ("0", "false", "no", "off")


class _CommSampler:
    """Turns the cumulative counters of ``spark_dl.compression.stats`` into per-step metrics.

    Contract with the compression package (duck-typed, so either side can evolve): the module
    ``spark_dl.compression.stats`` exposes the process's stats object as ``stats``/``STATS``, or
    via ``get()``/``current()``, or is that object itself. The object has cumulative
    ``bytes_sent``, ``calls`` and ``seconds``; optional ``bytes_dense`` (or ``bytes_uncompressed``)
    gives the compression ratio.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.last: tuple[float, ...] | None = None
        self.last_step: int | None = None

    @staticmethod
    def load() -> "_CommSampler | None":
        try:
            from spark_dl.compression import stats  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - no compression package (or a broken one): nothing to sample
            return None
        return _CommSampler(stats)

    def _object(self) -> Any:
        m = self.module
        for name in ("stats", "STATS"):
            obj = getattr(m, name, None)
            if obj is not None and not callable(obj):
                return obj
        for name in ("get", "current"):
            fn = getattr(m, name, None)
            if callable(fn):
                return fn()
        return m

    def sample(self, step: int, out: dict[str, float]) -> None:
        s = self._object()
        try:
            now = (
                float(s.bytes_sent),
                float(s.calls),
                float(s.seconds),
                float(getattr(s, "bytes_dense", getattr(s, "bytes_uncompressed", -1.0))),
            )
        except (AttributeError, TypeError, ValueError):
            return
        last, last_step = self.last, self.last_step
        self.last, self.last_step = now, step
        if last is None or last_step is None or step <= last_step or now[1] <= last[1]:
            return
        steps = step - last_step
        sent = now[0] - last[0]
        out["comm/bytes_sent_per_step"] = sent / steps
        out["comm/allreduce_s_per_step"] = (now[2] - last[2]) / steps
        out["comm/allreduce_calls_per_step"] = (now[1] - last[1]) / steps
        if now[3] >= 0 and sent > 0:
            out["comm/compression_ratio"] = (now[3] - last[3]) / sent


class _Buffer:
    """Metric records of this rank, handed to the outbox in batches by a daemon thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[tuple] = []
        self.auto_step = 0
        self.comm = _CommSampler.load()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="spark-dl-metrics", daemon=True)
        self.thread.start()

    def add(self, metrics: Mapping[str, Any], step: int | None, all_ranks: bool) -> None:
        values = _numbers(metrics)
        step = self.auto_step if step is None else _step(step)
        if self.comm is not None:
            self.comm.sample(step, values)
        rec = (time.time(), step, values, all_ranks)
        with self.lock:
            self.auto_step = step + 1
            self.records.append(rec)

    def flush(self) -> None:
        with self.lock:
            recs, self.records = self.records, []
        if recs:
            rank_api.send_to_driver(protocol.TRACKING_METRICS, recs)

    def _loop(self) -> None:
        while True:
            self.wake.wait(FLUSH_S)
            self.flush()


_buffer: _Buffer | None = None
_pending_models: list[threading.Thread] = []
_rank: int = 0
_fork_warned: int = 0  # the forked process that was already told so (once per process)


def install(enabled: bool) -> None:
    """Start the rank-side tracking machinery when the driver tracks this job (it decides: an
    executor does not see the driver's settings). Called once by the rank's entry point."""
    global _buffer, _rank
    _rank = int(os.environ.get("RANK", "0"))
    if not enabled:
        return
    _buffer = _Buffer()
    from spark_dl.tracking.rank import fluent

    fluent.install()
    ctx = rank_api.get_context()
    import socket

    rank_api.send_to_driver(
        protocol.TRACKING_RANK_INFO,
        {
            "rank": ctx.rank, "host": socket.gethostname(), "local_rank": ctx.local_rank,
            "local_size": ctx.local_size, "cross_rank": ctx.cross_rank, "cross_size": ctx.cross_size,
        },
    )


def flush_metrics() -> None:
    """Hand the buffered metric records to the outbox now (a checkpoint follows them on the wire)."""
    if _buffer is not None:
        _buffer.flush()


def finish(timeout: float = 600.0) -> None:
    """Send everything still buffered (metrics, models being serialized). Called before the rank's
    final outbox flush, on success and on failure alike."""
    if _buffer is None:
        return
    deadline = time.monotonic() + timeout
    for t in list(_pending_models):
        t.join(max(0.0, deadline - time.monotonic()))
    _buffer.flush()
    if _rank == 0:
        backend = _backend()
        if backend:
            rank_api.send_to_driver(protocol.TRACKING_PARAMS, {"backend": backend})


def _backend() -> str | None:
    import sys

    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:  # noqa: BLE001 - informational only
        pass
    return None


def _active() -> bool:
    return _buffer is not None


def _forked(fn: str) -> bool:
    """True in a process forked from the rank (typically a DataLoader worker, num_workers > 0):
    nothing there sends to the driver, so the call is dropped, with one warning per process."""
    global _fork_warned
    if not rank_api.in_forked_child():
        return False
    pid = os.getpid()
    if _fork_warned != pid:
        _fork_warned = pid
        warnings.warn(
            f"spark_dl.{fn} was called in a process forked from rank {_rank} (pid {pid}, e.g. a DataLoader "
            "worker with num_workers > 0), which has no link to the driver: what it logs is dropped (said once "
            "per process). Log from the training loop in the rank's main process instead, e.g. return the "
            "values with the batch and log them there.",
            TrackingWarning,
            stacklevel=3,
        )
        _flush_stderr()
    return True


def _flush_stderr() -> None:
    import sys

    try:
        sys.stderr.flush()  # a DataLoader worker may leave with os._exit, which flushes nothing
    except (OSError, ValueError):
        pass


# -- public API -----------------------------------------------------------------------------------
def _numbers(metrics: Any) -> dict[str, float]:
    """``metrics`` as ``{name: float}``, or an error naming the metric that is not one number."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"log_metrics takes a dict {{name: number}}, got {type(metrics).__name__}")
    values = {}
    for k, v in metrics.items():
        try:
            values[str(k)] = float(v)
        except (TypeError, ValueError, OverflowError, RuntimeError) as e:
            shape = f" of shape {tuple(v.shape)}" if hasattr(v, "shape") else ""
            raise TypeError(f"log_metrics: the value of {k!r} is a {type(v).__name__}{shape}, not one number ({e}): "
                            "pass a number or a one-element tensor (e.g. loss.item())") from None
    return values


def _step(step: Any) -> int:
    """An int, numpy integer or integer tensor (what ``__index__`` takes): a float step is refused,
    not truncated."""
    try:
        if isinstance(step, bool):
            raise TypeError
        return operator.index(step)
    except TypeError:
        raise TypeError(f"log_metrics: step must be an int, got {step!r}") from None


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *, all_ranks: bool = False) -> None:
    """Log ``{name: number}`` for ``step`` (default: one more than this rank's previous step).

    Costs a few microseconds: the values are buffered and sent to the driver every 50 ms. Rank 0's
    metrics land in the run under their names; with ``all_ranks=True`` (or
    ``HorovodRunner(tracking=Tracking(all_ranks=True))``) every rank's also land as ``name/rank<r>``.
    Values may be Python numbers or one-element tensors. Outside a rank process they go to the
    active MLflow run, if any.
    """
    b = _buffer
    if b is not None:
        if not _forked("log_metrics"):
            b.add(metrics, step, all_ranks)
    elif not rank_api.in_rank_process():
        _local("log_metrics", _numbers(metrics), step=None if step is None else _step(step))


def log_metric(key: str, value: Any, step: int | None = None, *, all_ranks: bool = False) -> None:
    """Log one metric; see :func:`log_metrics`."""
    log_metrics({key: value}, step, all_ranks=all_ranks)


def log_params(params: Mapping[str, Any]) -> None:
    """Log parameters to the run (nested dicts become ``a.b.c``). Only rank 0's are kept."""
    if not isinstance(params, Mapping):
        raise TypeError(f"log_params takes a dict {{name: value}}, got {type(params).__name__}")
    if _buffer is not None:
        if _rank == 0 and not _forked("log_params"):
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
    if _buffer is not None:
        if _rank == 0 and not _forked("set_tags"):
            rank_api.send_to_driver(protocol.TRACKING_TAGS, {str(k): str(v) for k, v in tags.items()})
    elif not rank_api.in_rank_process():
        _local("set_tags", dict(tags))


def log_artifact_bytes(data: bytes, artifact_file: str) -> None:
    """Store ``data`` as ``artifact_file`` in the run (files from ranks other than 0 go under ``rank<r>/``)."""
    if _buffer is None:
        return
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"log_artifact_bytes takes bytes, got {type(data).__name__} (text: .encode('utf-8'))")
    _check_artifact_path(artifact_file)
    if _forked("log_artifact_bytes"):
        return
    path = artifact_file if _rank == 0 else f"rank{_rank}/{artifact_file}"
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
    if _buffer is None:
        if not rank_api.in_rank_process():
            import mlflow.pytorch

            if mlflow.active_run() is not None:
                from spark_dl.tracking.models import log_torch_model

                snapshot = _snapshot(model, name, input_example)
                log_torch_model(snapshot, name, input_example, run_id=mlflow.active_run().info.run_id)
        return
    if _rank != 0 or _forked("log_model"):
        return
    snapshot = _snapshot(model, name, input_example)
    data = _serialize(snapshot)  # here, not on the sender thread: a model that cannot be pickled fails the call
    meta = {"name": name, "input_example": _to_numpy(input_example), "state_dict": isinstance(snapshot, Mapping),
            "bytes": len(data)}
    del snapshot
    t = threading.Thread(target=_send_model, args=(data, meta), name="spark-dl-model", daemon=True)
    _pending_models.append(t)
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
            protocol.TRACKING_MODEL, {"id": model_id, "seq": i, "data": chunk, "last": i == n - 1, "meta": meta if i == 0 else None}
        )
        if outbox is not None and n > 1:
            outbox.flush()  # one chunk in the queue at a time: metrics keep flowing between chunks


def _local(fn: str, *args: Any, **kwargs: Any) -> None:
    """Outside a rank process: write to the active MLflow run, if there is one."""
    import sys

    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        getattr(mlflow, fn)(*args, **kwargs)
