"""A cluster takes a 10.213.N.0/24 subnet no interface here holds: a cluster whose owner was killed
before ``down()`` leaves its bridge and address behind, and a new cluster on the same subnet had
its workers fail to reach the master (they did not register within 120 s). A real interface,
made and removed here; needs root and iproute2, as CI has."""
from __future__ import annotations

import os
import subprocess

import pytest

from spark_dl.testing import cluster


@pytest.fixture
def stale_bridge():
    """A bridge holding 10.213.<subnet>.1/24, as a cluster killed before down() leaves it."""
    try:
        cluster.check_can_run()
    except cluster.ClusterUnavailable as e:
        pytest.skip(f"no network namespaces here: {e}")
    free = cluster._free_subnet(None, os.getpid() % cluster.SUBNETS)
    name = f"sdltest{os.getpid() % 100000}"
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"10.213.{free}.1/24", "dev", name], check=True)
        yield name, free
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


def test_a_subnet_on_an_interface_is_skipped(stale_bridge):
    name, taken = stale_bridge
    assert cluster.subnets_in_use()[taken] == name
    start = taken - cluster.FIRST_SUBNET
    chosen = cluster._free_subnet(None, start)
    assert chosen != taken and chosen not in cluster.subnets_in_use()


def test_asking_for_a_subnet_on_an_interface_says_which_and_how_to_free_it(stale_bridge):
    name, taken = stale_bridge
    with pytest.raises(cluster.ClusterUnavailable, match=rf"10\.213\.{taken}\.0/24 is already on interface {name}.*"
                                                          rf"ip link del {name}"):
        cluster.up(1, subnet=taken)
