"""``hvd.join()``: a rank out of data keeps taking part in the others' gradient reductions, with
zeros, until every rank has joined (uneven data per rank).

torch.distributed matches collectives by call order and cannot skip a rank, so the ranks agree
on each step first: every ``DistributedOptimizer`` step (of the whole job, not of a process set)
begins with a two-number all-reduce on a Gloo group of its own, ``[1, optimizer id + 1]`` from a
rank still training and ``[0, 0]`` from a joined one. A joined rank loops on that all-reduce: a
non-zero count names the optimizer the others are stepping, and it runs that optimizer's
collectives with zero gradients; a zero count means every rank has joined. Then every rank takes
the last joiner's parameters and optimizer state for each optimizer, so all ranks leave
``join()`` with the same model whatever the loop did between steps (LR schedules, clipping).
Averages divide by the whole job's size (the joined ranks' zeros count, as in DDP's join by
default).

The agreement costs one tiny all-reduce per step, started with the step's first bucket so it
overlaps backward; ``SPARK_DL_HVD_JOIN=0`` leaves it out (and ``join()`` then refuses to run).
"""
from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

_group: Any = None
_group_made = False
_optimizers: list[weakref.ref] = []
_active_rounds = 0     # steps this rank took part in as a training rank since the last join()
_someone_joined = False


def enabled() -> bool:
    return os.environ.get("SPARK_DL_HVD_JOIN", "1") != "0"


def setup() -> None:
    """Called by ``init()`` on every rank: a fresh registry (the control group comes with the
    first optimizer or join(), so code using neither never builds it)."""
    global _group, _group_made, _active_rounds, _someone_joined
    _group, _group_made = None, False
    _optimizers.clear()
    _active_rounds, _someone_joined = 0, False


def _make_group() -> None:
    # Collective over the job: called where every rank is (building a whole-job optimizer, which
    # is collective itself, or join()), the first time only.
    global _group, _group_made
    if not _group_made:
        _group = dist.new_group(backend="gloo") if dist.get_world_size() > 1 and enabled() else None
        _group_made = True


def register(optimizer: Any) -> int:
    """Give a whole-job optimizer its id (creation order, the same on every rank)."""
    _make_group()
    _optimizers.append(weakref.ref(optimizer))
    return len(_optimizers) - 1


def start_control(optimizer_id: int) -> Any:
    """A training rank's side of the per-step agreement, started (async, so it overlaps backward);
    pass the result to :func:`finish_control`."""
    if _group is None:
        return None
    ctrl = torch.tensor([1, optimizer_id + 1], dtype=torch.int64)
    return ctrl, dist.all_reduce(ctrl, group=_group, async_op=True)


def finish_control(started: Any) -> None:
    """Wait for :func:`start_control`'s all-reduce; notes whether some rank has joined."""
    global _active_rounds, _someone_joined
    if started is None:
        return
    ctrl, work = started
    work.wait()
    _active_rounds += 1
    if int(ctrl[0]) < dist.get_world_size():
        _someone_joined = True


def control(optimizer_id: int) -> None:
    """:func:`start_control` and :func:`finish_control` at once."""
    finish_control(start_control(optimizer_id))


def check_collective() -> None:
    """Refuse a collective while a rank is known to be joined: it would wait for that rank forever."""
    if _someone_joined:
        raise RuntimeError(
            "a rank has called hvd.join() and now only follows DistributedOptimizer steps: other "
            "collectives must wait until every rank has called hvd.join() (call it after the training "
            "loop, before evaluation or metric all-reduces)"
        )


def join(device: int = -1) -> int:
    """Mark this rank as out of data and take part in the other ranks' ``DistributedOptimizer``
    steps with zero gradients until every rank has joined; then every rank takes the last
    joiner's parameters and optimizer state.

    Returns the rank that joined last (the highest such rank when several joined at the same
    step). ``device`` is accepted for Horovod's signature; zeros go where each gradient lives.
    """
    global _active_rounds, _someone_joined
    from .basics import _check

    _check()
    _someone_joined = False
    if dist.get_world_size() == 1:
        return 0
    _make_group()
    if _group is None:
        raise RuntimeError("hvd.join() follows the other ranks' steps through a per-step agreement that "
                           "SPARK_DL_HVD_JOIN=0 turned off: unset SPARK_DL_HVD_JOIN to use join()")
    while True:
        ctrl = torch.zeros(2, dtype=torch.int64)
        dist.all_reduce(ctrl, group=_group)
        active, ids = int(ctrl[0]), int(ctrl[1])
        if active == 0:
            break
        if ids % active:
            raise RuntimeError("ranks still training are stepping different DistributedOptimizers at once; "
                               "every rank must step its optimizers in the same order")
        ref = _optimizers[ids // active - 1] if ids // active - 1 < len(_optimizers) else None
        opt = ref() if ref is not None else None
        if opt is None:
            raise RuntimeError(f"the other ranks are stepping DistributedOptimizer #{ids // active - 1}, "
                               "which this rank does not have (every rank must create the same optimizers)")
        opt._hvd_follow_step()
    rounds = torch.tensor([_active_rounds], dtype=torch.int64)
    every = [torch.empty_like(rounds) for _ in range(dist.get_world_size())]
    dist.all_gather(every, rounds, group=_group)
    _active_rounds = 0
    counts = [int(c) for c in every]
    last = max(range(len(counts)), key=lambda r: (counts[r], r))
    # an optimizer collected on one rank only must not leave the ranks broadcasting different lists
    alive = torch.tensor([ref() is not None for ref in _optimizers], dtype=torch.int64)
    dist.all_reduce(alive, op=dist.ReduceOp.MIN, group=_group)
    for ref, live in zip(_optimizers, alive.tolist()):
        opt = ref()
        if live and opt is not None and not opt._hvd_retired:  # retired alike on every rank
            opt._hvd_take_from(last)
    return last
