"""The allocator settings rank processes start with (spark_dl/launch/allocator.py), in real
child processes: what they change is the page faults a step pays for its fresh big tensors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from spark_dl.launch.allocator import ALLOCATOR_ENV, with_allocator_env

# Allocates a 64 MB tensor, frees it, allocates and fills one again: the second one's page faults.
SECOND_TOUCH = """
import json, resource, torch
torch.empty(16 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(16 << 20).fill_(2.0)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def _faults(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", SECOND_TOUCH], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_freed_big_tensors_stay_mapped_for_the_next_step():
    # 4 KB pages on both sides (no huge pages), so only glibc's settings differ
    base = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV} | {"THP_MEM_ALLOC_ENABLE": "0"}
    plain = _faults(base)
    kept = _faults(with_allocator_env(dict(base)))
    assert plain > 10_000  # 64 MB mapped fresh: one fault per 4 KB page
    assert kept < plain / 100  # the freed block's pages, already faulted in, are reused


def test_a_users_own_allocator_settings_win():
    env = with_allocator_env({"MALLOC_MMAP_THRESHOLD_": "131072", "THP_MEM_ALLOC_ENABLE": "0"})
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072" and env["THP_MEM_ALLOC_ENABLE"] == "0"
    assert env["MALLOC_TRIM_THRESHOLD_"] == ALLOCATOR_ENV["MALLOC_TRIM_THRESHOLD_"]
