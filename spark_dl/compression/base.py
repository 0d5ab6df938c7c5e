"""The compressor contract: a :class:`Payload` on the wire and a :class:`Compressor` that makes it.

A compressor is a pair ``compress: tensor -> Payload`` and ``decompress: Payload -> tensor``.
The wire tensors of a payload are what ranks exchange; its ``meta`` stays local. Two rules let
the collectives exchange payloads without sending their layout:

* the wire tensors' shapes and dtypes depend only on the input's shape and dtype;
* ``meta`` depends only on the input's shape/dtype and on state every rank shares (a step
  counter, a seed), never on the values.

So a rank can decompress another rank's payload for the same region with its own ``meta``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from spark_dl.compression.training import first_moment_decay, optimizer_settings, second_moment_decay
from spark_dl.errors import as_int, in_range

Key = Hashable


@dataclass
class Meta:
    """What every decompression needs: the original shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Payload:
    """One compressed tensor: ``tensors`` go on the wire, ``meta`` never leaves the process."""

    tensors: list[torch.Tensor]
    meta: Any

    @property
    def nbytes(self) -> int:
        """Bytes the wire tensors occupy."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Compressor:
    """Base class. Subclasses implement :meth:`compress`, :meth:`decompress`, :meth:`bits_per_element`,
    and may override :meth:`decompress_into` with a fused path.

    ``summable``: all_reduce(SUM) of the wire tensors of W payloads, then :meth:`decompress`,
    equals the sum of the W decompressions, so the payload can ride an ordinary all_reduce.
    ``key`` names the tensor for compressors that keep per-tensor state (error feedback,
    warm starts, step counters); stateless compressors ignore it.
    """

    summable: bool = False
    # True for a compressor that picks another per reduction (Auto): allreduce hands it the call
    chooses: bool = False
    # Warm-up, shared momentum and lr rescaling (spark_dl.compression.training), for the
    # compressors with error feedback; None: told nothing, changes nothing.
    feedback: Any = None
    # Consecutive elements that share one statistic (1-bit's means, a sign scale; 0: the whole
    # tensor), or None where none is shared. Not None: a bucket packing several tensors is
    # compressed layer by layer (spark_dl.compression.layers), so no statistic spans two of them.
    span: int | None = None

    def observe(self, *, lr: float | None = None, momentum: float = 0.0, beta2: float = 0.0,
                beta1: float = 0.0) -> None:
        """The optimizer's lr, (SGD) momentum and (Adam-style) ``beta2`` and ``beta1`` for the step
        about to be reduced; call before the step's first reduction. Error-feedback compressors
        rescale their residuals when the lr moves, compress the shared velocity under momentum and
        precondition by the second moment under ``beta2`` (the sign compressors compress the shared
        first moment there too; see :mod:`spark_dl.compression.training`); ``TopK()`` keeps more
        entries under ``beta2`` (and is told through the ``ErrorFeedback`` that wraps it); the others
        ignore it."""
        if self.feedback is not None:
            self.feedback.observe(getattr(self, "residuals", None), lr=lr, momentum=momentum, beta2=beta2,
                                  beta1=beta1)

    def decay_advice(self) -> str | None:
        """Why error feedback around this compressor is measured short of uncompressed training
        under a decaying lr, which the optimizer alone does not show, and the fix; None where
        nothing is known (:class:`~spark_dl.compression.ErrorFeedback` warns with it once)."""
        return None

    def observe_optimizer(self, optimizer: Any) -> None:
        """:meth:`observe` with the lr, momentum (SGD's) and ``betas`` (Adam-style) of
        ``optimizer``'s first param group."""
        lr, momentum = optimizer_settings(optimizer)
        self.observe(lr=lr, momentum=momentum, beta2=second_moment_decay(optimizer),
                     beta1=first_moment_decay(optimizer))

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        """Write (``accumulate``: add) the decompressed values into ``out``, a contiguous 1-D
        float32 tensor of the payload's numel. What the collectives call to sum W payloads: the
        native kernels do it in one pass with no temporary; this default decompresses first."""
        v = self.decompress(payload).reshape(-1)
        if accumulate:
            out.add_(v)
        else:
            out.copy_(v)

    def compress_averaged(self, tensor: torch.Tensor, world: int, key: Key = None) -> Payload:
        """``compress(tensor / world)``; error feedback folds the division into its own pass."""
        return self.compress(tensor / world, key)

    def subtract_decompressed(self, p: torch.Tensor, payload: Payload) -> torch.Tensor:
        """``p - decompress(payload)`` in p's memory, for ``payload = compress(p)`` of a float32
        ``p``: error feedback's new residual. Sparse compressors override it to touch only the
        entries they kept (the same values: p_i - 0 is p_i)."""
        return p.sub_(self.decompress(payload).to(torch.float32))

    def bits_per_element(self) -> float:
        """Nominal wire bits per element of a large fp32 tensor."""
        raise NotImplementedError

    def reset(self, key: Key = None) -> None:
        """Forget per-tensor state for ``key`` (all state when ``None``). Stateless: no-op."""

    @property
    def stateful(self) -> bool:
        """True when ``key`` matters, so :func:`~spark_dl.compression.allreduce` needs a ``name``."""
        return False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"

    def _params(self) -> dict[str, Any]:
        return {}


def check_float(tensor: torch.Tensor, who: str) -> None:
    """Lossy compressors only make sense on floating-point tensors: say so clearly."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who} compresses torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(
            f"{who} compresses floating-point tensors, got dtype {tensor.dtype}; "
            "send integer tensors uncompressed (NoneCompressor)."
        )


def flat32(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D float32 view/copy of ``tensor`` (contiguous; copies only when it must)."""
    return tensor.reshape(-1).to(torch.float32)


def restore(flat: torch.Tensor, meta: Meta) -> torch.Tensor:
    """Back to the original shape and dtype."""
    return flat.to(meta.dtype).reshape(meta.shape)


def _public_compressors() -> dict[str, type]:
    """Compressor classes by lower-case name, to suggest the one a string like ``"qsgd"`` means."""
    found, todo = {}, [Compressor]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not cls.__name__.startswith("_"):
            found.setdefault(cls.__name__.lower(), cls)
    return found


def _needs_arguments(cls: type) -> bool:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the call itself say what it needs
        return False
    named = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return any(p.default is inspect.Parameter.empty and p.kind in named for p in params)


def as_compressor(value: Any, who: str, *, instances_only: bool = False) -> Compressor:
    """``value`` as a compressor, checked where it is handed over rather than at the first compress.

    An instance is returned as is; a :class:`Compressor` subclass that takes no arguments is
    instantiated (as ``hvd``'s ``compression=`` does); anything else is a TypeError that says what
    to pass. ``instances_only`` (:func:`allreduce`, called every step) refuses classes too: a fresh
    instance per call would drop the state a compressor keeps between calls.
    """
    if isinstance(value, Compressor):
        return value
    if isinstance(value, str) and value.lower() == "auto":  # the one name taken: Auto needs no choosing
        return _public_compressors()["auto"]()  # Auto, found as a subclass: auto.py builds on this module
    if isinstance(value, type) and issubclass(value, Compressor):
        name = value.__name__
        if _needs_arguments(value):
            raise TypeError(f"{who} got the class {name}, which takes arguments: pass {name}(...) (an instance).")
        if instances_only:
            raise TypeError(
                f"{who} got the class {name}: pass {name}() (an instance), created once and reused on every "
                "call; a compressor keeps state between calls (error feedback, warm starts, step counters)."
            )
        return value()
    hint = "QSGD(), TopK(0.01) or PowerSGD()"
    if isinstance(value, str):
        cls = _public_compressors().get(value.replace("_", "").replace("-", "").lower())
        if cls is not None:
            hint = f"{cls.__name__}({'...' if _needs_arguments(cls) else ''})"
    raise TypeError(f"{who} got {value!r}, which is not a spark_dl.compression.Compressor: use an instance "
                    f"such as {hint}.")


def int_param(value: Any, who: str, name: str, low: int | None = None, high: int | None = None, *,
              none: bool = False, why: str = "") -> int | None:
    """A constructor's integer parameter (numpy integers included, bools not) as a Python int, or a
    ValueError naming the compressor, the parameter, what it must be and the value; ``none``:
    ``None`` is allowed and returned as is."""
    if value is None and none:
        return None
    n = as_int(value)
    if n is None or not in_range(n, low=low, high=high, integer=True):
        span = f" in {low}..{high}" if low is not None and high is not None else \
            f" >= {low}" if low is not None else ""
        raise ValueError(f"{who} {name} must be an int{span}{' or None' if none else ''}{why}, got {value!r}")
    return n


def real_param(value: Any, who: str, name: str, low: float, high: float | None = None, *,
               open_low: bool = False) -> float:
    """A constructor's real-number parameter as a float: finite, not a bool, ``low <= value``
    (``<`` with ``open_low``) and ``value <= high``; else a ValueError that says so."""
    if not in_range(value, low=low, high=high, low_open=open_low):
        span = f"in {'(' if open_low else '['}{low:g}, {high:g}]" if high is not None else \
            f"{'>' if open_low else '>='} {low:g}"
        raise ValueError(f"{who} {name} must be a finite real number {span}, got {value!r}")
    return float(value)
