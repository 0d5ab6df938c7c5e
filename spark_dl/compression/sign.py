"""Sign compressors: 1 bit per element plus one or two floats, with error feedback built in."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Compressor, Key, Meta, Payload, check_float, flat32, restore
from .bits import pack, unpack
from .memory import ErrorFeedback


@dataclass
class _SignMeta(Meta):
    pass


def _signs(x: torch.Tensor) -> torch.Tensor:
    # g_i >= 0 counts as positive, as in Seide et al.'s threshold at zero.
    return pack(x >= 0, 1)


class SignMeans(Compressor):
    """1-bit quantization of Seide et al. (2014), without memory.

    q_i(g) = mean{g_j : g_j >= 0} if g_i >= 0 else mean{g_j : g_j < 0} (an empty mean is 0).
    Wire: n sign bits packed 8 per byte + the two means as float32: n + 64 bits.
    """

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "OneBit")
        x = flat32(tensor)
        pos = x >= 0
        n_pos = int(pos.sum())
        s_pos = x.clamp(min=0).sum()  # the sum over g_i >= 0 (zeros add nothing)
        means = torch.stack([s_pos / max(n_pos, 1), (x.sum() - s_pos) / max(x.numel() - n_pos, 1)])
        return Payload([means, pack(pos, 1)], _SignMeta(tensor.shape, tensor.dtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        means, bits = payload.tensors
        meta = payload.meta
        pos = unpack(bits, meta.numel, 1).to(torch.float32)
        return restore(pos.mul_(means[0] - means[1]).add_(means[1]), meta)

    def bits_per_element(self) -> float:
        return 1.0


class ScaledSign(Compressor):
    """Scaled sign of Karimireddy et al. (2019), without memory: q(p) = (||p||_1 / n) sign(p).

    Wire: n sign bits + one float32 scale.
    """

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "EFSign")
        x = flat32(tensor)
        scale = (x.abs().sum() / max(x.numel(), 1)).reshape(1)
        return Payload([scale, pack(x >= 0, 1)], Meta(tensor.shape, tensor.dtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        scale, bits = payload.tensors
        meta = payload.meta
        signs = unpack(bits, meta.numel, 1).to(torch.float32).mul_(2).sub_(1)
        return restore(signs.mul_(scale), meta)

    def bits_per_element(self) -> float:
        return 1.0


class OneBit(ErrorFeedback):
    """1-bit SGD: :class:`SignMeans` with error feedback per tensor name. Not summable."""

    def __init__(self) -> None:
        super().__init__(SignMeans())

    def __repr__(self) -> str:
        return "OneBit()"


class EFSign(ErrorFeedback):
    """EF-signSGD: :class:`ScaledSign` of p = g + e, with e <- p - q(p). Not summable."""

    def __init__(self) -> None:
        super().__init__(ScaledSign())

    def __repr__(self) -> str:
        return "EFSign()"
