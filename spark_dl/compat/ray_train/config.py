"""Ray Train's configuration classes, with Ray's names and defaults: :class:`ScalingConfig`,
:class:`RunConfig`, :class:`FailureConfig`, :class:`CheckpointConfig`, :class:`SyncConfig` and
``ray.train.torch``'s :class:`TorchConfig`; and the checks that say which of Ray's settings
spark-dl refuses, and the spark-dl way to their effect."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from spark_dl import LaunchRefused
from spark_dl.errors import in_range


@dataclass
class ScalingConfig:
    """``num_workers`` ranks, each with a GPU when ``use_gpu`` (Spark GPU scheduling on executors);
    ``num_workers=(min_workers, max_workers)`` is elastic: each attempt runs as many as there are
    free task slots for, in that range (``HorovodRunner(min_np=...)``), and a run on fewer than
    ``max_workers`` looks for free slots every ``elastic_resize_monitor_interval_s`` seconds: when
    there are, it stops at the next ``train.report(..., checkpoint=...)`` and goes on from that
    checkpoint on more workers (``HorovodRunner(grow_interval=...)``).
    ``resources_per_worker`` may say ``{"CPU": n}`` (Spark's ``spark.task.cpus`` decides; the value is
    not applied) and ``{"GPU": 1}``; ``placement_strategy`` is Spark's to decide and is ignored."""

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict | None = None
    placement_strategy: str = "PACK"
    trainer_resources: dict | None = None
    elastic_resize_monitor_interval_s: float = 60.0


@dataclass
class TorchConfig:
    """Ray's ``ray.train.torch.TorchConfig``: the process group's ``backend`` (None: NCCL on GPUs,
    Gloo otherwise; ``"gloo"`` keeps GPU workers on Gloo) and ``timeout_s``, how long a collective
    waits for the other workers before it fails. ``init_method`` (``"env"`` or ``"tcp"``) is how
    Ray's workers meet; here the launcher's rendezvous serves both."""

    backend: str | None = None
    init_method: str = "env"
    timeout_s: float = 1800


def check_torch_config(config: Any, use_gpu: bool) -> TorchConfig | None:
    """``TorchTrainer(torch_config=...)`` checked (None stays None)."""
    if config is None:
        return None
    if not isinstance(config, TorchConfig):
        raise LaunchRefused(f"torch_config must be a TorchConfig (spark_dl.ray_train.torch.TorchConfig), got "
                            f"{type(config).__name__}")
    if config.backend not in (None, "nccl", "gloo"):
        raise LaunchRefused(f"TorchConfig(backend={config.backend!r}): the backend is 'nccl', 'gloo' or None (NCCL on "
                            "GPUs, Gloo otherwise)")
    if config.backend == "nccl" and not use_gpu:
        raise LaunchRefused("TorchConfig(backend='nccl') needs a GPU per worker: pass ScalingConfig(use_gpu=True), or "
                            "leave backend=None (Gloo on CPU workers)")
    if config.init_method not in ("env", "tcp"):
        raise LaunchRefused(f"TorchConfig(init_method={config.init_method!r}): 'env' or 'tcp' (either way the workers "
                            "meet through the launcher's rendezvous)")
    if not in_range(config.timeout_s, low=0, low_open=True):
        raise LaunchRefused(f"TorchConfig(timeout_s={config.timeout_s!r}) must be a number of seconds > 0")
    return config


@dataclass
class FailureConfig:
    """``max_failures``: restarts of the whole run (``HorovodRunner(max_restarts=...)``)."""

    max_failures: int = 0
    fail_fast: bool = False


@dataclass
class CheckpointConfig:
    """Which reported checkpoints stay in ``storage_path/name``: all (``num_to_keep=None``), else
    the ``num_to_keep`` latest, or the best by ``checkpoint_score_attribute`` (a reported metric;
    ``checkpoint_score_order`` "max" or "min"); the latest is always among them."""

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"


@dataclass
class SyncConfig:
    """Ray's ``SyncConfig``, accepted for its defaults: checkpoints are written straight into
    ``storage_path`` as they are reported, so there is nothing to sync; ``sync_artifacts=True``
    (Ray uploads files the workers write into their trial folder) is refused at construction."""

    sync_period: int = 300
    sync_timeout: int = 1800
    sync_artifacts: bool = False
    sync_artifacts_on_checkpoint: bool = True


@dataclass
class RunConfig:
    """``name`` names the MLflow run and the result folder ``storage_path/name`` (default
    ``~/spark_dl_results``, as Ray's is ``~/ray_results``).

    Ray's other fields are accepted where they change nothing here: ``verbose``, ``sync_config``
    (without ``sync_artifacts``), ``storage_filesystem=pyarrow.fs.LocalFileSystem()``, empty
    ``callbacks``/``worker_runtime_env``; ``TorchTrainer`` refuses the rest with the spark-dl way
    to get their effect (``stop``, ``callbacks``, ``progress_reporter``, ``log_to_file``,
    ``local_dir``, other file systems, ``worker_runtime_env``)."""

    name: str | None = None
    storage_path: str | os.PathLike | None = None
    failure_config: FailureConfig | None = None
    checkpoint_config: CheckpointConfig | None = None
    verbose: int | None = None
    # Ray's, after spark-dl's own (a positional RunConfig(name, path, failure_config) keeps working)
    storage_filesystem: Any = None
    sync_config: SyncConfig | None = None
    stop: Any = None
    callbacks: list | None = None
    progress_reporter: Any = None
    log_to_file: bool | str | tuple = False
    local_dir: str | None = None
    worker_runtime_env: dict | None = None


def run_config_refusal(config: RunConfig) -> str | None:
    """Why ``config`` asks for something spark-dl does not do (None: nothing): the field, and the
    spark-dl way to its effect."""
    if config.stop is not None:
        return (f"RunConfig(stop={config.stop!r}): stop criteria are not supported; end the loop yourself when a "
                "metric says so, on every worker alike (e.g. decide on rank 0 and share it with "
                "train.collective.broadcast_from_rank_zero), so every worker reports as many times")
    callbacks = config.callbacks or []
    callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    if callbacks:
        names = [type(c).__name__ for c in callbacks]
        if any("mlflow" in n.lower() for n in names):
            return (f"RunConfig(callbacks={names}): MLflow tracking is built in (rank 0's reports are the run's "
                    "metrics, train_loop_config its params): drop the MLflow callback")
        return (f"RunConfig(callbacks={names}): Ray Tune/Train callbacks are not run; reports reach MLflow (built in) "
                "and Result.metrics_dataframe, and code can go in the loop (rank 0) or after fit()")
    if config.progress_reporter is not None:
        return ("RunConfig(progress_reporter=...): no progress tables are printed; rank 0's reports are MLflow "
                "metrics as they come (and train.report's metrics are in Result.metrics_dataframe): drop it")
    if config.log_to_file:
        return (f"RunConfig(log_to_file={config.log_to_file!r}): every rank's stdout/stderr is printed on the driver, "
                "tagged with its rank, and kept in the MLflow run as logs/rank<r>.txt: drop log_to_file")
    if config.local_dir is not None:
        return f"RunConfig(local_dir={config.local_dir!r}): Ray's deprecated name; pass storage_path"
    if config.worker_runtime_env:
        return ("RunConfig(worker_runtime_env=...): the workers are Spark tasks, in the executors' environment; set "
                "it through Spark (spark.executorEnv.<NAME>, --py-files/--archives, the cluster's Python environment)")
    if getattr(config.sync_config, "sync_artifacts", False):
        return ("RunConfig(sync_config=SyncConfig(sync_artifacts=True)): nothing is synced: checkpoints are written "
                "into storage_path as reported; write other files into storage_path/name yourself "
                "(train.get_context().get_trial_dir(), on storage every executor mounts)")
    fs = config.storage_filesystem
    if fs is not None and not local_filesystem(fs):
        return (f"RunConfig(storage_filesystem={type(fs).__name__}): spark-dl writes checkpoints to a file system "
                "path; drop storage_filesystem and pass the folder where the storage is mounted on the driver and "
                "executors as storage_path")
    return None


def local_filesystem(fs: Any) -> bool:
    """Whether ``fs`` is pyarrow's local file system: paths on it are file system paths, as spark-dl's are."""
    try:
        from pyarrow.fs import LocalFileSystem
    except ImportError:  # no pyarrow here: then fs cannot be one
        return False
    return isinstance(fs, LocalFileSystem)



def local_path(storage_path: str | os.PathLike | None) -> str:
    """``storage_path`` as a file system path: ``file:`` URIs on this host are, other URIs are
    refused (a directory named ``s3:`` would silently take the checkpoints)."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    path = os.path.expanduser(os.fspath(storage_path or "~/spark_dl_results"))
    # a scheme of two letters at least (C:/ is a Windows path) and a slash: "run:1" may name a folder
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):/", path)
    if scheme is None:
        return path
    name = scheme.group(1).lower()
    if name == "file":
        url = urlparse(path)
        if url.netloc not in ("", "localhost"):
            raise LaunchRefused(f"RunConfig(storage_path={path!r}): a file: URI names a path on this machine "
                                f"(file:///path), not on host {url.netloc!r}; pass the folder's path")
        return url2pathname(url.path)
    hint = ""
    if name == "dbfs":
        rest = path[len("dbfs:"):].lstrip("/")
        mount = "/" + rest if rest.startswith("Volumes/") else "/dbfs/" + rest
        hint = f" (Databricks mounts it at {mount})"
    raise LaunchRefused(f"RunConfig(storage_path={path!r}): spark-dl writes checkpoints to a file system path, not "
                        f"to a {scheme.group(1)}: URI; pass the folder where the storage is mounted on the driver and "
                        f"executors{hint}")
