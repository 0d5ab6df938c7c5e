"""The rendezvous port is drawn below the kernel's ephemeral range, where outgoing connections
cannot take it between the pick and rank 0's bind."""
from __future__ import annotations

import contextlib
import socket

from spark_dl.task.ports import FIRST, LOW_DEFAULT, TRIES, ephemeral_low, free_port


def _bindable(port: int) -> bool:
    with socket.socket() as s, contextlib.suppress(OSError):
        s.bind(("", port))
        return True
    return False


def test_the_port_is_below_the_ephemeral_range_and_free(tmp_path):
    low = ephemeral_low()
    assert low == int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(FIRST <= p < low and _bindable(p) for p in ports), ports
    assert len(ports) > 10  # drawn at random: two launches on one host do not pick alike
    # a kernel range that cannot be read: the ranges Linux, IANA, macOS and Windows use start above LOW_DEFAULT
    assert ephemeral_low(str(tmp_path / "missing")) == LOW_DEFAULT
    assert FIRST <= free_port(str(tmp_path / "missing")) < LOW_DEFAULT
    (tmp_path / "garbled").write_text("not ports\n")
    assert ephemeral_low(str(tmp_path / "garbled")) == LOW_DEFAULT


def test_no_room_below_the_range_or_no_free_port_there_falls_back_to_the_kernels_pick(tmp_path):
    low_range = tmp_path / "low"
    low_range.write_text("1024\t65535\n")  # nothing below the range to draw from
    port = free_port(str(low_range))
    assert port > 0 and _bindable(port)
    # every port below a range that starts TRIES ports above FIRST is taken: the kernel's pick
    narrow = tmp_path / "narrow"
    narrow.write_text(f"{FIRST + TRIES}\t65535\n")
    held = []
    try:
        for p in range(FIRST, FIRST + TRIES):
            s = socket.socket()
            with contextlib.suppress(OSError):  # taken already: as good as held
                s.bind(("", p))
                s.listen()
            held.append(s)
        port = free_port(str(narrow))
        assert not FIRST <= port < FIRST + TRIES and _bindable(port)
    finally:
        for s in held:
            s.close()
