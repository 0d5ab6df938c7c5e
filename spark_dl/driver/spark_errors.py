"""Spark's errors in spark-dl's words: the useful part of a Py4J text, what a lost executor means,
and what an executor whose Python lacks a module needs."""
from __future__ import annotations

import re
import sys

_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def missing_module_hint(text: str, python: str | None = None) -> str:
    """What to do when an executor's Python could not import a module spark-dl's task needs ("" if
    ``text`` names none). The executors run their own interpreter, PYSPARK_PYTHON's or ``python3``'s
    on their PATH, not the driver's: a package installed only where the driver runs is the usual cause."""
    found = _NO_MODULE.search(text)
    if found is None:
        return ""
    where = f" ({python})" if python else ""
    driver = f" (the driver runs {sys.executable})" if python != sys.executable else ""
    return (f"\nThe executors' Python{where} cannot import {found.group(1)!r}{driver}: spark-dl, torch and their "
            "dependencies must be installed in the Python the executors run. Install them there (on Databricks: "
            "%pip install in the notebook, or a cluster library), or point PYSPARK_PYTHON or spark.pyspark.python "
            "at a Python that has them.")


def executor_lost_hint(summary: str, relayed: bool) -> str:
    """What to do about a stage that failed because an executor JVM went away ("" for other failures)."""
    if "ExecutorLostFailure" not in summary:
        return ""
    hint = "\nAn executor was lost during the run"
    # Standalone says "exited with code 137", YARN "Exit status: 137" or "killed by YARN for exceeding ... memory"
    if re.search(r"exit(?:ed)? (?:with )?(?:code|status):? 137\b|exceeding .*memory", summary, re.IGNORECASE):
        hint += (" (exit code 137: killed with SIGKILL, usually by the OS or the cluster manager for using more "
                 "memory than the executor's container was given; the ranks' memory counts against it: raise "
                 "spark.executor.memoryOverhead, or lower the batch size)")
    if relayed:
        hint += ("; Spark does not rerun a failed barrier stage, and barrier task 0 relayed this attempt, so what "
                 "it held (output, metrics, checkpoints saved in it) is lost")
    return hint + (". Restarts launch the run again after such a loss: HorovodRunner(max_restarts=N), "
                   "TorchDistributor(max_restarts=N), TorchTrainer's FailureConfig(max_failures=N).")


def spark_error_summary(e: BaseException, max_lines: int = 30) -> str:
    """The useful part of a Py4J error: the Python traceback from the executor, or the first lines."""
    # Py4J prefixes "An error occurred while calling o43.isEmpty.\n: " to the Java exception
    text = re.sub(r"^An error occurred while calling [\w.]+\.\s*\n?:?\s*", "", str(e))
    text = text.split("\nJVM stacktrace:")[0]  # Spark Connect appends the server's Java stack
    start = text.rfind("Traceback (most recent call last)")
    if start >= 0:
        lines = []
        for line in text[start:].splitlines():
            if line.startswith("\tat ") or line.startswith("\tat"):
                break
            lines.append(line)
        return "\n".join(lines[-max_lines:])
    return "\n".join([line for line in text.strip().splitlines() if not line.startswith("\tat")][:5])
