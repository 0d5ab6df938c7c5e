"""Per-host system metrics, sampled on the executors and sent through the job's channel.

One sampler per host: the task that runs the host's local rank 0 starts it. It reads psutil (and
GPU utilization/memory through NVML or ``nvidia-smi`` where the host has NVIDIA GPUs) every
``SPARK_DL_SYSTEM_METRICS_INTERVAL`` seconds (default 5; 0 turns it off). The driver logs the
samples as ``system/<host>/<metric>`` with the sample index as the step.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from typing import Any, Callable

from spark_dl import protocol
from spark_dl.errors import env_number

DEFAULT_INTERVAL_S = 5.0


def interval_s() -> float:
    """Seconds between samples, from the driver's ``SPARK_DL_SYSTEM_METRICS_INTERVAL``."""
    return env_number(protocol.SYSTEM_METRICS_ENV, DEFAULT_INTERVAL_S, unit=" s")


def sample(psutil: Any) -> dict[str, float]:
    """One reading of this host."""
    vm = psutil.virtual_memory()
    out = {
        "cpu_percent": float(psutil.cpu_percent(interval=None)),
        "memory_percent": float(vm.percent),
        "memory_used_gb": (vm.total - vm.available) / 1e9,
    }
    out.update(gpu_sample())
    return out


_nvml: Any = None  # the initialised pynvml module, False once it proved unusable


def _nvml_sample() -> dict[str, float] | None:
    global _nvml
    if _nvml is None:
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception:  # noqa: BLE001 - not installed, or no driver
            _nvml = False
    if not _nvml:
        return None
    out = {}
    for i in range(_nvml.nvmlDeviceGetCount()):
        h = _nvml.nvmlDeviceGetHandleByIndex(i)
        mem = _nvml.nvmlDeviceGetMemoryInfo(h)
        out[f"gpu{i}_utilization_percent"] = float(_nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        out[f"gpu{i}_memory_used_gb"] = mem.used / 1e9
        out[f"gpu{i}_memory_percent"] = 100.0 * mem.used / mem.total if mem.total else 0.0
    return out


def _smi_sample() -> dict[str, float] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    res = subprocess.run([smi, "--query-gpu=index,utilization.gpu,memory.used,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    if res.returncode != 0:
        return None
    out = {}
    for line in res.stdout.strip().splitlines():
        idx, util, used, total = (f.strip() for f in line.split(","))
        out[f"gpu{idx}_utilization_percent"] = float(util)
        out[f"gpu{idx}_memory_used_gb"] = float(used) * 2**20 / 1e9  # MiB
        out[f"gpu{idx}_memory_percent"] = 100.0 * float(used) / float(total) if float(total) else 0.0
    return out


def gpu_sample(use_nvml: bool = True) -> dict[str, float]:
    """Utilization and memory of every GPU of this host, through NVML (``nvidia-ml-py``) or else
    ``nvidia-smi``; empty without either. Neither creates a CUDA context, so it is safe in the
    Spark task process, which never loads torch."""
    try:
        got = _nvml_sample() if use_nvml else None
        if got is None:
            got = _smi_sample()
        return got or {}
    except Exception:  # noqa: BLE001 - a monitoring hiccup must never touch the job
        return {}


class Sampler:
    """Daemon thread that calls ``send(kind, data)`` with a sample every ``interval`` seconds."""

    def __init__(self, host: str, send: Callable[[str, Any], None], interval: float) -> None:
        import psutil

        self.psutil = psutil
        self.host = host
        self.send = send
        self.interval = interval
        self.stopped = threading.Event()
        psutil.cpu_percent(interval=None)  # prime: the first reading covers the time since this call
        self.thread = threading.Thread(target=self._loop, name="spark-dl-system-metrics", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        step = 0
        while not self.stopped.wait(self.interval if step else min(1.0, self.interval)):
            try:
                values = sample(self.psutil)
            except Exception:  # noqa: BLE001 - a monitoring hiccup must never touch the job
                continue
            self.send(protocol.TRACKING_SYSTEM,
                      {"host": self.host, "time": time.time(), "step": step, "metrics": values})
            step += 1

    def stop(self) -> None:
        self.stopped.set()


def start_sampler(
    host: str, local_ranks: list[int], send: Callable[[str, Any], None], interval: float
) -> Sampler | None:
    """Start the host's sampler if this task runs local rank 0 and the driver asked for samples
    (``interval`` > 0, decided on the driver: executors do not see its settings); else None."""
    if 0 not in local_ranks:
        return None
    if interval <= 0:
        return None
    try:
        return Sampler(socket.gethostname(), send, interval)
    except ImportError:  # psutil missing on this executor
        return None
