"""Two network namespaces joined by a veth pair shaped with ``tc tbf``: a real, slow link on one
machine for the benchmarks' 2-rank runs (needs root and iproute2; private 10.213.x addresses).

    with shaped_link(1000) as link:        # None (with link.why set) where it cannot be made
        cmd = link.wrap(rank, [sys.executable, ...])  # run in rank's namespace
        env = link.env(rank)                          # Gloo bound to that rank's veth end
        results = run_ranks(script, args, link, port)  # or link=None: on loopback
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator


@dataclass
class Link:
    namespaces: list[str]
    devices: list[str]
    addresses: list[str]
    rate_mbit: int

    def wrap(self, rank: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[rank], *cmd]

    def env(self, rank: int) -> dict[str, str]:
        return dict(os.environ, GLOO_SOCKET_IFNAME=self.devices[rank])


def add_rank_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden options a benchmark passes to its own rank processes (``--rank`` set: be a rank)."""
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def run_ranks(script: str, args: list[str], link: Link | None, port: int, timeout: float = 3600) -> dict:
    """Run ``script --rank r --master M --port port --out F *args`` for ranks 0 and 1, in the link's
    namespaces (on loopback with ``link=None``), and return the JSON rank 0 wrote to F."""
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    master = link.addresses[0] if link else "127.0.0.1"
    procs: list[subprocess.Popen] = []
    try:
        for r in (0, 1):
            cmd = [sys.executable, os.path.abspath(script), "--rank", str(r), "--master", master,
                   "--port", str(port), "--out", out, *args]
            procs.append(subprocess.Popen(link.wrap(r, cmd) if link else cmd,
                                          env=link.env(r) if link else dict(os.environ)))
        codes = [p.wait(timeout=timeout) for p in procs]
        if any(codes):
            raise SystemExit(f"rank processes exited with {codes}")
        with open(out) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.unlink(out)


class Unavailable(Exception):
    """Why no shaped link could be made here (printed by the benchmarks as they skip it)."""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def shaped_link(rate_mbit: int, tag: str | None = None) -> Iterator[Link]:
    """The link while the block runs; removed after it. Raises :class:`Unavailable`."""
    if os.geteuid() != 0:
        raise Unavailable("needs root (network namespaces and tc)")
    if not (shutil.which("ip") and shutil.which("tc")):
        raise Unavailable("`ip`/`tc` missing (apt-get install iproute2)")
    tag = tag or str(os.getpid() % 100000)
    link = Link([f"sdlbench{tag}a", f"sdlbench{tag}b"], [f"sdl{tag}a", f"sdl{tag}b"],
                ["10.213.0.1", "10.213.0.2"], rate_mbit)
    try:
        try:
            _sh("ip", "netns", "add", link.namespaces[0])
            _sh("ip", "netns", "add", link.namespaces[1])
            _sh("ip", "link", "add", link.devices[0], "type", "veth", "peer", "name", link.devices[1])
            for i in (0, 1):
                ns, dev = link.namespaces[i], link.devices[i]
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{link.addresses[i]}/30", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                # Token bucket at the link rate; the burst must cover one timer tick at that rate.
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", f"{rate_mbit}mbit", "burst", "1mb", "latency", "100ms")
        except (subprocess.CalledProcessError, OSError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise Unavailable(f"cannot create network namespaces ({detail.strip()})") from None
        yield link
    finally:
        for ns in link.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
