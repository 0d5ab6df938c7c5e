"""``spark_dl.horovod.spark.run`` / ``run_elastic``: Horovod-on-Spark code (``horovod.spark.run(fn,
args, kwargs, num_proc)``) in real barrier stages, with Horovod's options mapped or refused."""
from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest
import spark_dl.horovod.spark as horovod_spark
from slots import OtherJob
from test_elastic import BATCH, N, elastic_train

from spark_dl import LaunchRefused


def fn(magic, scale=1.0, main="a kwarg named like HorovodRunner.run's first parameter"):
    import os

    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
    print(f"rank {hvd.rank()} of {hvd.size()} says hi", flush=True)
    env = {k: os.environ.get(k) for k in ("MY_VAR", "RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    return hvd.rank(), total.item() * scale, magic, main, env


def test_run_returns_every_ranks_result_in_rank_order(spark):
    out = horovod_spark.run(fn, args=(7,), kwargs={"scale": 2.0, "main": "m"}, num_proc=2,
                            env={"MY_VAR": "v", "RANK": "9"}, nics={"lo"})
    assert [o[:4] for o in out] == [(0, 6.0, 7, "m"), (1, 6.0, 7, "m")]
    envs = [o[4] for o in out]
    assert [e["RANK"] for e in envs] == ["0", "1"], "the launcher's RANK, not env's"
    assert {e["MY_VAR"] for e in envs} == {"v"}
    assert {(e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) for e in envs} == {("lo", "lo")}


def test_num_proc_defaults_to_the_default_parallelism(spark):
    out = horovod_spark.run(fn, args=(1,))
    assert len(out) == spark.sparkContext.defaultParallelism == 4
    assert [o[1] for o in out] == [10.0] * 4


def test_rank_output_goes_to_the_given_streams_with_timestamps(spark):
    out, err = io.StringIO(), io.StringIO()
    horovod_spark.run(fn, args=(1,), num_proc=2, stdout=out, stderr=err, prefix_output_with_timestamp=True)
    lines = [line for line in out.getvalue().splitlines() if "says hi" in line]
    assert len(lines) == 2
    for line in lines:
        assert re.match(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[\d\]<stdout>: rank \d of 2 says hi$", line), line


@pytest.mark.parametrize("kwargs, match", [
    ({"use_mpi": True}, "spark-dl has no MPI"),
    ({"extra_mpi_args": "-x FOO"}, "no MPI to pass them to"),
    ({"executable": "/usr/bin/python3"}, "PYSPARK_PYTHON"),
    ({"num_proc": 0}, "num_proc must be an int >= 1"),
    ({"env": ["X=1"]}, "env must be a dict"),
    ({"args": 5}, r"args must be a tuple of fn's positional arguments, got 5: for one argument write args=\(5,\)"),
    ({"args": "ab"}, r"args must be a tuple .*args=\('ab',\)"),
    ({"kwargs": [("scale", 1)]}, "kwargs must be a dict of fn's keyword arguments"),
    ({"kwargs": {1: 2}}, r"kwargs must be a dict .*\(str keys\)"),
])
def test_what_has_no_counterpart_is_refused(kwargs, match):
    with pytest.raises(LaunchRefused, match=match):
        horovod_spark.run(fn, **{"args": (1,), "num_proc": 2, **kwargs})


@pytest.mark.parametrize("value", ["abc", "-5", "nan", "inf"])
def test_a_bad_start_timeout_in_the_environment_is_named(monkeypatch, value):
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", value)
    with pytest.raises(LaunchRefused, match=rf"HOROVOD_SPARK_START_TIMEOUT='{value}' is not a number >= 0 s.*unset it "
                                           r"for the default, 600 s"):
        horovod_spark.run(fn, args=(1,), num_proc=2)


def test_numpy_counts_and_an_env_start_timeout_are_taken(spark, monkeypatch):
    import numpy

    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", " 45 ")
    assert [o[:2] for o in horovod_spark.run(fn, args=(1,), num_proc=numpy.int64(2))] == [(0, 3.0), (1, 3.0)]
    runner = horovod_spark._runner(numpy.int32(3), None, None, None, None, None, None, None, False, None, 0)
    assert runner.np == 3 and type(runner.np) is int and runner.start_timeout == 45.0


def test_run_elastic_restarts_from_the_last_commit(spark, tmp_path):
    outs = horovod_spark.run_elastic(elastic_train, kwargs={"out_dir": str(tmp_path)}, num_proc=2)
    assert [o["attempt"] for o in outs] == [1, 1], "one restart after rank 1 died"
    assert [o["start"]["epoch"] for o in outs] == [1, 1] and outs[0]["params"] == outs[1]["params"]


def test_run_elastic_takes_the_free_slots_up_to_max_num_proc(spark):
    outs = horovod_spark.run_elastic(fn, args=(1,), num_proc=2, max_num_proc=4)  # local[4]: all four free
    assert [o[:2] for o in outs] == [(r, 10.0) for r in range(4)]  # 1 + 2 + 3 + 4 over four ranks


def test_run_elastic_grows_at_a_commit_when_slots_free_up(spark, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(horovod_spark, "RUN_ELASTIC_GROW_INTERVAL_S", 0.5)  # Horovod finds new hosts in seconds
    with OtherJob(spark.sparkContext, str(tmp_path)) as other:
        other.start()  # local[4] has two free slots: the run starts on min_num_proc=2
        # a commit after every batch; attempt 0's batches are slow, and after its third one rank 0
        # lets the other job's two slots go
        outs = horovod_spark.run_elastic(elastic_train, num_proc=2, min_num_proc=2, max_num_proc=4, reset_limit=0,
                                         kwargs={"out_dir": str(tmp_path), "epochs": 2, "crash": None,
                                                 "commit_every": 1, "release": str(tmp_path)})
    assert [o["size"] for o in outs] == [4] * 4 and [o["attempt"] for o in outs] == [1] * 4
    assert "growing from 2 to all 4 ranks" in capfd.readouterr().err
    # the grown attempt resumed epoch 0 from the commit it stopped at: the samples committed on two
    # ranks are not seen again, the rest of the epoch is split over four, and epoch 1 is whole
    committed = set(outs[0]["start"]["committed"])
    assert outs[0]["start"]["epoch"] == 0 and len(committed) >= 3 * 2 * BATCH and len(committed) % (2 * BATCH) == 0
    epoch0 = sorted(i for o in outs for e, i in o["seen"] if e == 0)
    assert committed.isdisjoint(epoch0) and sorted(committed | set(epoch0)) == list(range(N))
    assert len(epoch0) == N - len(committed)
    assert sorted(i for o in outs for e, i in o["seen"] if e == 1) == list(range(N))
    assert all(o["params"] == outs[0]["params"] for o in outs)


@pytest.mark.parametrize("kwargs, match", [
    ({"min_num_proc": 3}, r"min_num_proc=3 <= num_proc=2 <= max_num_proc=2 does not hold"),
    ({"max_np": 1}, r"min_num_proc=2 <= num_proc=2 <= max_num_proc=1 does not hold"),
    ({"min_num_proc": 0}, "min_num_proc must be an int >= 1, got 0"),
    ({"args": 1}, "args must be a tuple"),
])
def test_run_elastic_refuses_sizes_out_of_order(spark, kwargs, match):
    with pytest.raises(LaunchRefused, match=match):
        horovod_spark.run_elastic(fn, **{"args": (1,), "num_proc": 2, **kwargs})


def test_without_a_session_num_proc_cannot_default_and_says_so():
    code = "import spark_dl.horovod.spark as hs\nhs.run(print)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "LaunchRefused" in proc.stderr and "no active SparkSession" in proc.stderr
    assert "SparkSession.builder" in proc.stderr
