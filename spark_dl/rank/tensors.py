"""One walk over nested containers of tensors (dicts, lists, tuples, named tuples), for the
state_dict snapshots of ``hvd`` and the batches ``prepare_data_loader`` moves to a device; and
the device the default process group's collectives take tensors on."""
from __future__ import annotations

from typing import Any, Callable


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn(t)`` in place of every tensor ``t`` in it; dicts come back as plain
    dicts, lists, tuples and named tuples as their own type; anything else as it is."""
    import torch

    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def comm_device() -> Any:
    """Device that tensors must live on for the default group's backend."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
