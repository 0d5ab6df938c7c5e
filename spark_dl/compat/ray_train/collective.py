"""``ray.train.collective``: synchronising a TorchTrainer's workers without writing collectives.

``train.collective.barrier()`` and ``train.collective.broadcast_from_rank_zero(data)``, as in Ray,
over the run's process group (a Gloo twin of it under NCCL, so any picklable data works).
"""
from __future__ import annotations

from typing import Any

from spark_dl.compat.ray_train.session import current_worker

__all__ = ["barrier", "broadcast_from_rank_zero"]


def barrier() -> None:
    """Return once every worker has called it."""
    import torch.distributed as dist

    dist.barrier(group=current_worker().group)


def broadcast_from_rank_zero(data: Any) -> Any:
    """Rank 0's ``data`` on every worker (the others' ``data`` is ignored). Ray means it for small
    values (a few KB): a path, a flag, a seed; larger state belongs in a checkpoint."""
    import torch.distributed as dist

    box = [data]
    dist.broadcast_object_list(box, src=0, group=current_worker().group)
    return box[0]
