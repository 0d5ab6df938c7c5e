"""Ranks use the interface of the address Spark reaches their executor by, unless the user names one."""
from __future__ import annotations

import psutil

import spark_dl
from spark_dl.task.network import interface_of, resolve, route_interface, socket_interface_env

LOOPBACK = next(name for name, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))


def test_the_interface_holding_an_address_is_found_by_address_or_name():
    assert interface_of("127.0.0.1") == LOOPBACK
    assert interface_of("localhost") == LOOPBACK
    assert interface_of("192.0.2.1") is None  # TEST-NET-1: on no interface here
    assert resolve("no-such-host.invalid") is None


def test_an_address_on_no_interface_falls_back_to_the_route_to_rank_0():
    # 127.0.1.1 is what Debian's /etc/hosts maps the hostname to: on no interface, routed over loopback
    assert route_interface("127.0.1.1") == LOOPBACK
    assert socket_interface_env("127.0.1.1", "127.0.0.1") == {"GLOO_SOCKET_IFNAME": LOOPBACK,
                                                               "NCCL_SOCKET_IFNAME": LOOPBACK}


def test_a_users_own_interface_setting_wins():
    assert socket_interface_env("127.0.0.1", "127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"}, {}) == {
        "NCCL_SOCKET_IFNAME": LOOPBACK}
    both = {"GLOO_SOCKET_IFNAME": "eth9", "NCCL_SOCKET_IFNAME": "eth9"}
    assert socket_interface_env("127.0.0.1", "127.0.0.1", {}, both) == {}


def _ifnames():
    import os

    return [os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")]


def test_ranks_get_the_interface_and_env_overrides_it():
    assert spark_dl.HorovodRunner(np=-2).run(_ifnames) == [LOOPBACK, LOOPBACK]
    runner = spark_dl.HorovodRunner(np=-2, env={"GLOO_SOCKET_IFNAME": LOOPBACK, "NCCL_SOCKET_IFNAME": "none0"})
    assert runner.run(_ifnames) == [LOOPBACK, "none0"]
