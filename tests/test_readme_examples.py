"""The README's self-contained examples run as written (the recipe section has its own test,
tests/train/test_readme.py; the others are fragments of a training loop)."""
from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

from script_forks import ScriptForks

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()

EXAMPLES = [
    ("## Quick start", 0),
    ("## The launcher: `HorovodRunner`", 0),  # Ray Train's helpers
    ("## The launcher: `HorovodRunner`", 1),  # Ray Train's TorchTrainer
    ("## The launcher: `HorovodRunner`", 2),  # ... with Lightning
    ("## The launcher: `HorovodRunner`", 4),  # restarts and checkpoints
    ("## The launcher: `HorovodRunner`", 5),  # sharded checkpoints
    ("## The launcher: `HorovodRunner`", 6),  # Spark Connect
    ("## PySpark's `TorchDistributor`, on this launcher", 0),
    ("## Training on a Spark DataFrame", 0),
    ("## Training on a Spark DataFrame", 1),
    ("## Training on a Spark DataFrame", 4),  # a LightningModule
    ("## Training on a Spark DataFrame", 5),  # staged Parquet data
    ("## Horovod-compatible API", 0),
    ("## Horovod-compatible API", 1),  # Horovod's own imports
    ("## Horovod-compatible API", 3),  # Adasum
    ("## Horovod-compatible API", 4),  # join
    ("## Horovod-compatible API", 5),  # process sets
    ("## Horovod-compatible API", 6),  # elastic
    ("## Horovod-compatible API", 7),  # horovod.spark.run
    ("## Gradient compression", 0),
    ("## Tracking with MLflow", 0),
    ("## Tracking with MLflow", 1),
]


def block(heading: str, index: int) -> str:
    assert heading in README, f"README has no {heading!r} section"
    section = re.split(r"\n## ", README.split(heading, 1)[1], maxsplit=1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


@pytest.fixture(scope="module")
def python():
    """``python example.py``, minus the ~3 s of imports each fresh interpreter pays (tests/script_forks.py)."""
    forks = ScriptForks({**os.environ, "PYSPARK_PYTHON": sys.executable})
    yield forks
    forks.close()


@pytest.mark.parametrize("heading,index", EXAMPLES, ids=[f"{h[3:]}-{i}" for h, i in EXAMPLES])
def test_readme_example_runs(heading, index, tmp_path, python, sqlite_uri):
    (tmp_path / "example.py").write_text(block(heading, index))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_DL_TRACKING": "1",
           "MLFLOW_TRACKING_URI": sqlite_uri}
    proc = python.run(str(tmp_path / "example.py"), str(tmp_path), env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a "# ..." line right after a print(...) is what the README says it prints
    lines = block(heading, index).splitlines()
    for line, shown in zip(lines, lines[1:]):
        if line.startswith("print(") and shown.startswith("# "):
            assert shown[2:] in proc.stdout, (shown, proc.stdout[-2000:])
