"""Unpickle what a rank sent (a checkpoint, a return value) where its CUDA tensors can live.

A pickled tensor's storage is rebuilt by ``torch.storage._load_from_bytes``: a ``torch.load`` with
no ``map_location``, so a GPU-saved tensor raises "Attempting to deserialize object on a CUDA
device" in a process without CUDA (a CPU-only driver of GPU executors) and lands on the saver's GPU
in one with it (every rank filling rank 0's GPU). :func:`loads` rebuilds storages with a
``map_location`` of its own.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO


def loads(blob: bytes | memoryview, map_location: Any) -> Any:
    """``pickle.loads(blob)`` (cloudpickle's too) with every tensor storage loaded by
    ``torch.load(..., map_location=map_location)``."""
    return _Unpickler(io.BytesIO(blob), map_location).load()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, map_location: Any) -> None:
        super().__init__(file)
        self.map_location = map_location

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return self._load_storage
        return super().find_class(module, name)

    def _load_storage(self, data: bytes) -> Any:
        import torch

        return torch.load(io.BytesIO(data), weights_only=False, map_location=self.map_location)


def driver_device(storage: Any, location: str) -> Any:
    """A map_location for the driver: a GPU-saved storage stays on that GPU where the driver has it
    (local mode on a GPU host), else comes to the CPU (a CPU driver of GPU executors)."""
    if not location.startswith("cuda"):
        return None
    import torch

    index = int(location.partition(":")[2] or 0)
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        return None
    return storage


def check_map_location(map_location: Any, where: str) -> None:
    """Refuse what ``torch.load`` would not take as a map_location, naming what it does."""
    if map_location is None or callable(map_location) or isinstance(map_location, (str, dict)):
        return
    import torch

    if isinstance(map_location, torch.device):
        return
    raise TypeError(
        f"{where}: map_location must be None (each rank's own device), a device such as 'cpu', a dict "
        f"such as {{'cuda:0': 'cpu'}} or a function (storage, location), as torch.load takes; got {map_location!r}"
    )
