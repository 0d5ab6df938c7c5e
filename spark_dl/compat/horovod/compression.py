"""``hvd.Compression`` and the one function every gradient/tensor reduction here goes through.

Horovod's ``Compression.none`` / ``Compression.fp16`` are classes with static
``compress``/``decompress``; here they are :mod:`spark_dl.compression` compressor instances, so any
compressor of that package (``QSGD()``, ``PowerSGD()``, ``OneBit()``, ...) is accepted as
``compression=`` by :func:`allreduce` and :class:`DistributedOptimizer`.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from spark_dl import compression
from spark_dl.compression import Compressor
from spark_dl.compression import allreduce as compressed_allreduce
from spark_dl.compression.base import Meta, Payload, as_compressor
from spark_dl.compression.fp import Cast


class HorovodPayload(Payload):
    """A :class:`~spark_dl.compression.base.Payload` that also unpacks as Horovod's
    ``(tensor_compressed, ctx)``."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.tensors[0].view(self.meta.shape), self))


class _TupleProtocol:
    """Horovod's ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)`` next to
    spark-dl's payload protocol (what the collectives call): a tensor that is not floating point
    passes through uncast, as in Horovod."""

    def compress(self, tensor: torch.Tensor, key: Any = None) -> Payload:
        if not tensor.is_floating_point():  # a copy, as the collectives reduce wire tensors in place
            return HorovodPayload([tensor.reshape(-1).clone()], Meta(tensor.shape, tensor.dtype))
        p = super().compress(tensor, key)  # type: ignore[misc]
        return HorovodPayload(p.tensors, p.meta)

    def decompress(self, payload: Any, ctx: Any = None) -> torch.Tensor:
        if ctx is None:
            return super().decompress(payload)  # type: ignore[misc]
        return payload.to(ctx.meta.dtype).view(ctx.meta.shape)


class NoneCompressor(_TupleProtocol, compression.NoneCompressor):
    """:class:`spark_dl.compression.NoneCompressor`, also with Horovod's tuple protocol."""


class FP16(_TupleProtocol, compression.FP16):
    """:class:`spark_dl.compression.FP16`, also with Horovod's tuple protocol."""


class Compression:
    """Horovod's compression namespace: ``Compression.none`` and ``Compression.fp16``, and
    ``Compression.auto`` (:class:`spark_dl.compression.Auto`: a class, so each
    ``DistributedOptimizer`` gets its own, with its own measurements and decisions)."""

    none = NoneCompressor()
    fp16 = FP16()
    auto = compression.Auto


def resolve(compression: Any, per_call: bool = False) -> Compressor:
    """The compressor behind ``compression`` (an instance, or a class taking no arguments).

    ``per_call``: for a collective (``hvd.allreduce``), where a class would make a fresh instance on
    every call, so a compressor that keeps state between calls would silently lose it: refused."""
    c = as_compressor(compression, "compression")
    if per_call and isinstance(compression, type) and c.stateful:
        name = compression.__name__
        raise TypeError(f"compression={name} keeps state between calls (error feedback, warm starts, step "
                        f"counters), which a fresh instance per call would drop: create {name}() once and pass it, "
                        "with a name= that is the same on every rank")
    return c


def for_tensor(compressor: Compressor, tensor: torch.Tensor) -> Compressor:
    """``compressor`` for ``tensor``: a cast (fp16, bf16) leaves a tensor that is not floating point
    as it is, as Horovod's ``Compression.fp16`` does (a count averaged with the gradients' settings)."""
    return Compression.none if is_cast(compressor) and not tensor.is_floating_point() else compressor


def is_cast(compressor: Compressor) -> bool:
    return isinstance(compressor, Cast)


def is_none(compressor: Compressor) -> bool:
    return isinstance(compressor, compression.NoneCompressor)


def reduce(tensor: torch.Tensor, compressor: Compressor, *, average: bool, name: str | None,
           group: Any = None, layout: list | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum (``average=False``) or average ``tensor`` over ``group`` through ``compressor``;
    synchronous. ``layout``: shapes of the gradients packed in a fusion bucket; ``out``: where the
    result goes (``tensor`` itself is allowed)."""
    return compressed_allreduce(tensor, compressor, op="average" if average else "sum", name=name,
                                group=group, layout=layout, out=out)
