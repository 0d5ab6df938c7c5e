"""glibc malloc in a rank process: large freed blocks are kept for reuse instead of going back to
the kernel.

glibc serves a block above its mmap threshold (dynamic, at most 32 MB) with a fresh ``mmap`` and
unmaps it when it is freed, so a tensor of that size allocated every step (a gradient after
``zero_grad()``, which sets it to ``None``; a layer's activations; a collective's buffer) costs
its page faults and the kernel's zeroing every step again: about 16 ms of a 169 ms DDP PowerSGD
step of the 10.3M-parameter MLP of ``benchmarks/time_to_accuracy.py`` (``benchmarks/allocator.py``).
PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``) preloads tcmalloc (or jemalloc) for
the same reason; a rank cannot load another allocator after it started (a zygote-forked rank never
starts), so spark-dl tells glibc, in every rank, through ``mallopt``:

- ``M_MMAP_MAX = 0``: no block comes from its own ``mmap``; all come from the heap, where a freed
  block is reused by the next allocation of its size without a page fault;
- ``M_TRIM_THRESHOLD = 1 GiB``: free memory at the top of the heap is returned to the kernel only
  beyond 1 GiB.

The cost: a rank's resident memory stays near its peak (freed memory is kept for reuse, up to
1 GiB of it at the heap's top). ``SPARK_DL_MALLOC=0`` (in ``env=``, or the executor's or driver's
environment) leaves glibc as it is, and so do the user's own settings of what this sets (the
``MALLOC_MMAP_MAX_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_``
variables or their ``glibc.malloc`` tunables) and another allocator in ``LD_PRELOAD``: theirs win.
Other glibc settings, such as the ``MALLOC_ARENA_MAX`` that YARN's NodeManager passes to its
containers, apply beside these. Elsewhere than glibc (musl, macOS) nothing changes.
"""
from __future__ import annotations

import ctypes
import os
from typing import Mapping

from spark_dl import protocol

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc")
# the user's own settings of what tune() sets, as variables and as GLIBC_TUNABLES names
USER_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
USER_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold",
                 "glibc.malloc.top_pad")


def choice(env: Mapping[str, str]) -> str:
    """What :func:`tune` does in a process with ``env``: ``"reuse"``, or why not: ``"off"``
    (``SPARK_DL_MALLOC=0``), ``"user"`` (the user's own malloc settings or allocator),
    ``"not glibc"``."""
    if protocol.switched_off(env, protocol.MALLOC_ENV):
        return "off"
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(k in env for k in USER_VARIABLES) or any(t in tunables for t in USER_TUNABLES):
        return "user"
    if any(a in env.get("LD_PRELOAD", "") for a in OTHER_ALLOCATORS):
        return "user"
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return "not glibc"
    except (ValueError, OSError):
        return "not glibc"
    return "reuse"


def tune(env: Mapping[str, str] | None = None) -> str:
    """Apply the settings above in this process unless ``env`` (default ``os.environ``) turns
    them off; returns :func:`choice`'s answer (``"failed"`` if glibc refused a setting)."""
    what = choice(os.environ if env is None else env)
    if what != "reuse":
        return what
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and ok
    except (OSError, AttributeError):
        return "not glibc"
    return "reuse" if ok else "failed"
