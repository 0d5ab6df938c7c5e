"""Memory-allocator settings every rank process starts with, where the user has not set them.

A training step allocates gradient-sized CPU tensors again and again. Left alone, glibc maps
each large allocation fresh (mmap) and unmaps it on free, so every step pays the page faults of
first touching it (2-3 ms per 100 MB here). Both variables are read once at process start, so
they go in the environment the rank is spawned with.
"""
from __future__ import annotations

import os
import sys

ALLOCATOR_ENV = {
    # torch backs CPU allocations of 2 MB+ with transparent huge pages: a fresh 100 MB tensor
    # then costs 50 page faults instead of 25,000 (read by torch at its first large allocation)
    "THP_MEM_ALLOC_ENABLE": "1",
    # glibc serves allocations under 512 MB from its heap and keeps up to 512 MB of freed heap
    # mapped, so the next step's tensors reuse pages already faulted in (a rank's resident size
    # then stays at its peak; MALLOC_MMAP_THRESHOLD_=131072 restores glibc's default)
    "MALLOC_MMAP_THRESHOLD_": str(512 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(512 << 20),
}


def with_allocator_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every :data:`ALLOCATOR_ENV` variable it does not set already."""
    for key, value in ALLOCATOR_ENV.items():
        env.setdefault(key, value)
    return env


def reexec_with_allocator_env() -> None:
    """Restart this script under :data:`ALLOCATOR_ENV` unless its environment has it (the
    benchmarks: they time what a rank process runs). glibc reads its variables at start only."""
    if any(key not in os.environ for key in ALLOCATOR_ENV):
        os.execve(sys.executable, [sys.executable, *sys.argv], with_allocator_env(dict(os.environ)))
