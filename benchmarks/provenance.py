"""What every benchmark's header says about the code it measured, and the one free port its ranks meet on."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def commit() -> str:
    """The short commit of this checkout, with " (with local changes)" when tracked files differ from it
    (a result measured on uncommitted code says so); "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=_HERE, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=_HERE, timeout=10).stdout.strip()
        return (head + (" (with local changes)" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a local process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
