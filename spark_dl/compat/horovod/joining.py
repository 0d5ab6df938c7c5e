"""``hvd.join()``: a rank out of data keeps taking part in the others' gradient reductions, with
zeros, until every rank has joined (uneven data per rank).

torch.distributed matches collectives by call order and cannot skip a rank, so the ranks agree
on each step first: every ``DistributedOptimizer`` step begins with a two-number all-reduce on a
Gloo group of its own, ``[1, optimizer id + 1]`` from a rank still training and ``[0, 0]`` from a
joined one. Each process set has such a control (the whole job's, and one per registered set,
over its members), and an optimizer uses its set's. A joined rank loops on the control's
all-reduce: a non-zero count names the optimizer the others are stepping, and it runs that
optimizer's collectives with zeros; a zero count means every member has joined. A rank in
process sets follows each of its sets' controls on a thread of its own, as the sets step
independently. Then, set by set (the job first, then the sets in registration order, the same
on every rank), the members take the last joiner's parameters and optimizer state, so all ranks
leave ``join()`` with the same models whatever the loop did between steps (LR schedules,
clipping). Averages divide by the set's size (the joined ranks' zeros count, as in DDP's join by
default). Whole-job all-reduces outside the optimizers are followed too, on one more thread,
through the check every collective starts with (:func:`.checks.follow`). The last joiner is the
rank that took part in the most steps and checked collectives since the previous ``join()``.

The agreement costs one tiny all-reduce per step, started with the step's first bucket so it
overlaps backward; ``SPARK_DL_HVD_JOIN=0`` leaves it out (and ``join()`` then refuses to run).
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from spark_dl import protocol
from spark_dl.compat.horovod.state import check
from spark_dl.rank import works


class _Control:
    """One set's per-step agreement: its Gloo group (None: a set of one, or the agreement is off),
    its members, the optimizers stepped on it and what this rank has seen of it."""

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self.group = group
        self.ranks = ranks
        self.optimizers: list[weakref.ref] = []
        self.active_rounds = 0  # steps this rank took part in as a training rank since the last join()
        self.someone_joined = False


_job: _Control | None = None  # the whole job's, made with the first optimizer or join()
_sets: dict[int, _Control] = {}  # process set id -> its control, made when the set is registered


def enabled() -> bool:
    return not protocol.switched_off(os.environ, protocol.HVD_JOIN_ENV)


_collectives = 0  # checked whole-job collectives this rank took part in as a training rank since the last join()


def setup() -> None:
    """Called by ``init()`` and ``shutdown()`` on every rank: a fresh registry."""
    global _job, _collectives
    _job = None
    _collectives = 0
    _sets.clear()


def start() -> None:
    """Called by ``init()`` on every rank: the job's control group, made where every rank is (a
    rank that joins early must not be creating it while the others run a collective)."""
    _job_control()


def stop() -> None:
    """Called by ``shutdown()``: destroy the controls' groups and start afresh."""
    for c in [_job, *_sets.values()]:
        if c is not None and c.group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            dist.destroy_process_group(c.group)
    setup()


def note_collective() -> None:
    """A checked collective on the whole job ran with this rank training (for who joined last)."""
    global _collectives
    _collectives += 1


def _job_control() -> _Control:
    # Collective over the job: init() makes it on every rank, so later calls find it made.
    global _job
    if _job is None:
        world = dist.get_world_size()
        _job = _Control(dist.new_group(backend="gloo") if world > 1 and enabled() else None, list(range(world)))
    return _job


def add_set(set_id: int, ranks: list[int]) -> None:
    """A process set was registered (on every rank, as ``new_group`` requires): its control."""
    group = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 and enabled() else None
    _sets[set_id] = _Control(group, list(ranks))


def remove_set(set_id: int) -> None:
    control = _sets.pop(set_id, None)
    if control is not None and control.group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
        dist.destroy_process_group(control.group)


def register(optimizer: Any, set_id: int = 0) -> tuple[_Control, int]:
    """Give an optimizer its id on its set's control (creation order, the same on every member)."""
    control = _job_control() if set_id == 0 else _sets[set_id]
    control.optimizers.append(weakref.ref(optimizer))
    return control, len(control.optimizers) - 1


def start_control(ticket: tuple[_Control, int]) -> Any:
    """A training rank's side of the per-step agreement, started (async, so it overlaps backward);
    pass the result to :func:`finish_control`."""
    control, optimizer_id = ticket
    if control.group is None:
        return None
    ctrl = torch.tensor([1, optimizer_id + 1], dtype=torch.int64)
    return control, ctrl, works.hold(dist.all_reduce(ctrl, group=control.group, async_op=True))


def finish_control(started: Any) -> None:
    """Wait for :func:`start_control`'s all-reduce; notes whether some member has joined."""
    if started is None:
        return
    control, ctrl, work = started
    work.wait()
    control.active_rounds += 1
    if int(ctrl[0]) < len(control.ranks):
        control.someone_joined = True


def control(ticket: tuple[_Control, int]) -> None:
    """:func:`start_control` and :func:`finish_control` at once."""
    finish_control(start_control(ticket))


def check_collective(set_id: int = 0) -> None:
    """Refuse a collective while a rank is known to be joined: it would wait for that rank forever.
    With the collectives' checks on, the whole job's are left to them (a joined rank follows
    all-reduces; :mod:`.checks`)."""
    checked = not protocol.switched_off(os.environ, protocol.HVD_CHECKS_ENV)
    joined = _job is not None and _job.someone_joined and not checked
    if set_id and set_id in _sets:
        joined = joined or _sets[set_id].someone_joined
    if joined:
        raise RuntimeError(
            "a rank has called hvd.join() and now only follows DistributedOptimizer steps: other "
            "collectives must wait until every rank has called hvd.join() (call it after the training "
            "loop, before evaluation or metric all-reduces)"
        )


def join(device: int = -1, follow: Any = None) -> int:
    """Mark this rank as out of data and take part in the other ranks' ``DistributedOptimizer``
    steps (on the whole job and on this rank's process sets) with zero gradients until every rank
    has joined; then the members of each set take its last joiner's parameters and optimizer state.

    Returns the rank that joined last (the highest such rank when several joined at the same
    step). ``device`` is accepted for Horovod's signature; zeros go where each gradient lives.
    ``follow``: run on a thread of its own meanwhile, taking part in the other ranks' collectives
    until every rank has joined (:func:`.checks.follow`).
    """
    check()
    job = _job_control() if dist.get_world_size() > 1 else None
    for c in [job, *_sets.values()]:
        if c is not None:
            c.someone_joined = False
    if job is None:
        return 0
    if job.group is None:
        raise RuntimeError("hvd.join() follows the other ranks' steps through a per-step agreement that "
                           "SPARK_DL_HVD_JOIN turned off: unset SPARK_DL_HVD_JOIN to use join()")
    me = dist.get_rank()
    mine = [c for _, c in sorted(_sets.items()) if me in c.ranks and c.group is not None]
    errors: list[BaseException] = []

    def follow_set(c: _Control) -> None:
        try:
            _follow(c)
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread below
            errors.append(e)

    def follow_collectives() -> None:
        try:
            follow()
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread below
            errors.append(e)

    threads = [threading.Thread(target=follow_set, args=(c,), name="hvd-join-set", daemon=True) for c in mine]
    if follow is not None:
        threads.append(threading.Thread(target=follow_collectives, name="hvd-join-collectives", daemon=True))
    for t in threads:
        t.start()
    _follow(job)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    last = _settle(job)
    for _, c in sorted(_sets.items()):
        if c in mine:
            _settle(c)
    return last


def _follow(c: _Control) -> None:
    """Follow the set's steps with zeros until every member has joined."""
    while True:
        ctrl = torch.zeros(2, dtype=torch.int64)
        dist.all_reduce(ctrl, group=c.group)
        active, ids = int(ctrl[0]), int(ctrl[1])
        if active == 0:
            return
        if ids % active:
            raise RuntimeError("ranks still training are stepping different DistributedOptimizers at once; "
                               "every rank must step its optimizers in the same order")
        index = ids // active - 1
        ref = c.optimizers[index] if index < len(c.optimizers) else None
        opt = ref() if ref is not None else None
        if opt is None:
            where = "" if c is _job else f" on the process set of ranks {c.ranks}"
            raise RuntimeError(f"the other ranks are stepping DistributedOptimizer #{index}{where}, "
                               "which this rank does not have (every rank must create the same optimizers)")
        opt._hvd_follow_step()


def _settle(c: _Control) -> int:
    """Every member takes the set's last joiner's optimizers; returns that (global) rank."""
    global _collectives
    rounds = torch.tensor([c.active_rounds + (_collectives if c is _job else 0)], dtype=torch.int64)
    every = [torch.empty_like(rounds) for _ in c.ranks]
    dist.all_gather(every, rounds, group=c.group)
    c.active_rounds = 0
    if c is _job:
        _collectives = 0
    counts = [int(n) for n in every]
    last = c.ranks[max(range(len(counts)), key=lambda i: (counts[i], i))]
    # an optimizer collected on one rank only must not leave the ranks broadcasting different lists
    alive = torch.tensor([ref() is not None for ref in c.optimizers], dtype=torch.int64)
    dist.all_reduce(alive, op=dist.ReduceOp.MIN, group=c.group)
    for ref, live in zip(c.optimizers, alive.tolist()):
        opt = ref()
        if live and opt is not None and not opt._hvd_retired:  # retired alike on every member
            opt._hvd_take_from(last)
    return last
