"""Error feedback: remember what compression dropped and send it next time.

With a (possibly biased) compressor ``C`` and decompressor ``D``, per tensor key::

    p_t     = g_t + e_t             # add what was dropped before
    send      C(p_t)
    e_{t+1} = p_t - D(C(p_t))       # what was dropped now

Nothing is lost, only delayed: sum_t D(C(p_t)) = sum_t g_t - e_{T+1}. This is what makes
1-bit, sign and top-k compression converge to the same optimum as exact SGD.

A step whose p is not finite (an inf or NaN gradient, as mixed precision's loss scaling makes
and then skips) leaves no residual for its key: what it sends stays non-finite, so the skip
still happens, but the steps after it start from e = 0 instead of adding inf or NaN for ever.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from spark_dl.compression.base import Compressor, Key, Payload, as_compressor, check_float, int_param
from spark_dl.compression.stats import CompressionWarning
from spark_dl.compression.training import TrainingFeedback, all_finite


def key_matches(key: Key, prefix: Key) -> bool:
    """``key`` belongs to ``prefix``: equal, or a tuple whose first item is ``prefix``."""
    return key == prefix or (isinstance(key, tuple) and len(key) > 0 and key[0] == prefix)


class Residuals:
    """Float32 residual memory per key. A key whose shape changes starts from zero again."""

    def __init__(self) -> None:
        self.memory: dict[Key, torch.Tensor] = {}

    def get(self, key: Key) -> torch.Tensor | None:
        """``e[key]``, or None."""
        return self.memory.get(key)

    def add(self, tensor: torch.Tensor, key: Key, world: int = 1) -> torch.Tensor:
        """``tensor / world + e[key]`` in float32 (a new tensor; ``tensor`` is not modified), in one
        pass where e fits: the division rides the add (one rounding, the same bits as dividing
        first in float32 when ``world`` is a power of two)."""
        e = self.get(key)
        fits = e is not None and e.shape == tensor.shape and e.device == tensor.device
        if fits and e.dtype == torch.float32 and (
                world != 1 or tensor.dtype in (torch.float32, torch.float16, torch.bfloat16)):
            # float32 by promotion; with world 1 the same sums as the copy-and-add below
            return torch.add(e, tensor, alpha=1.0 / world) if world != 1 else torch.add(tensor, e)
        p = tensor.to(torch.float32, copy=True)
        if world != 1:
            p.div_(world)
        return p.add_(e) if fits else p

    def add_scaled(self, tensor: torch.Tensor, key: Key, scale: float = 1.0) -> torch.Tensor:
        """``e[key] + scale * tensor`` in float32, computed in e's memory when it fits (the
        caller then owns it: it must store a new residual for ``key``), else a new tensor."""
        e = self.memory.get(key)
        if (e is not None and e.shape == tensor.shape and e.device == tensor.device
                and e.dtype == torch.float32 and e.is_contiguous()):
            del self.memory[key]
            return e.add_(tensor, alpha=scale)
        return tensor.to(torch.float32).mul(scale) if scale != 1.0 else tensor.to(torch.float32, copy=True)

    def store(self, key: Key, residual: torch.Tensor) -> None:
        self.memory[key] = residual

    def drop(self, key: Key) -> None:
        """Forget ``e[key]`` alone (:meth:`reset` also forgets the keys under it)."""
        self.memory.pop(key, None)

    def reset(self, key: Key = None) -> None:
        if key is None:
            self.memory.clear()
        else:
            for k in [k for k in self.memory if key_matches(k, key)]:
                del self.memory[k]

    def keys(self) -> list[Key]:
        """The keys that hold a residual (reads none of them)."""
        return list(self.memory)

    def __len__(self) -> int:
        return len(self.memory)


class PendingResiduals(Residuals):
    """Residuals whose native encoders leave part of the update ``pending``: a residual is kept
    as a tensor plus a correction the next step's pass applies while it reads that tensor (one
    pass over memory fewer). Reading :attr:`memory`, :meth:`get` (that key only) or pickling
    settles the corrections first, so the residuals seen from outside are always ``e``.
    Subclasses say how a correction is settled in place (:meth:`_settle`)."""

    def __init__(self) -> None:
        self._memory: dict[Key, torch.Tensor] = {}
        self.pending: dict[Key, Any] = {}

    def _settle(self, e: torch.Tensor, pending: Any) -> None:
        raise NotImplementedError

    def get(self, key: Key) -> torch.Tensor | None:
        """``e[key]`` (its correction settled; the other keys' stay pending), or None."""
        pending = self.pending.pop(key, None)
        if pending is not None:
            self._settle(self._memory[key], pending)
        return self._memory.get(key)

    @property  # type: ignore[override]
    def memory(self) -> dict[Key, torch.Tensor]:
        for key, pending in self.pending.items():
            self._settle(self._memory[key], pending)
        self.pending.clear()
        return self._memory

    @memory.setter
    def memory(self, value: dict[Key, torch.Tensor]) -> None:
        self._memory, self.pending = value, {}

    def __getstate__(self) -> dict:
        return {"_memory": self.memory, "pending": {}}

    def store(self, key: Key, residual: torch.Tensor) -> None:
        self._memory[key] = residual
        self.pending.pop(key, None)

    def drop(self, key: Key) -> None:
        self._memory.pop(key, None)
        self.pending.pop(key, None)

    def reset(self, key: Key = None) -> None:
        for d in (self.pending, self._memory):
            for k in [k for k in d if key is None or key_matches(k, key)]:
                del d[k]

    def keys(self) -> list[Key]:
        return list(self._memory)

    def __len__(self) -> int:
        return len(self._memory)


@dataclass
class EFMeta:
    """An error-feedback payload's meta: the inner compressor's, and the shape and dtype of the
    tensor that was compressed (the inner one saw the float32 sum with the residual)."""

    inner: Any
    shape: torch.Size
    dtype: torch.dtype


# Uncompressed reductions per tensor before a biased compressor starts (measured on digits and a
# 1.6M-parameter MLP: see docs/guide/compression.md, "What each compressor needs to converge").
WARMUP_STEPS = 0
# Up to this many ranks, error-feedback compressors exchange whole compressed tensors (one
# compression stage, (W-1) compressed copies sent per rank); above it, the scatter-reduce (about
# 2 copies, a second compression stage).
SINGLE_STAGE_UP_TO = 8


class ErrorFeedback(Compressor):
    """Wraps any compressor with error-feedback memory keyed by tensor name (see module doc).

    ``warmup_steps``: reductions of each tensor that go uncompressed first.
    ``compress_momentum``: under momentum SGD (as told by :meth:`Compressor.observe`), compress
    each rank's gradient plus the shared velocity's momentum rather than its gradient alone (and
    where ``feedback.first_moment`` is set, as in ``OneBit`` and ``EFSign``, Adam's shared first
    moment under Adam-style optimizers).
    ``single_stage_up_to``: up to this many ranks, a non-summable compressor's payloads are
    all-gathered and summed (one compression stage) rather than scatter-reduced and compressed
    again. All three, and the residuals' rescaling when the lr moves, are described in
    :mod:`spark_dl.compression.training`. Once the lr told has fallen to half its peak, a
    :class:`CompressionWarning` says so where the wrapped compressor is measured short under a
    decaying lr (:meth:`Compressor.decay_advice`: top-k under momentum SGD, EF-sign where the lr is
    halved early in the run).
    """

    def __init__(self, compressor: Compressor, warmup_steps: int = WARMUP_STEPS,
                 compress_momentum: bool = True, single_stage_up_to: int = SINGLE_STAGE_UP_TO) -> None:
        self.compressor = as_compressor(compressor, "ErrorFeedback")
        self.residuals = Residuals()
        self.feedback = feedback_for(type(self).__name__, warmup_steps, compress_momentum, single_stage_up_to)

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.compressor.summable

    @property
    def stateful(self) -> bool:
        return True

    @property
    def span(self) -> int | None:  # type: ignore[override]
        return self.compressor.span

    # whether the decay warning was given (class default: pickles from before); the peak lr is the feedback's
    _decay_warned: bool = False

    def observe(self, *, lr: float | None = None, momentum: float = 0.0, beta2: float = 0.0,
                beta1: float = 0.0) -> None:
        super().observe(lr=lr, momentum=momentum, beta2=beta2, beta1=beta1)
        if self.compressor.feedback is None:  # TopK()'s ratio follows the optimizer
            self.compressor.observe(lr=lr, momentum=momentum, beta2=beta2, beta1=beta1)
        # warned once, when the lr has fallen to half its peak
        peak = self.feedback.peak_lr  # the highest lr told so far, this one included
        if lr is not None and lr > 0 and lr <= peak / 2 and not self._decay_warned:
            reason = self.decay_advice()
            if reason is not None:
                self._decay_warned = True
                warnings.warn(f"{self!r} under a decaying lr (now {lr:.3g}, from {peak:.3g}): {reason}",
                              CompressionWarning, stacklevel=4)

    def decay_advice(self) -> str | None:
        return self.compressor.decay_advice()

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        return self._feed_back(tensor, key, 1)

    def compress_averaged(self, tensor: torch.Tensor, world: int, key: Key = None) -> Payload:
        """``compress(tensor / world)`` with the division inside the pass that adds the residual,
        p = e + tensor / world (:meth:`Residuals.add`): what an averaging all-reduce calls, with
        no divided copy of the gradient."""
        return self._feed_back(tensor, key, world)

    def _feed_back(self, tensor: torch.Tensor, key: Key, world: int) -> Payload:
        check_float(tensor, type(self).__name__)
        p = self.residuals.add(tensor, key, world)
        payload = self.compressor.compress(p, key)
        residual = self.compressor.subtract_decompressed(p, payload)
        if all_finite(residual):  # a finite residual whose sum overflows is kept, as the sign kernels keep theirs
            self.residuals.store(key, residual)
        else:
            self.residuals.drop(key)  # an inf/NaN gradient (a step AMP skips) must not poison every later step
        return Payload(payload.tensors, EFMeta(payload.meta, tensor.shape, tensor.dtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        meta: EFMeta = payload.meta
        out = self.compressor.decompress(Payload(payload.tensors, meta.inner))
        return out.to(meta.dtype).reshape(meta.shape)

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        meta: EFMeta = payload.meta
        if meta.dtype == torch.float32:  # the inner payload holds exactly these float32 values
            self.compressor.decompress_into(Payload(payload.tensors, meta.inner), out, accumulate)
        else:
            super().decompress_into(payload, out, accumulate)

    def bits_per_element(self) -> float:
        return self.compressor.bits_per_element()

    def reset(self, key: Key = None) -> None:
        self.residuals.reset(key)
        self.compressor.reset(key)
        self.feedback.reset(key)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "feedback" not in state:  # pickled before training feedback existed: as before
            self.feedback = TrainingFeedback(0, compress_momentum=False, rescale_lr=False, precondition=False)
        old_peak = self.__dict__.pop("_peak_lr", None)  # pickled when the decay warning kept its own peak
        if old_peak is not None:
            self.feedback.peak_lr = max(self.feedback.peak_lr, old_peak)

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r})"


def feedback_for(who: str, warmup_steps: Any, compress_momentum: Any, single_stage_up_to: Any) -> TrainingFeedback:
    """A compressor's :class:`TrainingFeedback`, its arguments checked."""
    if not isinstance(compress_momentum, bool):
        raise TypeError(f"{who} compress_momentum must be True or False, got {compress_momentum!r}")
    return TrainingFeedback(int_param(warmup_steps, who, "warmup_steps", 0), compress_momentum,
                            single_stage_up_to=int_param(single_stage_up_to, who, "single_stage_up_to", 0))
