"""CPU time per test, the JVMs, rank processes and scripts a test starts included.

The suite is bound by its CPU on 2 cores, and a test's wall time says little about its CPU:
it waits on JVMs and ranks, beside another test worker. ``time``'s user and sys leave out the
processes nobody waits for (JVMs, forked ranks). This plugin puts each test process (each
pytest-xdist worker) in a cgroup of its own, which every process it starts inherits, and records
the cgroup's CPU time around each test: one JSON line per test in ``$CPU_PER_TEST_DIR`` (default
``/tmp/cpu-per-test``), ``{"id", "cpu", "wall"}`` in seconds. A module's fixtures count towards its
first test. Needs root and a cgroup v1 ``cpuacct`` or cgroup v2 hierarchy::

    PYTHONPATH=scripts python -m pytest -p cpu_per_test              # records, then
    python scripts/cpu_per_test.py [--top 30]                        # the report
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

CGROUPS = Path(os.environ.get("CPU_PER_TEST_CGROUPS", "/sys/fs/cgroup"))  # where the hierarchies are mounted
V1, V2 = CGROUPS / "cpuacct", CGROUPS
OUT = Path(os.environ.get("CPU_PER_TEST_DIR", "/tmp/cpu-per-test"))
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")


def _join_cgroup() -> Path:
    """A cgroup of this process's own; the file that counts its CPU."""
    name = f"cpu-per-test-{WORKER}-{os.getpid()}"
    if (V1 / "cpuacct.usage").exists():
        group, usage = V1 / name, "cpuacct.usage"
    elif (V2 / "cgroup.controllers").exists():
        group, usage = V2 / name, "cpu.stat"
    else:
        raise pytest.UsageError(f"cpu_per_test: no cgroup v1 cpuacct or cgroup v2 hierarchy under {CGROUPS}")
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise pytest.UsageError(f"cpu_per_test: cannot make or join the cgroup {group} ({e}): run as root") from None
    return group / usage


def _seconds(usage: Path) -> float:
    text = usage.read_text()
    if usage.name == "cpu.stat":  # usage_usec N
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec"))) / 1e6
    return int(text) / 1e9  # nanoseconds


_usage: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _usage
    _usage = _join_cgroup()
    OUT.mkdir(parents=True, exist_ok=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _usage is None:
        return
    try:  # back to the parent group, and the group removed: not while a process it started (a JVM) is left in it
        (_usage.parent.parent / "cgroup.procs").write_text(str(os.getpid()))
        _usage.parent.rmdir()
    except OSError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _seconds(_usage), time.monotonic()
    yield
    record = {"id": item.nodeid, "cpu": _seconds(_usage) - cpu, "wall": time.monotonic() - wall}
    with open(OUT / f"{WORKER}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def report(folder: Path, top: int) -> str:
    """The tests and the files that took the most CPU, and the totals."""
    rows = [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]
    if not rows:
        return f"no records in {folder}"
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["id"].split("::")[0]]
        f[0], f[1], f[2] = f[0] + r["cpu"], f[1] + r["wall"], f[2] + 1
    lines = [f"{len(rows)} tests: {sum(r['cpu'] for r in rows) / 60:.1f} CPU minutes, "
             f"{sum(r['wall'] for r in rows) / 60:.1f} minutes of test time over the workers",
             f"\n{'CPU s':>8}{'wall s':>8}  test"]
    lines += [f"{r['cpu']:8.1f}{r['wall']:8.1f}  {r['id']}" for r in sorted(rows, key=lambda r: -r["cpu"])[:top]]
    lines.append(f"\n{'CPU s':>8}{'wall s':>8}{'tests':>7}  file")
    by_cpu = sorted(files.items(), key=lambda kv: -kv[1][0])[:top]
    lines += [f"{c:8.1f}{w:8.1f}{n:7d}  {name}" for name, (c, w, n) in by_cpu]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("folder", nargs="?", default=str(OUT))
    args = parser.parse_args()
    print(report(Path(args.folder), args.top))
