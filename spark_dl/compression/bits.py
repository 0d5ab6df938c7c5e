"""Packing small unsigned codes densely into bytes: ``b`` bits per element, not one byte.

``b`` in {1, 2, 4, 8} packs ``8 // b`` codes per byte; any other width is stored as ``b``
bit-planes of one bit each, so the size is always ``b * ceil(n / 8)`` bytes or less.
"""
from __future__ import annotations

import torch


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes :func:`pack` returns for ``n`` codes of ``bits`` bits."""
    if 8 % bits == 0:
        per = 8 // bits
        return (n + per - 1) // per
    return bits * ((n + 7) // 8)


def _pack_aligned(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    n = codes.numel()
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.view(-1, per)
    out = groups[:, 0].clone()
    for i in range(1, per):
        out.bitwise_left_shift_(bits).bitwise_or_(groups[:, i])
    return out


def _unpack_aligned(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange((per - 1) * bits, -1, -bits, device=packed.device, dtype=torch.uint8)
    codes = packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(mask)
    return codes.reshape(-1)[:n]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes, each ``< 2**bits``, into a 1-D uint8 tensor."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    if 8 % bits == 0:
        return _pack_aligned(codes, bits) if bits < 8 else codes.clone()
    planes = [_pack_aligned(codes.bitwise_right_shift(b).bitwise_and_(1), 1) for b in range(bits)]
    return torch.cat(planes)


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes as a 1-D uint8 tensor."""
    if 8 % bits == 0:
        return _unpack_aligned(packed, n, bits) if bits < 8 else packed[:n].clone()
    plane = (n + 7) // 8
    codes = torch.zeros(n, dtype=torch.uint8, device=packed.device)
    for b in range(bits):
        codes.bitwise_or_(_unpack_aligned(packed[b * plane:(b + 1) * plane], n, 1).bitwise_left_shift(b))
    return codes
