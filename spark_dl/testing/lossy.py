"""A lossy link in user space, for kernels without ``netem``: one worker's traffic re-routed through two
TAP devices, whose frames a small process copies across, dropping the given fraction at random.

The worker's address moves from its veth to a TAP device in its namespace; a second TAP device joins
the cluster's bridge; the copying process holds both. Connections survive the move (they are keyed
by address, not by device), so it can start and stop under a running job. Linux, root.

    python -m spark_dl.testing.lossy forward ROOT_TAP NAMESPACE NS_TAP LOSS_PCT
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import random
import select
import struct
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from spark_dl.testing.cluster import Cluster

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def forward(root_tap: str, namespace: str, ns_tap: str, loss_pct: float) -> None:
    """Copy frames between ``root_tap`` (this namespace) and ``ns_tap`` (in ``namespace``) until
    killed, each frame lost with probability ``loss_pct`` / 100, in both directions."""
    outer = _open_tap(root_tap)
    with open(f"/var/run/netns/{namespace}") as ns:
        if ctypes.CDLL(None, use_errno=True).setns(ns.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    inner = _open_tap(ns_tap)
    other = {outer: inner, inner: outer}
    p = loss_pct / 100.0
    rng = random.Random()
    while True:
        for fd in select.select([outer, inner], [], [])[0]:
            frame = os.read(fd, 65536)
            if rng.random() >= p:
                with contextlib.suppress(OSError):  # a full queue on the other side drops it, as a link would
                    os.write(other[fd], frame)


@contextlib.contextmanager
def lossy(cluster: Cluster, worker: int, loss_pct: float) -> Iterator[None]:
    """Within the block, worker ``worker``'s link loses ``loss_pct`` percent of its frames each way
    (its ``tc`` rate shaping does not apply meanwhile)."""
    w = cluster.workers[worker]
    root_tap, ns_tap = f"sdlt{cluster.tag}r{worker}", f"sdlt{cluster.tag}n{worker}"
    _sh("ip", "tuntap", "add", "dev", root_tap, "mode", "tap")
    _sh("ip", "-n", w.namespace, "tuntap", "add", "dev", ns_tap, "mode", "tap")
    proc = subprocess.Popen([sys.executable, "-m", "spark_dl.testing.lossy", "forward", root_tap, w.namespace,
                             ns_tap, str(loss_pct)])
    try:
        _sh("ip", "link", "set", root_tap, "master", cluster.bridge)
        _sh("ip", "link", "set", root_tap, "up")
        _sh("ip", "-n", w.namespace, "link", "set", ns_tap, "up")
        _attached(w.namespace, ns_tap, proc)
        _move(cluster, worker, "eth0", ns_tap)
        yield
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _move(cluster, worker, ns_tap, "eth0")
        proc.kill()
        proc.wait()
        subprocess.run(["ip", "link", "del", root_tap], capture_output=True)
        subprocess.run(["ip", "-n", w.namespace, "link", "del", ns_tap], capture_output=True)


def _attached(namespace: str, tap: str, proc: subprocess.Popen, limit: float = 10.0) -> None:
    """Until the copying process holds the namespace's TAP device (before that, frames sent to it are lost)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the lossy link's copying process exited with {proc.returncode}")
        out = subprocess.run(["ip", "-n", namespace, "link", "show", tap], capture_output=True, text=True).stdout
        if "NO-CARRIER" not in out and "LOWER_UP" in out:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the lossy link's copying process did not attach to {tap} within {limit:g} s")


def _move(cluster: Cluster, worker: int, src: str, dst: str) -> None:
    """Move the worker's address and default route from device ``src`` to ``dst`` in its namespace,
    and forget the old device's neighbours on both sides (the peers learn the new MAC at once)."""
    w = cluster.workers[worker]
    ns = ("ip", "-n", w.namespace)
    _sh(*ns, "addr", "del", f"{w.address}/24", "dev", src)
    _sh(*ns, "addr", "add", f"{w.address}/24", "dev", dst)
    _sh(*ns, "route", "replace", "default", "via", cluster.driver_host, "dev", dst)
    _sh("ip", "neigh", "flush", "dev", cluster.bridge)
    _sh(*ns, "neigh", "flush", "all")


if __name__ == "__main__":
    if sys.argv[1:2] != ["forward"] or len(sys.argv) != 6:
        sys.exit(__doc__)
    forward(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
