"""The rendezvous port: free on this host when picked, and still free when rank 0 binds it.

A port from ``bind(0)`` comes from the kernel's ephemeral range, the range every outgoing
connection on the host also takes its local port from. Between the pick (in the barrier task)
and rank 0's ``TCPStore`` bind (in the rank process, seconds later) any connection the host
opens, to Spark's block managers, to MLflow, to the other tasks, can take it, and rank 0 then
fails with EADDRINUSE (seen in CI, where two test workers and a Spark JVM open connections
all the time). A port below that range is taken only by a process that binds it by number.
"""
from __future__ import annotations

import random
import socket

# Linux's file; where it cannot be read, the ranges Linux (32768-60999) and IANA, macOS and
# Windows (49152-65535) use both lie above LOW_DEFAULT.
EPHEMERAL_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOW_DEFAULT = 32768
# Rendezvous ports are drawn from [FIRST, the ephemeral range's low end): above the well-known
# and most registered services' ports.
FIRST = 20000
TRIES = 64


def ephemeral_low(path: str = EPHEMERAL_FILE) -> int:
    """The low end of the kernel's ephemeral port range, or :data:`LOW_DEFAULT`."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return LOW_DEFAULT


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def free_port(path: str = EPHEMERAL_FILE) -> int:
    """A TCP port free on this host now, below the ephemeral range (see the module doc); a port
    from ``bind(0)`` where that range starts too low to leave room, or no port below it is free."""
    low = ephemeral_low(path)
    if low - FIRST >= TRIES:
        rng = random.SystemRandom()  # two launches on one host must not draw the same sequence
        for _ in range(TRIES):
            port = rng.randrange(FIRST, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
