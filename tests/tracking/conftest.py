"""Real MLflow stores for the tracking tests: a fresh SQLite store per test, one `mlflow server` per session."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

SERVER_START_TIMEOUT_S = 90


def _free_port() -> int:
    from spark_dl.task.ports import free_port  # below the ephemeral range: no connection takes it first

    return free_port()


@pytest.fixture(autouse=True)
def _tracking_on(monkeypatch):
    """The root conftest turns tracking off for the other suites; these tests are about it."""
    monkeypatch.setenv("SPARK_DL_TRACKING", "1")


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch, sqlite_uri):
    """This test's own local store (the default kind in MLflow 3: SQLite), active through the env."""
    import mlflow

    uri = sqlite_uri
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("SPARK_DL_SYSTEM_METRICS_INTERVAL", "0.5")
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on 127.0.0.1 (SQLite backend, local artifact root); yields its URI."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start: see {root / 'server.log'}")
        time.sleep(0.3)
    yield uri
    os.killpg(proc.pid, 15)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    log.close()


@pytest.fixture
def server_uri(mlflow_server, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    yield mlflow_server
    mlflow.set_tracking_uri(None)
