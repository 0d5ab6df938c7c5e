"""The self-contained examples of the README and the docs pages run as written and print what they
say they print. Each is found by page, heading and position under that heading; the large-minibatch
recipe page has its own test (tests/train/test_readme.py), and the other blocks are fragments of a
training loop."""
from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest
from script_forks import ScriptForks

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (page, heading, index of the python block in that heading's section)
EXAMPLES = [
    ("README.md", "## Quick start", 0),
    ("docs/guide/ray-train.md", "## Ray Train's helpers: `prepare_model`, `prepare_data_loader`", 0),
    ("docs/guide/ray-train.md", "## Ray Train's `TorchTrainer`", 0),
    ("docs/guide/ray-train.md", "## PyTorch Lightning inside the loop", 0),
    ("docs/guide/restarts.md", "# Restarts and checkpoints", 0),
    ("docs/guide/restarts.md", "## Sharded state: `save_checkpoint(state, sharded=True)`", 0),
    ("docs/guide/spark-connect.md", "# Spark Connect", 0),
    ("docs/guide/torch-distributor.md", "# PySpark's `TorchDistributor`", 0),
    ("docs/guide/dataframes.md", "# Training on a Spark DataFrame", 0),
    ("docs/guide/estimator.md", "# `TorchEstimator`: `fit(df)` / `transform(df)`", 0),
    ("docs/guide/lightning-estimator.md", "# A `LightningModule` in the estimator", 0),
    ("docs/guide/staging.md", "# Staged Parquet data: `prepare_data` / `fit_on_parquet`", 0),
    ("docs/guide/horovod.md", "# Horovod-compatible API", 0),
    ("docs/guide/horovod.md", "## Horovod's own imports", 0),
    ("docs/guide/horovod.md", "## Adasum (`op=hvd.Adasum`)", 0),
    ("docs/guide/horovod.md", "## Uneven data: `hvd.join()`", 0),
    ("docs/guide/horovod.md", "## Process sets", 0),
    ("docs/guide/horovod-spark.md", "## Elastic Horovod (`hvd.elastic`)", 0),
    ("docs/guide/horovod-spark.md", "## Horovod on Spark: `horovod.spark.run`", 0),
    ("docs/guide/compression.md", "# Gradient compression", 0),
    ("docs/guide/compression.md", "## Let spark-dl pick: `\"auto\"`", 0),
    ("docs/guide/tracking.md", "# Tracking with MLflow", 0),
    ("docs/guide/tracking.md", "## Options", 0),
]


def section(page: str, heading: str) -> str:
    """The text under `heading` (a whole line of `page`), up to the next heading of its level or higher."""
    lines = (ROOT / page).read_text().split("\n")
    assert heading in lines, f"{page} has no heading {heading!r}"
    start = lines.index(heading) + 1
    level = len(heading) - len(heading.lstrip("#"))
    out, fence = [], False
    for line in lines[start:]:
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,%d} " % level, line):
            break
        out.append(line)
    return "\n".join(out)


def block(page: str, heading: str, index: int) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", section(page, heading), re.S | re.M)
    assert index < len(blocks), f"{page} {heading!r} has {len(blocks)} python blocks, not {index + 1}"
    return blocks[index]


def test_docs_quick_start_is_the_readme_one():
    """docs/index.md repeats the README's quick start; the README's is the one executed below."""
    assert block("docs/index.md", "## Quick start", 0) == block("README.md", "## Quick start", 0)


@pytest.fixture(scope="module")
def python():
    """``python example.py``, minus the ~3 s of imports each fresh interpreter pays (tests/script_forks.py)."""
    forks = ScriptForks({**os.environ, "PYSPARK_PYTHON": sys.executable})
    yield forks
    forks.close()


# Its example starts a Spark Connect server in the example's own JVM, which must end with it.
OWN_JVM = {("docs/guide/spark-connect.md", "# Spark Connect", 0)}


@pytest.fixture(scope="module")
def jvm():
    """One JVM for the examples, handed to each as PySpark's own shell and spark-submit hand theirs
    to Python (PYSPARK_GATEWAY_PORT): an example's ``SparkSession.builder...getOrCreate()`` makes
    its SparkContext in it, instead of starting a JVM of its own (about 13 s of CPU each on 2
    cores). After each example, the context it left running is stopped, as its JVM's exit would."""
    from pyspark import SparkConf
    from pyspark.java_gateway import launch_gateway

    gateway = launch_gateway(SparkConf())
    yield gateway
    gateway.shutdown()
    gateway.proc.stdin.close()  # the JVM exits when its parent's pipe closes
    gateway.proc.wait(timeout=60)


def _stop_what_it_left(gateway) -> None:
    # SparkContext.getActive, which has no static forwarder: called on the Scala object itself
    scala_object = gateway.jvm.java.lang.Class.forName("org.apache.spark.SparkContext$").getField("MODULE$").get(None)
    active = scala_object.getActive()
    if active.isDefined():
        active.get().stop()
    gateway.jvm.org.apache.spark.sql.SparkSession.clearDefaultSession()


@pytest.mark.parametrize("page,heading,index", EXAMPLES,
                         ids=[f"{p}:{h.lstrip('# ')}-{i}" for p, h, i in EXAMPLES])
def test_readme_example_runs(page, heading, index, tmp_path, python, jvm, sqlite_uri):
    code = block(page, heading, index)
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_DL_TRACKING": "1",
           "MLFLOW_TRACKING_URI": sqlite_uri}
    if (page, heading, index) not in OWN_JVM:
        env.update(PYSPARK_GATEWAY_PORT=str(jvm.gateway_parameters.port),
                   PYSPARK_GATEWAY_SECRET=jvm.gateway_parameters.auth_token)
    try:
        proc = python.run(str(tmp_path / "example.py"), str(tmp_path), env, timeout=300)
    finally:
        _stop_what_it_left(jvm)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a "# ..." line right after a print(...) is what the page says it prints
    lines = code.splitlines()
    for line, shown in zip(lines, lines[1:]):
        if line.startswith("print(") and shown.startswith("# "):
            assert shown[2:] in proc.stdout, (shown, proc.stdout[-2000:])
