"""runners/run_script.py, torchrun for Spark, as a user runs it: real spark-submit on a two-executor
local cluster once; the rest under plain python with SPARK_HOME pointing nowhere, so any JVM start
would fail them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyspark

ROOT = Path(__file__).resolve().parents[2]
RUNNER = str(ROOT / "runners" / "run_script.py")
OPTIONS = ("--np", "--env", "--nodes", "--max-restarts", "--run-timeout", "--start-timeout", "--checkpoint-dir",
           "--quiet", "--no-tracking", "--master")

TRAIN = """
import argparse, os
import torch, torch.distributed as dist
p = argparse.ArgumentParser()
p.add_argument("--np", type=int)            # the same name as a runner option: it must reach the script
p.add_argument("--fail-first-attempt", action="store_true")
p.add_argument("--exit", type=int, default=0)
a = p.parse_args()
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
if dist.get_rank() == 1 and (a.exit or (a.fail_first_attempt and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0")):
    raise SystemExit(a.exit or 5)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item()}, --np {a.np}, "
      f"MY_VAR={os.environ.get('MY_VAR')}, attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
print(f"rank {dist.get_rank()} local rank {os.environ['LOCAL_RANK']} node {os.environ['GROUP_RANK']}", flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SPARK_DL_TRACKING": "0", **extra}


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, RUNNER, *args], capture_output=True, text=True,
                          env=_env(SPARK_HOME="/nonexistent/spark"), cwd=ROOT, timeout=timeout)


def _script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return str(path)


def test_spark_submit_runs_the_script_on_every_rank_with_its_own_arguments(tmp_path):
    exe = shutil.which("spark-submit") or os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    cmd = [exe, "--master", "local-cluster[2,1,1024]", "--conf", "spark.executor.memory=768m",
           "--conf", "spark.ui.enabled=false", RUNNER, "--np", "2", "--env", "MY_VAR=x=1", _script(tmp_path),
           "--np", "7"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (0, 1):  # streamed to the driver, tagged with the rank
        assert f"[{r}]<stdout>: rank {r} of 2: sum 3.0, --np 7, MY_VAR=x=1, attempt 0" in proc.stdout
    assert "run_script.py: " in proc.stderr and "finished on 2 ranks" in proc.stderr


def test_local_processes_without_spark(tmp_path):
    proc = _python("--np", "-2", _script(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1]<stdout>: rank 1 of 2: sum 3.0, --np None" in proc.stdout


def test_a_failing_rank_exits_1_naming_the_rank_and_status(tmp_path):
    proc = _python("--np", "-2", _script(tmp_path), "--exit", "3")
    assert proc.returncode == 1
    assert f"run_script.py: {tmp_path / 'train.py'} failed: rank 1 on localhost failed" in proc.stderr
    assert "exited with status 3" in proc.stderr


def test_max_restarts_reruns_a_failed_attempt(tmp_path):
    proc = _python("--np", "-2", "--max-restarts", "1", _script(tmp_path), "--fail-first-attempt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 2: sum 3.0, --np None, MY_VAR=None, attempt 1" in proc.stdout
    assert "finished on 2 ranks, 1 restart(s)" in proc.stderr


def test_nodes_tasks_makes_each_spark_task_a_node(tmp_path):
    """Under plain python on local[2]: both tasks share the host, yet each is its own node."""
    proc = subprocess.run([sys.executable, RUNNER, "--np", "2", "--master", "local[2]", "--nodes", "tasks",
                           "--no-tracking", _script(tmp_path)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 local rank 0 node 0" in proc.stdout and "rank 1 local rank 0 node 1" in proc.stdout


def test_quiet_keeps_rank_output_off_the_driver(tmp_path):
    proc = _python("--np", "-2", "--quiet", _script(tmp_path))
    assert proc.returncode == 0 and "rank 0 of 2" not in proc.stdout


def test_refusals_exit_1_before_spark_starts(tmp_path):
    for args, needle in [
        ([str(tmp_path / "missing.py")], "does not exist"),
        (["--env", "RANK=3", _script(tmp_path)], "env sets RANK"),
    ]:
        proc = _python("--np", "2", *args, timeout=30)  # np > 0: Spark would start, and fail, if reached
        assert proc.returncode == 1, (args, proc.stderr)
        assert "run_script.py: run refused: " in proc.stderr and needle in proc.stderr, (args, proc.stderr)


def test_spark_that_cannot_start_is_one_line_not_a_trace(tmp_path):
    """SPARK_HOME points nowhere here, so the JVM cannot start: the runner says so and exits 1."""
    proc = _python("--np", "2", "--master", "local[2]", _script(tmp_path), timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "run_script.py: could not start Spark on master 'local[2]' (" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_arguments_exit_2_and_help_lists_options():
    for args, needle in [
        ([], "the following arguments are required: script"),
        (["--np", "0", "x.py"], "must not be 0"),
        (["--env", "NOVALUE", "x.py"], "must be NAME=VALUE"),
        (["--run-timeout", "-1", "x.py"], "must be a finite number of seconds > 0"),
        (["--nodes", "racks", "x.py"], "invalid choice: 'racks'"),
    ]:
        proc = _python(*args, timeout=30)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)
    proc = _python("--help", timeout=30)
    assert proc.returncode == 0 and all(o in proc.stdout for o in OPTIONS) and "Exit codes" in proc.stdout


def test_a_timeout_that_is_not_a_finite_number_above_0_is_refused_naming_the_flag_value_and_fix():
    for flag, value, unset in [("--run-timeout", "inf", "no limit"), ("--run-timeout", "nan", "no limit"),
                               ("--run-timeout", "-5", "no limit"), ("--start-timeout", "inf", "the default, 300")]:
        proc = _python(flag, value, "x.py", timeout=30)
        assert proc.returncode == 2, (flag, value, proc.stderr)
        assert (f"argument {flag}: must be a finite number of seconds > 0, got '{value}': pass one, e.g. 600, "
                f"or leave the option out for {unset}") in proc.stderr, proc.stderr


def test_a_script_path_that_is_not_a_regular_file_says_what_it_is(tmp_path):
    for path, needle in [("/dev/null", "training script '/dev/null' is a character device (/dev/null), not a "
                                       "regular file: name the .py file to run"),
                         (str(tmp_path), f"training script '{tmp_path}' is a folder ({tmp_path}): name the .py file")]:
        proc = _python("--np", "2", path, timeout=30)  # np > 0: refused before Spark would start (and fail)
        assert proc.returncode == 1, proc.stderr
        assert f"run_script.py: run refused: {needle}" in proc.stderr and "does not exist" not in proc.stderr


EXITS_OR_RAISES = """
import sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print(f"rank {dist.get_rank()} done", flush=True)
if dist.get_rank() == 1:
    if sys.argv[1] == "exit":
        sys.exit(3)
    def load_batch():
        raise ValueError("bad batch 17")
    load_batch()
"""


def test_a_script_exiting_with_a_status_is_one_line_without_tracebacks_a_raise_keeps_its_traceback(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(EXITS_OR_RAISES)
    proc = _python("--np", "-2", str(script), "exit")
    assert proc.returncode == 1
    assert proc.stderr.count(f"[1]<stderr>: {script} exited with status 3\n") == 1, proc.stderr
    assert f"run_script.py: {script} failed: rank 1 on localhost failed: {script} exited with status 3" \
        in proc.stderr, proc.stderr
    assert proc.stderr.count("exited with status 3") == 2, proc.stderr  # the rank's line and the error
    assert "Traceback" not in proc.stderr and "ScriptExit" not in proc.stderr and "rank_main" not in proc.stderr
    proc = _python("--np", "-2", str(script), "raise")
    assert proc.returncode == 1
    assert "failed: rank 1 on localhost failed: builtins.ValueError: bad batch 17" in proc.stderr, proc.stderr
    assert "Remote traceback (rank 1):" in proc.stderr and f'File "{script}", line 11, in load_batch' in proc.stderr


def test_a_spark_master_no_one_answers_at_is_one_line_before_spark_starts(tmp_path):
    """Spark would start, wait out its registration retries (a minute) and the barrier stage's start
    timeout; a closed port is named at once instead."""
    import socket
    import time

    with socket.socket() as s:  # bound, never listening: nothing answers there
        s.bind(("127.0.0.1", 0))
        master = f"spark://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        proc = _python("--np", "2", "--master", master, _script(tmp_path), timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert f"run_script.py: could not start Spark: no Spark master answers at {master} (" in proc.stderr
    assert "ConnectionRefusedError" in proc.stderr and "sbin/start-master.sh" in proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - t0 < 30


STALLING = """
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(600)
dist.all_reduce(torch.ones(1))
"""


def test_stall_options_end_a_stalled_script_and_off_turns_one_off(tmp_path):
    script = tmp_path / "stalls.py"
    script.write_text(STALLING)
    proc = _python("--np", "-2", "--stall-warning", "off", "--stall-timeout", "3", str(script))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[spark-dl] stalled:" not in proc.stderr  # no warning: it is off
    assert "failed: rank 0 (localhost) has waited" in proc.stderr and "in dist.all_reduce at stalls.py:8" in proc.stderr
    bad = _python("--np", "-2", "--stall-timeout", "soon", str(script))
    assert bad.returncode == 2 and "--stall-timeout: must be a finite number of seconds > 0" in bad.stderr
