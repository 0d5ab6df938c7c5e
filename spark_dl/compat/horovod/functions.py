"""Whole-model helpers: broadcast parameters, optimizer state and arbitrary Python objects."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from spark_dl.compat.horovod.basics import rank
from spark_dl.compat.horovod.checks import check_same, disagreement
from spark_dl.compat.horovod.exceptions import CollectiveError
from spark_dl.compat.horovod.handles import begin
from spark_dl.compat.horovod.ops import allgather_parts, fused_inplace, to_wire, with_name
from spark_dl.compat.horovod.process_sets import ProcessSet, check_root, global_process_set, group_of
from spark_dl.compat.horovod.process_sets import resolve as resolve_set
from spark_dl.rank.tensors import comm_device, map_tensors


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` in place with ``root_rank``'s values (on ``process_set``'s ranks).

    ``params`` is a ``state_dict()``, ``named_parameters()`` or ``parameters()`` (a list, a
    generator or a dict). Tensors are fused per dtype and device into one broadcast each. Every
    rank must pass the same names, shapes and dtypes in the same order (checked first: otherwise
    a ``ValueError`` on every rank names the first difference).
    """
    begin()
    ps = resolve_set(process_set)
    check_root(ps, root_rank)
    if isinstance(params, Mapping):
        named = [(repr(k), t) for k, t in sorted(params.items())]
    elif isinstance(params, Iterable):
        named = [(repr(p[0]), p[1]) if isinstance(p, tuple) else (f"tensor #{i}", p) for i, p in enumerate(params)]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: pass a dict or an iterable of tensors")
    for _, t in named:
        if not torch.is_tensor(t):
            raise ValueError(f"broadcast_parameters got a {type(t).__name__}, expected tensors")
    _check_same_tensors("broadcast_parameters", "tensors", named, root_rank, ps)
    tensors = [t for _, t in named]

    def broadcast(_j: int, flat: torch.Tensor, _sizes: list[int]) -> torch.Tensor:
        sent = to_wire(flat)
        dist.broadcast(sent, src=root_rank, group=group_of(ps))
        return sent.to(flat.dtype)

    fused_inplace(tensors, broadcast)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (of ``process_set``; serialized with cloudpickle)."""
    begin()
    ps = resolve_set(process_set)
    check_root(ps, root_rank)
    # unchecked, ranks naming different roots hang in the length's broadcast
    check_same("broadcast_object", ps, with_name({"root_rank": str(root_rank)}, name))
    group = group_of(ps)
    dev = comm_device()
    is_root = rank() == root_rank
    if is_root:
        data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8).to(dev)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(length, src=root_rank, group=group)
    if not is_root:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(data, src=root_rank, group=group)
    return obj if is_root else cloudpickle.loads(data.cpu().numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's (of ``process_set``) ``obj``, in rank order (serialized with cloudpickle)."""
    begin()
    ps = resolve_set(process_set)
    data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8).to(comm_device())
    return [cloudpickle.loads(part.cpu().numpy().tobytes())
            for part in allgather_parts(data, ps, name, collective="allgather_object")]


_SAME_MODEL = ("every rank must build the same model (a size such as a vocabulary or a number of classes, "
               "if computed from each rank's own data, differs between ranks: compute it on one rank and "
               "hvd.broadcast_object it to the others)")


def _check_same_tensors(who: str, noun: str, named: list[tuple[str, torch.Tensor]], root_rank: int,
                        ps: ProcessSet) -> None:
    """Raise on every member of ``ps`` unless all pass ``root_rank``'s labels, shapes and dtypes,
    in order. Mismatched broadcasts fail badly on Gloo: a shorter receiver aborts the job, a longer
    one silently keeps a prefix of the root's bytes, another dtype gets garbage, one more dtype
    (one more fused broadcast) hangs. Costs one all-reduce of five int64
    (:func:`.checks.disagreement`); the layouts themselves are gathered only to word the error."""
    layout = [(label, list(t.shape), str(t.dtype).removeprefix("torch.")) for label, t in named]
    layouts = disagreement(who, layout, ps)
    if layouts is None:
        return
    root = ps.ranks.index(root_rank)
    r = next(i for i, lay in enumerate(layouts) if lay != layouts[root])
    where = _first_difference(layouts[r], ps.ranks[r], layouts[root], root_rank)
    if len(layouts[r]) != len(layouts[root]):
        where = (f"rank {ps.ranks[r]} has {len(layouts[r])} {noun} but rank {root_rank} has "
                 f"{len(layouts[root])}, and {where}")
    raise CollectiveError(f"{who}: {where}: {_SAME_MODEL}")


def _first_difference(layout: list[tuple], r: int, root_layout: list[tuple], root: int) -> str:
    """The first entry where rank ``r``'s ``layout`` (label, shape, dtype) differs from rank ``root``'s."""
    def entry(e: tuple) -> str:
        return f"{e[0]} ({e[2]} {e[1]})"

    i = next((i for i, (a, b) in enumerate(zip(layout, root_layout)) if a != b), min(len(layout), len(root_layout)))
    labels, root_labels = [e[0] for e in layout], [e[0] for e in root_layout]
    if i == len(root_layout) or (i < len(layout) and layout[i][0] not in root_labels):
        return f"rank {r}'s {entry(layout[i])} is not among rank {root}'s"
    if i == len(layout) or root_layout[i][0] not in labels:
        return f"rank {root}'s {entry(root_layout[i])} is not among rank {r}'s"
    (label, shape, dtype), (root_label, root_shape, root_dtype) = layout[i], root_layout[i]
    if label != root_label:
        return f"rank {r} passes {label} where rank {root} passes {root_label} (the same names in another order)"
    return f"rank {r}'s {label} is {dtype} {shape} but rank {root}'s is {root_dtype} {root_shape}"


def to_cpu(value: Any, copy: bool = False) -> Any:
    """``value`` (a state_dict, nested) with its tensors in host memory; ``copy``: always new
    tensors, never views of the live ones (a snapshot that later steps must not change)."""
    return map_tensors(value, lambda t: t.detach().to("cpu", copy=copy))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters (lr, momentum, ...) equal ``root_rank``'s.

    The whole ``state_dict()`` is sent, so any optimizer works (L-BFGS included). Tensors travel
    through host memory; ``load_state_dict`` moves them to each parameter's device. Every rank's
    optimizer must hold parameters of the same shapes and dtypes, in the same groups (checked
    first: otherwise a ``ValueError`` on every rank names the first difference).
    """
    begin()
    ps = resolve_set(process_set)
    check_root(ps, root_rank)
    labelled = [(f"param_groups[{g}]['params'][{j}]", p)
                for g, group in enumerate(optimizer.param_groups) for j, p in enumerate(group["params"])]
    _check_same_tensors("broadcast_optimizer_state", "parameters", labelled, root_rank, ps)
    if not optimizer.state:
        # as Horovod, which initialises a fresh optimizer's state with a step on zero gradients,
        # leaves them: parameters that take gradients have one afterwards
        for _, p in labelled:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    state = broadcast_object(to_cpu(optimizer.state_dict()), root_rank, process_set=ps)
    if rank() != root_rank:
        optimizer.load_state_dict(state)
