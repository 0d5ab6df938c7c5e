"""A rank's tracking from its start to its end: called by the rank's entry point."""
from __future__ import annotations

import socket

from spark_dl import protocol
from spark_dl.rank import context as rank_api
from spark_dl.tracking.rank import buffer, fluent
from spark_dl.tracking.rank.buffer import finish

__all__ = ["install", "finish"]


def install(enabled: bool) -> None:
    """Start the rank-side tracking machinery when the driver tracks this job (it decides: an
    executor does not see the driver's settings), and route MLflow's fluent API to it."""
    buffer.start(enabled)
    if not enabled:
        return
    fluent.install()
    ctx = rank_api.get_context()
    rank_api.send_to_driver(
        protocol.TRACKING_RANK_INFO,
        {
            "rank": ctx.rank, "host": socket.gethostname(), "local_rank": ctx.local_rank,
            "local_size": ctx.local_size, "cross_rank": ctx.cross_rank, "cross_size": ctx.cross_size,
        },
    )
