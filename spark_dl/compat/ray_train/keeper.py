"""On the driver: :class:`CheckpointKeeper`, the observer of a ``TorchTrainer`` run that writes each
checkpoint rank 0 reports into the run's folder, keeps the ones ``CheckpointConfig`` asks for, and
records the run (:mod:`spark_dl.ray_train.record`) for ``TorchTrainer.restore`` and
``Result.from_path``."""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from typing import Any

from spark_dl.compat.ray_train.checkpoint import Checkpoint, unpack_checkpoint
from spark_dl.compat.ray_train.config import CheckpointConfig
from spark_dl.compat.ray_train.record import RECORD, checkpoint_indices, flatten, score
from spark_dl.compat.ray_train.storage import checkpoint_folder


class CheckpointKeeper:
    """Driver-side observer: writes each checkpoint rank 0 reports into ``path`` as it arrives
    (``checkpoint_<report index>``, or the report's ``checkpoint_dir_name``) and keeps
    ``num_to_keep`` of them: the best by ``checkpoint_score_attribute`` if set, else the latest;
    the latest is always kept."""

    def __init__(self, path: str, config: CheckpointConfig, earlier: dict | None = None, trial_id: str = "") -> None:
        self.path = path
        self.config = config
        self.trial_id = trial_id
        # numbering continues after what the folder holds (a restored or repeated run): none overwritten
        self.offset = 1 + max(checkpoint_indices(path), default=-1)
        # a restored run goes on with its earlier fits' reports and kept checkpoints (num_to_keep counts them)
        self.history: list[dict] = list(earlier["reports"]) if earlier else []
        self.kept: list[tuple[Checkpoint, dict]] = [
            (Checkpoint(os.path.join(path, folder)), metrics) for folder, metrics in (earlier or {}).get("kept", [])
            if os.path.isdir(os.path.join(path, folder))]
        self.latest: Checkpoint | None = self.kept[-1][0] if self.kept else None
        self._lock = threading.Lock()
        self._warned = False

    def record(self, reports: list[dict]) -> None:
        """Write the run's reports so far (earlier fits' first) and the kept checkpoints."""
        record = {"reports": self.history + list(reports),
                  "kept": [[os.path.basename(c.path), m] for c, m in self.kept], "trial_id": self.trial_id}
        tmp = os.path.join(self.path, f".{RECORD}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(record, f, default=repr)  # a report's odd value (an array) as its text
            os.replace(tmp, os.path.join(self.path, RECORD))
        except OSError as e:  # restore() then knows less; the run itself is not at stake
            sys.stderr.write(f"[spark-dl] could not record the run in {self.path}: {e}\n")

    def on_start(self, job: dict) -> None:
        pass

    def on_log(self, rank: int, stream: str, line: str) -> None:
        pass

    def on_finish(self, error: BaseException | None) -> None:
        pass

    def on_message(self, rank: int, kind: str, data: Any) -> None:
        pass

    def on_checkpoint(self, blob: Any, step: int | None) -> None:
        """Rank 0's ``report`` stored a checkpoint: ``step`` is the report's index."""
        import cloudpickle

        state = cloudpickle.loads(blob)
        if "ray_train_path" in state:  # the workers wrote it into the storage: only its path came
            checkpoint = Checkpoint(state["ray_train_path"])
        else:
            name = state.get("ray_train_name")
            folder = os.path.join(self.path, name) if name else checkpoint_folder(self.path, self.offset + step)
            checkpoint = unpack_checkpoint(state["ray_train_checkpoint"], folder)
        metrics = state["reports"][step]
        attr = self.config.checkpoint_score_attribute
        if attr is not None and score(metrics, attr) is None and not self._warned:
            self._warned = True  # Ray logs it too; once is enough
            sys.stderr.write(f"[spark-dl] CheckpointConfig(checkpoint_score_attribute={attr!r}): report {step} has no "
                             f"number there (its metrics: {sorted(flatten(metrics))}), so its checkpoint ranks below "
                             "every scored one\n")
        with self._lock:
            self.kept = [(c, m) for c, m in self.kept if c.path != checkpoint.path]  # a restart's redo
            self.kept.append((checkpoint, metrics))
            self.latest = checkpoint
            self._prune()
            self.record(state["reports"])

    def _prune(self) -> None:
        n = self.config.num_to_keep
        if n is None or len(self.kept) <= n:
            return
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            keep = self.kept[-n:]
        else:
            sign = 1 if self.config.checkpoint_score_order == "max" else -1

            def rank(cm: tuple[Checkpoint, dict]) -> tuple[bool, float]:
                value = score(cm[1], attr)  # a report without a number there ranks below every other, as in Ray
                return (value is not None, sign * value if value is not None else 0.0)

            ranked = sorted(self.kept, key=rank, reverse=True)
            keep = ranked[:n]
            if self.kept[-1] not in keep:  # the latest is what a resumed run needs
                keep = keep[:-1] + [self.kept[-1]] if n > 1 else [self.kept[-1]]
        for c, m in self.kept:
            if (c, m) not in keep:
                shutil.rmtree(c.path, ignore_errors=True)
        self.kept = [cm for cm in self.kept if cm in keep]  # in report order

