"""What every rank passes to a collective is checked to agree before the data travels, as
Horovod's coordinator does ("Mismatched allreduce tensor shapes"), and the same exchange lets a
rank in ``hvd.join()`` take part in the others' all-reduces.

torch.distributed compares nothing, and on Gloo ranks that disagree fail badly (measured on 2
ranks): a reduction of different sizes aborts a rank (SIGABRT) or, fused in a
``grouped_allreduce``, hangs; a broadcast receiver expecting more bytes silently keeps a prefix
of the root's values (one expecting fewer aborts), the same bytes in another dtype are garbage,
different ops mix their results and different roots or different collectives hang.

So every collective on a process set first all-reduces (MAX) five int64 on the op's group:
``[h, -h, 0, -rank, followable]``, ``h`` a hash of what must agree (the collective, the tensors'
shapes and dtypes, the op, compressor with its settings, scale factors, root, ``name``). It has
the same size on every rank, so it completes whatever the ranks pass, and every rank passed the
same ``h`` iff ``max(h) == -max(-h)``. Only on a mismatch are the descriptions gathered, to name
each rank's in the :class:`~.exceptions.CollectiveError` every rank then raises.

A rank in ``join()`` loops on the same exchange (:func:`follow`), sending ``[min, min, 1, min, 0]``
(int64's minimum, below every real value). The others then see that a rank joined; for an
all-reduce (``followable``) the lowest training rank sends how to take part (a picklable
callable, run by the joined rank with zeros), and any other collective is refused with a
``RuntimeError``, as Horovod refuses them. Every rank joined: ``max(h)`` is the minimum.

``DistributedOptimizer``'s and ``SyncBatchNorm``'s per-step reductions are not checked (the same
parameters and layers on every rank, which ``broadcast_parameters`` checks).
``SPARK_DL_HVD_CHECKS=0`` in every rank's environment leaves the check out (and with it the
following of collectives by joined ranks).
"""
from __future__ import annotations

import hashlib
import numbers
import os
from typing import Any, Sequence

import cloudpickle
import torch
import torch.distributed as dist

from spark_dl import protocol
from spark_dl.compat.horovod import joining
from spark_dl.compat.horovod.exceptions import CollectiveError
from spark_dl.compat.horovod.process_sets import ProcessSet, global_process_set, group_of
from spark_dl.rank.tensors import comm_device

SHAPES = "shape and dtype"
ALL_SHAPES = "shapes and dtypes"  # of a list of tensors


def enabled() -> bool:
    """Whether collectives are checked (the switch in the module docstring is not off)."""
    return not protocol.switched_off(os.environ, protocol.HVD_CHECKS_ENV)


def describe(tensors: torch.Tensor | Sequence[torch.Tensor]) -> str:
    """``float32 [4, 2]``; for a list, ``[float32 [4], int64 []]``."""
    if torch.is_tensor(tensors):
        return f"{str(tensors.dtype).removeprefix('torch.')} [{', '.join(map(str, tensors.shape))}]"
    return f"[{', '.join(describe(t) for t in tensors)}]"


def setting(value: object) -> str:
    """How an argument that must agree is compared and named: numbers by value (``0.5``,
    ``np.float64(0.5)`` and ``torch.tensor(0.5)`` agree), objects by their ``repr`` (a
    compressor's names its settings), except a default ``repr`` holding an address, which differs
    on every rank: its class then."""
    if isinstance(value, numbers.Real) or (torch.is_tensor(value) and value.numel() == 1):
        return repr(float(value))
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


_JOINED = -(2 ** 63)  # below any hash, minus hash or minus rank


def check_same(collective: str, ps: ProcessSet, fields: dict[str, str], follow: Any = None) -> None:
    """Raise a :class:`CollectiveError` on every member of ``ps`` unless all pass the same
    ``collective`` and ``fields`` (what must agree -> this rank's value, ``SHAPES`` or
    ``ALL_SHAPES`` first, from :func:`describe`; the others are named ``name=value``). One
    all-reduce of five int64 on ``ps``'s group.

    ``follow``: how a rank in ``join()`` takes part in this collective (a picklable callable it
    runs with zeros), for the all-reduces; without it the collective is refused while a rank is
    joined."""
    if ps.size() == 1 or not enabled():
        return
    agreed, joined, source, _ = _round((collective, fields), ps, follow is not None)
    if ps is global_process_set:
        joining.note_collective()
    if not agreed:
        raise CollectiveError(_message(collective, _gather((collective, fields), ps), ps.ranks))
    if joined:
        _joined(collective, follow, source, ps)


def disagreement(collective: str, value: object, ps: ProcessSet) -> list | None:
    """None when every member of ``ps`` passed a ``value`` of the same ``repr``, otherwise every
    member's value in rank order. One all-reduce of five int64 on ``ps``'s group whatever they
    pass; the values travel only when they differ. Refused while a rank is joined."""
    if ps.size() == 1:
        return None
    agreed, joined, source, _ = _round((collective, value), ps, False)
    if not agreed:
        every = _gather((collective, value), ps)
        if any(v is not None and v[0] != collective for v in every):
            raise CollectiveError(_message(collective, every, ps.ranks))
        return [None if v is None else v[1] for v in every]
    if joined:
        _joined(collective, None, source, ps)
    return None


def _round(value: object, ps: ProcessSet, followable: bool, joined: bool = False) -> tuple[bool, bool, int, bool]:
    """(every training member agrees, some member is joined, the lowest training rank, followable);
    ``joined``: this rank is in ``join()`` (``value`` is then ignored)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "big") >> 1  # within int64, and so is -h
    mine = [_JOINED, _JOINED, 1, _JOINED, 0] if joined else [h, -h, 0, -dist.get_rank(), int(followable)]
    extremes = torch.tensor(mine, dtype=torch.int64, device=comm_device())
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group_of(ps))
    highest, minus_lowest, joined, minus_source, follows = extremes.tolist()
    return highest == -minus_lowest, joined == 1, -minus_source, follows == 1


def _gather(value: object, ps: ProcessSet) -> list:
    every: list = [None] * dist.get_world_size(group_of(ps))
    dist.all_gather_object(every, value, group=group_of(ps))
    return every


def _send(source: int, obj: Any, ps: ProcessSet) -> Any:
    """``source``'s ``obj`` on every member (cloudpickle; lambdas and partials travel)."""
    dev = comm_device()
    if dist.get_rank() == source:
        data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8).to(dev)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(length, src=source, group=group_of(ps))
    if dist.get_rank() != source:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(data, src=source, group=group_of(ps))
    return obj if dist.get_rank() == source else cloudpickle.loads(data.cpu().numpy().tobytes())


def _joined(collective: str, follow: Any, source: int, ps: ProcessSet) -> None:
    if follow is None:
        raise RuntimeError(f"{collective}: a rank has called hvd.join() and takes part in all-reduces only (as in "
                           "Horovod): call allgather, broadcast, alltoall and reducescatter before join(), or after "
                           "every rank has joined")
    _send(source, follow, ps)


def follow(ps: ProcessSet = global_process_set) -> None:
    """A joined rank's side (``join()`` runs it): take part in the others' checked collectives on
    ``ps`` until every member has joined: their all-reduces with zeros, nothing for the others."""
    while True:
        agreed, _, source, followable = _round(None, ps, False, joined=True)
        if source == -_JOINED:
            return  # nobody is training
        if not agreed:
            _gather(None, ps)
        elif followable:
            _send(source, None, ps)()


def _message(collective: str, every: list, ranks: list[int]) -> str:
    # joined ranks (None) took part in the exchange only
    ranks, every = [r for r, e in zip(ranks, every) if e is not None], [e for e in every if e is not None]
    if any(c != collective for c, _ in every):
        return (f"{collective}: every rank must call the same collectives in the same order, got "
                + ", ".join(f"rank {r}: {c}" for r, (c, _) in zip(ranks, every)))
    differing = [k for k in every[0][1] if any(f[k] != every[0][1][k] for _, f in every)]

    def value(k: str, v: str) -> str:
        return v if k in (SHAPES, ALL_SHAPES) else f"{k}={v}"

    return (f"{collective}: every rank must pass the same {_and(differing)}, got "
            + ", ".join(f"rank {r}: {' '.join(value(k, f[k]) for k in differing)}" for r, (_, f) in zip(ranks, every)))


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
