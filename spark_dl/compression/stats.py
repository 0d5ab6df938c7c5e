"""Per-process byte accounting of every compressed collective, read by the tracking layer."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CompressionStats:
    """Cumulative totals for this process.

    ``bytes_sent``: bytes this rank sent, counted per algorithm: a ring all-reduce of N bytes
    over W ranks sends 2 (W-1)/W N; an all-to-all sends every chunk except its own; an
    all-gather sends its own piece to W-1 ranks. ``bytes_dense``: what a ring all-reduce of
    the same tensors in their own dtype would have sent. ``seconds``: wall time inside
    ``allreduce`` (compression included).
    """

    bytes_sent: int = 0
    bytes_dense: int = 0
    elements: int = 0
    calls: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += int(n)

    def add_call(self, elements: int, dense_bytes: int, seconds: float) -> None:
        with self._lock:
            self.calls += 1
            self.elements += int(elements)
            self.bytes_dense += int(dense_bytes)
            self.seconds += seconds

    @property
    def ratio(self) -> float:
        """bytes_dense / bytes_sent: how many times fewer bytes compression sent."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else float("nan")

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense,
                    "elements": self.elements, "calls": self.calls, "seconds": self.seconds}

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent = self.bytes_dense = self.elements = self.calls = 0
            self.seconds = 0.0

    def __getstate__(self) -> dict:
        return self.snapshot()

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]


stats = CompressionStats()
