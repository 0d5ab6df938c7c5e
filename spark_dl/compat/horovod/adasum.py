"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021).

Two gradients combine as ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``: orthogonal ones add up,
equal ones give the same vector once (their average), and in between the shared component is
counted once. Ranks combine pairwise up a binary tree by recursive doubling: at distance d each
rank swaps its partial result with rank ``r xor d`` and both compute the same combination, so after
log2(W) exchanges every rank holds the whole tree's result, bit for bit the same (the formula is
symmetric in floating point too: products and sums commute). A world that is not a power of two
first folds its extra ranks into their partners and sends them the result at the end.

The dot products are taken per tensor: a fused buffer passes the sizes of the tensors packed in
it, so each layer gets its own coefficients, as in Horovod.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def combine(a: torch.Tensor, b: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Adasum of two 1-D tensors, per segment of ``sizes`` (the whole tensor by default).

    A zero vector takes coefficient 1, so ``combine(0, b) == b``.
    """
    if a.shape != b.shape or a.dim() != 1:
        raise ValueError(f"combine takes two 1-D tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    sizes = [a.numel()] if sizes is None else [int(s) for s in sizes]
    if sum(sizes) != a.numel():
        raise ValueError(f"sizes add up to {sum(sizes)} elements, the tensors have {a.numel()}")
    work = _work_dtype(a.dtype)
    out = torch.empty(a.numel(), dtype=work, device=a.device)
    for x, y, o in zip(a.split(sizes), b.split(sizes), out.split(sizes)):
        if x.numel() == 0:
            continue
        # float64 dot products: the coefficients compare |a|^2 with a.b, which float32 sums of
        # millions of terms would blur
        xd, yd = x.double(), y.double()
        dot, xx, yy = torch.dot(xd, yd), torch.dot(xd, xd), torch.dot(yd, yd)
        cx = torch.where(xx > 0, 1 - dot / (2 * xx.clamp_min(torch.finfo(torch.float64).tiny)), 1.0)
        cy = torch.where(yy > 0, 1 - dot / (2 * yy.clamp_min(torch.finfo(torch.float64).tiny)), 1.0)
        torch.add(x.to(work) * cx.to(work), y.to(work) * cy.to(work), out=o)
    return out.to(a.dtype)


def _swap(x: torch.Tensor, peer: int, group: Any) -> torch.Tensor:
    y = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, peer, group), dist.P2POp(dist.irecv, y, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return y


def allreduce(tensor: torch.Tensor, sizes: Sequence[int] | None = None, group: Any = None) -> torch.Tensor:
    """Adasum of every member of ``group``'s ``tensor`` (1-D, contiguous); returns a new tensor,
    the same on every member. ``sizes``: the tensors packed in ``tensor``, each combined with its
    own dot products."""
    if not tensor.is_floating_point():
        raise ValueError(f"Adasum combines floating-point tensors, got {tensor.dtype}; use op=hvd.Sum for integers")
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    world = len(ranks)
    x = tensor.reshape(-1).clone()
    if world == 1:
        return x
    p = 1 << (world.bit_length() - 1)  # largest power of two <= world
    if me >= p:
        # an extra rank: its partner me - p combines for it and sends back the end result
        dist.send(x, ranks[me - p], group)
        dist.recv(x, ranks[me - p], group)
        return x
    if me + p < world:
        y = torch.empty_like(x)
        dist.recv(y, ranks[me + p], group)
        x = combine(x, y, sizes)
    d = 1
    while d < p:
        peer = me ^ d
        y = _swap(x, ranks[peer], group)
        x = combine(x, y, sizes) if me < peer else combine(y, x, sizes)
        d <<= 1
    if me + p < world:
        dist.send(x, ranks[me + p], group)
    return x


def reference(vectors: Sequence[torch.Tensor], sizes: Sequence[int] | None = None) -> torch.Tensor:
    """The tree :func:`allreduce` computes, on one process: for checking it, and for reading."""
    world = len(vectors)
    p = 1 << (world.bit_length() - 1)
    level = [combine(vectors[i], vectors[i + p], sizes) if i + p < world else vectors[i] for i in range(p)]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1], sizes) for i in range(0, len(level), 2)]
    return level[0]
