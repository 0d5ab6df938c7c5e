"""``TorchDistributor``: PySpark's ``pyspark.ml.torch.distributor.TorchDistributor`` on spark-dl's launcher.

Code written for PySpark's class switches by changing the import. What a training function or
script sees is what torchrun gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...,
``TORCHELASTIC_RUN_ID``), so ``torch.distributed.init_process_group(backend)`` works as before;
failures, logs, restarts and tracking are :class:`spark_dl.HorovodRunner`'s.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping

from spark_dl.driver import cluster
from spark_dl.driver.options import START_TIMEOUT_S, rank_env
from spark_dl.driver.runner import HorovodRunner, RunInfo
from spark_dl.driver.stalls import DEFAULT, Default
from spark_dl.errors import LaunchRefused, NoGPUs, as_int
from spark_dl.tracking.driver.observer import Tracking


class TorchDistributor:
    """Run a PyTorch training function or script on ``num_processes`` processes.

    Args:
        num_processes: how many processes train (one per GPU with ``use_gpu``).
        local_mode: True: the processes run on the driver, no Spark tasks; False: one Spark
            barrier stage on the cluster's executors.
        use_gpu: True: every process gets a GPU (the driver's in local mode; Spark GPU
            scheduling, ``spark.task.resource.gpu.amount``, on executors); False: processes see
            no GPU (``CUDA_VISIBLE_DEVICES=""``).
        _ssl_conf: accepted for PySpark's signature and ignored: spark-dl's channel to the driver
            is authenticated with a per-run secret, whatever ``spark.ssl.enabled`` says.

    The keyword-only arguments are :class:`spark_dl.HorovodRunner`'s (every rank's output is
    streamed by default, as PySpark does).
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        _ssl_conf: str | None = None,
        *,
        driver_log_verbosity: str = "all",
        start_timeout: float = START_TIMEOUT_S,
        tracking: bool | Tracking | None = None,
        progress: bool | None = None,
        max_restarts: int = 0,
        checkpoint_dir: str | os.PathLike | None = None,
        run_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stall_warning: float | None | Default = DEFAULT,
        stall_timeout: float | None | Default = DEFAULT,
    ) -> None:
        if as_int(num_processes) is None or num_processes < 1:
            raise LaunchRefused(f"num_processes must be an int >= 1 (how many processes train), got {num_processes!r}")
        for name, value in (("local_mode", local_mode), ("use_gpu", use_gpu)):
            if not isinstance(value, bool):
                raise LaunchRefused(f"{name} must be True or False, got {value!r}")
        self.num_processes = as_int(num_processes)
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        gpu_env = {} if use_gpu else {"CUDA_VISIBLE_DEVICES": ""}
        self._options: dict[str, Any] = dict(
            driver_log_verbosity=driver_log_verbosity, start_timeout=start_timeout, tracking=tracking,
            progress=progress, max_restarts=max_restarts, checkpoint_dir=checkpoint_dir, run_timeout=run_timeout,
            env={**gpu_env, **rank_env(env)}, stall_warning=stall_warning, stall_timeout=stall_timeout,
        )
        self._observers: list[Any] = []  # driver-side Observers for each run (spark_dl.ray_train's)
        self._runner(num_processes)  # every option checked now, not at run()
        if use_gpu:
            self._processes()  # GPUs there are none of: refused now (NoGPUs, a RuntimeError), as PySpark does
        self.last_run: RunInfo | None = None  # what HorovodRunner.last_run says of the latest run()

    def run(self, train_object: Callable[..., Any] | str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every process and return rank 0's value, or run
        the training script at path ``train_object`` with command-line ``args`` and return None.

        A failure raises :class:`spark_dl.RankFailed` (a ``RuntimeError``) naming the failing rank,
        with its traceback and last output lines.
        """
        is_script = isinstance(train_object, (str, os.PathLike))
        if is_script and kwargs:
            raise LaunchRefused(
                f"a training script takes command-line arguments only, got keyword arguments {sorted(kwargs)}: "
                "pass them as strings, e.g. run('train.py', '--lr=0.001')"
            )
        if not is_script and not callable(train_object):
            raise LaunchRefused(
                "train_object must be a training function or the path of a training script, got "
                f"{type(train_object).__name__}: {train_object!r:.80}"
            )
        runner = self._runner(self._processes())
        try:
            if is_script:
                runner.run_script(train_object, *[str(a) for a in args])  # as PySpark's class does
                return None
            return runner.run(train_object, *args, **kwargs)
        finally:
            self.last_run = runner.last_run

    # ------------------------------------------------------------------------------------------
    def _runner(self, processes: int) -> HorovodRunner:
        # PySpark runs one torchrun per task: LOCAL_RANK counts within a task, GROUP_RANK numbers
        # the tasks, and a task sees only its own GPUs (Lightning's devices=1, num_nodes=N idiom)
        runner = HorovodRunner(np=-processes if self.local_mode else processes, nodes="tasks", **self._options)
        if not self.use_gpu:
            runner.ranks_per_task = 1  # GPUs or not in the tasks, one process each (PySpark's count)
        runner.observers.extend(self._observers)
        return runner

    def _processes(self) -> int:
        """How many processes to start, checked against the GPUs there are when ``use_gpu``."""
        if not self.use_gpu:
            return self.num_processes
        if not self.local_mode:
            session = cluster.active_session(self.num_processes)
            raw = cluster.conf(session, "spark.task.resource.gpu.amount", "0") or "0"
            if float(raw) < 1:
                raise NoGPUs(
                    f"use_gpu=True runs one process per GPU, but spark.task.resource.gpu.amount={raw}, so Spark "
                    "gives the tasks no GPU of their own. Configure Spark GPU scheduling (spark.executor.resource."
                    "gpu.amount, spark.task.resource.gpu.amount=1, a discovery script) or pass use_gpu=False."
                )
            return self.num_processes
        gpus = _driver_gpus()
        if gpus == 0:
            raise NoGPUs(
                "use_gpu=True with local_mode=True trains on the driver's GPUs, and torch sees none here "
                "(torch.cuda.device_count() == 0). Pass use_gpu=False to train on CPUs (Gloo)."
            )
        if self.num_processes > gpus:
            # PySpark's TorchDistributor does the same (with a warning): one process per driver GPU
            sys.stderr.write(
                f"[spark-dl] num_processes={self.num_processes} is more than the driver's {gpus} GPU(s): "
                f"training with {gpus} processes, one per GPU\n"
            )
            return gpus
        return self.num_processes


def _driver_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()  # counts devices without creating a CUDA context
