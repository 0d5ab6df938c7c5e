"""Whether ``hvd.init()`` has run in this process: the one piece of state every other module of
:mod:`spark_dl.horovod` checks before it acts. It imports nothing from the package, so any
module can import it (:mod:`.basics` sets it; collectives, process sets and ``join()`` check it).
"""
from __future__ import annotations

_initialized = False


def is_initialized() -> bool:
    """Whether :func:`~spark_dl.horovod.init` has been called (and not undone by
    :func:`~spark_dl.horovod.shutdown`)."""
    return _initialized


def set_initialized(value: bool) -> None:
    """Called by ``init()`` and ``shutdown()`` only."""
    global _initialized
    _initialized = value


def check() -> None:
    """Raise as Horovod does when a call needs ``hvd.init()`` first."""
    if not _initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
