"""Reproducible random streams that need no stored generator (so state pickles as ints)."""
from __future__ import annotations

import zlib

import torch


def generator(device: torch.device, *parts: object) -> torch.Generator:
    """A generator seeded by a stable hash of ``parts`` (the same in every process)."""
    seed = zlib.crc32(repr(parts).encode()) | (zlib.adler32(repr(parts[::-1]).encode()) << 32)
    g = torch.Generator(device=device)
    g.manual_seed(seed & ((1 << 63) - 1))
    return g


def process_rank() -> int:
    """This process's rank in the default group, 0 without one: decorrelates per-rank noise."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 ``a`` in [0, 2**32) and a constant ``c``, without overflowing
    int64: c is split into 16-bit halves."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def counter_uniform(start: int, count: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniforms in [0, 1) (float32, multiples of 2**-24) for element indices start..start+count-1:
    a hash of (index, seed), the same floats as the native QSGD kernel draws (native/kernels.c,
    qrand), on any device and in any order of evaluation."""
    i = torch.arange(start, start + count, dtype=torch.int64, device=device)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    x = (_mul32(i & _M32, 0x9E3779B1) + k0 + _mul32(i >> 32, 0x85EBCA77)) & _M32
    h = _fmix32(x) ^ k1
    return (h >> 8).to(torch.float32) * 2.0 ** -24
