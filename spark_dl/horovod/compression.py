"""``hvd.Compression`` and the one function every gradient/tensor reduction here goes through.

Horovod's ``Compression.none`` / ``Compression.fp16`` are classes with static
``compress``/``decompress``; here they are :mod:`spark_dl.compression` compressor instances, so any
compressor of that package (``QSGD()``, ``PowerSGD()``, ``OneBit()``, ...) is accepted as
``compression=`` by :func:`allreduce` and :class:`DistributedOptimizer`.
"""
from __future__ import annotations

from typing import Any

import torch

from spark_dl.compression import FP16, Compressor, NoneCompressor
from spark_dl.compression import allreduce as compressed_allreduce


class Compression:
    """Horovod's compression namespace: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor()
    fp16 = FP16()


def resolve(compression: Any) -> Compressor:
    """The compressor behind ``compression`` (an instance, or a class taking no arguments)."""
    if isinstance(compression, type) and issubclass(compression, Compressor):
        return compression()
    if isinstance(compression, Compressor):
        return compression
    raise TypeError(
        f"compression={compression!r} is not a spark_dl.compression.Compressor: use "
        "hvd.Compression.none, hvd.Compression.fp16 or a compressor such as spark_dl.compression.QSGD()."
    )


def is_none(compressor: Compressor) -> bool:
    return isinstance(compressor, NoneCompressor)


def reduce(tensor: torch.Tensor, compressor: Compressor, *, average: bool, name: str | None,
           group: Any = None, layout: list | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum (``average=False``) or average ``tensor`` over ``group`` through ``compressor``;
    synchronous. ``layout``: shapes of the gradients packed in a fusion bucket; ``out``: where the
    result goes (``tensor`` itself is allowed)."""
    return compressed_allreduce(tensor, compressor, op="average" if average else "sum", name=name,
                                group=group, layout=layout, out=out)
