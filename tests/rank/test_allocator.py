"""spark_dl.rank.allocator: a rank reuses a large freed block without page faults (glibc told so),
unless the user turned it off or chose their own malloc settings."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from spark_dl import HorovodRunner
from spark_dl.protocol import MALLOC_ENV
from spark_dl.rank import allocator

BLOCK = 64 << 20  # above glibc's largest mmap threshold (32 MB): mmapped and unmapped each time by default
HUGE_PAGES = BLOCK >> 21  # a block faulted in again costs at least one fault per 2 MB (ranks use huge pages)


def churn(cycles: int = 5) -> dict:
    """Allocate, touch and free a 64 MB tensor ``cycles`` times (as a gradient after zero_grad());
    the minor page faults that cost, and what the rank's allocator setting was."""
    import resource

    import torch

    from spark_dl.rank import allocator

    for _ in range(4):  # the first faults its pages in whatever the setting, and the heap settles
        torch.empty(BLOCK // 4).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        torch.empty(BLOCK // 4).fill_(1.0)
    return {"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
            "choice": allocator.choice(os.environ)}


@pytest.mark.parametrize("env", [{}, {"LD_PRELOAD": "", "PATH": "/bin"}, {"MALLOC_ARENA_MAX": "4"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}])
def test_choice_is_reuse_by_default_and_beside_other_malloc_settings(env):
    assert allocator.choice(env) == "reuse"


@pytest.mark.parametrize("value", ["0", "off", "false", " No "])
def test_choice_off(value):
    assert allocator.choice({MALLOC_ENV: value}) == "off"


@pytest.mark.parametrize("env", [
    {"MALLOC_MMAP_THRESHOLD_": "131072"},
    {"MALLOC_TRIM_THRESHOLD_": "0"},
    {"MALLOC_MMAP_MAX_": "65536"},
    {"MALLOC_TOP_PAD_": "0"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_max=8"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    {"LD_PRELOAD": "/opt/gperftools/lib/libtcmalloc_minimal.so.4"},
])
def test_users_own_malloc_settings_win(env):
    assert allocator.choice(env) == "user"


def test_tune_in_a_fresh_interpreter():
    """tune() itself, in a process of its own (it changes the process's malloc for good)."""
    code = textwrap.dedent(f"""
        import resource, torch
        from spark_dl.rank import allocator
        print(allocator.tune({{}}))
        for _ in range(4):  # the heap settles: small allocations after the first ones land in its space
            torch.empty({BLOCK // 4}).fill_(1.0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            torch.empty({BLOCK // 4}).fill_(1.0)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    what, faults = out.stdout.split()
    assert what == "reuse"
    assert int(faults) < HUGE_PAGES, faults  # 5 x 16384 without it (4 kB pages here)


def test_a_rank_reuses_large_blocks():
    out = HorovodRunner(np=-2).run(churn)
    assert out["choice"] == "reuse"
    assert out["faults"] < HUGE_PAGES, out


def test_switched_off_a_rank_faults_as_glibc_does():
    out = HorovodRunner(np=-2, env={MALLOC_ENV: "0"}).run(churn)
    assert out["choice"] == "off"
    assert out["faults"] >= 5 * HUGE_PAGES, out  # every block faulted in again


def test_users_malloc_variable_leaves_glibc_alone():
    out = HorovodRunner(np=-2, env={"MALLOC_TRIM_THRESHOLD_": "131072"}).run(churn)
    assert out["choice"] == "user"
    assert out["faults"] >= 5 * HUGE_PAGES, out
