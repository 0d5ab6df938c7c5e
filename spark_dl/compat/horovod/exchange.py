"""Horovod's slice-exchanging collectives, ``alltoall`` and ``reducescatter``, on one
``torch.distributed.all_to_all_single`` each (Gloo and NCCL both have it, uneven splits included).

Both slice along dimension 0 and are differentiable, with Horovod's backward rules: alltoall's
gradient travels back by the reverse alltoall, reducescatter's by an allgather.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from spark_dl.compat.horovod.basics import Adasum, Average, ReduceOp, Sum
from spark_dl.compat.horovod.checks import SHAPES, check_same, describe
from spark_dl.compat.horovod.compression import Compression, for_tensor, is_none
from spark_dl.compat.horovod.compression import resolve as resolve_compression
from spark_dl.compat.horovod.exceptions import CollectiveError
from spark_dl.compat.horovod.handles import CallableHandle, begin, deferred
from spark_dl.compat.horovod.ops import (
    AllreduceFunction,
    allgather,
    allgather_parts,
    check_layouts,
    follower,
    fused_inplace,
    gather_counts,
    gather_rows,
    on_comm_device,
    reduce_fields,
    reduce_into,
    resolve_op,
    scale_,
    tensor_layout,
    to_wire,
    with_name,
)
from spark_dl.compat.horovod.process_sets import ProcessSet, global_process_set, group_of
from spark_dl.compat.horovod.process_sets import resolve as resolve_set
from spark_dl.compat.horovod.state import check
from spark_dl.compression import FP16


def _splits_list(splits: Any, rows: int, world: int) -> list[int]:
    if splits is None:
        if rows % world:
            raise ValueError(
                f"alltoall without splits divides dimension 0 equally among the {world} ranks, but it "
                f"has {rows} rows: pass splits=[rows for rank 0, rank 1, ...] summing to {rows}."
            )
        return [rows // world] * world
    values = splits.tolist() if torch.is_tensor(splits) else list(splits)
    if (torch.is_tensor(splits) and (splits.is_floating_point() or splits.is_complex())) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"alltoall splits must be integers (row counts), got {splits!r}")
    out = [int(v) for v in values]
    if len(out) != world or any(s < 0 for s in out) or sum(out) != rows:
        raise ValueError(
            f"alltoall splits must be {world} non-negative row counts (one per rank) summing to "
            f"dimension 0 ({rows}); got {out}."
        )
    return out


def _alltoall(tensor: torch.Tensor, splits: list[int], ps: ProcessSet) -> tuple[torch.Tensor, list[int]]:
    """Exchange the row counts, then the rows; returns (received rows, rows from each rank).
    Each count travels with the sender's layout, so every rank checks every rank's at no extra
    cost: Gloo aborts a rank whose rows are longer than another's, or mixes dtypes into garbage."""
    x = to_wire(on_comm_device(tensor.detach()).contiguous())
    rest = tensor_layout(tensor)[1:]
    sent = torch.tensor([[n] + rest for n in splits], dtype=torch.int64, device=x.device)
    got = torch.empty_like(sent)
    group = group_of(ps)
    dist.all_to_all_single(got, sent, group=group)
    layouts = got.tolist()
    check_layouts("alltoall", layouts, ps)
    received = [lay[0] for lay in layouts]
    out = x.new_empty((sum(received),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=received, input_split_sizes=splits, group=group)
    return out.to(device=tensor.device, dtype=tensor.dtype), received


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, ps):
        out, received = _alltoall(tensor, splits, ps)
        ctx.received, ctx.ps = received, ps
        return out, torch.tensor(received, dtype=torch.int32)

    @staticmethod
    def backward(ctx, grad, _splits_grad):
        # the rows went from splits to received; their gradients go the other way
        return _alltoall(grad, ctx.received, ctx.ps)[0], None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` consecutive rows of ``tensor`` (dimension 0) to rank r and return the
    rows every rank sent here, in rank order. Without ``splits`` the rows are divided equally.

    Returns the received tensor, or, when ``splits`` is given, ``(tensor, received_splits)``
    with the int32 row counts that came from each rank, as Horovod does. Ranks may send
    different numbers of rows; the other dimensions must agree.
    """
    begin()
    ps = resolve_set(process_set)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension (it slices dimension 0)")
    split_list = _splits_list(splits, tensor.shape[0], ps.size())
    check_same("alltoall", ps, with_name({}, name))
    out, received = _Alltoall.apply(tensor, split_list, ps)
    return out if splits is None else (out, received)


def _reducescatter(tensor: torch.Tensor, op: ReduceOp, half: bool, prescale: float,
                   postscale: float, ps: ProcessSet) -> torch.Tensor:
    world, me = ps.size(), ps.rank()
    x = on_comm_device(tensor.detach())
    if prescale != 1.0:
        x = scale_(x.clone(), prescale)
    n = x.shape[0]
    rows = [n // world + (1 if r < n % world else 0) for r in range(world)]  # torch.tensor_split's cut
    wire = x.to(torch.float16) if half else to_wire(x)
    mine = rows[me]
    got = wire.new_empty((world * mine,) + tuple(x.shape[1:]))
    # every rank sends each rank that rank's slice and receives W copies of its own: the
    # reduction is then local, and each rank sends (W - 1) / W of the tensor, as a ring would
    dist.all_to_all_single(got, wire.contiguous(), output_split_sizes=[mine] * world, input_split_sizes=rows,
                           group=group_of(ps))
    parts = got.view((world, mine) + tuple(x.shape[1:])).to(x.dtype)
    if op in (Average, Sum):
        out = parts.sum(0, dtype=x.dtype)  # torch sums small integers and bools into int64
        if op == Average:
            out = out / world if out.is_floating_point() else torch.div(out, world, rounding_mode="trunc")
    elif op == ReduceOp.Min:
        out = parts.amin(0)
    elif op == ReduceOp.Max:
        out = parts.amax(0)
    else:
        out = parts.prod(0)
    if postscale != 1.0:
        out = scale_(out, postscale)
    return out.to(tensor.device)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, half, prescale, postscale, ps):
        ctx.args = (op, prescale, postscale, ps)
        return _reducescatter(tensor, op, half, prescale, postscale, ps)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, ps = ctx.args
        if op not in (Average, Sum):
            raise RuntimeError(f"reducescatter with op={op.name} has no gradient (Horovod defines Average and Sum)")
        full = torch.cat(allgather_parts(grad, ps)).to(grad.device)
        # Horovod's rule: the slices' gradients gathered, times the set's size for Sum (not divided
        # by it for Average), times both scale factors
        scale = prescale * postscale * (ps.size() if op == Sum else 1)
        return full * scale if scale != 1.0 else full, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (``op``: Average by default, Sum, Min, Max, Product) and
    return this rank's slice of the result along dimension 0: rank r gets the r-th of
    ``torch.tensor_split(result, size())`` (the first ``rows % size`` ranks one row more; with
    ``process_set``, r is the position in the set and size its size).

    ``compression``: ``Compression.none`` or ``Compression.fp16`` (slices travel as float16 and
    are reduced in the tensor's dtype). Differentiable for Average and Sum.
    """
    begin()
    op = resolve_op(op)
    ps = resolve_set(process_set)
    compressor = resolve_compression(compression, per_call=True)
    half = _half(tensor, op, compressor)
    check_same("reducescatter", ps, reduce_fields(tensor, op, compressor, prescale_factor, postscale_factor, name))
    return _Reducescatter.apply(tensor, op, half, prescale_factor, postscale_factor, ps)


def _half(tensor: torch.Tensor, op: ReduceOp, compressor: Any) -> bool:
    """Refuse what reducescatter cannot do; whether ``tensor``'s slices travel as float16."""
    if op == Adasum:
        raise CollectiveError("reducescatter does not take op=hvd.Adasum (nor does Horovod's): use Average or Sum")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension (it slices dimension 0)")
    compressor = for_tensor(compressor, tensor)
    half = not is_none(compressor)
    if half and not isinstance(compressor, FP16):
        raise ValueError("reducescatter takes compression=hvd.Compression.none or hvd.Compression.fp16")
    return half


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`~spark_dl.horovod.allreduce` of every tensor in ``tensors`` as one operation:
    tensors of one dtype and device travel fused in a single collective. Returns new tensors;
    differentiable (then each tensor is reduced on its own, as the autograd graph needs, so every
    rank's tensors must require grad, or none's)."""
    begin()
    op = resolve_op(op, average)
    ps = resolve_set(process_set)
    compressor = resolve_compression(compression, per_call=True)
    tensors = list(tensors)
    _check_items(tensors, "grouped_allreduce")
    differentiable = any(t.requires_grad for t in tensors)
    check_same("grouped_allreduce", ps,
               {**reduce_fields(tensors, op, compressor, prescale_factor, postscale_factor, name),
                "requires_grad": str(differentiable)},
               follow=follower(tensors, op, compressor, fused=not differentiable))
    if differentiable:
        return [AllreduceFunction.apply(t, op, None if name is None else f"{name}.{i}", compressor, prescale_factor,
                                        postscale_factor, ps)
                for i, t in enumerate(tensors)]
    outs = [t.detach().clone() for t in tensors]
    _fused_reduce(outs, op, name, compressor, prescale_factor, postscale_factor, ps)
    return outs


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       compression: Any = Compression.none, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`: one fused collective per dtype and device; returns
    ``tensors``."""
    begin()
    op = resolve_op(op, average)
    ps = resolve_set(process_set)
    compressor = resolve_compression(compression, per_call=True)
    tensors = list(tensors)
    _check_items(tensors, "grouped_allreduce")
    check_same("grouped_allreduce", ps,
               {**reduce_fields(tensors, op, compressor, prescale_factor, postscale_factor, name),
                "requires_grad": "False"},
               follow=follower(tensors, op, compressor, fused=True))
    _fused_reduce(tensors, op, name, compressor, prescale_factor, postscale_factor, ps)
    return tensors


def _fused_reduce(tensors: list[torch.Tensor], op: ReduceOp, name: str | None, compressor: Any,
                  prescale_factor: float, postscale_factor: float, ps: ProcessSet) -> None:
    def reduce(j: int, flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        key = None if name is None else f"{name}.group{j}"
        return reduce_into(flat, op, key, compressor, prescale_factor, postscale_factor, sizes, ps)

    fused_inplace(tensors, reduce)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`~spark_dl.horovod.allgather` of every tensor in ``tensors``, in order (first
    dimensions may differ between ranks); returns the gathered tensors. Differentiable."""
    begin()
    tensors = _tensor_list(tensors, "grouped_allgather")
    return [allgather(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`reducescatter` of every tensor in ``tensors``, in order; returns this rank's slice
    of each. Differentiable for Average and Sum."""
    begin()
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    op = resolve_op(op)
    ps = resolve_set(process_set)
    compressor = resolve_compression(compression, per_call=True)
    halves = [_half(t, op, compressor) for t in tensors]
    check_same("grouped_reducescatter", ps,
               reduce_fields(tensors, op, compressor, prescale_factor, postscale_factor, name))
    return [_Reducescatter.apply(t, op, half, prescale_factor, postscale_factor, ps)
            for t, half in zip(tensors, halves)]


def sparse_sum(tensor: torch.Tensor, group: Any, average: bool) -> torch.Tensor:
    """Every member of ``group``'s sparse COO ``tensor`` gathered (indices and values; ranks may
    have different numbers of entries) and summed where entries coincide, or averaged: only the
    entries travel, not the dense size. Returns a coalesced sparse tensor on ``tensor``'s device."""
    world = dist.get_world_size(group)
    t = tensor.coalesce()
    counts = gather_counts(t._nnz(), group)  # once, for the indices and the values
    indices = torch.cat(gather_rows(t.indices().t(), counts, group)).t()
    values = torch.cat(gather_rows(t.values(), counts, group))
    out = torch.sparse_coo_tensor(indices.to(tensor.device), values.to(tensor.device), tensor.shape).coalesce()
    if average:
        out = out / world if out.is_floating_point() else torch.sparse_coo_tensor(
            out.indices(), torch.div(out.values(), world, rounding_mode="trunc"), out.shape)
    return out


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                           process_set: ProcessSet = global_process_set) -> CallableHandle:
    """Start an all-reduce of a sparse COO tensor (``nn.Embedding(sparse=True)``'s gradient, say):
    ``handle()`` (or ``synchronize(handle)``) returns the coalesced sparse sum (``op=Sum``) or
    average of every rank's tensor. Only the entries travel (an allgather of indices and values), as in Horovod."""
    check()
    ps = resolve_set(process_set)
    op = resolve_op(op)
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async takes a sparse COO tensor (tensor.is_sparse); use allreduce "
                         "for dense tensors")
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, got {op.name}")
    # the entries' counts travel anyway, but not the dense size, the dtype nor the op: unchecked,
    # another dtype's values are garbage and another op mixes sums with averages
    def reduce() -> torch.Tensor:
        check_same("sparse_allreduce_async", ps, with_name({SHAPES: describe(tensor), "op": op.name}, name))
        return sparse_sum(tensor.detach(), group_of(ps), average=op == Average)

    # Horovod's handle for it is a function returning the result; this one works with synchronize() too
    return CallableHandle(deferred(name, reduce))


def _check_items(tensors: Any, who: str) -> None:
    for t in tensors:
        if not torch.is_tensor(t):
            raise TypeError(f"{who} takes a list of tensors, got a {type(t).__name__}")


def _tensor_list(tensors: Any, who: str) -> list[torch.Tensor]:
    if torch.is_tensor(tensors):
        raise TypeError(f"{who} takes a list of tensors, got one tensor: wrap it in a list")
    tensors = list(tensors)
    _check_items(tensors, who)
    return tensors


# ---- asynchronous forms -------------------------------------------------------------------------
# Handles for poll()/synchronize() like Horovod's. Each runs to completion when it starts (the row
# counts must be exchanged before the rows can be); see .handles for when that is.

def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an :func:`alltoall`; ``synchronize(handle)`` returns what :func:`alltoall` would
    (``(tensor, received_splits)`` when ``splits`` is given)."""
    check()
    return deferred(name, lambda: alltoall(tensor.detach(), splits, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                        op: Any = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> int:
    """Start a :func:`reducescatter`; ``synchronize(handle)`` returns this rank's slice."""
    check()
    return deferred(name, lambda: reducescatter(tensor.detach(), name, compression, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            compression: Any = Compression.none, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start a :func:`grouped_allreduce`; ``synchronize(handle)`` returns the list of results."""
    check()
    tensors = [t.detach() for t in tensors]
    return deferred(name, lambda: grouped_allreduce(tensors, average, name, compression, op, prescale_factor,
                                                    postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             compression: Any = Compression.none, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start a :func:`grouped_allreduce_`; ``synchronize(handle)`` returns ``tensors``, reduced."""
    check()
    return deferred(name, lambda: grouped_allreduce_(tensors, average, name, compression, op, prescale_factor,
                                                     postscale_factor, process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start a :func:`grouped_allgather`; ``synchronize(handle)`` returns the gathered tensors."""
    check()
    tensors = [t.detach() for t in tensors]
    return deferred(name, lambda: grouped_allgather(tensors, name, process_set))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                compression: Any = Compression.none, op: Any = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> int:
    """Start a :func:`grouped_reducescatter`; ``synchronize(handle)`` returns this rank's slices."""
    check()
    tensors = [t.detach() for t in tensors]
    return deferred(name, lambda: grouped_reducescatter(tensors, name, compression, op, prescale_factor,
                                                        postscale_factor, process_set))
