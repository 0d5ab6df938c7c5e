"""Rank side of tracking: the buffer behind ``log_metrics`` and the rank's tracking state.

Nothing here talks to MLflow. ``log_metrics`` appends one record to an in-process buffer
(microseconds); a daemon thread hands the buffer to the rank's outbox every ``FLUSH_S`` as one
``tracking/metrics`` message, and the driver writes it to MLflow. :func:`finish` (called by the
rank's entry point before its last outbox flush) sends whatever is still buffered, so every metric
logged before a rank returns or raises reaches the driver.
"""
from __future__ import annotations

import operator
import os
import threading
import time
import warnings
from typing import Any, Mapping

from spark_dl import protocol
from spark_dl.errors import TrackingWarning
from spark_dl.rank import context as rank_api

FLUSH_S = 0.05


class CommSampler:
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
    def load() -> "CommSampler | None":
        try:
            from spark_dl.compression import stats  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - no compression package (or a broken one): nothing to sample
            return None
        return CommSampler(stats)

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
        # error feedback's residual norm over the gradient's, per compressor ("OneBit",
        # "ErrorFeedback(TopK)" as comm/ef_residual_ratio/ErrorFeedback.TopK: MLflow names take no brackets)
        for who, ratio in dict(getattr(s, "residual_ratios", None) or {}).items():
            out[f"comm/ef_residual_ratio/{who.replace('(', '.').rstrip(')')}"] = float(ratio)
        # compression="auto": per tensor, the chosen compressor (its index in Auto.candidates), the
        # step time with it (measured, else as probed) and bytes per call; and the switches so far
        for name, row in dict(getattr(s, "choices", None) or {}).items():
            out[f"comm/auto/{name}/choice"] = float(row["index"])
            seconds = row["measured_s"] if row["measured_s"] is not None else row["predicted_s"]
            if seconds is not None:
                out[f"comm/auto/{name}/seconds"] = float(seconds)
            if row["bytes"] is not None:
                out[f"comm/auto/{name}/bytes"] = float(row["bytes"])
        if getattr(s, "choices", None):
            out["comm/auto_switches"] = float(s.switches)


class MetricBuffer:
    """Metric records of this rank, handed to the outbox in batches by a daemon thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[tuple] = []
        self.auto_step = 0
        self.comm = CommSampler.load()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="spark-dl-metrics", daemon=True)
        self.thread.start()

    def add(self, metrics: Mapping[str, Any], step: int | None, all_ranks: bool) -> None:
        values = numbers(metrics)
        step = self.auto_step if step is None else as_step(step)
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


_buffer: MetricBuffer | None = None
_pending_models: list[threading.Thread] = []
_rank: int = 0
_fork_warned: int = 0  # the forked process that was already told so (once per process)


def start(enabled: bool) -> None:
    """Set this rank's tracking up: a metric buffer when the driver tracks the job."""
    global _buffer, _rank
    _rank = int(os.environ.get("RANK", "0"))
    if enabled:
        _buffer = MetricBuffer()


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
        backend = backend_name()
        if backend:
            rank_api.send_to_driver(protocol.TRACKING_PARAMS, {"backend": backend})


def backend_name() -> str | None:
    import sys

    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:  # noqa: BLE001 - informational only
        pass
    return None


def active() -> bool:
    return _buffer is not None


def rank() -> int:
    """This rank (0 outside a rank process)."""
    return _rank


def add(metrics: Mapping[str, Any], step: int | None, all_ranks: bool) -> None:
    """Buffer one record (see :meth:`MetricBuffer.add`); a no-op before :func:`start`."""
    if _buffer is not None:
        _buffer.add(metrics, step, all_ranks)


def track_model_thread(t: threading.Thread) -> None:
    """A model being serialized in the background: :func:`finish` waits for it."""
    _pending_models.append(t)


def forked(fn: str) -> bool:
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
        flush_stderr()
    return True


def flush_stderr() -> None:
    import sys

    try:
        sys.stderr.flush()  # a DataLoader worker may leave with os._exit, which flushes nothing
    except (OSError, ValueError):
        pass


def numbers(metrics: Any) -> dict[str, float]:
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


def as_step(step: Any) -> int:
    """An int, numpy integer or integer tensor (what ``__index__`` takes): a float step is refused,
    not truncated."""
    try:
        if isinstance(step, bool):
            raise TypeError
        return operator.index(step)
    except TypeError:
        raise TypeError(f"log_metrics: step must be an int, got {step!r}") from None
