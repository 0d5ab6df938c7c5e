"""Bucket sums in a fixed order, so the torch path and the C kernels agree bit for bit.

A sum over a bucket is defined as (native/kernels.c, "deterministic sums", implements the same):

* the bucket is cut into pieces at multiples of ``BLOCK`` elements (global indices);
* a piece is summed in 8 float64 lanes, element i into lane (i - piece start) % 8, each lane from
  0.0 in index order, then the 8 lanes from 0.0 in lane order;
* the bucket's sum is its pieces' sums added from 0.0 in index order.

float32 values (and their squares) convert to float64 exactly, so only the order of additions
matters, and it is fixed: the result does not depend on thread counts, SIMD width or device.
``torch.cumsum`` adds sequentially, which is what makes the order expressible in torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 65536


def _last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sequential sum from 0.0 along ``dim`` (cumsum's last element)."""
    return t.cumsum(dim).select(dim, -1)


def _piece_sums(rows: torch.Tensor) -> torch.Tensor:
    """Lane sums of each row of a (pieces, length) float64 tensor (zero padding is harmless:
    a lane is never -0.0, since it starts at +0.0)."""
    n, length = rows.shape
    if length == 0:
        return rows.new_zeros(n)
    pad = -length % 8
    if pad:
        rows = F.pad(rows, (0, pad))
    return _last(_last(rows.view(n, -1, 8), 1), 1)


def bucket_sums(v: torch.Tensor, bucket: int) -> torch.Tensor:
    """Per-bucket sums (float64) of the 1-D float64 tensor ``v`` cut into buckets of ``bucket``."""
    n = v.numel()
    if n == 0:
        return v.new_zeros(0)
    bucket = max(1, min(bucket, n))
    nb = -(-n // bucket)
    if BLOCK % bucket == 0:  # no bucket crosses a block: one piece per bucket
        return _piece_sums(F.pad(v, (0, nb * bucket - n)).view(nb, bucket))
    if bucket == n or bucket % BLOCK == 0:  # pieces are whole blocks
        nblk = -(-n // BLOCK)
        pieces = _piece_sums(F.pad(v, (0, nblk * BLOCK - n)).view(nblk, BLOCK))
        per = -(-bucket // BLOCK) if bucket != n else nblk
        pieces = F.pad(pieces, (0, nb * per - nblk))  # zero pieces past the end add nothing
        return _last(pieces.view(nb, per), 1)
    # General: one block at a time; a piece is a bucket's part inside the block.
    out = v.new_zeros(nb)
    for s in range(0, n, BLOCK):
        e = min(s + BLOCK, n)
        first = s // bucket
        dev = v.device
        nxt = (first + 1) * bucket
        inner = torch.arange(nxt, e, bucket, device=dev) if nxt < e else torch.empty(0, dtype=torch.int64, device=dev)
        starts = torch.cat([torch.tensor([s], device=dev), inner])
        ends = torch.cat([starts[1:], torch.tensor([e], device=dev)])
        width = int((ends - starts).max())
        idx = torch.arange(s, e, device=dev)
        piece = torch.searchsorted(starts, idx, right=True) - 1
        rows = v.new_zeros(starts.numel(), width)
        rows[piece, idx - starts[piece]] = v[s:e]
        out[first:first + starts.numel()] += _piece_sums(rows)  # one piece per bucket here
    return out


def bucket_lengths(n: int, bucket: int, device: torch.device | None = None) -> torch.Tensor:
    """The length of each bucket of ``bucket`` elements that n elements are cut into, the last one
    holding the rest (int64, on ``device``; empty when n is 0)."""
    nb = -(-n // bucket)
    lengths = torch.full((nb,), bucket, dtype=torch.int64, device=device)
    if nb:
        lengths[-1] = n - bucket * (nb - 1)
    return lengths


def bucket_counts(mask: torch.Tensor, bucket: int) -> torch.Tensor:
    """Per-bucket number of true entries of a 1-D bool tensor (int64, exact)."""
    n = mask.numel()
    bucket = max(1, min(bucket, n)) if n else 1
    nb = -(-n // bucket)
    return F.pad(mask.to(torch.int64), (0, nb * bucket - n)).view(nb, bucket).sum(1)
