"""What a run's folder (``storage_path/name``) holds: its record, ``spark_dl_run.json`` (the run's
id, its reports and its kept checkpoints), written by the driver's :class:`~spark_dl.ray_train.keeper.CheckpointKeeper`
and read back by ``TorchTrainer.restore`` and ``Result.from_path``; its ``checkpoint_<n>`` folders;
and the reports' metrics as checkpoints are ranked by them."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from spark_dl.compat.ray_train.storage import checkpoint_folder

RECORD = "spark_dl_run.json"  # the run's id, reports and kept checkpoints, for restore() and Result.from_path


def read_record(path: str) -> dict | None:
    """What the run in ``path`` recorded (None if nothing)."""
    try:
        with open(os.path.join(path, RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("reports"), list) else None


def latest_kept(path: str) -> str | None:
    """The latest checkpoint the run in ``path`` kept: its record's (named folders included), else
    (a folder without one) the highest ``checkpoint_<n>``."""
    record = read_record(path)
    if record is not None:
        kept = [os.path.join(path, folder) for folder, _ in record.get("kept", [])
                if os.path.isdir(os.path.join(path, folder))]
        return kept[-1] if kept else None
    latest = max(checkpoint_indices(path), default=None)
    return checkpoint_folder(path, latest) if latest is not None else None


def checkpoint_indices(path: str) -> list[int]:
    """The numbers of the ``checkpoint_<n>`` folders in ``path``."""
    if not os.path.isdir(path):
        return []
    return [int(d[len("checkpoint_"):]) for d in os.listdir(path)
            if d.startswith("checkpoint_") and d[len("checkpoint_"):].isdigit()]


def flatten(metrics: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested metrics as Ray flattens them: ``{"val": {"loss": 1}}`` -> ``{"val/loss": 1}``."""
    flat: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, Mapping):
            flat.update(flatten(v, f"{prefix}{k}/"))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def score(metrics: dict, attr: str) -> float | None:
    """The report's number for ``checkpoint_score_attribute`` (``"val/loss"`` reaches into a nested
    dict); None where it has none (missing, not a number, NaN)."""
    value = metrics[attr] if attr in metrics else flatten(metrics).get(attr)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    return None
