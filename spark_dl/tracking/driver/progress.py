"""A tqdm bar on the driver following rank 0: step, loss and throughput, live."""
from __future__ import annotations

import sys
import threading
from typing import Any, TextIO


class ProgressBar:
    """Created on the first metrics from rank 0; updated from rank 0's channel thread only."""

    def __init__(self, file: TextIO | None = None, total: int | None = None,
                 samples_per_step: int | None = None) -> None:
        self.file = file
        self.total = total
        self.samples_per_step = samples_per_step
        self._bar: Any = None
        self._lock = threading.Lock()

    def update(self, step: int, metrics: dict[str, float], steps_per_s: float | None) -> None:
        with self._lock:
            bar = self._bar
            if bar is None:
                from tqdm.auto import tqdm

                bar = self._bar = tqdm(
                    total=self.total, unit="step", desc="spark-dl", file=self.file or sys.stderr,
                    mininterval=0.5, dynamic_ncols=True, leave=True,
                )
            shown = {}
            for key in ("loss", "train_loss", "val_loss", "acc", "accuracy"):
                if key in metrics:
                    shown[key] = f"{metrics[key]:.4g}"
            if steps_per_s and self.samples_per_step:
                shown["samples/s"] = f"{steps_per_s * self.samples_per_step:.4g}"
            if shown:
                bar.set_postfix(shown, refresh=False)
            if step + 1 > bar.n:
                bar.update(step + 1 - bar.n)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()  # draws the final state (a refresh first would print it twice off a tty)
                self._bar = None
