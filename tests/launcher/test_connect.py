"""Spark Connect: HorovodRunner and the layers on it, driven from a Connect client.

A real Spark Connect server (``SparkConnectServer`` through spark-submit, on a two-executor local
cluster) runs in its own JVM; each client is a process of its own (connect_client.py), as a
notebook on a shared-access cluster talks to its driver.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyspark
import pytest

from spark_dl.driver.cluster import slots_of_master
from spark_dl.driver.spark_errors import executor_lost_hint, spark_error_summary

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER_START_S = 120


def _free_port() -> int:
    from spark_dl.task.ports import free_port  # below the ephemeral range: no connection takes it first

    return free_port()


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory):
    home = os.path.dirname(pyspark.__file__)
    port = _free_port()
    log = tmp_path_factory.mktemp("connect") / "server.log"
    env = {**os.environ, "SPARK_HOME": home, "PYSPARK_PYTHON": sys.executable}
    cmd = [os.path.join(home, "bin", "spark-submit"),
           "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
           "--master", "local-cluster[2,1,1024]",
           "--conf", f"spark.connect.grpc.binding.port={port}",
           "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
           "--conf", "spark.executor.memory=768m",
           "--conf", "spark.ui.enabled=false"]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while "Spark Connect server started" not in log.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Spark Connect server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the executor JVMs it started
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def client(mode: str, url: str, tmp_path) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "connect_client.py"), mode, url],
                          capture_output=True, text=True, timeout=240, cwd=str(tmp_path),
                          env={**os.environ, "PID_DIR": str(tmp_path)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the client failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


def test_horovod_runner_through_spark_connect(connect_url, tmp_path):
    out, text = client("run", connect_url, tmp_path)
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == ["0", "1"]
    assert all(r["sum"] == 3.0 and r["tag"] == "a" and r["y"] == 4 for r in ranks)  # one Gloo group, args sent
    assert ranks[0]["task_pid"] != ranks[1]["task_pid"], "each rank runs under its own barrier task"
    assert "[1]<stdout>: hello from rank 1" in text  # the ranks' output reaches the client

    failure = out["failure"]  # the failing rank's error, at once; the other rank is stopped
    assert failure["type"] == "RankFailed" and failure["rank"] == 1
    assert "ValueError: loss is NaN on rank 1" in failure["message"]
    assert failure["seconds"] < 30 and out["left_alive"] == []
    assert out["after_failure"] == 3.0  # the interrupted job left the cluster usable
    assert out["restarted"] == 1  # max_restarts: the second attempt's result

    too_many = out["too_many"]  # declared by spark.master, refused before launch
    assert too_many["type"] == "LaunchRefused" and too_many["seconds"] < 5
    assert "np=3 needs 3 task slots" in too_many["message"]
    assert "spark.master=local-cluster[2,1,1024]" in too_many["message"]

    hung = out["run_timeout"]
    assert hung["type"] == "JobFailed" and "exceeded run_timeout=3 s" in hung["message"] and hung["seconds"] < 30
    assert "[1]<stdout>: script rank 1 of 2 ['--code', '0']" in text  # run_script, as torchrun would
    script = out["script_failure"]
    assert script["type"] == "RankFailed" and script["rank"] == 1 and "exited with status 3" in script["message"]


def test_data_and_compatibility_layers_through_spark_connect(connect_url, tmp_path):
    out, _ = client("data", connect_url, tmp_path)
    first, second = out["shards"]
    assert not set(first) & set(second) and sorted(first + second) == [float(i) for i in range(10)]
    assert out["distributor"] == [0, 2, "0", 5]  # TorchDistributor(local_mode=False): a task per process
    refused = out["distributor_gpu"]
    assert refused["type"] == "NoGPUs" and "spark.task.resource.gpu.amount=0" in refused["message"]
    assert out["horovod_spark"] == [0, 1]  # num_proc defaults to the declared parallelism
    assert out["ray"] == {"rows": 20, "world": 2, "lr": 0.1}  # Ray Train's TorchTrainer, 40 rows in two shards
    est = out["estimator"]  # y = 3x - 0.05, fitted by DDP, predicted by the executors
    assert est["rows"] == 40
    assert abs(est["weight"] - 3.0) < 0.05 and abs(est["bias"] + 0.05) < 0.05 and est["max_error"] < 0.05
    assert len(est["val_history"]) == 60 and est["val_history"][-1] < 1e-3  # held-out rows, a second DataFrame
    saved = out["saved"]  # Spark ML's save / overwrite() / load from a Connect client
    assert "already exists" in saved["exists_error"]
    assert saved["predictions_equal"] and saved["history_equal"] and saved["estimator_epochs"] == 7
    staged = out["staged"]  # prepare_data + fit_on_parquet: the server's executors write and read the Parquet
    assert sum(staged["rows"]) == 40 and staged["rows"][1] > 0
    assert abs(staged["weight"] - 3.0) < 0.05 and staged["val_history"][-1] < 1e-3 and staged["left"] == ["runs"]


def test_start_timeout_and_stopped_session_through_spark_connect(connect_url, tmp_path):
    out, _ = client("timeout", connect_url, tmp_path)
    timed_out = out["timed_out"]  # another job holds every slot: no hang, and the job is interrupted
    assert timed_out["type"] == "JobFailed" and timed_out["seconds"] < 20
    assert "only 0 of 2 barrier tasks started within 4 s" in timed_out["message"]
    assert "spark.driver.host" in timed_out["message"] and "raise start_timeout" in timed_out["message"]
    assert out["after"] == 3.0
    stopped = out["stopped"]
    assert stopped["type"] == "LaunchRefused" and "no active SparkSession" in stopped["message"]


def test_a_client_the_executors_cannot_reach_through_the_relay(connect_url, tmp_path):
    out, text = client("relay", connect_url, tmp_path)
    assert "[spark-dl] the executors report to barrier task 0, not to this client" in text
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == ["0", "1"] and all(r["sum"] == 3.0 and r["y"] == 2 for r in ranks)
    assert "[1]<stdout>: hello from rank 1" in text  # the ranks' output, replayed at the end
    assert out["loss"] == [[0, 1.0], [1, 0.5], [2, 1 / 3]]  # rank 0's metrics reach this client's MLflow run

    failure = out["failure"]  # task 0 stops the others and reports rank 1's error
    assert failure["type"] == "RankFailed" and failure["rank"] == 1
    assert "ValueError: loss is NaN on rank 1" in failure["message"]
    assert failure["seconds"] < 30 and out["left_alive"] == []
    assert out["resumed"] == {"step": 7}  # saved through task 0, kept here, served to the restart by task 0
    assert out["big"] is True  # a 3 MB result, in several result rows

    hung = out["run_timeout"]  # task 0 enforces it, with each rank's last line
    assert hung["type"] == "JobFailed" and "exceeded run_timeout=3 s" in hung["message"] and hung["seconds"] < 30
    assert "[1]<stdout>: rank 1 waits for a peer" in hung["message"]
    first, second = out["shards"]
    assert not set(first) & set(second) and sorted(first + second) == [float(i) for i in range(10)]
    # TorchTrainer's merged checkpoint, written by the workers (they see the storage) or through task 0
    assert out["ray_shared"] == out["ray_driver"] == {"shard-0": "0", "shard-1": "1"}
    # a fit resuming from it: in place where the workers see the folder, else served by the relay
    assert out["ray_shared_resumed"]["files"] == out["ray_driver_resumed"]["files"] == out["ray_driver"]
    assert out["ray_shared_resumed"]["in_place"] and not out["ray_driver_resumed"]["in_place"]

    timed_out = out["timed_out"]  # the server's progress reports show the tasks never started
    assert timed_out["type"] == "JobFailed" and timed_out["seconds"] < 20
    assert "only 0 of 2 barrier tasks started within 4 s" in timed_out["message"]


def test_a_relayed_run_whose_task_0_loses_its_executor_fails_fast_and_max_restarts_relaunches_it(
        connect_url, tmp_path):
    out, _ = client("lost", connect_url, tmp_path)
    lost = out["lost"]  # Spark does not rerun a failed barrier result stage: the run fails, saying why
    assert lost["type"] == "JobFailed" and lost["seconds"] < 60 and out["left_alive"] == []
    assert "ExecutorLostFailure" in lost["message"]
    assert "exit code 137: killed with SIGKILL, usually by the OS or the cluster manager" in lost["message"]
    assert "barrier task 0 relayed this attempt, so what it held (output, metrics, checkpoints saved in it) is " \
           "lost. Restarts launch the run again after such a loss: HorovodRunner(max_restarts=N)" in lost["message"]
    # relaunched: the checkpoint the lost attempt saved through task 0 went with it
    assert out["relaunched"] == {"restart_count": 1, "checkpoint": None} and out["left_alive_relaunched"] == []


@pytest.mark.parametrize("master, task_cpus, slots", [
    ("local", 1, 1), ("local[3]", 1, 3), ("local[4, 2]", 1, 4), ("local[6]", 4, 1),
    ("local-cluster[2,1,1024]", 1, 2), ("local-cluster[2, 3, 1024]", 2, 2),
    ("local[*]", 1, None), ("yarn", 1, None), ("spark://host:7077", 1, None), ("k8s://https://h:443", 1, None),
])
def test_slots_a_master_declares(master, task_cpus, slots):
    assert slots_of_master(master, task_cpus) == slots


def test_error_summary_drops_the_servers_java_stack():
    error = RuntimeError("Job aborted due to stage failure: task 1 failed.\nValueError: bad\n\n"
                         "JVM stacktrace:\norg.apache.spark.SparkException: Job aborted\n\tat org.apache.Foo")
    summary = spark_error_summary(error)
    assert "ValueError: bad" in summary and "JVM" not in summary and "org.apache" not in summary


def test_a_lost_executor_gets_a_hint_only_where_the_error_says_so():
    other = ("ExecutorLostFailure (executor 3 exited unrelated to the running tasks) "
             "Reason: Remote RPC client disassociated")
    hint = executor_lost_hint(other, relayed=False)
    assert hint.startswith("\nAn executor was lost during the run. Restarts launch the run again after such a loss: "
                           "HorovodRunner(max_restarts=N)")  # no memory advice without exit code 137, no relay note
    assert "FailureConfig(max_failures=N)" in hint
    for yarn in ("ExecutorLostFailure (executor 2 exited) Reason: Container marked as failed. Exit status: 137.",
                 "ExecutorLostFailure Reason: Container killed by YARN for exceeding physical memory limits."):
        assert "exit code 137: killed with SIGKILL" in executor_lost_hint(yarn, relayed=False)
    assert executor_lost_hint("Job aborted: ValueError: bad", relayed=True) == ""
