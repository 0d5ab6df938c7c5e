"""Handles of Horovod's asynchronous collectives (``allreduce_async`` and the like): ``poll`` and
``synchronize``, and when the collective behind a handle starts.

torch.distributed matches collectives by the order ranks issue them; Horovod matches them by
name, so a rank may submit an async op and reach a ``barrier()`` that another rank reaches
first. To allow that, an async op is only recorded when submitted, and starts (its check, then
its transfer) at the first of: ``synchronize`` or ``poll`` of it or of a later handle, or the
next collective other than ``barrier()``. Pending ops start in submission order, so every rank
issues them in the same sequence. As in Horovod, a ``name`` may not be reused while an op of
that name has not been synchronized.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from spark_dl.compat.horovod.state import check

Start = Callable[[], tuple[Any, Callable[[], Any]]]


@dataclass
class _Op:
    name: str | None
    start: Start | None  # None once started
    work: Any = None  # a torch.distributed Work, or None when the op completed as it started
    finish: Callable[[], Any] | None = None


_ops: dict[int, _Op] = {}  # in submission order
_next_handle = itertools.count(1)
_starting = False


def submit(name: str | None, start: Start) -> int:
    """Record an async op; ``start()`` issues it and returns ``(work, finish)``: ``work`` (a
    torch.distributed Work, or None) is waited for, then ``finish()`` gives the result."""
    if name is not None and any(op.name == name for op in _ops.values()):
        raise ValueError(f"an operation named {name!r} was submitted and not synchronized yet: every pending "
                         "operation needs a name of its own (as in Horovod)")
    handle = next(_next_handle)
    _ops[handle] = _Op(name, start)
    return handle


def completed(result: Any, name: str | None = None) -> int:
    """A handle for a result computed already."""
    return submit(name, lambda: (None, lambda: result))


def deferred(name: str | None, compute: Callable[[], Any]) -> int:
    """A handle for an op that ``compute()`` runs to completion when it starts."""
    def start() -> tuple[Any, Callable[[], Any]]:
        result = compute()
        return None, lambda: result

    return submit(name, start)


def start_pending(upto: int | None = None) -> None:
    """Start the pending ops, in submission order (up to ``upto``'s, or all); a collective calls
    it first, so the ops submitted before it go first on every rank."""
    global _starting
    if _starting:  # an op starting runs collectives of its own: the later ops wait their turn
        return
    _starting = True
    try:
        for handle, op in list(_ops.items()):
            if op.start is not None:
                start, op.start = op.start, None
                try:
                    op.work, op.finish = start()
                except BaseException:
                    del _ops[handle]
                    raise
            if handle == upto:
                break
    finally:
        _starting = False


def _op(handle: int) -> _Op:
    try:
        return _ops[handle]
    except (KeyError, TypeError):
        raise ValueError(f"unknown or already synchronized handle {handle!r}") from None


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` had finished when called (then :func:`synchronize`
    won't block). An op not started yet starts now (with the ones submitted before it), so a
    loop polling it progresses."""
    op = _op(handle)
    if op.start is not None:
        start_pending(handle)
        return False
    return op.work is None or op.work.is_completed()


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its output."""
    op = _op(handle)
    start_pending(handle)
    del _ops[handle]
    if op.work is not None:
        op.work.wait()
    return op.finish()


class CallableHandle(int):
    """A handle that is also the function Horovod returns for some async ops (calling it
    synchronizes)."""

    def __call__(self) -> Any:
        return synchronize(self)


def clear() -> None:
    """Forget every handle (``shutdown()``: their ops can no longer run)."""
    _ops.clear()


def begin() -> None:
    """What every collective but ``barrier()`` does first: check ``init()``, start pending ops."""
    check()
    start_pending()
