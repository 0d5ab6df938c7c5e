"""Per-host system metrics, sampled on the executors and sent through the job's channel.

One sampler per host: the task that runs the host's local rank 0 starts it. It reads psutil (and
GPU memory/utilization through ``torch.cuda`` when torch is already loaded and sees GPUs) every
``SPARK_DL_SYSTEM_METRICS_INTERVAL`` seconds (default 5; 0 turns it off). The driver logs the
samples as ``system/<host>/<metric>`` with the sample index as the step.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Callable

DEFAULT_INTERVAL_S = 5.0


def interval_s() -> float:
    """Seconds between samples, from the driver's ``SPARK_DL_SYSTEM_METRICS_INTERVAL``."""
    try:
        return float(os.environ.get("SPARK_DL_SYSTEM_METRICS_INTERVAL", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S


def sample(psutil: Any) -> dict[str, float]:
    """One reading of this host."""
    vm = psutil.virtual_memory()
    out = {
        "cpu_percent": float(psutil.cpu_percent(interval=None)),
        "memory_percent": float(vm.percent),
        "memory_used_gb": (vm.total - vm.available) / 1e9,
    }
    torch = sys.modules.get("torch")  # never import torch (and create a CUDA context) just for this
    if torch is not None:
        try:
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    out[f"gpu{i}_utilization_percent"] = float(torch.cuda.utilization(i))
                    out[f"gpu{i}_memory_used_gb"] = float(torch.cuda.device_memory_used(i)) / 1e9
        except Exception:  # noqa: BLE001 - needs pynvml / a recent torch: skip GPU readings
            pass
    return out


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
            self.send("tracking/system", {"host": self.host, "time": time.time(), "step": step, "metrics": values})
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
