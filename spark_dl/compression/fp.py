"""Lossless-ish casts: no compression, float16 and bfloat16. All summable."""
from __future__ import annotations

import torch

from spark_dl.compression import native
from spark_dl.compression.base import Compressor, Key, Meta, Payload, check_float


class NoneCompressor(Compressor):
    """Sends the tensor as it is (any dtype, integers included)."""

    summable = True

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        # A copy: collectives reduce wire tensors in place and must not touch the caller's tensor.
        return Payload([tensor.reshape(-1).clone()], Meta(tensor.shape, tensor.dtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0].reshape(payload.meta.shape)

    def bits_per_element(self) -> float:
        return 32.0


class Cast(Compressor):
    """Sends the tensor cast to ``wire_dtype`` (a 16-bit float); subclassed by :class:`FP16` and
    :class:`BF16`, and what reductions test for to treat a cast apart (scaling before the sum)."""

    wire_dtype: torch.dtype
    summable = True

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        return self.compress_scaled(tensor, 1.0, key)

    def decompress(self, payload: Payload) -> torch.Tensor:
        wire = payload.tensors[0]
        if payload.meta.dtype == torch.float32 and wire.dtype == self.wire_dtype and native.enabled(wire):
            return native.from_half(wire).reshape(payload.meta.shape)
        return wire.to(payload.meta.dtype).reshape(payload.meta.shape)

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        wire = payload.tensors[0]
        if payload.meta.dtype == torch.float32 and wire.dtype == self.wire_dtype and native.enabled(wire, out):
            native.from_half(wire, out, accumulate)
        else:
            super().decompress_into(payload, out, accumulate)

    def compress_scaled(self, tensor: torch.Tensor, scale: float, key: Key = None) -> Payload:
        """``compress(tensor * scale)`` in one pass: how ``allreduce`` divides by the world size
        before the sum (no fp16 overflow) without a pass of its own."""
        check_float(tensor, type(self).__name__)
        if tensor.dtype == torch.float32 and native.enabled(tensor):
            return Payload([native.to_half(tensor, self.wire_dtype, scale)], Meta(tensor.shape, tensor.dtype))
        scaled = tensor * scale if scale != 1.0 else tensor
        wire = scaled.reshape(-1).to(self.wire_dtype, copy=True)
        return Payload([wire], Meta(tensor.shape, tensor.dtype))

    def bits_per_element(self) -> float:
        return 16.0


class FP16(Cast):
    """IEEE half precision (10-bit mantissa, max 65504). ``allreduce`` divides by the world
    size before summing, so an average of large gradients does not overflow."""

    wire_dtype = torch.float16


class BF16(Cast):
    """bfloat16: float32's range with an 8-bit mantissa; relative error <= 2**-8 per element."""

    wire_dtype = torch.bfloat16
