"""Horovod's exception types (``horovod.common.exceptions``), so ``except hvd.HorovodInternalError``
works as in Horovod code."""
from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed inside the library (Horovod raises it when a peer is lost; elastic
    Horovod restores the last committed state on it)."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed (elastic Horovod); ``skip_sync`` says whether state must be synced."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__()
        self.skip_sync = skip_sync


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
