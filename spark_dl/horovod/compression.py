"""``hvd.Compression`` and the one function every reduction in this package goes through.

Horovod's ``Compression.none`` / ``Compression.fp16`` are classes with static
``compress``/``decompress``; here they are compressor instances, so anything accepted as
``compression=`` (also by :class:`DistributedOptimizer`) is a compressor object.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _NoneAdapter:
    """Sends the tensor as it is."""

    summable = True

    def __repr__(self) -> str:
        return "Compression.none"


class _FP16Adapter:
    """Sends floating-point tensors as float16, halving the bytes on the wire."""

    summable = True

    def __repr__(self) -> str:
        return "Compression.fp16"


class Compression:
    """Horovod's compression namespace: ``Compression.none`` and ``Compression.fp16``."""

    none = _NoneAdapter()
    fp16 = _FP16Adapter()


def resolve(compression: Any) -> Any:
    """Return the compressor object behind ``compression`` or raise ``TypeError``."""
    if isinstance(compression, (_NoneAdapter, _FP16Adapter)):
        return compression
    raise TypeError(
        f"compression={compression!r} is not supported: use hvd.Compression.none or "
        "hvd.Compression.fp16."
    )


def is_none(compressor: Any) -> bool:
    return isinstance(compressor, _NoneAdapter)


def reduce(tensor: torch.Tensor, compressor: Any, *, average: bool, name: str | None,
           group: Any = None) -> torch.Tensor:
    """Sum (``average=False``) or average ``tensor`` over ``group`` through ``compressor``.

    Synchronous. Returns the reduced tensor (may be ``tensor`` itself, reduced in place).
    """
    world = dist.get_world_size(group)
    if isinstance(compressor, _FP16Adapter) and tensor.is_floating_point():
        # Divide before summing: an fp16 sum of large gradients overflows where the mean does not.
        wire = (tensor / world if average else tensor).to(torch.float16)
        dist.all_reduce(wire, group=group)
        return wire.to(tensor.dtype)
    dist.all_reduce(tensor, group=group)
    if average:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(world)
        else:
            tensor.copy_(torch.div(tensor, world, rounding_mode="trunc"))
    return tensor
