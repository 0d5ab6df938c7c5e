"""runners/train_digits.py as a user runs it: real spark-submit on a two-executor local cluster.

Each spark-submit starts a JVM and a local cluster, so there are two of them; the checks that must
not start Spark (--help, bad arguments, --np -N) run under plain python with SPARK_HOME pointing
nowhere, so any attempt to start a JVM would fail them.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyspark
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "runners" / "train_digits.py")
CLUSTER = "local-cluster[2,1,1024]"
OPTIONS = ("--np", "--epochs", "--batch-size", "--lr", "--compression", "--seed", "--min-accuracy",
           "--max-restarts", "--run-timeout", "--checkpoint-dir", "--no-tracking", "--master")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_DL_TRACKING="0")
    env.update(extra)
    return env


def _spark_submit(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    exe = shutil.which("spark-submit") or os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    cmd = [exe, "--master", CLUSTER, "--conf", "spark.executor.memory=768m", "--conf", "spark.ui.enabled=false",
           SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=timeout)


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # No Spark for these: a JVM start would fail on the bogus SPARK_HOME.
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          env=_env(SPARK_HOME="/nonexistent/spark"), cwd=ROOT, timeout=timeout)


def _accuracy(stdout: str) -> float:
    match = re.search(r"^test accuracy: ([0-9.]+)", stdout, re.MULTILINE)
    assert match, f"no accuracy line in stdout:\n{stdout}"
    return float(match.group(1))


def test_help_lists_every_option_and_exit_codes():
    proc = _python("--help", timeout=30)
    assert proc.returncode == 0, proc.stderr
    for option in OPTIONS:
        assert option in proc.stdout
    for name in ("qsgd", "powersgd", "efsign", "topk"):
        assert name in proc.stdout
    assert "Exit codes" in proc.stdout


def test_bad_arguments_exit_2_with_argparse_message():
    for args, needle in [
        (["--compression", "zip"], "invalid choice: 'zip'"),
        (["--np", "0"], "must not be 0"),
        (["--epochs", "two"], "--epochs"),
        (["--min-accuracy", "1.5"], "between 0 and 1"),
        (["--bogus"], "unrecognized arguments"),
        (["--max-restarts", "-1"], "must be 0 or more"),
        (["--run-timeout", "0"], "must be a finite number of seconds > 0"),
        (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
        (["--lr", "-0.1"], "argument --lr: must be a finite number > 0, got -0.1"),
    ]:
        proc = _python(*args, timeout=30)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)


def test_accuracy_below_minimum_exits_3_without_spark():
    # (with --compression auto: the runner takes it as it takes a compressor's name)
    proc = _python("--np", "-2", "--epochs", "1", "--no-tracking", "--min-accuracy", "0.999", "--compression", "auto")
    assert proc.returncode == 3, proc.stderr
    assert 0.0 < _accuracy(proc.stdout) < 0.999 and "compression=auto" in proc.stdout
    assert "below --min-accuracy 0.999" in proc.stderr


def test_a_killed_rank_is_restarted_and_training_resumes_after_the_last_epoch(tmp_path):
    import glob
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, SCRIPT, "--np", "-2", "--epochs", "6", "--no-tracking",
                             "--max-restarts", "1", "--min-accuracy", "0.8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            # a stall is told after 30 s, so a hang's report names where each rank was
                            env=_env(SPARK_HOME="/nonexistent/spark", TMPDIR=str(tmp_path),
                                     HOROVOD_STALL_CHECK_TIME_SECONDS="30"))
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(str(tmp_path / "spark-dl-checkpoint-*" / "latest.ckpt")):  # epoch 0 is done
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "spark_dl.rank.main" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        ranks[-1].kill()
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the restarted run did not finish within 180 s; its stderr ends:\n{err[-6000:]}")
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    # the killed rank's exit, or the other rank's error from its broken collective: whichever reached the driver first
    assert re.search(r"\[spark-dl\] attempt 1 of 2 failed: rank [01] on localhost failed: ", err), err
    assert "(restart 1 of max_restarts=1); load_checkpoint() returns the one saved at step" in err
    assert _accuracy(out) > 0.8


def test_a_job_whose_driver_was_killed_resumes_from_checkpoint_dir(tmp_path):
    import signal
    import time

    ckpt = tmp_path / "ckpt"
    args = [sys.executable, SCRIPT, "--np", "-2", "--epochs", "6", "--no-tracking", "--checkpoint-dir", str(ckpt),
            "--min-accuracy", "0.8"]
    env = _env(SPARK_HOME="/nonexistent/spark")
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "latest.ckpt").exists():  # epoch 0 is done
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # the driver dies; its ranks die with it
        first.communicate(timeout=30)
    finally:
        first.kill()
    again = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.search(rf"\[spark-dl\] resuming from {re.escape(str(ckpt))}: load_checkpoint\(\) returns the one "
                     r"saved at step \d+", again.stderr), again.stderr
    assert _accuracy(again.stdout) > 0.8


def test_spark_submit_trains_with_qsgd_on_local_cluster():
    proc = _spark_submit("--np", "2", "--epochs", "3", "--compression", "qsgd", "--no-tracking",
                         "--min-accuracy", "0.8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _accuracy(proc.stdout) > 0.8
    assert "2 ranks, compression=qsgd, 3 epochs" in proc.stdout


def test_spark_submit_more_ranks_than_slots_exits_1_with_launch_refused_message():
    # spark-submit merges Python's stderr into its stdout; the runner's errors must still reach
    # spark-submit's stderr. spark-submit's master also wins over the script's --master.
    proc = _spark_submit("--np", "5", "--no-tracking", "--master", "local[8]", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ignoring --master local[8]: spark-submit set the master to local-cluster[2,1,1024]" in proc.stderr
    assert "train_digits.py: run refused: np=5 needs 5 task slots at once, but this cluster has only 2" in proc.stderr
    # The typed error's message, not a Python or Py4J traceback.
    assert "Traceback" not in proc.stderr
    assert "Py4JJavaError" not in proc.stderr
    assert "test accuracy" not in proc.stdout


def test_run_timeout_must_be_finite_naming_the_flag_value_and_fix():
    for value in ("inf", "nan", "-1"):
        proc = _python("--run-timeout", value, timeout=30)
        assert proc.returncode == 2, (value, proc.stderr)
        assert (f"argument --run-timeout: must be a finite number of seconds > 0, got '{value}': pass one, e.g. 600, "
                "or leave the option out for no limit") in proc.stderr, proc.stderr
