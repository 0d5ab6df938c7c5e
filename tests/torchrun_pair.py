"""Run a script as ``torchrun --nproc-per-node 2`` would start it (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in the environment, a fresh interpreter per rank), several times, and check that every
rank exits 0 after printing "returned": the exits the tests of spark_dl.rank.works make safe."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def exits_cleanly(script: Path, args: list[str], runs: int) -> None:
    for _ in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
        procs = [subprocess.Popen([sys.executable, str(script), *args], env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
        assert all(o[0].strip() == "returned" for o in outs)
