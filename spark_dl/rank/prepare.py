"""Ray Train's helpers for a training function: the rank's device, a model wrapped for data
parallelism, and a ``DataLoader`` sharded across the ranks.

``prepare_data_loader`` goes one step further than Ray's: the sampler's epoch advances on every
pass over the loader, so each epoch is shuffled differently without ``sampler.set_epoch`` calls
(calling it still works, and wins).
"""
from __future__ import annotations

from typing import Any

from spark_dl.rank.context import cuda_index, get_context, init
from spark_dl.rank.tensors import map_tensors

PARALLEL_STRATEGIES = ("ddp", None)


def get_device():
    """This rank's ``torch.device``: its own GPU (the one :func:`spark_dl.init` binds) or the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", cuda_index())
    return torch.device("cpu")


def get_devices() -> list:
    """Ray's ``get_devices()``: this rank's devices (one, :func:`get_device`)."""
    return [get_device()]


def enable_reproducibility(seed: int = 0) -> None:
    """Ray's ``enable_reproducibility``: seed Python's, NumPy's and torch's generators with ``seed``
    and make torch choose deterministic algorithms (cuDNN autotuning off, cuBLAS's workspace fixed),
    at some cost in speed. Call it first in the training function."""
    import os
    import random

    import numpy as np
    import torch

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's documented requirement for determinism
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def prepare_model(model, *, move_to_device: bool = True, parallel_strategy: str | None = "ddp",
                  parallel_strategy_kwargs: dict[str, Any] | None = None):
    """Move ``model`` to this rank's device and wrap it in ``DistributedDataParallel``.

    Initialises the process group first if :func:`spark_dl.init` has not been called. With one
    rank, or ``parallel_strategy=None``, the model is returned unwrapped; a model already wrapped
    in DDP is returned as it is. ``parallel_strategy_kwargs`` go to DDP
    (``find_unused_parameters=True``, ``bucket_cap_mb=...``).
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if parallel_strategy not in PARALLEL_STRATEGIES:
        raise ValueError(
            f"parallel_strategy must be 'ddp' or None, got {parallel_strategy!r} (FSDP is not wrapped "
            "here: wrap the model yourself after spark_dl.init())"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        return model
    ctx = get_context()  # outside a rank: says so, before init would fail on a missing MASTER_ADDR
    init()
    device = get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy is None or ctx.world_size == 1:
        return model
    kwargs = dict(parallel_strategy_kwargs or {})
    if device.type == "cuda" and move_to_device:
        kwargs.setdefault("device_ids", [device.index])
    return DistributedDataParallel(model, **kwargs)


def prepare_data_loader(data_loader, *, add_dist_sampler: bool = True, move_to_device: bool = True):
    """Give this rank its share of ``data_loader``'s dataset, and its batches on its device.

    The loader is rebuilt with a ``DistributedSampler`` (shuffled if the loader was) and every
    other setting kept: batch size (per rank), workers, collate function, ``drop_last``. The
    result iterates like the loader; each pass is one epoch, shuffled with the sampler's epoch
    advanced by one (``loader.sampler.set_epoch(e)`` before a pass sets it instead, as after a
    restart). Refuses, naming the fix, an ``IterableDataset`` and samplers it cannot shard.
    """
    import torch
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        DistributedSampler,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
    )

    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"prepare_data_loader takes a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    ctx = get_context()
    loader = data_loader
    if add_dist_sampler and ctx.world_size > 1 and not isinstance(loader.sampler, DistributedSampler):
        if isinstance(loader.dataset, IterableDataset):
            raise ValueError(
                "an IterableDataset has no indices to share out between ranks: make each rank's iterator "
                "yield its own part (spark_dl.get_context().rank / .world_size) and pass add_dist_sampler=False"
            )
        if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
            raise ValueError(
                f"the loader's batch_sampler ({type(loader.batch_sampler).__name__}) decides the batches itself, "
                "so it cannot be sharded here: shard its indices per rank and pass add_dist_sampler=False"
            )
        if type(loader.sampler) not in (SequentialSampler, RandomSampler):
            raise ValueError(
                f"the loader's sampler ({type(loader.sampler).__name__}) cannot be sharded here: wrap it so each "
                "rank draws its own part, and pass add_dist_sampler=False"
            )
        sampler = DistributedSampler(
            loader.dataset, num_replicas=ctx.world_size, rank=ctx.rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
        )
        loader = DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
            timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
            prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
            persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
            **({"in_order": loader.in_order} if hasattr(loader, "in_order") else {}),
        )
    device = get_device() if move_to_device else None
    return ShardedLoader(loader, device if device is not None and device != torch.device("cpu") else None)


class ShardedLoader:
    """What :func:`prepare_data_loader` returns: the rebuilt loader, epochs advanced per pass,
    batches moved to the rank's device. Other attributes (``dataset``, ``sampler``,
    ``batch_size``) are the loader's."""

    def __init__(self, loader, device) -> None:
        self.loader = loader
        self.device = device
        self._next_epoch = 0
        self._epoch_set = getattr(loader.sampler, "epoch", None)  # what we last set: a change is the user's

    def __iter__(self):
        sampler = self.loader.sampler
        if hasattr(sampler, "set_epoch") and hasattr(sampler, "epoch"):
            if sampler.epoch != self._epoch_set:  # the user called sampler.set_epoch: follow them
                self._next_epoch = sampler.epoch
            sampler.set_epoch(self._next_epoch)
            self._epoch_set = self._next_epoch
            self._next_epoch += 1
        for batch in self.loader:
            yield batch if self.device is None else to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name == "loader":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def to_device(batch, device):
    """``batch`` with every tensor in it (in tuples, lists, dicts, named tuples) on ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
