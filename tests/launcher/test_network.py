"""Ranks use the interface of the address Spark reaches their executor by, unless the user names one."""
from __future__ import annotations

import psutil
import pytest

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


# A host whose DNS server takes the question and never answers, as one the host cannot reach does:
# a network and mount namespace of its own, where /etc/resolv.conf names a UDP socket that only
# reads (waiting 3 s per lookup, not glibc's default 2 x 5 s, to keep the test short).
SILENT_DNS = """
import socket
_dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
_dns.bind(("127.0.0.1", 53))
"""


def _on_a_host_whose_dns_is_silent(tmp_path, code: str, answering: bool = False, timeout: float = 120):
    import os
    import subprocess
    import sys

    (tmp_path / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:3 attempts:1\n")
    (tmp_path / "hosts").write_text("127.0.0.1\tlocalhost\n")
    (tmp_path / "main.py").write_text(("" if answering else SILENT_DNS) + code)
    setup = (f"mount --bind {tmp_path / 'resolv.conf'} /etc/resolv.conf && mount --bind {tmp_path / 'hosts'} "
             f"/etc/hosts && ip link set lo up && exec {sys.executable} {tmp_path / 'main.py'}")
    user = ["--map-root-user"] if os.geteuid() != 0 else []
    done = subprocess.run(["unshare", "--net", "--mount", *user, "sh", "-c", setup], capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    if user and done.returncode != 0 and "unshare failed" in done.stderr:  # as root (CI) it always runs
        pytest.skip(f"namespaces of its own need root or unprivileged user namespaces here: {done.stderr.strip()}")
    return done


LOOKUP = """
import time
from spark_dl.task.network import slow_reverse_lookup
started = time.monotonic()
print(repr(slow_reverse_lookup("127.0.0.1", "host-a", 0.5)))
print(time.monotonic() - started)
"""


def test_a_resolver_that_does_not_answer_is_reported_naming_the_host_and_the_fix(tmp_path):
    done = _on_a_host_whose_dns_is_silent(tmp_path, LOOKUP)
    assert done.returncode == 0, done.stderr
    warning, seconds = done.stdout.splitlines()
    assert "[spark-dl] on host-a, a reverse DNS lookup of ::ffff:127.0.0.1 has not answered in 0.5 s" in warning
    assert "/etc/hosts" in warning and "options timeout:1 attempts:1" in warning
    assert float(seconds) < 2.5  # it waits for the limit, not for the lookup


def test_a_resolver_that_answers_at_once_is_not_reported(tmp_path):
    # the same host, nothing listening on the DNS port: refused at once, which is an answer
    done = _on_a_host_whose_dns_is_silent(tmp_path, LOOKUP, answering=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "None", done.stdout


def test_a_run_on_a_host_whose_dns_is_silent_says_why_its_ranks_start_late(tmp_path):
    done = _on_a_host_whose_dns_is_silent(tmp_path, """
import os
os.environ["SPARK_DL_TRACKING"] = "0"
from spark_dl import HorovodRunner

def main():
    import spark_dl
    spark_dl.init()
    return 7

print("result", HorovodRunner(np=-2).run(main))
""")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result 7" in done.stdout
    out = done.stdout + done.stderr
    assert "<log>: [spark-dl] on " in out, out
    assert "a reverse DNS lookup of ::ffff:127.0.0.1 has not answered in 2 s" in out, out
    assert out.count("a reverse DNS lookup") == 1, out  # once per host, not per rank
