"""The example notebooks run as-is, and their Databricks exports match them.

Each notebook is executed top to bottom by nbclient in a real ``python3`` kernel (its own embedded
Spark on ``local[2]``, its own JVM), in a temporary working directory; any failing cell fails the
test. Then a key output of each notebook is checked.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
NAMES = ["quickstart", "compression", "dataframe", "large_batch"]

_spec = importlib.util.spec_from_file_location("spark_dl_notebooks_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = build  # its dataclasses look their module up
_spec.loader.exec_module(build)


def stdout_of(nb) -> str:
    return "".join(
        out.get("text", "")
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.outputs if out.output_type == "stream" and out.name == "stdout"
    )


@pytest.fixture
def kernel_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("SPARK_DL_TRACKING", "0")
    # The kernel, and through the JVM the ranks, import spark_dl from this checkout.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return tmp_path


def execute(name: str, cwd: Path):
    nb = nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    assert not (cwd / "mlflow.db").exists() and not (cwd / "mlruns").exists()
    return nb


def test_quickstart_runs(kernel_env):
    nb = execute("quickstart", kernel_env)
    out = stdout_of(nb)
    assert "local[2]" in out
    result = re.search(r"result: (\{.*\})", out)
    assert result, out
    value = eval(result.group(1))  # the dict the notebook printed
    assert value["rank"] == 0 and value["world_size"] == 2 and value["loss"] < 0.01
    assert "[0]<log>: rank 0 done" in out and "[1]<log>: rank 1 done" in out
    # driver_log_verbosity="all": every rank's prints reach the driver, tagged
    for rank in (0, 1):
        for i in range(3):
            assert f"[{rank}]<stdout>: hello {i} from rank {rank} of 2" in out
    assert "returned: 0" in out
    # spark_dl.TorchDistributor: PySpark's arguments, positional args, output streamed
    assert "[1]<stdout>: rank 1: all-reduced 3.0" in out and "returned: 1.5" in out
    # RankFailed from the rank that raised
    assert "failed rank: 1 | exception: builtins.ValueError" in out
    assert "[1]<stdout>: rank 1 starting" in out
    assert "cause: ValueError('rank 1 ran out of luck')" in out


def test_compression_runs(kernel_env):
    nb = execute("compression", kernel_env)
    out = stdout_of(nb)
    rows = {
        m.group(1): (float(m.group(2)), float(m.group(3)), float(m.group(4)))
        for m in re.finditer(r"^(\w+)\s+accuracy ([\d.]+)\s+sent\s+([\d.]+) MB \(\s*([\d.]+)x less", out, re.M)
    }
    assert list(rows) == ["none", "fp16", "qsgd", "onebit", "powersgd"], out
    assert rows["none"][0] > 0.85 and rows["fp16"][0] > 0.85
    assert all(acc > 0.5 for acc, _, _ in rows.values()), rows  # well above chance (0.1)
    assert rows["none"][2] == 1.0 and rows["fp16"][2] == 2.0
    assert rows["onebit"][1] < rows["qsgd"][1] < rows["fp16"][1] < rows["none"][1]
    assert rows["powersgd"][1] < rows["fp16"][1]
    images = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1


def test_dataframe_runs(kernel_env):
    nb = execute("dataframe", kernel_env)
    out = stdout_of(nb)
    assert "|-- pixels: array" in out and "|-- label: long" in out
    assert "1437 training rows, 360 test rows" in out
    assert "(718 rows on this rank)" in out  # 1437 rows, 2 ranks, remainder dropped
    accuracy = re.search(r"test accuracy: ([\d.]+)", out)
    assert accuracy and float(accuracy.group(1)) > 0.9, out
    # the TorchEstimator cells: early stopping within the 50 epochs, the executors' predictions scored
    stopped = re.search(r"stopped after (\d+) of 50 epochs; held-out accuracy ([\d.]+)", out)
    assert stopped and int(stopped.group(1)) < 50 and float(stopped.group(2)) > 0.9, out
    estimator = re.search(r"estimator test accuracy: ([\d.]+)", out)
    assert estimator and float(estimator.group(1)) > 0.9, out


def test_large_batch_runs(kernel_env):
    nb = execute("large_batch", kernel_env)
    out = stdout_of(nb)
    assert "local[2]" in out and "18 runs in" in out, out
    rows = {
        (m.group(1), int(m.group(2))): (int(m.group(3)), float(m.group(4)), float(m.group(5)), float(m.group(6)))
        for m in re.finditer(r"^(no-scaling|linear\+warmup|linear)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+) ± ([\d.]+)$",
                             out, re.M)
    }
    methods, batches = ["no-scaling", "linear", "linear+warmup"], [32, 128, 512]
    assert list(rows) == [(m, b) for m in methods for b in batches], out
    # fixed epochs: 16x the batch, 16x fewer steps (1437 rows, 2 ranks, remainders dropped)
    assert [rows["linear", b][0] for b in batches] == [440, 110, 20]
    # lr: base 0.03 at batch 32; linear scaling multiplies it by batch / 32
    assert [rows["no-scaling", b][1] for b in batches] == [0.03, 0.03, 0.03]
    assert [rows["linear+warmup", b][1] for b in batches] == [0.03, 0.12, 0.48]
    error = {k: v[2] for k, v in rows.items()}
    assert all(e < 0.5 for e in error.values()), rows
    # at k = 1 the three methods are the same run
    assert error["no-scaling", 32] == error["linear", 32] == error["linear+warmup", 32] < 0.05
    # Figure 1's shape: unscaled, the error climbs with the batch; linear scaling + warmup keeps it
    # near the small-batch error, and well below no scaling at the largest batch
    assert error["no-scaling", 512] > error["no-scaling", 32] + 0.05, rows
    assert error["linear+warmup", 512] < error["no-scaling", 512] - 0.05, rows
    assert error["linear+warmup", 512] < error["linear+warmup", 32] + 0.03, rows
    images = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1


@pytest.mark.parametrize("name", NAMES)
def test_databricks_export_matches_notebook(name):
    nb = nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4)
    nbformat.validate(nb)
    assert all(not c.outputs and c.execution_count is None for c in nb.cells if c.cell_type == "code")
    source = (NOTEBOOKS / "databricks" / f"{name}.py").read_text()
    assert source.startswith("# Databricks notebook source\n")
    compile(source, f"{name}.py", "exec")
    body = source[len("# Databricks notebook source\n"):]
    cells = [c.strip() for c in body.split("\n# COMMAND ----------\n")]
    code_cells = [c for c in cells if not c.startswith("# MAGIC %md")]
    assert len(code_cells) == sum(c.cell_type == "code" for c in nb.cells)
    markdown = [c for c in cells if c.startswith("# MAGIC %md")]
    assert len(markdown) == sum(c.cell_type == "markdown" for c in nb.cells)
    assert "SparkSession.builder.getOrCreate()" in source and ".master(" not in source


def test_committed_files_are_what_build_writes(tmp_path):
    build.build(tmp_path)
    for name in NAMES:
        assert (tmp_path / f"{name}.ipynb").read_text() == (NOTEBOOKS / f"{name}.ipynb").read_text(), (
            f"notebooks/{name}.ipynb is stale: run python notebooks/build.py")
        assert (tmp_path / "databricks" / f"{name}.py").read_text() == \
            (NOTEBOOKS / "databricks" / f"{name}.py").read_text()
