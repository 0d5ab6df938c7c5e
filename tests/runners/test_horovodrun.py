"""runners/horovodrun.py, horovodrun's command line on Spark, with a Horovod script left as it was
written: a real Spark local cluster once, local processes otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNER = str(ROOT / "runners" / "horovodrun.py")

HOROVOD_SCRIPT = """
import argparse
import torch
import horovod.torch as hvd                       # as written for horovodrun
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float)
a = p.parse_args()
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
print(f"rank {hvd.rank()} of {hvd.size()}: sum {total}, lr {a.lr}", flush=True)
"""


def _run(*args: str, spark: bool = False, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_DL_TRACKING": "0", **extra_env}
    if not spark:
        env["SPARK_HOME"] = "/nonexistent/spark"  # any JVM start would fail
    return subprocess.run([sys.executable, RUNNER, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)


def test_a_horovod_script_on_local_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    proc = _run("-np", "-2", "--gloo", "python", str(script), "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        assert f"rank {r} of 2: sum 3.0, lr 0.1" in proc.stdout + proc.stderr


def test_no_tracking_logs_nothing_where_tracking_is_on_by_default(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    store = tmp_path / "mlflow.db"
    proc = _run("-np", "-2", "--no-tracking", "python", str(script), "--lr", "0.3",
                SPARK_DL_TRACKING="1", MLFLOW_TRACKING_URI=f"sqlite:///{store}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 of 2: sum 3.0, lr 0.3" in proc.stdout + proc.stderr
    assert not store.exists()  # not even created


def test_interpreter_flags_a_leading_double_dash_and_start_timeout_as_horovodrun_takes_them(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    proc = _run("-np", "-2", "--start-timeout", "60", "--", "python", "-u", str(script), "--lr", "0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 of 2: sum 3.0, lr 0.2" in proc.stdout + proc.stderr
    assert "horovodrun.py: " in proc.stderr and "run_script.py:" not in proc.stderr  # its own name


def test_a_horovod_script_in_a_spark_barrier_stage(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    proc = _run("--num-proc", "2", "--master", "local[2]", str(script), "--lr", "0.5", spark=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        assert f"rank {r} of 2: sum 3.0, lr 0.5" in proc.stdout + proc.stderr


def test_what_spark_cannot_do_is_refused_with_exit_2(tmp_path):
    script = str(tmp_path / "train.py")
    for args, message in [(["-np", "2", "-H", "a:2,b:2", "python", script], "Spark places the ranks"),
                          (["-np", "2", "--mpi", "python", script], "no MPI here"),
                          (["-np", "2", "python", "-m", "train"], "python -m: the command must be a script file"),
                          (["-np", "2", "python", "-X", "dev", script], "python -X: interpreter options cannot"),
                          (["-np", "2", "-p", "12345", "python", script], "-p/--ssh-port: Spark starts the ranks"),
                          (["-np", "2", "--min-np", "1", "python", script], "run_elastic"),
                          (["-np", "2", "bash", "run.sh"], "must be a Python script"),
                          (["python", script], "-np/--num-proc"),
                          (["-np", "0", "python", script], "")]:
        proc = _run(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)


def test_a_start_timeout_that_is_not_a_finite_number_above_0_is_refused_under_horovodrun_s_name(tmp_path):
    proc = _run("-np", "2", "--start-timeout", "inf", "python", str(tmp_path / "train.py"))
    assert proc.returncode == 2, proc.stderr
    assert ("horovodrun.py: error: argument --start-timeout: must be a finite number of seconds > 0, got 'inf'"
            in proc.stderr), proc.stderr


STALLING_SCRIPT = """
import time
import torch
import horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    time.sleep(600)
hvd.allreduce(torch.ones(1), name="never_joined")
"""


def test_horovodruns_stall_check_options_reach_the_stall_inspector(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STALLING_SCRIPT)
    proc = _run("-np", "-2", "--stall-check-warning-time-seconds", "1", "--stall-check-shutdown-time-seconds", "3",
                "python", str(script))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[spark-dl] stalled: rank 0" in proc.stderr
    failed = next(line for line in proc.stderr.splitlines() if line.startswith("horovodrun.py: "))
    assert "train.py failed: rank 0 (localhost) has waited" in failed
    assert "in hvd.allreduce at train.py:8 in <module> for rank 1 (localhost)" in failed
    assert "--- rank 1 on localhost ---" in proc.stderr  # every rank's stack follows


def test_no_stall_check_turns_both_bounds_off():
    sys.path.insert(0, str(ROOT / "runners"))
    try:
        import horovodrun
    finally:
        sys.path.pop(0)
    assert horovodrun.translate(["-np", "2", "--no-stall-check", "python", "t.py"])[-5:] == [
        "--stall-warning", "off", "--stall-timeout", "off", "t.py"]
    assert horovodrun.translate(["-np", "2", "--stall-check-shutdown-time-seconds", "0", "t.py"])[-3:] == [
        "--stall-timeout", "off", "t.py"]
