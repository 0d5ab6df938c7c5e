"""Whole-model helpers: broadcast parameters, optimizer state and arbitrary Python objects."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from ..tensors import comm_device, map_tensors
from .basics import _check, rank
from .ops import allgather_parts, fused_inplace
from .process_sets import ProcessSet, check_root, global_process_set, group_of
from .process_sets import resolve as resolve_set


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` in place with ``root_rank``'s values (on ``process_set``'s ranks).

    ``params`` is a ``state_dict()``, ``named_parameters()`` or ``parameters()`` (a list, a
    generator or a dict). Tensors are fused per dtype and device into one broadcast each.
    """
    _check()
    ps = resolve_set(process_set)
    check_root(ps, root_rank)
    if isinstance(params, Mapping):
        tensors = [t for _, t in sorted(params.items())]
    elif isinstance(params, Iterable):
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: pass a dict or an iterable of tensors")
    for t in tensors:
        if not torch.is_tensor(t):
            raise ValueError(f"broadcast_parameters got a {type(t).__name__}, expected tensors")

    def broadcast(_j: int, flat: torch.Tensor, _sizes: list[int]) -> torch.Tensor:
        dist.broadcast(flat, src=root_rank, group=group_of(ps))
        return flat

    fused_inplace(tensors, broadcast)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (of ``process_set``; serialized with cloudpickle)."""
    _check()
    ps = resolve_set(process_set)
    check_root(ps, root_rank)
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
    _check()
    ps = resolve_set(process_set)
    data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8).to(comm_device())
    return [cloudpickle.loads(part.cpu().numpy().tobytes()) for part in allgather_parts(data, ps)]


def _to_cpu(value: Any, copy: bool = False) -> Any:
    """``value`` (a state_dict, nested) with its tensors in host memory; ``copy``: always new
    tensors, never views of the live ones (a snapshot that later steps must not change)."""
    return map_tensors(value, lambda t: t.detach().to("cpu", copy=copy))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters (lr, momentum, ...) equal ``root_rank``'s.

    The whole ``state_dict()`` is sent, so any optimizer works (L-BFGS included). Tensors travel
    through host memory; ``load_state_dict`` moves them to each parameter's device.
    """
    state = broadcast_object(_to_cpu(optimizer.state_dict()), root_rank, process_set=process_set)
    if rank() != root_rank:
        optimizer.load_state_dict(state)
