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
