"""Shared fixtures: real SparkSessions on ``local[4]`` and ``local-cluster[2,1,1024]``.

One JVM holds one SparkContext at a time, so a single session-scoped pool owns the current
session and switches masters at most once: tests are ordered so that everything needing
``local[4]`` runs before everything needing the local cluster.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

LOCAL = "local[4]"
CLUSTER = "local-cluster[2,1,1024]"

# JVM options for every Spark JVM the suite starts, its subprocesses' included (see the file);
# a SPARK_CONF_DIR of the caller's own is kept
os.environ.setdefault("SPARK_CONF_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "spark-conf"))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# MLflow tracking is on by default; only tests/tracking (which turns it back on, against stores of
# its own) should write runs, not every launcher test into ./mlflow.db.
os.environ["SPARK_DL_TRACKING"] = "0"


class SparkPool:
    def __init__(self) -> None:
        self.master: str | None = None
        self.session = None

    def get(self, master: str):
        from pyspark.sql import SparkSession

        if self.master == master and self.session is not None:
            return self.session
        self.stop()
        self.session = (
            SparkSession.builder.master(master)
            .appName("spark-dl-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.executor.memory", "768m")
            .getOrCreate()
        )
        self.session.sparkContext.setLogLevel("ERROR")
        self.master = master
        if master == CLUSTER:
            self._wait_for_executors(2)
        return self.session

    def _wait_for_executors(self, n: int, timeout_s: float = 120.0) -> None:
        """A local cluster's executor JVMs register seconds after the session starts (more on a
        loaded machine): wait here, so the tests that time a refusal time the refusal only."""
        import time

        status = self.session.sparkContext._jsc.sc().getExecutorMemoryStatus()  # the driver's entry too
        deadline = time.monotonic() + timeout_s
        while status.size() < n + 1 and time.monotonic() < deadline:
            time.sleep(0.25)
            status = self.session.sparkContext._jsc.sc().getExecutorMemoryStatus()

    def stop(self) -> None:
        if self.session is not None:
            self.session.stop()
        self.session = None
        self.master = None


@pytest.fixture(scope="session")
def spark_pool():
    pool = SparkPool()
    yield pool
    pool.stop()


@pytest.fixture
def spark(spark_pool):
    """A SparkSession on ``local[4]``, shared by the whole test session."""
    return spark_pool.get(LOCAL)


@pytest.fixture
def spark_cluster(spark_pool):
    """A SparkSession on ``local-cluster[2,1,1024]``: two executor JVMs with one core each."""
    return spark_pool.get(CLUSTER)


SLOW_FIXTURES = {"spark", "spark_cluster", "spark_pool", "mlflow_server", "server_uri"}
SLOW_PATHS = (
    "runners", "notebooks", "data", "multihost", "test_benchmarks.py", "test_readme_examples.py",
    "test_doc_examples.py", "test_docs.py", os.path.join("native", "test_sanitizers.py"),
    os.path.join("launcher", "test_connect.py"), os.path.join("launcher", "test_sessions.py"),
    os.path.join("train", "test_readme.py"),
)


def pytest_collection_modifyitems(session, config, items):
    def order(item) -> int:
        names = getattr(item, "fixturenames", ())
        # First: pytest-xdist hands each worker a first run of consecutive tests (an eighth of the
        # suite each), so tests/multihost's module fixture starts one cluster, on one worker. Split
        # over both, it started two side by side and the suite took 44:35 instead of 27 minutes.
        # (`--dist loadgroup` would say it; pytest-xdist 3.8 cannot rename the tests of pytest 9.2.)
        if "hosts" in names:
            return -1
        if "spark_cluster" in names:
            return 2
        if "spark" in names:
            return 1
        return 0

    items.sort(key=order)  # stable: keeps file order within each group

    # The fast tier (`pytest -m "not slow"`) leaves out what starts a Spark JVM, an MLflow server,
    # a notebook kernel or a whole script: the rest runs in minutes, for the inner loop
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        path = os.path.relpath(str(item.path), os.path.dirname(os.path.abspath(__file__)))
        if names & SLOW_FIXTURES or path.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)

    # Test functions are sent to rank processes like a notebook's: by value, since a Spark worker
    # cannot import the test modules.
    import cloudpickle

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(tests_dir + os.sep) and not name.endswith("conftest"):
            cloudpickle.register_pickle_by_value(module)


@pytest.fixture
def horovod_imports():
    """Horovod's imports (``horovod.spark.torch``, ``horovod.spark.common.store``, ...) in this test,
    as ``spark_dl.horovod_imports.install()`` gives them on a driver; gone after it."""
    from spark_dl import horovod_imports

    horovod_imports.install()
    yield
    sys.meta_path.remove(horovod_imports._finder)
    for name in [m for m in sys.modules if m == "horovod" or m.startswith("horovod.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def _mlflow_state_stays_in_its_test():
    """``mlflow.set_experiment`` sets ``MLFLOW_EXPERIMENT_ID`` in ``os.environ`` and MLflow's active
    experiment for the rest of the process; a test that calls it would otherwise choose the
    experiment of whichever tests its process runs next (another store's id: a refused launch)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    fluent = sys.modules.get("mlflow.tracking.fluent")
    active = getattr(fluent, "_active_experiment_id", None)
    yield
    for k in [k for k in os.environ if k.startswith("MLFLOW_") and k not in saved]:
        del os.environ[k]
    os.environ.update(saved)
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None:
        fluent._active_experiment_id = active


@pytest.fixture(scope="session")
def _template_db(tmp_path_factory):
    """An initialised SQLite MLflow store, copied per test: creating the schema takes over a second,
    copying it none."""
    import mlflow

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    here = os.getcwd()
    os.chdir(path.parent)  # experiment 0's artifact root is ./mlruns of where it is made: not the checkout
    try:
        mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    finally:
        os.chdir(here)
    return path


@pytest.fixture
def sqlite_uri(tmp_path, _template_db) -> str:
    """A new local MLflow store of this test's own at ``tmp_path / "mlflow.db"`` (MLflow 3's default kind)."""
    shutil.copy(_template_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
