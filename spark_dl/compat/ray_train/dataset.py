"""``get_dataset_shard(name)``'s :class:`DataShard`: this worker's share of a Spark DataFrame passed
in ``TorchTrainer(datasets=...)``, iterated as Ray's ``DataIterator`` is."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from spark_dl import get_device


class DataShard:
    """``get_dataset_shard(name)``: this rank's share of a Spark DataFrame passed in ``datasets``."""

    def __init__(self, data) -> None:
        self._data = data
        self._epoch = 0

    def iter_torch_batches(self, *, prefetch_batches: int = 1, batch_size: int | None = 256, dtypes: Any = None,
                           device: Any = "auto", collate_fn: Callable | None = None, drop_last: bool = False,
                           local_shuffle_buffer_size: int | None = None, local_shuffle_seed: int | None = None,
                           pin_memory: bool = False) -> Iterator[Any]:
        """Ray's ``DataIterator.iter_torch_batches``: ``{column: tensor}`` batches on ``device``
        (``"auto"``: the worker's), cast to ``dtypes`` (one dtype or ``{column: dtype}``), or
        whatever ``collate_fn`` makes of ``{column: numpy array}``; ``batch_size=None``: all of this
        worker's rows in one batch. Each pass is the next epoch (a new shuffle of the whole
        DataFrame unless ``shards(df, shuffle=False)`` was passed). ``prefetch_batches``: 0 fetches
        each batch when it is asked for; more fetch the next one in the background (one ahead)."""
        import torch

        if collate_fn is not None and dtypes is not None:
            raise ValueError("iter_torch_batches: collate_fn and dtypes cannot be combined (as in Ray): cast in "
                             "collate_fn")
        if local_shuffle_buffer_size is not None or local_shuffle_seed is not None:
            raise ValueError("iter_torch_batches: local_shuffle_buffer_size/local_shuffle_seed are not supported: "
                             "every epoch already shuffles the whole DataFrame across workers "
                             "(shards(df, shuffle=True), the default; seed=... fixes it)")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"iter_torch_batches: batch_size must be an int >= 1 or None (all rows in one batch), "
                             f"got {batch_size!r}")
        if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) or prefetch_batches < 0:
            raise ValueError(f"iter_torch_batches: prefetch_batches must be an int >= 0, got {prefetch_batches!r}")
        cast = _dtype_caster(dtypes)
        epoch, self._epoch = self._epoch, self._epoch + 1
        target = get_device() if device == "auto" else device
        size = batch_size if batch_size is not None else max(1, len(self._data))
        for batch in self._data.batches(size, epoch=epoch, drop_last=drop_last and batch_size is not None,
                                        prefetch=prefetch_batches > 0):
            out = collate_fn({k: v.numpy() for k, v in batch.items()}) if collate_fn is not None else cast(batch)
            if pin_memory and torch.cuda.is_available():
                out = _to_device(out, None, pin=True)
            yield _to_device(out, target) if target is not None else out

    def iter_batches(self, *, batch_size: int | None = 256, batch_format: str = "numpy", drop_last: bool = False,
                     prefetch_batches: int = 1) -> Iterator[Any]:
        """Ray's ``DataIterator.iter_batches``: ``{column: numpy array}`` batches (``batch_format=
        "numpy"``, the default) or pandas DataFrames (``"pandas"``); each pass is the next epoch."""
        if batch_format not in ("numpy", "default", "pandas"):
            raise ValueError(f"iter_batches(batch_format={batch_format!r}): 'numpy' or 'pandas'")
        for batch in self.iter_torch_batches(batch_size=batch_size, drop_last=drop_last, device=None,
                                             prefetch_batches=prefetch_batches):
            arrays = {k: v.numpy() for k, v in batch.items()}
            if batch_format == "pandas":
                import pandas as pd

                yield pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in arrays.items()})
            else:
                yield arrays

    def iter_rows(self) -> Iterator[dict]:
        """Ray's ``DataIterator.iter_rows``: this worker's rows of the next epoch, one dict each."""
        for batch in self.iter_batches():
            names = list(batch)
            for i in range(len(batch[names[0]]) if names else 0):
                yield {k: batch[k][i] for k in names}


def _dtype_caster(dtypes: Any) -> Callable[[dict], dict]:
    import torch

    if dtypes is None:
        return lambda batch: batch
    if isinstance(dtypes, torch.dtype):
        return lambda batch: {k: v.to(dtypes) for k, v in batch.items()}
    if isinstance(dtypes, Mapping) and all(isinstance(d, torch.dtype) for d in dtypes.values()):
        return lambda batch: {k: v.to(dtypes[k]) if k in dtypes else v for k, v in batch.items()}
    raise TypeError(f"iter_torch_batches: dtypes must be a torch.dtype or {{column: torch.dtype}}, got {dtypes!r}")


def _to_device(data: Any, device: Any, pin: bool = False) -> Any:
    """Tensors in ``data`` (a tensor, or dicts, lists and tuples of them) moved to ``device``
    (or pinned); anything else as it is."""
    import torch

    if isinstance(data, torch.Tensor):
        return data.pin_memory() if pin else data.to(device)
    if isinstance(data, Mapping):
        return {k: _to_device(v, device, pin) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(v, device, pin) for v in data)
    return data
