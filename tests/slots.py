"""Task slots taken by another Spark job, for the tests of runs sized by the free slots (min_np)."""
from __future__ import annotations

import os
import threading
import time

from spark_dl.driver import cluster


class OtherJob:
    """Another Spark job holding two task slots from :meth:`start` until ``release`` appears (or
    60 s pass); leaving the ``with`` block releases it and waits for it to end."""

    def __init__(self, sc, flags: str) -> None:
        self.sc = sc
        self.flags = flags
        self.release = release = os.path.join(flags, "release")

        def hold(i):
            open(os.path.join(flags, f"holding-{i}"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)

        self.thread = threading.Thread(target=lambda: sc.parallelize(range(2), 2).foreach(hold))

    def start(self) -> None:
        self.thread.start()
        # both tasks hold a slot: counted by their own marks, since while another job's tasks are
        # ending the cluster's busy count can reach 2 before these two run
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(self.flags, f"holding-{i}")) for i in range(2)
        ):
            time.sleep(0.05)
        assert cluster.slots(self.sc).busy >= 2, "the other job's two tasks run but hold no slots"

    def __enter__(self) -> "OtherJob":
        return self

    def __exit__(self, *_) -> None:
        open(self.release, "w").close()
        if self.thread.is_alive():
            self.thread.join()
