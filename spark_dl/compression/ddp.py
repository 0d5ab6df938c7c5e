"""A DDP communication hook that all-reduces each gradient bucket through a compressor.

    state, hook = make_ddp_hook(QSGD())
    ddp_model.register_comm_hook(state, hook)

Contract: the hook returns a completed ``torch.futures.Future`` holding the bucket's averaged
(``op="average"``) or summed gradients, identical on every rank. Per-bucket compressor state
(error feedback, PowerSGD's Q, step counters) is keyed ``"ddp.bucket<i>"`` (PowerSGD factors
each gradient of the bucket as its own matrix, as torch's ``powerSGD_hook`` does); when bucket i's
layout (its parameters' shapes) changes, as after DDP rebuilds its buckets following the first
iteration, that state is reset on every rank alike. The state pickles without its process group
(restored as the default group), so it can be checkpointed with the model.
"""
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .base import Compressor, as_compressor
from .collectives import OPS, allreduce
from .fp import NoneCompressor


@dataclass
class DDPHookState:
    """What the hook keeps between steps: the compressor (with its memories) and bucket layouts."""

    compressor: Compressor
    op: str = "average"
    process_group: Any = None
    layouts: dict[int, tuple] = field(default_factory=dict)
    resets: int = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["process_group"] = None  # a process group is a live connection, not data
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _layout(bucket: dist.GradBucket) -> tuple:
    return (bucket.buffer().numel(), tuple(tuple(p.shape) for p in bucket.parameters()))


def _shapes(bucket: dist.GradBucket) -> list[tuple[int, ...]] | None:
    """The gradients' shapes when they tile the buffer in order (layer-wise PowerSGD needs them),
    else None: the bucket is then treated as one flat tensor."""
    buffer, at = bucket.buffer(), 0
    base = buffer.data_ptr()
    shapes = []
    for g in bucket.gradients():
        if g.data_ptr() != base + at * buffer.element_size():
            return None
        shapes.append(tuple(g.shape))
        at += g.numel()
    return shapes if at == buffer.numel() else None


# DDP checks these annotations at runtime, so they are real objects here, not strings.
def compressed_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce ``bucket.buffer()`` through ``state.compressor`` (see the module docstring)."""
    index = bucket.index()
    name = f"ddp.bucket{index}"
    layout = _layout(bucket)
    if state.layouts.get(index) != layout:
        if index in state.layouts:
            state.resets += 1
        state.compressor.reset(name)
        state.layouts[index] = layout
    # The result goes straight into the bucket (read in full before it is written): no result
    # tensor, and DDP has nothing to copy back.
    buffer = bucket.buffer()
    out = allreduce(buffer, state.compressor, op=state.op, name=name, group=state.process_group,
                    layout=_shapes(bucket), out=buffer)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


def make_ddp_hook(compressor: Compressor | None = None, *, op: str = "average",
                  process_group: Any = None) -> tuple[DDPHookState, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``. ``compressor``:
    an instance, or a compressor class that takes no arguments (instantiated once, here)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    c = NoneCompressor() if compressor is None else as_compressor(compressor, "make_ddp_hook")
    state = DDPHookState(c, op, process_group)
    return state, compressed_hook


ddp_hook = make_ddp_hook
