"""Per-process byte accounting of every compressed collective, read by the tracking layer, and
the watch on error feedback: residual norms and non-finite gradients, with a warning when
compressed training goes wrong."""
from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

# A tensor's residual is measured on every WATCH_EVERY-th compressed reduction (it reads the
# residual and the gradient once more: a pass over memory each).
WATCH_EVERY = 10
# ||e|| / ||g|| above this, and rising over the last RISING samples, is a residual growing without
# bound. Converging runs stay within a few units (1-bit on digits: 0.5-3; top-k 1%: up to ~30 at
# its start, as a residual of k/n of the entries holds about n/k steps of the rest).
RESIDUAL_ALARM = 100.0
RISING = 3


class CompressionWarning(RuntimeWarning):
    """Compressed training is going wrong: a residual growing without bound, a non-finite gradient."""


@dataclass
class CompressionStats:
    """Cumulative totals for this process.

    ``bytes_sent``: bytes this rank sent, counted per algorithm: a ring all-reduce of N bytes
    over W ranks sends 2 (W-1)/W N; an all-to-all sends every chunk except its own; an
    all-gather sends its own piece to W-1 ranks. ``bytes_dense``: what a ring all-reduce of
    the same tensors in their own dtype would have sent. ``seconds``: wall time inside
    ``allreduce`` (compression included). ``residual_ratios``: per compressor (``"OneBit"``,
    ``"ErrorFeedback(TopK)"``), the error-feedback residual's norm relative to the norm of what
    each rank compresses (its averaged share of the gradient, or of its velocity under momentum
    compression), the largest over its tensors at their latest measurement (every
    ``WATCH_EVERY``-th compressed reduction of a tensor). ``choices``: what
    :class:`~spark_dl.compression.auto.Auto` picked per tensor name (``compressor``, ``elements``,
    ``predicted_s`` and ``measured_s``: seconds per step, as probed and since; ``bytes`` per call,
    every candidate's ``times``, ``reason``, ``excluded``); ``switches``: how many times it changed
    its mind after a first decision.
    """

    bytes_sent: int = 0
    bytes_dense: int = 0
    elements: int = 0
    calls: int = 0
    seconds: float = 0.0
    residual_ratios: dict[str, float] = field(default_factory=dict)
    choices: dict[str, dict] = field(default_factory=dict)
    switches: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += int(n)

    def add_call(self, elements: int, dense_bytes: int, seconds: float) -> None:
        with self._lock:
            self.calls += 1
            self.elements += int(elements)
            self.bytes_dense += int(dense_bytes)
            self.seconds += seconds

    def set_choice(self, name: str, row: dict) -> None:
        with self._lock:
            self.choices[name] = row

    def note_switch(self) -> None:
        with self._lock:
            self.switches += 1

    @property
    def ratio(self) -> float:
        """bytes_dense / bytes_sent: how many times fewer bytes compression sent."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else float("nan")

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense,
                    "elements": self.elements, "calls": self.calls, "seconds": self.seconds}

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent = self.bytes_dense = self.elements = self.calls = 0
            self.seconds = 0.0
            self.residual_ratios = {}
            self.choices = {}
            self.switches = 0

    def __getstate__(self) -> dict:
        return {**self.snapshot(), "residual_ratios": dict(self.residual_ratios), "choices": dict(self.choices),
                "switches": self.switches}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]


stats = CompressionStats()


def label(c: Any) -> str:
    """The compressor's name in metrics and warnings: ``OneBit``, ``ErrorFeedback(TopK)``."""
    inner = getattr(c, "compressor", None)
    return f"{type(c).__name__}({type(inner).__name__})" if type(c).__name__ == "ErrorFeedback" else type(c).__name__


@dataclass
class _Watched:
    calls: int = 0
    ratios: list[float] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)


_watched: dict[tuple[str, Any], _Watched] = {}
_watch_lock = threading.Lock()


# norm() sums rows of this many elements in the tensor's precision, and the rows' squares in float64
_NORM_ROW = 4096


def norm(t: torch.Tensor) -> float:
    """The tensor's 2-norm as a Python float: rows of 4096 elements in float32 (or the tensor's
    wider dtype), their squares summed in float64. A norm in float64 throughout converts every
    element first: 124 ms for a 9.4M-element gradient on one core, against 5.6 ms this way, and the
    watch measures three such norms of every compressed tensor each ``WATCH_EVERY`` steps."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.float64 or flat.numel() <= _NORM_ROW:
        return float(torch.linalg.vector_norm(flat, dtype=torch.float64))
    whole = flat.numel() // _NORM_ROW * _NORM_ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_ROW), dim=1, dtype=torch.float32)
    tail = float(torch.linalg.vector_norm(flat[whole:], dtype=torch.float64))
    total = float(rows.double().square().sum()) + tail * tail
    if not math.isfinite(total) and bool(torch.isfinite(flat).all()):
        # a row's squares overflowed float32 (elements above ~1e19): finite, so measure it in float64
        return float(torch.linalg.vector_norm(flat, dtype=torch.float64))
    return math.sqrt(total)


def residual_norm(residuals: Any, name: Any) -> float:
    """The norm of every residual kept for ``name`` (its chunks' and pieces' keys included)."""
    total = 0.0
    for k in residuals.keys():
        if k == name or (isinstance(k, tuple) and k[:1] == (name,)):
            total += norm(residuals.get(k)) ** 2
    return math.sqrt(total)


def watch(c: Any, name: Any, x: torch.Tensor, result: torch.Tensor, world: int) -> None:
    """After a compressed reduction of ``x`` (what this rank compressed, before the division by
    ``world``) under ``name``: on every ``WATCH_EVERY``-th, record the residual ratio in
    :data:`stats` and warn (once per compressor and tensor) when it grows without bound or when the
    gradient or the result is not finite."""
    who = label(c)
    with _watch_lock:
        w = _watched.setdefault((who, name), _Watched())
        w.calls += 1
        if (w.calls - 1) % WATCH_EVERY:
            return
    g, out = norm(x) / max(world, 1), norm(result)
    if not (math.isfinite(g) and math.isfinite(out)):
        _warn_once(w, "nonfinite", f"{who} reduced a non-finite gradient for '{name}' (inf or NaN). Once, under "
                   "a GradScaler, that is a skipped step; if the loss is not finite either, training has diverged: "
                   "lower the lr, raise the compressor's warmup_steps, or compare with NoneCompressor().")
        return
    residuals = getattr(c, "residuals", None)
    if residuals is None or g == 0:
        return
    ratio = residual_norm(residuals, name) / g
    with _watch_lock:
        w.ratios = (w.ratios + [ratio])[-RISING - 1:]
        latest = max(v.ratios[-1] for (who2, _), v in _watched.items() if who2 == who and v.ratios)
    with stats._lock:
        stats.residual_ratios[who] = latest
    rising = len(w.ratios) > RISING and all(a < b for a, b in zip(w.ratios, w.ratios[1:]))
    if ratio > RESIDUAL_ALARM and rising:
        _warn_once(w, "residual", f"{who}: the error-feedback residual of '{name}' is {ratio:.0f}x the gradient "
                   "and still growing, so compression drops more than it sends back and training is diverging. "
                   "Reduce through DistributedOptimizer or make_ddp_hook(c, optimizer=opt) (shared momentum "
                   "and lr rescaling), keep warmup_steps, lower the lr, or use a less lossy compressor.")


def _warn_once(w: _Watched, what: str, message: str) -> None:
    if what not in w.warned:
        w.warned.add(what)
        warnings.warn(message, CompressionWarning, stacklevel=4)
