"""What every rank passes to an explicit collective (``allreduce``, ``broadcast``,
``reducescatter``, ``grouped_allreduce`` and their variants) is checked to agree before the
data travels, as Horovod's coordinator does ("Mismatched allreduce tensor shapes").

torch.distributed compares nothing, and on Gloo ranks that disagree fail badly (measured on 2
ranks): a reduction of different sizes aborts a rank (SIGABRT) or, fused in a
``grouped_allreduce``, hangs; a broadcast receiver expecting more bytes silently keeps a prefix
of the root's values (one expecting fewer aborts), the same bytes in another dtype are garbage,
different ops mix their results and different roots hang.

So a checked call first all-reduces (MAX) ``[h, -h]`` on the op's group, ``h`` a hash of what
must agree: the collective, the tensors' shapes and dtypes, and the op, compressor (with its
settings), scale factors or root.
It has the same size on every rank, so it completes whatever the ranks pass, and every rank
passed the same ``h`` iff ``max(h) == -max(-h)``. Only on a mismatch are the descriptions
gathered, to name each rank's in the ``ValueError`` every rank then raises.

``allgather`` and ``alltoall`` need no extra call: their layouts travel with the row counts
they exchange anyway. ``DistributedOptimizer``'s and ``SyncBatchNorm``'s per-step reductions are
not checked (the same parameters and layers on every rank, which ``broadcast_parameters`` checks).
``SPARK_DL_HVD_CHECKS=0`` in every rank's environment leaves the check out.
"""
from __future__ import annotations

import hashlib
import numbers
import os
from typing import Sequence

import torch
import torch.distributed as dist

from spark_dl import protocol
from spark_dl.compat.horovod.process_sets import ProcessSet, group_of
from spark_dl.rank.tensors import comm_device

SHAPES = "shape and dtype"
ALL_SHAPES = "shapes and dtypes"  # of a list of tensors


def enabled() -> bool:
    return os.environ.get(protocol.HVD_CHECKS_ENV, "1") != "0"


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


def check_same(collective: str, ps: ProcessSet, fields: dict[str, str]) -> None:
    """Raise a ``ValueError`` on every member of ``ps`` unless all pass the same ``collective``
    and ``fields`` (what must agree -> this rank's value, ``SHAPES`` or ``ALL_SHAPES`` first, from
    :func:`describe`; the others are named ``name=value`` in the error). One all-reduce of
    two int64 on ``ps``'s group."""
    if ps.size() == 1 or not enabled() or agree((collective, fields), ps):
        return
    every: list = [None] * ps.size()
    dist.all_gather_object(every, (collective, fields), group=group_of(ps))
    raise ValueError(_message(collective, every, ps.ranks))


def agree(value: object, ps: ProcessSet) -> bool:
    """Whether every member of ``ps`` passed a ``value`` of the same ``repr``: one all-reduce (MAX)
    of ``[h, -h]`` for a hash ``h`` of it, the same size on every rank whatever they pass."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "big") >> 1  # within int64, and so is -h
    extremes = torch.tensor([h, -h], dtype=torch.int64, device=comm_device())
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group_of(ps))
    highest, minus_lowest = extremes.tolist()
    return highest == -minus_lowest


def _message(collective: str, every: list[tuple[str, dict[str, str]]], ranks: list[int]) -> str:
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
