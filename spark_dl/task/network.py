"""Which network interface a rank's collectives use: the one that carries its executor's address.

Gloo and NCCL pick the address they advertise to the other ranks from the machine's hostname unless
told an interface. Where the hostname resolves to a loopback address (Debian's and Ubuntu's
/etc/hosts map it to 127.0.1.1, as do many containers) every rank then advertises 127.0.0.1 and a
job across hosts cannot connect ("connectFullMesh failed ... remote=[127.0.0.1]"). The address
Spark uses for the executor is the one the other hosts reach it by, so the interface holding it is
the one to use; failing that, the interface of the route to rank 0's host. A user's own
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` (the executor's environment or ``env=``) wins.

And whether this host names addresses in time: torch's c10d store looks up the name of the peer of
every connection it makes or accepts, and where the resolver's DNS server does not answer, each
lookup waits out its timeout (10 s with glibc's defaults; pytorch#159007) before the ranks can start.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
from typing import Mapping

SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SLOW_LOOKUP_S = 2.0  # a resolver that answers takes milliseconds; one that times out, seconds


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


def slow_reverse_lookup(address: str, host: str, limit_s: float = SLOW_LOOKUP_S) -> str | None:
    """A warning if this host's resolver has not named ``address`` within ``limit_s`` seconds (else
    None): the lookup torch's store makes for every rank that connects to it. An IPv4 address is
    looked up in its IPv4-mapped IPv6 form, as a dual-stack server sees its clients, which
    /etc/hosts rarely lists, so the question goes to DNS. Waits at most ``limit_s``, a host name's
    own resolution included."""
    def as_store_sees_it(ip: str) -> str:
        return f"::ffff:{ip}" if ":" not in ip else ip

    try:  # an IP literal names its lookup now; a host name is resolved in the thread, within the limit
        shown = as_store_sees_it(str(ipaddress.ip_address(address.strip("[]"))))
    except ValueError:
        shown = address
    done = threading.Event()

    def look_up() -> None:
        ip = resolve(address)
        if ip is not None:
            try:
                socket.getnameinfo((as_store_sees_it(ip), 0, 0, 0), socket.NI_NUMERICSERV)
            except OSError:  # no name is an answer too
                pass
        done.set()

    threading.Thread(target=look_up, name="spark-dl-name-lookup", daemon=True).start()
    if done.wait(limit_s):
        return None
    return (f"[spark-dl] on {host}, a reverse DNS lookup of {shown} has not answered in {limit_s:g} s. "
            "torch.distributed looks up the name of the peer of every store connection and waits for each "
            "answer (10 s where the DNS server cannot be reached), so the ranks' start waits that long per "
            "connection. Give the hosts' addresses names (in /etc/hosts, IPv4-mapped forms such as "
            f"{shown} too, or PTR records in DNS), or have the resolver give up sooner "
            "('options timeout:1 attempts:1' in /etc/resolv.conf).")
