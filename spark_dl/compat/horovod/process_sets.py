"""Horovod's process sets: collectives on a subset of the ranks, each subset a ``torch.distributed``
group of its own, so disjoint sets run their collectives concurrently.

Registering a set (``init(process_sets=[...])`` or :func:`add_process_set`) creates its groups,
which torch.distributed requires of every rank, members or not: as in Horovod, every rank makes
those calls, with the same sets in the same order. Collectives then take ``process_set=`` and
are called by the set's members only. Ranks stay global: ``root_rank`` of a broadcast is a rank
of the job, as in Horovod; :meth:`ProcessSet.rank` is the position within the set.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch.distributed as dist

from spark_dl.compat.horovod import joining
from spark_dl.compat.horovod.joining import check_collective
from spark_dl.compat.horovod.state import check


class ProcessSet:
    """A set of ranks that run collectives together; pass it to ``init(process_sets=...)`` or
    :func:`add_process_set`, then as ``process_set=`` to collectives and ``DistributedOptimizer``."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm = None

    def __init__(self, ranks: Iterable[int]) -> None:
        if not isinstance(ranks, Iterable) or isinstance(ranks, (str, bytes)):
            raise ValueError(
                f"ProcessSet takes a list of ranks, got {type(ranks).__name__}: MPI communicators have "
                "no counterpart here (collectives run on torch.distributed)"
            )
        ranks = sorted(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet should be initialized with a list of integer ranks, got {ranks}")
        self.ranks = ranks
        self._group: Any = None       # collectives called by the user
        self._opt_group: Any = None   # DistributedOptimizer's background reductions

    def size(self) -> int | None:
        """Number of ranks in the set (None before it is registered)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's position within the set (-1 if not a member; None before registration)."""
        if self.process_set_id is None:
            return None
        me = dist.get_rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this process is a member (None before registration)."""
        return None if self.ranks is None or self.process_set_id is None else dist.get_rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}
_next_id = 1


def _check_ranks(ranks: Sequence[int]) -> None:
    world = dist.get_world_size()
    if ranks and (len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= world):
        raise ValueError(f"process set ranks {list(ranks)} must be distinct ranks of the job, 0..{world - 1}")


def setup(process_sets: Any) -> None:
    """Called by ``init()``: reset the registry and register ``process_sets`` (a list of sets,
    ``"dynamic"``, or None)."""
    global _next_id
    forget(destroy=True)  # sets a failed init() registered
    _next_id = 1
    global_process_set.ranks = list(range(dist.get_world_size()))
    global_process_set.process_set_id = 0
    _registered[0] = global_process_set
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, (str, bytes)) or not isinstance(process_sets, Iterable):
        raise ValueError(f'init(process_sets=...) takes a list of ProcessSet or "dynamic", got {process_sets!r}')
    for ps in process_sets:
        add_process_set(ps)


def forget(destroy: bool = False) -> None:
    """Unregister every set but the global one (``shutdown()``, a new ``init()``); ``destroy``: also
    destroy their groups (when the default group, which takes every group with it, stays)."""
    for ps in list(_registered.values()):
        if ps is global_process_set:
            continue
        if destroy:
            _destroy_groups(ps)
        ps.process_set_id = None
        ps._group = ps._opt_group = None
    _registered.clear()
    global_process_set._group = global_process_set._opt_group = None


def _destroy_groups(ps: ProcessSet) -> None:
    for group in (ps._group, ps._opt_group):
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a set of ranks (a :class:`ProcessSet` or a list of ranks) and return it.

    Every rank of the job must make the same ``add_process_set`` calls in the same order.
    """
    global _next_id
    check()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None and _registered.get(ps.process_set_id) is ps:
        raise ValueError(f"{ps} is already registered")
    _check_ranks(ps.ranks)
    for other in _registered.values():
        # the whole job's ranks may form a set of their own (a one-rank job's "even ranks"), as in Horovod
        if other is not global_process_set and other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} is already registered: {other}")
    if ps.ranks:  # a set of no ranks (an odd set of a one-rank job) has no collectives to run
        # new_group is collective over the whole job: members and non-members alike call it
        ps._group = dist.new_group(ps.ranks)
        ps._opt_group = dist.new_group(ps.ranks)
    joining.add_set(_next_id, ps.ranks)  # hvd.join()'s per-step agreement among its members
    ps.process_set_id = _next_id
    _registered[_next_id] = ps
    _next_id += 1
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set (every rank, same order); False for the global set or one not registered."""
    if process_set is global_process_set or _registered.get(process_set.process_set_id) is not process_set:
        return False
    del _registered[process_set.process_set_id]
    joining.remove_set(process_set.process_set_id)
    process_set.process_set_id = None
    _destroy_groups(process_set)
    process_set._group = process_set._opt_group = None
    return True


def process_sets() -> list[ProcessSet]:
    """Every registered set, the global one first."""
    return [_registered[i] for i in sorted(_registered)]


def ids_and_ranks() -> dict[int, list[int]]:
    """Every registered set's id and ranks (Horovod's ``_get_process_set_ids_and_ranks``)."""
    return {i: list(_registered[i].ranks) for i in sorted(_registered)}


def resolve(process_set: Any) -> ProcessSet:
    """Validate ``process_set=`` for a collective this rank is about to join."""
    check_collective()
    if process_set is None or process_set is global_process_set:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None or _registered.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) "
                         "or hvd.add_process_set() on every rank first")
    if dist.get_rank() not in process_set.ranks:
        raise ValueError(f"rank {dist.get_rank()} is not in {process_set}: only its members call "
                         "collectives with process_set= it")
    check_collective(process_set.process_set_id)  # a member of this set may have joined
    return process_set


def group_of(ps: ProcessSet) -> Any:
    """The torch.distributed group for user collectives on ``ps`` (None: the default group)."""
    return ps._group


def optimizer_group_of(ps: ProcessSet) -> Any:
    """The group a registered set made for its ``DistributedOptimizer``'s background reductions
    (None for the global set, whose optimizers make their own)."""
    return ps._opt_group


def check_root(ps: ProcessSet, root_rank: int) -> None:
    if ps is not global_process_set and root_rank not in ps.ranks:
        raise ValueError(f"root_rank={root_rank} is not in {ps}: a broadcast's root is a (global) rank of the set")
