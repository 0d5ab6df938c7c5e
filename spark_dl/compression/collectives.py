"""Compressed all-reduce on ``torch.distributed`` (Gloo and NCCL).

* Summable payloads (none, fp16, bf16, shared-seed random-k): one ``all_reduce`` per wire
  tensor, then decompress.
* PowerSGD: its own two all-reduce rounds (P, then Q).
* Everything else: compressed scatter-reduce + all-gather. The flat tensor is split into W
  chunks; rank j owns chunk j. Each rank compresses every chunk (error-feedback memory
  ``(name, "worker", j)``) and an ``all_to_all`` sends chunk j to rank j; rank j decompresses
  and sums the W copies, recompresses the sum (a second memory ``(name, "server")``) and an
  ``all_gather`` gives every rank every reduced chunk. Each rank sends about 2 (W-1)/W of one
  compressed copy of the tensor: O(size), not O(W size). Every rank decompresses the same
  payloads, so the result is identical on all ranks.

Payloads travel as one uint8 buffer each; the receiver unpacks it with the layout of its own
payload for the same chunk (see :mod:`spark_dl.compression.base`), so no sizes are exchanged.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .base import Compressor, Payload
from .fp import NoneCompressor, _Cast
from .powersgd import PowerSGD
from .stats import stats

OPS = ("average", "sum")


def to_bytes(payload: Payload) -> torch.Tensor:
    """The payload's wire tensors concatenated as one flat uint8 tensor."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in payload.tensors]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def from_bytes(buf: torch.Tensor, like: Payload) -> Payload:
    """Inverse of :func:`to_bytes`, with the layout and meta of ``like`` (views where aligned)."""
    tensors, offset = [], 0
    for t in like.tensors:
        n = t.numel() * t.element_size()
        piece = buf[offset:offset + n]
        if piece.storage_offset() % t.element_size():
            piece = piece.clone()  # viewing bytes as wider types needs an aligned start
        tensors.append(piece.view(t.dtype).reshape(t.shape))
        offset += n
    return Payload(tensors, like.meta)


def _ring_bytes(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


def _all_reduce(t: torch.Tensor, group: Any, world: int) -> None:
    if world > 1:
        dist.all_reduce(t, group=group)
        stats.add_bytes(_ring_bytes(t.numel() * t.element_size(), world))


def _summable(x: torch.Tensor, c: Compressor, name: Any, group: Any, world: int,
              scale: float = 1.0) -> torch.Tensor:
    if scale != 1.0:
        payload = c.compress_scaled(x, scale, key=name)  # fp16/bf16: the kernel divides as it casts
    else:
        payload = c.compress(x, key=name)
    for t in payload.tensors:
        _all_reduce(t, group, world)
    return c.decompress(payload)


def _all_gather(out: torch.Tensor, piece: torch.Tensor, group: Any) -> None:
    # torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, piece, group=group)


def _scatter_reduce_allgather(x: torch.Tensor, c: Compressor, name: Any, group: Any,
                              world: int) -> torch.Tensor:
    me = dist.get_rank(group) if world > 1 else 0
    chunks = torch.tensor_split(x.reshape(-1), world)
    sent = [c.compress(ch, key=(name, "worker", j)) for j, ch in enumerate(chunks)]
    buffers = [to_bytes(p) for p in sent]
    sizes = [b.numel() for b in buffers]
    own = sent[me]
    # Chunks differ by at most one element, so their payloads by a few bytes: pad every
    # payload to one 8-aligned width (aligned views, equal splits) and use the single-tensor
    # all_to_all and all_gather that Gloo and NCCL both provide.
    width = -(-max(sizes) // 8) * 8
    if world > 1:
        outgoing = torch.zeros(world, width, dtype=torch.uint8, device=x.device)
        for j, b in enumerate(buffers):
            outgoing[j, :sizes[j]] = b
        incoming = torch.empty_like(outgoing)
        dist.all_to_all_single(incoming, outgoing, group=group)
        stats.add_bytes((world - 1) * width)
        copies = [own if i == me else from_bytes(incoming[i, :sizes[me]], own) for i in range(world)]
    else:
        copies = [own]
    # Decode-accumulate into one buffer: the native kernels add each payload in one pass.
    reduced = torch.empty(chunks[me].numel(), dtype=torch.float32, device=x.device)
    for i, p in enumerate(copies):
        c.decompress_into(p, reduced, accumulate=i > 0)
    mine = to_bytes(c.compress(reduced.to(x.dtype), key=(name, "server")))
    if world == 1:
        return c.decompress(from_bytes(mine, own)).reshape(x.shape)
    padded = torch.zeros(width, dtype=torch.uint8, device=x.device)
    padded[:mine.numel()] = mine
    gathered = torch.empty(world, width, dtype=torch.uint8, device=x.device)
    _all_gather(gathered.view(-1), padded, group)
    stats.add_bytes((world - 1) * width)
    out = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    offset = 0
    for j in range(world):
        n_j = chunks[j].numel()
        c.decompress_into(from_bytes(gathered[j, :sizes[j]], sent[j]), out[offset:offset + n_j])
        offset += n_j
    return out.to(x.dtype).reshape(x.shape)


def allreduce(tensor: torch.Tensor, compression: Compressor | None = None, *,
              op: str = "average", name: Any = None, group: Any = None) -> torch.Tensor:
    """Sum or average ``tensor`` over ``group`` through ``compression``; synchronous.

    Returns a new tensor of the input's shape and dtype, identical on every rank; the input is
    not modified. ``op="average"`` divides by the world size *before* compressing (no fp16
    overflow; error-feedback memory then holds averaged units). ``name`` keys per-tensor state
    (error feedback, warm starts) and is required for stateful compressors. Bytes sent and time
    go to :data:`spark_dl.compression.stats`.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    c = NoneCompressor() if compression is None else compression
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce takes a torch.Tensor, got {type(tensor).__name__}")
    if c.stateful and name is None:
        raise ValueError(
            f"{c!r} keeps state per tensor (error feedback / warm start): pass name=... that is "
            "unique to this tensor and the same on every rank."
        )
    world = dist.get_world_size(group)
    start = time.perf_counter()
    average = op == "average"
    integer = not (tensor.is_floating_point() or tensor.is_complex())
    if tensor.numel() > 0 and average and isinstance(c, _Cast):
        # divide before the sum (no fp16 overflow) inside the cast: no pass of its own
        out = _summable(tensor, c, name, group, world, scale=1.0 / world)
        stats.add_call(tensor.numel(), _ring_bytes(tensor.numel() * tensor.element_size(), world),
                       time.perf_counter() - start)
        return out.to(tensor.dtype).reshape(tensor.shape)
    x = tensor / world if average and not integer else tensor
    if tensor.numel() == 0:
        out = x.clone()
    elif isinstance(c, PowerSGD):
        out = c.round(x, name, lambda t: _all_reduce(t, group, world))[0]  # the sum
    elif c.summable:
        out = _summable(x, c, name, group, world)
    else:
        out = _scatter_reduce_allgather(x, c, name, group, world)
    if average and integer:
        out = torch.div(out, world, rounding_mode="trunc")
    out = out.to(tensor.dtype).reshape(tensor.shape)
    stats.add_call(tensor.numel(), _ring_bytes(tensor.numel() * tensor.element_size(), world),
                   time.perf_counter() - start)
    return out
