"""Tensor fusion: gradients grouped into buckets, reduced one bucket at a time off the main thread.

Buckets are planned once, from the parameters in reverse registration order (backward produces
the last layers' gradients first, as in DDP), so every rank has the same buckets. The reducer
runs them strictly in submission order; callers submit in bucket order, so all ranks issue the
same collectives in the same sequence.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Sequence

import torch

from spark_dl.errors import env_number

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024


def fusion_threshold() -> int:
    """Bucket size limit in bytes: ``HOROVOD_FUSION_THRESHOLD`` (0 disables fusion), default 64 MiB."""
    return int(env_number("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD, integer=True, unit=" bytes"))


def plan_buckets(params: Sequence[torch.Tensor], threshold: int) -> list[list[torch.Tensor]]:
    """Split ``params``, last first, into runs of one dtype and device of at most ``threshold`` bytes.

    A tensor larger than ``threshold`` gets a bucket of its own.
    """
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    nbytes = 0
    for p in reversed(params):
        size = p.numel() * p.element_size()
        if current and (p.dtype != current[0].dtype or p.device != current[0].device or nbytes + size > threshold):
            buckets.append(current)
            current, nbytes = [], 0
        current.append(p)
        nbytes += size
    if current:
        buckets.append(current)
    return buckets


def plan_groups(params: Sequence[torch.Tensor], groups: Any) -> list[list[torch.Tensor]]:
    """Horovod's explicit grouping instead of the size threshold.

    ``groups``: an int n (n buckets of consecutive parameters, last first, as equal in count as
    they can be), or a list of parameter lists (one bucket each; parameters in none of them get
    a bucket each). Buckets are ordered by their first parameter, last first, and split where
    dtype or device changes.
    """
    order = list(reversed(params))
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
        raise ValueError(f"groups must be a number of groups or a list of lists of parameters, got {groups!r}")
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups must be >= 1 (or None for the size threshold), got {groups}")
        n = min(groups, len(order))
        cut = [round(i * len(order) / n) for i in range(n + 1)]
        buckets = [order[cut[i]:cut[i + 1]] for i in range(n)]
    else:
        position = {id(p): i for i, p in enumerate(order)}
        seen: set[int] = set()
        buckets = []
        for group in groups:
            if torch.is_tensor(group) or not isinstance(group, (list, tuple)):
                raise ValueError("groups must be a list of lists of parameters")
            for p in group:
                if not torch.is_tensor(p) or id(p) not in position:
                    raise ValueError("groups names a tensor that is not a parameter of the optimizer "
                                     "(or one that needs no gradient)")
                if id(p) in seen:
                    raise ValueError("a parameter is in two of the groups: each may be in one")
                seen.add(id(p))
            if group:
                buckets.append(sorted(group, key=lambda p: position[id(p)]))
        buckets += [[p] for p in order if id(p) not in seen]
        buckets.sort(key=lambda bucket: position[id(bucket[0])])
    out: list[list[torch.Tensor]] = []
    for bucket in buckets:
        runs: list[list[torch.Tensor]] = []
        for p in bucket:
            if runs and runs[-1][0].dtype == p.dtype and runs[-1][0].device == p.device:
                runs[-1].append(p)
            else:
                runs.append([p])
        out += runs
    return out


class BucketFailed(RuntimeError):
    """A bucket's reduction raised; the ranks are no longer in lockstep."""


class BucketReducer:
    """Reduces submitted buckets on one daemon thread, in submission order.

    ``reduce(index, flat, shapes)`` gets the bucket's gradients concatenated into one 1-D tensor
    (and their shapes, for layer-wise compressors) and returns the reduced tensor (same numel);
    the result is copied back into the gradients.
    """

    def __init__(self, reduce: Callable[[int, torch.Tensor, list], torch.Tensor]) -> None:
        self._reduce = reduce
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = 0
        self._completed = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, index: int, prepare: Callable[[], tuple[list[torch.Tensor], Callable[[], None] | None]],
               device: torch.device) -> None:
        """Queue a bucket on ``device``. Call it on the thread (and CUDA stream) that produced its
        gradients. ``prepare()`` runs first on the reducer thread and returns the bucket's dense
        gradients (fused and reduced in place) and a callable to run after them (or None)."""
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spark-dl-hvd-reducer", daemon=True)
            self._thread.start()
        with self._cond:
            self._submitted += 1
        self._queue.put((index, prepare, ready, device))

    def busy(self) -> bool:
        """Whether some submitted bucket has not finished yet."""
        with self._cond:
            return self._completed != self._submitted

    def wait(self) -> None:
        """Block until every submitted bucket is reduced; raise :class:`BucketFailed` if one failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._completed == self._submitted)
        if self._error is not None:
            raise BucketFailed(f"gradient all-reduce failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            index, prepare, ready, device = self._queue.get()
            if self._error is None:
                try:
                    self._reduce_bucket(index, prepare, ready, device)
                except BaseException as e:  # surfaced to the training thread by wait()
                    self._error = e
            with self._cond:
                self._completed += 1
                self._cond.notify_all()

    def _reduce_bucket(self, index: int, prepare: Callable[[], tuple[list[torch.Tensor], Any]], ready: Any,
                       device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        with torch.no_grad(), (torch.cuda.device(device) if on_gpu else contextlib.nullcontext()):
            if on_gpu:
                # Backward may have produced the gradients on another stream than this thread's current one.
                torch.cuda.current_stream().wait_event(ready)
            grads, after = prepare()
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                out = self._reduce(index, flat, [tuple(g.shape) for g in grads])
                offset = 0
                for g in grads:
                    g.copy_(out[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            if after is not None:
                after()
            if on_gpu:
                # wait() returning must mean the gradients are final for step() on any stream.
                torch.cuda.current_stream().synchronize()
