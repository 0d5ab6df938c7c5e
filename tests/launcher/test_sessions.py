"""Cluster configurations the shared sessions cannot have: each runs in its own process and JVM."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(*args: str, timeout: float = 180) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "special_sessions.py"), *args],
        capture_output=True, text=True, timeout=timeout,
    )
    return proc.stdout


def result(out: str):
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_no_active_session_says_how_to_make_one():
    code = "from spark_dl import HorovodRunner\nHorovodRunner(np=2).run(print)"
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t < 30
    assert proc.returncode != 0
    assert "LaunchRefused" in proc.stderr and "no active SparkSession" in proc.stderr
    assert "SparkSession.builder" in proc.stderr and "np=-2" in proc.stderr


def test_two_gpus_per_task_start_one_rank_per_gpu():
    ranks = result(run_script("gpu2"))
    assert [r["RANK"] for r in ranks] == ["0", "1"]
    assert ranks[0]["task_pid"] == ranks[1]["task_pid"], "both ranks come from the one task that holds both GPUs"
    assert [r["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["0,1", "0,1"]
    assert [r["SPARK_DL_CUDA_DEVICE"] for r in ranks] == ["0", "1"]
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1"]


def test_one_gpu_per_task_sets_cuda_visible_devices_from_the_task_resources():
    ranks = result(run_script("gpu1"))
    assert ranks[0]["task_pid"] != ranks[1]["task_pid"]
    visible = {r["CUDA_VISIBLE_DEVICES"] for r in ranks}
    assert len(visible) == 1 and sorted(visible.pop().split(",")) == ["0", "1"]
    # each rank's own GPU is at index LOCAL_RANK, so torch.cuda.set_device(local_rank) is right
    assert [r["SPARK_DL_CUDA_DEVICE"] for r in ranks] == [r["LOCAL_RANK"] for r in ranks] == ["0", "1"]


def test_dynamic_allocation_is_refused_before_launch():
    out = run_script("dynalloc")
    assert "REFUSED " in out and "spark.dynamicAllocation.enabled=false" in out
