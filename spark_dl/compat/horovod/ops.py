"""Horovod's tensor collectives (``allreduce``, ``allgather``, ``broadcast`` and their variants).

Each maps onto one or two ``torch.distributed`` calls on the default group, after a check that
every rank passes the same shapes, dtypes and arguments (:mod:`.checks`). Unlike Horovod,
collectives are matched across ranks by call order, not by ``name``: every rank must issue the
same collectives in the same order (``name`` still keys compressor state such as error feedback).
The out-of-place forms are differentiable, as in Horovod.
"""
from __future__ import annotations

import warnings
import zlib
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from spark_dl.compat.horovod import adasum, joining
from spark_dl.compat.horovod.basics import Adasum, Average, ReduceOp, Sum, rank
from spark_dl.compat.horovod.checks import ALL_SHAPES, SHAPES, check_same, describe, setting
from spark_dl.compat.horovod.checks import enabled as checks_enabled
from spark_dl.compat.horovod.checks import follow as follow_collectives
from spark_dl.compat.horovod.compression import Compression, for_tensor, is_cast, is_none
from spark_dl.compat.horovod.compression import reduce as reduce_compressed
from spark_dl.compat.horovod.compression import resolve as resolve_compression
from spark_dl.compat.horovod.exceptions import CollectiveError
from spark_dl.compat.horovod.handles import begin, deferred, submit, synchronize
from spark_dl.compat.horovod.process_sets import ProcessSet, check_root, global_process_set, group_of
from spark_dl.compat.horovod.process_sets import resolve as resolve_set
from spark_dl.compat.horovod.state import check
from spark_dl.rank import works
from spark_dl.rank.tensors import comm_device

_TORCH_OPS = {
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


def resolve_op(op: Any, average: bool | None = None) -> ReduceOp:
    """Horovod's rules: ``op`` wins, ``average`` is the deprecated spelling, default Average."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn("average= is deprecated, use op=hvd.Average or op=hvd.Sum", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else ReduceOp(op)


def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy in a dtype Gloo carries: it has no int16 (``Invalid scalar type``),
    whose values int32 holds exactly."""
    return tensor.to(torch.int32) if tensor.dtype == torch.int16 else tensor


def on_comm_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` where this rank's collectives run (itself when it is there already)."""
    dev = comm_device()
    return tensor if tensor.device == dev else tensor.to(dev)


def fused_inplace(tensors: list[torch.Tensor], run: Callable[..., torch.Tensor]) -> None:
    """Run one collective per dtype and device over ``tensors`` fused into a flat buffer on the
    comm device (groups in first-seen order, the same on every rank), and copy the result back
    into each tensor. ``run(j, flat, sizes)`` does group j's collective and returns the result;
    ``sizes`` are the numels of the tensors packed in ``flat``."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for j, group in enumerate(groups.values()):
            flat = run(j, on_comm_device(torch.cat([t.detach().reshape(-1) for t in group])),
                       [t.numel() for t in group])
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def scale_(tensor: torch.Tensor, factor: Any) -> torch.Tensor:
    """Multiply ``tensor`` by ``factor`` in place, as Horovod scales: integers in float64 and
    truncated back, float16/bfloat16 in float32."""
    if tensor.is_floating_point() and tensor.element_size() >= 4 or tensor.is_complex():
        return tensor.mul_(factor)
    wide = torch.float64 if not tensor.is_floating_point() else torch.float32
    return tensor.copy_(tensor.to(wide) * float(factor))


def reduce_into(work: torch.Tensor, op: ReduceOp, name: str | None, compressor: Any,
                 prescale_factor: float, postscale_factor: float,
                 sizes: list[int] | None = None, ps: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``work`` (a private buffer on the comm device; may be modified) over ``ps``.
    Returns the result. ``sizes``: the tensors fused in ``work``, for Adasum's per-tensor
    coefficients."""
    wire = to_wire(work)
    if wire is not work:
        return reduce_into(wire, op, name, compressor, prescale_factor, postscale_factor, sizes, ps).to(work.dtype)
    compressor = for_tensor(compressor, work)
    if prescale_factor != 1.0:
        scale_(work, prescale_factor)
    if op == Adasum:
        if not is_none(compressor):
            raise ValueError("op=hvd.Adasum combines full-precision tensors: pass compression=hvd.Compression.none")
        work = adasum.allreduce(work.reshape(-1), sizes, group_of(ps)).view_as(work)
    elif op in (Average, Sum):
        work = reduce_compressed(work, compressor, average=op == Average, name=name, group=group_of(ps))
    elif is_cast(compressor):  # Min, Max, Product of the cast tensor, as Horovod's fp16 does
        wire = work.to(compressor.wire_dtype)
        dist.all_reduce(wire, op=_TORCH_OPS[op], group=group_of(ps))
        work.copy_(wire)
    else:
        if not is_none(compressor):
            raise ValueError(f"compression is only supported with op=Average or Sum (or fp16/bf16 with any op), "
                             f"not {op.name}")
        dist.all_reduce(work, op=_TORCH_OPS[op], group=group_of(ps))
    if postscale_factor != 1.0:
        scale_(work, postscale_factor)
    return work


def _allreduce_copy(tensor: torch.Tensor, op: ReduceOp, name: str | None, compressor: Any,
                    prescale_factor: float, postscale_factor: float,
                    ps: ProcessSet = global_process_set) -> torch.Tensor:
    work = on_comm_device(tensor.detach()).clone()
    out = reduce_into(work, op, name, compressor, prescale_factor, postscale_factor, ps=ps)
    return out.to(tensor.device)


class AllreduceFunction(torch.autograd.Function):
    """The differentiable all-reduce behind :func:`allreduce`: ``apply(tensor, op, name,
    compressor, prescale_factor, postscale_factor, ps)``, unchecked; the gradient is reduced
    with the same op and scale factors."""

    @staticmethod
    def forward(ctx, tensor, op, name, compressor, prescale_factor, postscale_factor, ps):
        ctx.args = (op, prescale_factor, postscale_factor, ps)
        return _allreduce_copy(tensor, op, name, compressor, prescale_factor, postscale_factor, ps)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        return _allreduce_copy(grad, op, None, Compression.none, pre, post, ps), None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Average (default) or combine ``tensor`` over all ranks (or ``process_set``'s); returns a
    new tensor.

    ``op`` is ``Average``, ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``. The result is
    ``postscale_factor * op(prescale_factor * tensor)``. ``compression`` applies to Average/Sum.
    The input is not modified; gradients flow back through an all-reduce with the same op.
    """
    begin()
    op = resolve_op(op, average)
    ps = resolve_set(process_set)
    compressor = resolve_compression(compression, per_call=True)
    check_same("allreduce", ps, reduce_fields(tensor, op, compressor, prescale_factor, postscale_factor, name),
               follow=follower([tensor], op, compressor))
    return AllreduceFunction.apply(tensor, op, name, compressor, prescale_factor, postscale_factor, ps)


def reduce_fields(tensors: torch.Tensor | list[torch.Tensor], op: ReduceOp, compressor: Any,
                  prescale_factor: Any = 1.0, postscale_factor: Any = 1.0, name: str | None = None) -> dict[str, str]:
    """What every rank's reduction of ``tensors`` (one, or a group) must agree on, for
    :func:`~.checks.check_same`: the compressor with its settings (``QSGD(levels=7, ...)``), the
    scale factors (ranks scaling differently would sum numbers of different meanings) and the name."""
    fields = {SHAPES if torch.is_tensor(tensors) else ALL_SHAPES: describe(tensors), "op": op.name,
              "compression": setting(compressor), "prescale_factor": setting(prescale_factor),
              "postscale_factor": setting(postscale_factor)}
    return with_name(fields, name)


def with_name(fields: dict[str, str], name: str | None) -> dict[str, str]:
    """``fields`` with the collective's ``name``, when given (ranks naming an op differently would
    wait for each other forever in Horovod; here they are told)."""
    return fields if name is None else {**fields, "name": repr(name)}


def follower(tensors: list[torch.Tensor], op: ReduceOp, compressor: Any, fused: bool = False) -> Any:
    """How a rank in ``join()`` takes part in this all-reduce (:func:`.checks.check_same`'s
    ``follow``): None where it cannot (Adasum, compressors other than a cast)."""
    if op == Adasum or not (is_none(compressor) or is_cast(compressor)):
        return None
    return partial(follow_reduce, [(tuple(t.shape), t.dtype) for t in tensors], op, compressor, fused)


def follow_reduce(specs: list[tuple[tuple[int, ...], torch.dtype]], op: ReduceOp, compressor: Any,
                  fused: bool) -> None:
    """A joined rank's part in the others' all-reduce of tensors like ``specs``: the same
    collectives, with zeros."""
    zeros = [torch.zeros(shape, dtype=dtype, device=comm_device()) for shape, dtype in specs]
    if fused:
        fused_inplace(zeros, lambda _j, flat, sizes: reduce_into(flat, op, None, compressor, 1.0, 1.0, sizes))
    else:
        for z in zeros:
            reduce_into(z, op, None, compressor, 1.0, 1.0)


def follow_async_reduce(shape: tuple[int, ...], dtype: torch.dtype, op: ReduceOp) -> None:
    """A joined rank's part in the others' ``allreduce_async``: the same all-reduce, with zeros."""
    torch_op = dist.ReduceOp.SUM if op in (Average, Sum) else _TORCH_OPS[op]
    dist.all_reduce(to_wire(torch.zeros(shape, dtype=dtype, device=comm_device())), op=torch_op)


def sum_unchecked(tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable sum of ``tensor`` over all ranks without :func:`~.checks.check_same`: for
    per-step reductions whose layout is the model's (``SyncBatchNorm``'s statistics)."""
    return AllreduceFunction.apply(tensor, Sum, None, Compression.none, 1.0, 1.0, resolve_set(global_process_set))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's (or ``process_set`` member's) ``tensor`` along dimension 0, in
    rank order.

    Shapes must agree except for the first dimension, which may differ between ranks.
    """
    begin()
    return _Allgather.apply(tensor, name, resolve_set(process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a copy of ``root_rank``'s ``tensor`` on every rank (of ``process_set``; ``root_rank``
    is a global rank); the input is not modified."""
    begin()
    return _Broadcast.apply(tensor, root_rank, name, resolve_set(process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s value, in place; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of ``process_set``) reaches this call. Async ops submitted before it
    need not have started (as in Horovod, where they are matched by name, not order)."""
    check()
    ps = resolve_set(process_set)
    check_same("barrier", ps, {})
    dist.barrier(group=group_of(ps))


def join(device: int = -1) -> int:
    """Mark this rank as out of data: until every rank has joined, take part in the other ranks'
    all-reduces (``allreduce``, ``grouped_allreduce`` and their async forms) and
    ``DistributedOptimizer`` steps with zeros (other collectives are refused meanwhile, as in
    Horovod). Returns the rank that joined last, the same on every rank; see
    :func:`.joining.join` for the optimizers' part. ``device`` is accepted for Horovod's signature.
    """
    begin()
    follow = partial(follow_collectives, global_process_set) if checks_enabled() else None
    return joining.join(device, follow=follow)


# ---- asynchronous forms: a handle now, the result from synchronize(handle) (see .handles) ------

def _async_reduce(tensor: torch.Tensor, output: torch.Tensor, op: ReduceOp, name: str | None,
                  prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> int:
    check()
    ps = resolve_set(process_set)
    fields = reduce_fields(tensor, op, Compression.none, prescale_factor, postscale_factor, name)
    if op == Adasum:
        # point-to-point rounds, each depending on the last: done when it starts
        def adasum_now() -> torch.Tensor:
            check_same("allreduce", ps, fields)
            result = _allreduce_copy(tensor, op, name, Compression.none, prescale_factor, postscale_factor, ps)
            with torch.no_grad():
                output.copy_(result)
            return output

        return deferred(name, adasum_now)

    def start() -> tuple[Any, Callable[[], torch.Tensor]]:
        check_same("allreduce", ps, fields, follow=partial(follow_async_reduce, tuple(tensor.shape), tensor.dtype, op))
        inplace_ok = output is tensor and tensor.device == comm_device() and tensor.is_contiguous()
        work_t = tensor if inplace_ok else on_comm_device(tensor.detach()).clone()
        if prescale_factor != 1.0:
            scale_(work_t, prescale_factor)
        # floating point averages divide before the sum, as allreduce() does: the same numbers
        # travel, so a rank calling one form meets a rank calling the other
        floating = work_t.is_floating_point() or work_t.is_complex()
        if op == Average and floating:
            work_t.div_(ps.size())
        torch_op = dist.ReduceOp.SUM if op in (Average, Sum) else _TORCH_OPS[op]
        sent = to_wire(work_t)
        work = works.hold(dist.all_reduce(sent, op=torch_op, async_op=True, group=group_of(ps)))

        def finish() -> torch.Tensor:
            if sent is not work_t:
                work_t.copy_(sent)
            if op == Average and not floating:
                work_t.copy_(torch.div(work_t, ps.size(), rounding_mode="trunc"))
            if postscale_factor != 1.0:
                scale_(work_t, postscale_factor)
            if work_t is not output:
                with torch.no_grad():
                    output.copy_(work_t)
            return output

        return work, finish

    return submit(name, start)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an out-of-place :func:`allreduce`; the result comes from ``synchronize(handle)``."""
    op = resolve_op(op, average)
    return _async_reduce(tensor, torch.empty_like(tensor), op, name, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place :func:`allreduce_`; ``synchronize(handle)`` returns ``tensor``."""
    op = resolve_op(op, average)
    return _async_reduce(tensor, tensor, op, name, prescale_factor, postscale_factor, process_set)


def _async_broadcast(tensor: torch.Tensor, output: torch.Tensor, root_rank: int, name: str | None,
                     process_set: ProcessSet) -> int:
    check()
    ps = resolve_set(process_set)
    check_root(ps, root_rank)

    def start() -> tuple[Any, Callable[[], torch.Tensor]]:
        check_same("broadcast", ps, with_name({SHAPES: describe(tensor), "root_rank": str(root_rank)}, name))
        inplace_ok = output is tensor and tensor.device == comm_device() and tensor.is_contiguous()
        work_t = tensor if inplace_ok else on_comm_device(tensor.detach()).clone()
        sent = to_wire(work_t)
        work = works.hold(dist.broadcast(sent, src=root_rank, async_op=True, group=group_of(ps)))

        def finish() -> torch.Tensor:
            if sent is not work_t:
                work_t.copy_(sent)
            if work_t is not output:
                with torch.no_grad():
                    output.copy_(work_t)
            return output

        return work, finish

    return submit(name, start)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an out-of-place :func:`broadcast`."""
    return _async_broadcast(tensor, torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place :func:`broadcast_`."""
    return _async_broadcast(tensor, tensor, root_rank, name, process_set)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an :func:`allgather`; ``synchronize(handle)`` returns the gathered tensor."""
    check()
    ps = resolve_set(process_set)
    return deferred(name, lambda: _allgather_sync(tensor, ps, name))


# ---- allgather / broadcast with gradients -------------------------------------------------------

def gather_ints(values: list[int], group: Any) -> list[list[int]]:
    """Every member of ``group``'s ``values`` (as many on each), in rank order."""
    mine = torch.tensor(values, dtype=torch.int64, device=comm_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [e.tolist() for e in every]


def gather_counts(n: int, group: Any) -> list[int]:
    """Every member of ``group``'s ``n``, in rank order."""
    return [v[0] for v in gather_ints([n], group)]


def gather_rows(tensor: torch.Tensor, counts: list[int], group: Any) -> list[torch.Tensor]:
    """Every member's ``tensor`` (``counts[r]`` rows from rank r, the other dimensions equal), in
    rank order, on the comm device."""
    t = to_wire(on_comm_device(tensor.detach()).contiguous())
    longest = max(counts)
    if t.shape[0] < longest:
        # torch.distributed gathers equal shapes only: pad, then trim each rank's part.
        t = torch.cat([t, t.new_zeros((longest - t.shape[0],) + tuple(t.shape[1:]))])
    parts = [torch.empty_like(t) for _ in counts]
    dist.all_gather(parts, t, group=group)
    return [p[:n].to(tensor.dtype) for p, n in zip(parts, counts)]


_LAYOUT_DIMS = 8  # the other dimensions sent as they are; a tensor with more sends their hash


def tensor_layout(tensor: torch.Tensor) -> list[int]:
    """[rows, dtype, ndim, other dimensions...], a fixed length whatever the tensor."""
    rest = list(tensor.shape[1:])
    if len(rest) > _LAYOUT_DIMS:
        rest = [zlib.crc32(repr(rest).encode())]
    padding = [0] * (_LAYOUT_DIMS - len(rest))
    return [tensor.shape[0], zlib.crc32(str(tensor.dtype).encode()), tensor.dim()] + rest + padding


def _describe_layout(layout: list[int]) -> str:
    names = {zlib.crc32(str(d).encode()): str(d).removeprefix("torch.")
             for d in vars(torch).values() if isinstance(d, torch.dtype)}
    ndim = layout[2]
    rest = layout[3:3 + ndim - 1] if ndim - 1 <= _LAYOUT_DIMS else ["..."]
    return f"{names.get(layout[1], 'dtype?')} [{', '.join(map(str, ['rows'] + rest))}]"


def allgather_parts(tensor: torch.Tensor, ps: ProcessSet = global_process_set, name: str | None = None,
                    collective: str = "allgather") -> list[torch.Tensor]:
    """Every rank's (of ``ps``) ``tensor`` (first dimensions may differ), in rank order, on the
    comm device."""
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension (it concatenates along dim 0)")
    check_same(collective, ps, with_name({}, name))
    group = group_of(ps)
    # The row counts travel with the rest of the layout, so a mismatch costs no extra collective:
    # torch would gather mismatched tensors into garbage or break the connection (Horovod refuses).
    layouts = gather_ints(tensor_layout(tensor), group)
    check_layouts("allgather", layouts, ps)
    return gather_rows(tensor, [lay[0] for lay in layouts], group)


def check_layouts(who: str, layouts: list[list[int]], ps: ProcessSet) -> None:
    """Raise unless every member's layout (``tensor_layout``'s, one per member of ``ps`` in rank
    order) is the same but for the rows."""
    if any(lay[1:] != layouts[0][1:] for lay in layouts):
        members = ps.ranks or range(len(layouts))
        raise CollectiveError(
            f"{who}: every rank must pass the same dtype and the same sizes of every dimension but the first, "
            "got " + ", ".join(f"rank {r}: {_describe_layout(lay)}" for r, lay in zip(members, layouts))
        )


def _allgather_sync(tensor: torch.Tensor, ps: ProcessSet = global_process_set, name: str | None = None) -> torch.Tensor:
    return torch.cat(allgather_parts(tensor, ps, name)).to(tensor.device)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):
        ctx.rows = tensor.shape[0] if tensor.dim() else 0
        ctx.ps = ps
        return _allgather_sync(tensor, ps, name)

    @staticmethod
    def backward(ctx, grad):
        # Horovod's rule: the ranks' output gradients are averaged, then each takes its rows
        averaged = _allreduce_copy(grad, Average, None, Compression.none, 1.0, 1.0, ctx.ps)
        offset = sum(gather_counts(ctx.rows, group_of(ctx.ps))[: ctx.ps.rank()])
        return averaged.narrow(0, offset, ctx.rows), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root_rank, ctx.ps = root_rank, ps
        return synchronize(broadcast_async(tensor, root_rank, name, ps))

    @staticmethod
    def backward(ctx, grad):
        # Horovod's rule: the root gets the average of the ranks' output gradients, the others zeros
        averaged = _allreduce_copy(grad, Average, None, Compression.none, 1.0, 1.0, ctx.ps)
        if rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None
