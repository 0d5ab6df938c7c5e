"""Run Horovod's own PyTorch tests, unmodified, against spark-dl's Horovod API.

    python scripts/horovod_conformance.py                       # whole files, 2 ranks
    python scripts/horovod_conformance.py --np 4 --per-test     # each test in its own launch
    python scripts/horovod_conformance.py -k allgather --per-test --timeout 60

Each launch is ``HorovodRunner(np=-N)`` (N local rank processes); every rank runs pytest on the
test file, as ``horovodrun -np N pytest ...`` does with Horovod, and records each test's outcome
in a file of its own. A test passes when it passed on every rank (or passed on some and skipped
on the others), fails when it failed on any, and hangs when it did not finish within
``--timeout`` seconds (pytest-timeout ends that rank, and with it the launch). A whole-file
launch that ends early is resumed with the tests it did not reach, so one hang costs one test.

Horovod's ``test/utils/common.py`` imports ``mock`` and ``horovod.runner.util.threads.in_thread``
(Horovod's launcher, not its torch API): the ranks get ``unittest.mock`` and a daemon-thread
helper of this script's under those names when they are not installed.
``test_process_sets_static.py`` imports ``horovod.tensorflow`` but calls only the framework-free
process-set API (``init(process_sets=...)``, ``global_process_set``, ``shutdown``), so it runs
with ``horovod.tensorflow`` naming ``horovod.torch``.

Exit code: 0 when no test failed or hung, 1 otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

DEFAULT_SUITE = Path(__file__).resolve().parent.parent.parent / "shared" / "conformance" / "horovod"
DEFAULT_FILES = ("test_torch.py", "test_adasum_pytorch.py", "test_process_sets_static.py")
# the worst outcome on any rank wins
_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "hung": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="horovod_conformance.py",
        description="Run Horovod's PyTorch test files, unmodified, on local rank processes against "
                    "spark_dl.horovod, and print the counts of passed, failed, skipped and hung tests "
                    "and each failure.",
        epilog="Exit codes: 0 nothing failed or hung; 1 some test failed or hung; 2 bad arguments.")
    parser.add_argument("--suite", type=Path, default=DEFAULT_SUITE,
                        help="folder holding Horovod's test files (default: %(default)s)")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                        help="test files in --suite to run (default: %(default)s)")
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default: %(default)s)")
    parser.add_argument("--per-test", action="store_true",
                        help="each test in a launch of its own (default: each file in one launch)")
    parser.add_argument("-k", dest="keyword", default=None,
                        help="only tests whose name contains this text (several: comma-separated)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds one test may take before it counts as hung (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="also write every test's outcome here")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    args = parser.parse_args(argv)
    if args.np < 1:
        parser.error("--np must be >= 1")
    for name in args.files:
        if not (args.suite / name).is_file():
            parser.error(f"{args.suite / name} does not exist")
    return args


def collect(path: Path) -> list[str]:
    """The ``Class::test_method`` ids of a unittest file, in file order, without importing it."""
    tree = ast.parse(path.read_text())
    return [f"{node.name}::{item.name}"
            for node in tree.body if isinstance(node, ast.ClassDef)
            for item in node.body
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test")]


# ---- the ranks' side ------------------------------------------------------------------------------

def _in_thread(target: Any, args: tuple = (), name: str | None = None, daemon: bool = True,
               silent: bool = False) -> Any:
    """Start ``target(*args)`` on a daemon thread and return the thread."""
    import threading

    def run() -> None:
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def _install_harness_modules() -> None:
    import importlib
    import types
    import unittest.mock

    try:
        importlib.import_module("mock")
    except ImportError:
        sys.modules["mock"] = unittest.mock
    try:
        importlib.import_module("horovod.runner.util.threads")
    except ImportError:
        for name in ("horovod.runner", "horovod.runner.util", "horovod.runner.util.threads"):
            module = types.ModuleType(name)
            module.__path__ = []
            sys.modules[name] = module
        sys.modules["horovod.runner.util.threads"].in_thread = _in_thread
    try:
        importlib.import_module("horovod.tensorflow")
    except ImportError:
        sys.modules["horovod.tensorflow"] = importlib.import_module("horovod.torch")


class _Recorder:
    """A pytest plugin writing one JSON line per test event (start, then its outcome)."""

    def __init__(self, path: str, rank: int) -> None:
        self.out = open(path, "a", buffering=1)
        self.rank = rank

    def _write(self, **fields: Any) -> None:
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()
        os.fsync(self.out.fileno())

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self._write(event="start", test=nodeid.split("::", 1)[1])

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            outcome = "skipped" if report.skipped else report.outcome
            self._write(event="result", rank=self.rank, test=report.nodeid.split("::", 1)[1], outcome=outcome,
                        when=report.when, message=_short(report) if outcome != "passed" else "")


def _short(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def rank_main(test_file: str, tests: list[str], out_dir: str, timeout: float) -> int:
    """Run ``tests`` of ``test_file`` with pytest in this rank, recording to ``out_dir``."""
    import pytest

    _install_harness_modules()
    rank = os.environ.get("RANK", "0")
    ini = os.path.join(out_dir, "pytest.ini")
    if not os.path.exists(ini):
        with open(ini, "w") as f:
            f.write("[pytest]\n")
    return int(pytest.main(
        [f"{test_file}::{t}" for t in tests]
        + ["-c", ini, "--rootdir", os.path.dirname(test_file), "-p", "no:cacheprovider", "-q",
           "-o", f"timeout={timeout}", "-o", "timeout_method=thread", "-W", "ignore::DeprecationWarning"],
        plugins=[_Recorder(os.path.join(out_dir, f"rank{rank}.jsonl"), int(rank))]))


# ---- the driver's side ----------------------------------------------------------------------------

def _read(out_dir: str, np: int) -> tuple[dict[str, list[dict]], list[str]]:
    """Each test's results (one per rank that reported), and the tests some rank started."""
    results: dict[str, list[dict]] = {}
    started: list[str] = []
    for r in range(np):
        path = os.path.join(out_dir, f"rank{r}.jsonl")
        if not os.path.exists(path):
            continue
        for line in Path(path).read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                if event["test"] not in started:
                    started.append(event["test"])
            else:
                results.setdefault(event["test"], []).append(event)
    return results, started


def _combine(events: list[dict], np: int) -> tuple[str, str] | None:
    """A test's outcome from its ranks' reports; None until every rank has reported."""
    if len({e["rank"] for e in events}) < np:
        return None
    outcome = max((e["outcome"] for e in events), key=_SEVERITY.get)
    if outcome == "skipped" and any(e["outcome"] == "passed" for e in events):
        outcome = "passed"
    message = next((e["message"] for e in events if e["outcome"] == outcome and e["message"]), "")
    return outcome, message


def launch(test_file: Path, tests: list[str], args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """Run ``tests`` in launches of ``args.np`` ranks until each has an outcome; resumes after a
    launch that ended early (a hang or a crash) with the tests it did not reach."""
    from spark_dl import HorovodRunner

    outcomes: dict[str, tuple[str, str]] = {}
    remaining = list(tests)
    while remaining:
        with tempfile.TemporaryDirectory(prefix="hvd-conformance-") as out_dir:
            runner = HorovodRunner(np=-args.np, tracking=False, progress=False,
                                   driver_log_verbosity="all" if args.verbose else "log_callback_only",
                                   run_timeout=args.timeout * len(remaining) + 60)
            error = ""
            try:
                runner.run(rank_main, str(test_file), remaining, out_dir, args.timeout)
            except Exception as e:  # noqa: BLE001 - a failed launch still leaves its per-test records
                error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            results, started = _read(out_dir, args.np)
        for t in remaining:
            combined = _combine(results.get(t, []), args.np)
            if combined is not None:
                outcomes[t] = combined
        unfinished = [t for t in started if t not in outcomes]
        if unfinished:
            outcomes[unfinished[0]] = ("hung", f"did not finish on every rank within {args.timeout:.0f} s; {error}")
        elif error and not any(t in outcomes for t in remaining):
            outcomes[remaining[0]] = ("failed", f"launch failed before the test started: {error}")
        remaining = [t for t in remaining if t not in outcomes]
    return outcomes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    everything: dict[str, tuple[str, str]] = {}
    start = time.monotonic()
    for name in args.files:
        path = (args.suite / name).resolve()
        tests = collect(path)
        if args.keyword:
            words = args.keyword.split(",")
            tests = [t for t in tests if any(w in t for w in words)]
        batches = [[t] for t in tests] if args.per_test else [tests] if tests else []
        for batch in batches:
            for t, result in launch(path, batch, args).items():
                everything[f"{name}::{t}"] = result
                if args.per_test or args.verbose:
                    print(f"{result[0]:8} {name}::{t}", flush=True)
    counts = Counter(outcome for outcome, _ in everything.values())
    mode = "each test in its own launch" if args.per_test else "each file in one launch"
    print(f"\n{len(everything)} tests on {args.np} ranks ({mode}, {time.monotonic() - start:.0f} s): "
          + ", ".join(f"{counts[o]} {o}" for o in _SEVERITY))
    for test, (outcome, message) in everything.items():
        if outcome in ("failed", "hung"):
            print(f"  {outcome.upper():6} {test}: {message[:300]}")
    if args.json:
        args.json.write_text(json.dumps({t: {"outcome": o, "message": m} for t, (o, m) in everything.items()},
                                        indent=1))
    return 1 if counts["failed"] or counts["hung"] else 0


if __name__ == "__main__":
    sys.exit(main())
