"""scripts/cpu_per_test.py: the CPU a test's child processes use counts towards the test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BURN = '''
import subprocess, sys

def test_a_child_burns_cpu():
    burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)

def test_idle():
    pass
'''


def _pytest_with_the_plugin(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_burn.py").write_text(BURN)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts =\n")
    # not PYTEST_XDIST_WORKER and the like: the inner pytest is no xdist worker, whatever runs this test
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env = {**outer, "PYTHONPATH": str(ROOT / "scripts"), "CPU_PER_TEST_DIR": str(tmp_path / "records"), **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpu_per_test", "-p", "no:cacheprovider",
                           "test_burn.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_tests_child_processes_count_towards_its_cpu_or_the_plugin_says_why_it_cannot(tmp_path):
    done = _pytest_with_the_plugin(tmp_path)
    out = tmp_path / "records"
    if done.returncode != 0:  # no cgroups to join here: said at once, naming what is missing
        assert "cpu_per_test: " in done.stderr and ("cgroup" in done.stderr), done.stdout + done.stderr
        return
    records = {r["id"]: r for r in map(json.loads, (out / "main.jsonl").read_text().splitlines())}
    assert set(records) == {"test_burn.py::test_a_child_burns_cpu", "test_burn.py::test_idle"}, records
    assert records["test_burn.py::test_a_child_burns_cpu"]["cpu"] >= 0.45, records
    assert records["test_burn.py::test_idle"]["cpu"] < 0.2, records
    report = subprocess.run([sys.executable, str(ROOT / "scripts" / "cpu_per_test.py"), str(out)],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0 and report.stdout.startswith("2 tests: "), report.stdout + report.stderr
    assert "test_burn.py::test_a_child_burns_cpu" in report.stdout.splitlines()[3], report.stdout


def test_without_cgroups_the_plugin_stops_pytest_at_once_naming_where_it_looked(tmp_path):
    done = _pytest_with_the_plugin(tmp_path, CPU_PER_TEST_CGROUPS=str(tmp_path / "none"))
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error, before any test
    assert f"cpu_per_test: no cgroup v1 cpuacct or cgroup v2 hierarchy under {tmp_path / 'none'}" in done.stderr
