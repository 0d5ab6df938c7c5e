"""Horovod's exception types (``horovod.common.exceptions``), so ``except hvd.HorovodInternalError``
works as in Horovod code."""
from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed inside the library (Horovod raises it when a peer is lost; elastic
    Horovod restores the last committed state on it)."""


class CollectiveError(ValueError, RuntimeError):
    """A collective refused before any data travelled: the ranks passed different shapes, dtypes,
    ops, roots or collectives, or something no rank can do (``reducescatter`` with Adasum). A
    ``ValueError`` (how spark-dl refuses arguments) and a ``RuntimeError`` (what Horovod raises for
    these), so code written for either catches it."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed (elastic Horovod); ``skip_sync`` says whether state must be synced."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__()
        self.skip_sync = skip_sync


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "CollectiveError"]
