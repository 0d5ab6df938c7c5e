"""The driver's only MLflow client: one thread that writes a run in batches, retrying and buffering.

Callers (the observer, on channel threads) only enqueue. The writer thread turns what arrives
into ``MlflowClient.log_batch`` calls of at most 1000 entities (100 params, 100 tags), then
artifacts and models, then the run's end. A tracking server that is down or slow never reaches
training: failed calls are retried with exponential backoff while new data is buffered, one
warning is issued per run, and :meth:`MlflowWriter.close` waits a bounded time before giving up on
what could not be written (and says how much that was).

Errors MLflow calls permanent (a bad value, a param changed in a run the user opened; any 4xx
but 408/409/429) do not block the rest: the batch is bisected and only the offending entries are
dropped. A write that keeps failing while the store answers (an artifact location that cannot be
written, a server error on one request) is skipped after ``stall_s`` (at the end of the run, after
``grace_s / 2``, and the writes behind it are then tried once each), so that it never holds back
the run's end. A run MLflow refuses to create (an experiment that does not exist) is given up at once.
"""
from __future__ import annotations

import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from typing import Any
from urllib.parse import urlparse

from spark_dl.errors import TrackingWarning
from spark_dl.tracking.driver.store_check import is_local_store
from spark_dl.tracking.params import param_value

MAX_BATCH = 1000
MAX_PARAMS = 100
MAX_TAGS = 100
MAX_TAG_VALUE = 5000
BACKOFF_MAX_S = 10.0
LINGER_S = 0.5  # gather this long before writing a partial batch: fewer, fuller calls to the server
MAX_BUFFERED_METRICS = 5_000_000
_PERMANENT = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "BAD_REQUEST",
              "RESOURCE_ALREADY_EXISTS", "PERMISSION_DENIED", "MAX_BLOCK_SIZE_EXCEEDED", "MAX_READ_SIZE_EXCEEDED",
              "MAX_LIST_SIZE_EXCEEDED", "DATA_LOSS"}
_RETRYABLE_HTTP = {408, 409, 429}  # timeout, conflict, rate limit: a later try can succeed


def _permanent(e: BaseException) -> bool:
    """True for errors a retry cannot fix: MLflow rejecting the data (a 4xx answer but a timeout,
    conflict or rate limit), or our own data being bad (say, a model that does not unpickle).
    Connection trouble and server errors are transient."""
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        status = e.get_http_status_code()
        return e.error_code in _PERMANENT or (400 <= status < 500 and status not in _RETRYABLE_HTTP)
    return not isinstance(e, OSError)


class MlflowWriter:
    """Writes one MLflow run from a background thread.

    Args:
        tracking_uri: where to write (captured on the driver's calling thread).
        run_id: an existing run to log into (left open), or None to create one in ``experiment_id``
            (ended at :meth:`close` with the given status).
        grace_s: how long :meth:`close` keeps waiting while the server keeps failing (or, before any
            write succeeded, does not answer; a local store's first write is waited for as progress).
        stall_s: how long :meth:`close` waits for a server that answers but makes no progress, and
            how long one write may keep failing while the store answers before it is skipped.
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str | None,
        experiment_id: str | None = None,
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        grace_s: float = 5.0,
        stall_s: float = 60.0,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.owns_run = run_id is None
        self.experiment_id = experiment_id
        self.run_name = run_name
        self.create_tags = dict(tags or {})
        self.grace_s = grace_s
        self.stall_s = stall_s
        self.ready = threading.Event()  # the run exists (run_id is set)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._metrics: deque = deque()
        self._params: dict[str, str] = {}
        self._logged_params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._ops: deque = deque()
        self._tmp = tempfile.mkdtemp(prefix="spark-dl-tracking-")
        self._models: dict[str, Any] = {}
        self._failures = 0
        self._fail_since = 0.0
        self._skipping = False  # at the end, after one write was skipped: the rest get one try each
        self._written = False  # some call to the store has succeeded
        # a local store's first write creates it (a new SQLite file runs MLflow's schema migrations,
        # seconds on a busy machine): slow, not silent, so it is not cut off at grace_s
        self._local = is_local_store(tracking_uri)
        self._next_try = 0.0
        self._last_progress = time.monotonic()
        self._last_error: BaseException | None = None
        self._warned = False
        self._closing = False
        self._abandoned = False
        self.dropped = 0
        self.written_metrics = 0
        self._client = None
        self._thread = threading.Thread(target=self._loop, name="spark-dl-mlflow-writer", daemon=True)
        self._thread.start()

    # -- enqueue (any thread) ----------------------------------------------------------------------
    def log_metrics(self, metrics: list[tuple[str, float, int, int]]) -> None:
        """``[(key, value, timestamp_ms, step), ...]`` in order."""
        self._q.put(("metrics", metrics))

    def log_params(self, params: dict[str, Any]) -> None:
        self._q.put(("params", params))

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._q.put(("tags", tags))

    def log_artifact_bytes(self, path: str, data: bytes) -> None:
        self._q.put(("artifact_bytes", (path, data)))

    def log_artifact_file(self, local_path: str, artifact_dir: str | None) -> None:
        self._q.put(("artifact_file", (local_path, artifact_dir)))

    def model_chunk(self, chunk: dict) -> None:
        self._q.put(("model_chunk", chunk))

    def close(self, status: str, max_wait_s: float = 600.0) -> bool:
        """Write what is buffered, end the run with ``status`` if this writer created it, and stop.

        Returns True if everything was written. Waits while writes make progress (at most
        ``max_wait_s``), at most ``grace_s`` once the server keeps failing.
        """
        self._q.put(("end", status))
        start = time.monotonic()
        self._last_progress = max(self._last_progress, start)
        while self._thread.is_alive():
            self._thread.join(0.1)
            now = time.monotonic()
            failing_for = now - start if self._failures else 0.0
            # a server that never once answered (it takes connections and hangs) is not worth stall_s
            stall_s = self.stall_s if self._written or self._local else min(self.stall_s, self.grace_s)
            if (
                (self._failures and failing_for > self.grace_s and now - self._last_progress > self.grace_s)
                or now - self._last_progress > stall_s
                or now - start > max_wait_s
            ):
                self._abandoned = True
                left = len(self._metrics) + len(self._params) + len(self._tags) + len(self._ops) + self._q.qsize()
                if self._last_error is not None:
                    why = f": {type(self._last_error).__name__}: {self._last_error}"
                elif not self._written:
                    why = f": it did not answer within {stall_s:g} s"
                else:
                    why = ""
                self._warn(
                    f"MLflow tracking at {self.tracking_uri} could not be completed{why}. Training was not "
                    f"affected; about {left} pending MLflow writes were dropped.",
                    loss=True,
                )
                return False
        shutil.rmtree(self._tmp, ignore_errors=True)
        return self.dropped == 0

    # -- writer thread ---------------------------------------------------------------------------
    def _warn(self, message: str, loss: bool = False) -> None:
        """One warning per run; later ones that tell of lost data go to stderr (the first warning
        may only have told of retries)."""
        if not self._warned:
            self._warned = True
            warnings.warn(message, TrackingWarning, stacklevel=2)
        elif loss:
            print(f"spark-dl: {message}", file=sys.stderr, flush=True)

    def _pending(self) -> bool:
        return bool(self._metrics or self._params or self._tags or self._ops or self.run_id is None)

    def _write_at(self, ended: bool) -> float:
        """When the next write may happen: after a backoff; not before a batch fills or lingers."""
        at = self._next_try
        entities = len(self._metrics) + len(self._params) + len(self._tags)
        if self.run_id is not None and not ended and not self._ops and entities < MAX_BATCH:
            at = max(at, self._first_pending + LINGER_S)
        return at

    def _loop(self) -> None:
        ended = False
        self._first_pending = time.monotonic()
        while not self._abandoned:
            if not self._pending():
                self._first_pending = time.monotonic()
            wait = None if not self._pending() else max(0.0, self._write_at(ended) - time.monotonic())
            try:
                item = self._q.get(timeout=wait) if wait != 0.0 else self._q.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item[0] == "end":
                    self._ops.append(("end", item[1]))
                    ended = True
                else:
                    self._accept(*item)
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    item = None
            if time.monotonic() < self._write_at(ended):
                continue
            if not self._pending():
                if ended:
                    return
                continue
            self._attempt(ended)
            if ended and not self._pending():
                return

    def _accept(self, kind: str, data: Any) -> None:
        if kind == "metrics":
            from mlflow.entities import Metric

            room = MAX_BUFFERED_METRICS - len(self._metrics)
            if room < len(data):
                self.dropped += len(data) - max(room, 0)
                data = data[: max(room, 0)]
            self._metrics.extend(Metric(k, v, ts, step) for k, v, ts, step in data)
        elif kind == "params":
            for k, v in data.items():
                v = param_value(v)
                if self._logged_params.setdefault(k, v) == v and k not in self._params:
                    self._params[k] = v
        elif kind == "tags":
            for k, v in data.items():
                self._tags[k] = str(v)[:MAX_TAG_VALUE]
        elif kind == "model_chunk":
            self._accept_model_chunk(data)
        else:
            self._ops.append((kind, data))

    def _accept_model_chunk(self, chunk: dict) -> None:
        entry = self._models.get(chunk["id"])
        if entry is None:
            path = os.path.join(self._tmp, f"model-{chunk['id']}.pt")
            entry = self._models[chunk["id"]] = {"path": path, "meta": chunk["meta"], "file": open(path, "wb")}
        entry["file"].write(chunk["data"])
        if chunk["last"]:
            entry["file"].close()
            del self._models[chunk["id"]]
            self._ops.append(("model", (entry["path"], entry["meta"])))

    def _client_(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _probe(self) -> None:
        """Fail fast on an unreachable HTTP server, instead of in MLflow's minutes of retries."""
        u = urlparse(self.tracking_uri)
        if u.scheme not in ("http", "https") or not u.hostname:
            return
        port = u.port or (443 if u.scheme == "https" else 80)
        with socket.create_connection((u.hostname, port), timeout=3.0):
            pass

    def _attempt(self, ended: bool) -> None:
        answered = False  # the store is there: the probe passed, or it is not a server
        try:
            if self._failures or self.run_id is None or self._skipping:
                self._probe()
            answered = True
            if self.run_id is None:
                self._create_run()
            elif self._params or self._tags or self._metrics:
                self._write_batch()
            else:
                self._run_op(self._ops[0])
                self._ops.popleft()
        except Exception as e:  # noqa: BLE001 - the server's trouble must never reach training
            self._last_error = e
            if self.run_id is None and answered and _permanent(e):
                self._give_up(e)
                return
            if self.run_id is not None and not (self._params or self._tags or self._metrics) and _permanent(e):
                self._ops.popleft()  # this artifact/model cannot be written; the rest can
                self.dropped += 1
                self._warn(f"MLflow rejected a write ({type(e).__name__}: {e}); it was skipped.", loss=True)
                return
            now = time.monotonic()
            if not self._failures:
                self._fail_since = now
            self._failures += 1
            if answered and self.run_id is not None and (
                self._skipping or now - self._fail_since > (self.grace_s / 2 if ended else self.stall_s)
            ):
                self._skip_head(e, ended)
                return
            backoff_max = max(0.1, self.grace_s / 4) if ended else BACKOFF_MAX_S
            self._next_try = now + min(backoff_max, 0.25 * 2 ** (self._failures - 1))
            self._warn(
                f"MLflow tracking at {self.tracking_uri} failed ({type(e).__name__}: {e}). Training goes on; "
                "spark-dl buffers the run's data and retries in the background."
            )
            return
        self._failures = 0
        self._skipping = False
        self._written = True
        self._last_progress = time.monotonic()

    def _skip_head(self, e: BaseException, ended: bool) -> None:
        """The store answers but keeps failing this write: drop it, so that what is behind it (the
        run's end among them) is written. At the end, the writes after it get one try each."""
        if self._params or self._tags or self._metrics:
            n = min(len(self._metrics), MAX_BATCH)
            for _ in range(n):
                self._metrics.popleft()
            self.dropped += n + len(self._params) + len(self._tags)
            self._params.clear()
            self._tags.clear()
            what = f"{n} metric values and the pending params/tags"
        else:
            kind, data = self._ops.popleft()
            self.dropped += 1
            if kind == "artifact_bytes":
                what = f"artifact {data[0]!r}"
            elif kind == "artifact_file":
                what = f"artifact {os.path.basename(data[0])!r}"
            elif kind == "model":
                what = f"model {data[1].get('name')!r}"
            else:
                what = f"the run's {kind}"
        self._failures = 0
        self._skipping = ended
        self._last_progress = time.monotonic()
        self._warn(f"MLflow tracking at {self.tracking_uri} kept failing one write while answering "
                   f"({type(e).__name__}: {e}); skipped {what} so that the rest of the run could be written.",
                   loss=True)

    def _give_up(self, e: BaseException) -> None:
        """MLflow refuses to create the run: nothing of it can be written; say why, and stop."""
        self.dropped += len(self._metrics) + len(self._params) + len(self._tags) + len(self._ops) + 1
        self._abandoned = True
        where = f"experiment {self.experiment_id or '0'}"
        self._warn(
            f"MLflow at {self.tracking_uri} refused to create the run in {where} ({type(e).__name__}: {e}); "
            "this job is not tracked (training is not affected). Fix: check the tracking URI, and point "
            "MLFLOW_EXPERIMENT_ID or mlflow.set_experiment(...) at an experiment that exists there, or run with "
            "tracking=False.",
            loss=True,
        )

    def _create_run(self) -> None:
        run = self._client_().create_run(
            self.experiment_id or "0", start_time=int(time.time() * 1000), tags=self.create_tags, run_name=self.run_name
        )
        self.run_id = run.info.run_id
        self.ready.set()

    def _write_batch(self) -> None:
        from mlflow.entities import Param, RunTag

        params = [Param(k, v) for k, v in list(self._params.items())[:MAX_PARAMS]]
        tags = [RunTag(k, v) for k, v in list(self._tags.items())[:MAX_TAGS]]
        n = min(len(self._metrics), MAX_BATCH - len(params) - len(tags))
        metrics = [self._metrics[i] for i in range(n)]
        self._log_batch_isolating(metrics, params, tags)
        for _ in range(n):
            self._metrics.popleft()
        for p in params:
            del self._params[p.key]
        for t in tags:
            self._tags.pop(t.key, None)
        self.written_metrics += n

    def _log_batch_isolating(self, metrics: list, params: list, tags: list) -> None:
        try:
            self._client_().log_batch(self.run_id, metrics=metrics, params=params, tags=tags)
        except Exception as e:  # noqa: BLE001
            if not _permanent(e):
                raise
            total = len(metrics) + len(params) + len(tags)
            if total == 1:
                self.dropped += 1
                self._last_error = e
                self._warn(f"MLflow rejected a write to run {self.run_id} ({e}); it was skipped, the rest was written.",
                           loss=True)
                return
            # bisect so only the offending entries are lost
            items = [("m", x) for x in metrics] + [("p", x) for x in params] + [("t", x) for x in tags]
            for half in (items[: total // 2], items[total // 2:]):
                self._log_batch_isolating(
                    [x for k, x in half if k == "m"], [x for k, x in half if k == "p"], [x for k, x in half if k == "t"]
                )

    def _run_op(self, op: tuple) -> None:
        kind, data = op
        client = self._client_()
        if kind == "artifact_bytes":
            path, blob = data
            local_dir = tempfile.mkdtemp(dir=self._tmp)
            local = os.path.join(local_dir, os.path.basename(path))
            with open(local, "wb") as f:
                f.write(blob)
            client.log_artifact(self.run_id, local, os.path.dirname(path) or None)
        elif kind == "artifact_file":
            local, artifact_dir = data
            client.log_artifact(self.run_id, local, artifact_dir)
        elif kind == "model":
            self._log_model(*data)
        elif kind == "end":
            if self.owns_run:
                client.set_terminated(self.run_id, status=data)

    def _log_model(self, path: str, meta: dict) -> None:
        import torch

        from spark_dl.tracking.models import log_torch_model

        model = torch.load(path, map_location="cpu", weights_only=False)
        log_torch_model(model, meta["name"], meta.get("input_example"), self.run_id, self._client_())
