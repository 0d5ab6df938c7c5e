"""An executor whose Python lacks a module spark-dl needs: the error names the module, that Python
and the fix, whether the module was missing to Spark (unpickling the task) or to spark-dl's task.

The executors' Python is the test's own interpreter started with ``-S``: no site-packages, so only
what ``PYTHONPATH`` names can be imported, as on an executor where spark-dl was never installed."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import cloudpickle
import pytest

import spark_dl
from spark_dl import HorovodRunner, JobFailed

REPO = Path(spark_dl.__file__).resolve().parents[1]


def add(x):
    return x + 1


@pytest.fixture
def executor_python(spark, tmp_path):
    """``make(*folders)``: the session's next jobs run their Python workers with the test's interpreter
    under ``-S``, importing only Spark's zips and ``folders``."""
    sc = spark.sparkContext
    before = sc.pythonExec

    def make(*path: Path) -> None:
        script = tmp_path / "python"
        extra = ":".join(str(p) for p in path)
        script.write_text(  # Spark's own zips (pyspark, py4j) from PYTHONPATH, then the given folders;
            f"#!/bin/sh\ncd {tmp_path}\n"  # not the driver's folder, the repository's in a checkout
            """PYTHONPATH="$(echo "$PYTHONPATH" | tr : '\\n' | grep '[.]zip$' | paste -sd: -)"\n"""
            f'PYTHONPATH="$PYTHONPATH:{extra}" exec {sys.executable} -S "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        sc.pythonExec = str(script)  # read per job: Spark keeps a Python worker daemon per interpreter

    yield make
    sc.pythonExec = before


def test_an_executor_python_without_spark_dl_fails_the_run_naming_the_module_and_the_fix(executor_python):
    executor_python()
    with pytest.raises(JobFailed) as info:
        HorovodRunner(np=2).run(add, 1)
    text = str(info.value)
    assert "No module named 'spark_dl'" in text
    assert "The executors' Python cannot import 'spark_dl'" in text
    assert f"the driver runs {sys.executable}" in text and "PYSPARK_PYTHON" in text


def test_an_executor_python_without_psutil_fails_in_the_task_and_the_driver_names_it(executor_python, tmp_path):
    # spark_dl and cloudpickle importable, psutil not: the task connects and rendezvouses, then
    # fails looking up its network interface. Without its report the driver would see only a lost task.
    lib = tmp_path / "lib"
    lib.mkdir()
    os.symlink(Path(cloudpickle.__file__).parent, lib / "cloudpickle")
    executor_python(REPO, lib)
    with pytest.raises(JobFailed) as info:
        HorovodRunner(np=2).run(add, 1)
    text = str(info.value)
    assert text.startswith("barrier task ") and ": ModuleNotFoundError: No module named 'psutil'" in text
    assert f"The executors' Python ({sys.executable}) cannot import 'psutil'" in text
    assert "import psutil" in text.split("The task's traceback (its last lines):")[1]  # where it failed
    assert "lost contact" not in text
