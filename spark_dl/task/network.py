"""Which network interface a rank's collectives use: the one that carries its executor's address.

Gloo and NCCL pick the address they advertise to the other ranks from the machine's hostname unless
told an interface. Where the hostname resolves to a loopback address (Debian's and Ubuntu's
/etc/hosts map it to 127.0.1.1, as do many containers) every rank then advertises 127.0.0.1 and a
job across hosts cannot connect ("connectFullMesh failed ... remote=[127.0.0.1]"). The address
Spark uses for the executor is the one the other hosts reach it by, so the interface holding it is
the one to use; failing that, the interface of the route to rank 0's host. A user's own
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` (the executor's environment or ``env=``) wins.
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Mapping

SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def resolve(host: str) -> str | None:
    """``host`` as an IP address (itself if it is one); None if it does not resolve."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (OSError, IndexError):
        return None


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (an IP or a host name), or None."""
    import psutil

    ip = resolve(address)
    if ip is None:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == ip:
                return name
    return None


def route_interface(peer: str) -> str | None:
    """The interface this host would send to ``peer`` through (no packet is sent), or None."""
    ip = resolve(peer)
    if ip is None:
        return None
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # a UDP connect only picks the route
            return interface_of(s.getsockname()[0])
    except OSError:
        return None


def socket_interface_env(executor_address: str, master_addr: str, *settings: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for a rank whose executor Spark reaches at
    ``executor_address``, each unless one of ``settings`` (the user's environments) sets it."""
    missing = [k for k in SOCKET_IFNAME_ENV if not any(k in s for s in settings)]
    if not missing:
        return {}
    name = interface_of(executor_address) or route_interface(master_addr)
    return {k: name for k in missing} if name else {}
