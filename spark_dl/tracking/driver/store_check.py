"""Checks of the MLflow store a run will be tracked to, made on the driver before anything is launched.

The driver's :class:`~spark_dl.tracking.mlflow_writer.MlflowWriter` creates the run in the
background, so that a tracking server that is down never holds training up; a store that can never
take the run (an experiment that does not exist, a URI MLflow cannot open, a ``file:`` store
MLflow 3 refuses, a directory that cannot be written) would then only show at the end of
training, worded as a server failure being retried. Local stores answer in milliseconds, so they
are checked before the launch and refused with a :class:`~spark_dl.errors.LaunchRefused` that
says what to change. An HTTP server gets one request with a hard time bound
(:data:`HTTP_CHECK_S`), and only when an experiment was chosen: a server that is down or slow is
left to the writer's retries and never blocks or fails training.
"""
from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from spark_dl.errors import LaunchRefused

HTTP_CHECK_S = 2.5  # the most an HTTP tracking server's answer is waited for, in all
_OFF = "or run without MLflow: HorovodRunner(..., tracking=False)"
_SQLITE_FIX = "mlflow.set_tracking_uri(\"sqlite:///mlflow.db\") (or MLFLOW_TRACKING_URI=sqlite:///mlflow.db)"


@dataclass(frozen=True)
class CheckedStore:
    """What the check found: ``experiment_id`` is the experiment the run is to be created in when
    ``resolved`` (None: MLflow's default), else MLflow's own resolution is left to pick it."""

    uri: str
    experiment_id: str | None = None
    resolved: bool = False


def check_store(uri: str) -> CheckedStore:
    """Refuse (``LaunchRefused``) a tracking store that cannot take the run; say which experiment
    it goes to where that was found without waiting on a server."""
    scheme = _scheme(uri)
    _check_scheme(uri, scheme)
    if scheme in ("http", "https"):
        return _check_http(uri)
    if scheme == "sqlite" or scheme.startswith("sqlite+"):
        db = _sqlite_path(uri)
        if db is None:  # in memory: nothing to write on disk
            return CheckedStore(uri)
        _check_writable_file(uri, db)
        return _check_local(uri, store_exists=os.path.exists(db))
    if scheme in ("", "file"):
        _check_file_store_allowed(uri)
        root = _file_store_path(uri)
        _probe_dir(uri, root)
        return _check_local(uri, store_exists=True)
    return CheckedStore(uri)  # a database server, Databricks, a plugin's store: as before


# -- which experiment ----------------------------------------------------------------------------
def _chosen_experiment() -> tuple[str, str] | None:
    """``(kind, value)`` of the experiment the user chose, in the order ``mlflow.start_run()`` looks:
    ``("set_experiment", id)``, ``("name", name)``, ``("env", id)``; None for MLflow's default."""
    from mlflow.tracking import fluent

    active = getattr(fluent, "_active_experiment_id", None)
    if active:
        return "set_experiment", str(active)
    if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return "name", os.environ["MLFLOW_EXPERIMENT_NAME"]
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return "env", os.environ["MLFLOW_EXPERIMENT_ID"]
    return None


def _default_experiment() -> str | None:
    """MLflow's default experiment (a provider's, say a Databricks notebook's, else ``"0"``); None
    where MLflow cannot tell (an empty ``MLFLOW_EXPERIMENT_ID``, which the run has always ignored)."""
    try:
        from mlflow.tracking.fluent import _get_experiment_id

        return _get_experiment_id() or "0"
    except Exception:  # noqa: BLE001
        return None


def _source(kind: str) -> str:
    return {"set_experiment": "the active mlflow.set_experiment()", "env": "MLFLOW_EXPERIMENT_ID",
            "name": "MLFLOW_EXPERIMENT_NAME"}.get(kind, "MLflow's default")


def _missing(uri: str, experiment_id: str, kind: str, detail: str = "") -> LaunchRefused:
    if kind == "env":
        fix = ("unset MLFLOW_EXPERIMENT_ID or set it to the id of an experiment in this store, or choose one "
               "by name with mlflow.set_experiment(\"name\") (which creates it if need be)")
    elif kind == "set_experiment":
        fix = ("call mlflow.set_experiment(\"name\") again after mlflow.set_tracking_uri() (the experiment set "
               "earlier belongs to another store, or was deleted for good)")
    else:
        fix = "choose an experiment that exists: mlflow.set_experiment(\"name\") creates one if need be"
    why = f" ({detail})" if detail else ""
    return LaunchRefused(
        f"MLflow experiment id {experiment_id!r} (from {_source(kind)}) does not exist in the tracking store "
        f"{uri}{why}, so MLflow could not create the run in it and nothing was launched: {fix}; {_OFF}."
    )


def _deleted(uri: str, experiment_id: str, name: str, kind: str) -> LaunchRefused:
    return LaunchRefused(
        f"MLflow experiment {name!r} (id {experiment_id!r}, from {_source(kind)}) in the tracking store {uri} is "
        f"deleted, and MLflow creates no runs in a deleted experiment; nothing was launched. Restore it "
        f"(mlflow.MlflowClient().restore_experiment({experiment_id!r})) or choose another with "
        f"mlflow.set_experiment(\"name\"); {_OFF}."
    )


def _check_local(uri: str, store_exists: bool) -> CheckedStore:
    """Look the experiment up in a local store (milliseconds); refuse one that is missing or deleted."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if mlflow.active_run() is not None:
        return CheckedStore(uri)  # the run exists: it is logged into, whatever the experiment
    chosen = _chosen_experiment()
    kind = chosen[0] if chosen else "default"
    if chosen is None:
        experiment_id = _default_experiment()
        if experiment_id is None:
            return CheckedStore(uri)  # MLflow's resolution fails: left to it, as before
    try:
        if kind == "name":  # MLflow's own resolution (it creates an experiment of a new name)
            from mlflow.tracking.fluent import _get_experiment_id

            experiment_id = _get_experiment_id() or "0"
        elif chosen is not None:
            experiment_id = chosen[1]
        if not store_exists and experiment_id == "0":
            return CheckedStore(uri, experiment_id, resolved=True)  # a new store starts with it
        experiment = MlflowClient(tracking_uri=uri).get_experiment(experiment_id)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE") and kind != "name":
            raise _missing(uri, experiment_id, kind, e.message) from None
        if kind == "name":  # say, MLFLOW_EXPERIMENT_ID naming another experiment than the name
            raise LaunchRefused(
                f"MLFLOW_EXPERIMENT_NAME={chosen[1]!r} could not be resolved in the tracking store {uri} "
                f"({e.message}), so the run could not be tracked and nothing was launched: fix or unset "
                f"MLFLOW_EXPERIMENT_NAME (and MLFLOW_EXPERIMENT_ID), or call mlflow.set_experiment(\"name\"); {_OFF}."
            ) from None
        raise _unusable(uri, e) from None
    except Exception as e:  # noqa: BLE001 - a store that cannot be read cannot take the run either
        raise _unusable(uri, e) from None
    if experiment is None:  # MLflow 2's file store answers None
        raise _missing(uri, experiment_id, kind)
    if experiment.lifecycle_stage != "active":
        raise _deleted(uri, experiment_id, experiment.name, kind)
    return CheckedStore(uri, experiment_id, resolved=True)


def _unusable(uri: str, e: BaseException) -> LaunchRefused:
    text = getattr(e, "message", None) or str(e)
    return LaunchRefused(
        f"The MLflow tracking store {uri} cannot be used ({type(e).__name__}: {text.strip()}), so the run could "
        f"not be tracked and nothing was launched: repair it or use another, for instance {_SQLITE_FIX}; {_OFF}."
    )


# -- the URI -------------------------------------------------------------------------------------
def is_local_store(uri: str) -> bool:
    """Whether ``uri`` is a store on this machine's disk, as :func:`check_store` classifies them: a
    SQLite file or a file store (``"databricks"`` alone has no scheme either, and is a server)."""
    scheme = _scheme(uri)
    return scheme == "sqlite" or scheme.startswith("sqlite+") or (scheme in ("", "file")
                                                                  and not uri.startswith("databricks"))


def _scheme(uri: str) -> str:
    try:
        from mlflow.utils.uri import get_uri_scheme

        return get_uri_scheme(uri)
    except Exception:  # noqa: BLE001 - MLflow moved it: the plain parse
        return urlparse(uri).scheme


def _check_scheme(uri: str, scheme: str) -> None:
    """Refuse a URI no tracking store of MLflow's (plugins included) can open."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry

        known = list(registry._registry)
    except Exception:  # noqa: BLE001 - MLflow changed its registry: opening the store will say
        return
    if not known or uri in ("databricks", "databricks-uc", "uc") or scheme in known:
        return
    raise LaunchRefused(
        f"MLflow cannot open the tracking URI {uri!r}: it has no tracking store for the scheme {scheme!r} (it "
        f"knows {', '.join(repr(s) for s in known if s)} and plain paths), so the run could not be tracked and "
        f"nothing was launched. Set a URI MLflow can open, for instance {_SQLITE_FIX} or http://<host>:5000 for "
        f"a tracking server; {_OFF}."
    )


def _sqlite_path(uri: str) -> str | None:
    """The database file of a ``sqlite:`` URI (relative to the working directory, as SQLAlchemy
    reads it), or None for an in-memory one."""
    try:
        from sqlalchemy.engine import make_url

        database = make_url(uri).database
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: opening the store will say
        return None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.abspath(database)


def _file_store_path(uri: str) -> str:
    try:
        from mlflow.utils.file_utils import local_file_uri_to_path

        return os.path.abspath(local_file_uri_to_path(uri))
    except Exception:  # noqa: BLE001
        return os.path.abspath(urlparse(uri).path if uri.startswith("file:") else uri)


def _check_file_store_allowed(uri: str) -> None:
    """MLflow 3 refuses its file store (maintenance mode) unless ``MLFLOW_ALLOW_FILE_STORE=true``."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # MLflow 2: the file store is its default
        return
    if MLFLOW_ALLOW_FILE_STORE.get():
        return
    import mlflow

    why = ""
    try:
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

        if not is_tracking_uri_set() and uri == mlflow.get_tracking_uri():
            why = (" (MLflow picked it because no tracking URI is set and ./mlruns holds runs of an older "
                   "MLflow)")
    except Exception:  # noqa: BLE001 - only a hint
        pass
    raise LaunchRefused(
        f"The MLflow tracking URI {uri} is a file store{why}, which MLflow {mlflow.__version__} keeps in "
        f"maintenance mode and refuses to open unless MLFLOW_ALLOW_FILE_STORE=true, so the run could not be "
        f"tracked and nothing was launched. Use a SQLite store, {_SQLITE_FIX} (`mlflow migrate-filestore` moves "
        f"existing runs into one), or set MLFLOW_ALLOW_FILE_STORE=true in the driver's environment to keep the "
        f"file store; {_OFF}."
    )


def _unwritable(uri: str, path: str, what: str) -> LaunchRefused:
    return LaunchRefused(
        f"The MLflow tracking store {uri} cannot be written: {path} {what}, so the run could not be tracked and "
        f"nothing was launched. Point MLflow at a place this driver can write, for instance {_SQLITE_FIX} in a "
        f"writable working directory; {_OFF}."
    )


def _probe_dir(uri: str, path: str) -> None:
    """Refuse unless a file can be created in ``path`` or, where it does not exist yet, in its
    nearest existing parent (MLflow creates the rest). Creating one is the only test that holds for
    root and read-only mounts alike."""
    existing = path
    while not os.path.lexists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        where = "is" if existing == path else f"is under {existing}, which is"
        raise _unwritable(uri, path, f"{where} not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".spark-dl-write-check-", dir=existing)
    except OSError as e:
        why = e.strerror or str(e)
        if existing == path:
            raise _unwritable(uri, path, f"is not writable ({why})") from None
        what = f"does not exist and cannot be created: {existing} is not writable ({why})"
        raise _unwritable(uri, path, what) from None
    os.close(fd)
    os.unlink(probe)


def _creates_sqlite_dirs(uri: str) -> bool:
    """Whether MLflow creates the missing directories of a ``sqlite:///`` database (MLflow 3 does;
    MLflow 2 retries opening it for minutes)."""
    try:
        from mlflow.store.db import utils
    except ImportError:
        return False
    return hasattr(utils, "_make_parent_dirs_if_sqlite") and uri.startswith("sqlite:///")


def _check_writable_file(uri: str, path: str) -> None:
    """A SQLite database: its directory must take new files (the journal) and the file, where it
    exists, must open for writing."""
    if os.path.isdir(path):
        raise _unwritable(uri, path, "is a directory, not a SQLite database file")
    folder = os.path.dirname(path)
    if not os.path.lexists(folder) and not _creates_sqlite_dirs(uri):
        import mlflow

        raise _unwritable(uri, path, f"is in {folder}, which does not exist (MLflow {mlflow.__version__} does not "
                                     f"create it): create it first")
    _probe_dir(uri, folder)
    if os.path.exists(path):
        try:
            with open(path, "r+b"):
                pass
        except OSError as e:
            raise _unwritable(uri, path, f"cannot be opened for writing: {e.strerror or e}") from None


# -- an HTTP server ------------------------------------------------------------------------------
def _check_http(uri: str) -> CheckedStore:
    """One bounded request: refuse an experiment the server says does not exist or is deleted.
    Anything else (no answer in time, an error, no credentials) refuses nothing."""
    import mlflow

    if mlflow.active_run() is not None:
        return CheckedStore(uri)
    chosen = _chosen_experiment()
    if chosen is None:
        return CheckedStore(uri)  # MLflow's default: found without asking the server
    kind, value = chosen
    if kind == "name":
        answer = _http_get(uri, "/api/2.0/mlflow/experiments/get-by-name", {"experiment_name": value})
        if answer is None:  # down or slow: MLflow's lookup would block for minutes; the writer retries
            return CheckedStore(uri, os.environ.get("MLFLOW_EXPERIMENT_ID") or None, resolved=True)
        status, body = answer
        experiment = body.get("experiment") if status == 200 else None
        if not isinstance(experiment, dict):
            return CheckedStore(uri)  # a new name: MLflow's resolution creates it (the server just answered)
        if experiment.get("lifecycle_stage", "active") != "active":
            raise _deleted(uri, str(experiment.get("experiment_id")), value, kind)
        return CheckedStore(uri, str(experiment.get("experiment_id")), resolved=True)
    answer = _http_get(uri, "/api/2.0/mlflow/experiments/get", {"experiment_id": value})
    if answer is not None:
        status, body = answer
        code = body.get("error_code")
        if 400 <= status < 500 and code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise _missing(uri, value, kind, str(body.get("message") or code))
        experiment = body.get("experiment") if status == 200 else None
        if isinstance(experiment, dict) and experiment.get("lifecycle_stage", "active") != "active":
            raise _deleted(uri, value, str(experiment.get("name")), kind)
    # the id as chosen, without MLflow's lookup (minutes of retries when the server is down)
    return CheckedStore(uri, value, resolved=True)


def _http_get(uri: str, endpoint: str, params: dict[str, str]) -> tuple[int, dict[str, Any]] | None:
    """``(status, JSON body)`` of one GET to the tracking server with MLflow's credentials and
    headers, or None when there is no answer within :data:`HTTP_CHECK_S` (no retries)."""
    answer: list[tuple[int, dict[str, Any]]] = []

    def ask() -> None:
        try:
            from mlflow.utils.credentials import get_default_host_creds
            from mlflow.utils.rest_utils import http_request

            r = http_request(get_default_host_creds(uri), endpoint, "GET", max_retries=0, backoff_factor=0,
                             backoff_jitter=0, timeout=HTTP_CHECK_S, raise_on_status=False, params=params)
            try:
                body = r.json()
            except ValueError:
                body = {}
            answer.append((r.status_code, body if isinstance(body, dict) else {}))
        except Exception:  # noqa: BLE001 - no answer: the writer's retries deal with the server
            pass

    t = threading.Thread(target=ask, name="spark-dl-store-check", daemon=True)
    t.start()
    t.join(HTTP_CHECK_S)
    return answer[0] if answer else None
