"""Horovod's elastic API (``hvd.elastic``) on spark-dl's restarts: code written for Elastic Horovod
runs unchanged under ``HorovodRunner(np=..., max_restarts=N)``.

Elastic Horovod keeps the surviving workers alive and rolls them back to the last ``commit()`` in
memory. Spark's barrier stages cannot change their size, so here a failure ends the attempt and
spark-dl launches it again (every rank fresh, same world size); ``commit()`` therefore sends the
state to the driver (:func:`spark_dl.save_checkpoint`), and :func:`run` restores the last committed
state when a restarted attempt calls the training function, then calls the reset callbacks and
syncs every rank from rank 0, as Horovod does after a reset.
"""
from __future__ import annotations

import copy
import functools
import math
import random
from typing import Any, Callable, Iterator

import torch

from spark_dl.compat.horovod.basics import rank
from spark_dl.compat.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    to_cpu,
)
from spark_dl.rank import checkpoint, context

_KEY = "spark_dl.horovod.elastic"


class State:
    """Base of the elastic states: what ``commit()`` saves and a restart restores.

    Subclasses implement :meth:`save`, :meth:`restore`, :meth:`sync` and the ``_snapshot`` /
    ``_load_snapshot`` pair that turns the state into picklable data and back.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits = 0  # not a public name: a user attribute may be called "commits"

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Callables run after the state is restored from a commit (a restarted attempt)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Horovod calls this when hosts join or leave; a barrier stage's hosts never change."""

    def commit(self) -> None:
        """Save the state, on the driver: a failure after this resumes from here. Call it on every
        rank at the same points (it gathers the samplers' progress from all ranks)."""
        self.save()
        self._commits += 1
        checkpoint.save_checkpoint({_KEY: self._snapshot(), "commits": self._commits}, step=self._commits)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises here when hosts were added or removed; they never are in a barrier stage."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def _snapshot(self) -> dict:
        raise NotImplementedError

    def _load_snapshot(self, snapshot: dict) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain Python attributes (``epoch=0, batch=0``), saved by deep copy and synced from rank 0."""

    def __init__(self, bcast_object: Callable[..., Any] = broadcast_object, get_rank: Callable[[], int] = rank,
                 **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._saved_state = dict(kwargs)
        self._names = list(kwargs)
        super().__init__()
        for name, value in kwargs.items():
            setattr(self, name, value)

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        self._saved_state = copy.deepcopy(self._values())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved_state).items():
            setattr(self, name, value)

    def sync(self) -> None:
        if self._names:
            for name, value in self._bcast_object(self._values(), 0).items():
                setattr(self, name, value)
            self.save()

    def _snapshot(self) -> dict:
        return {"objects": copy.deepcopy(self._saved_state)}

    def _load_snapshot(self, snapshot: dict) -> None:
        self._saved_state = dict(snapshot["objects"])
        self.restore()


class TorchState(ObjectState):
    """A model, an optimizer, :class:`ElasticSampler` s and plain attributes, as ``hvd.elastic.TorchState``:
    ``TorchState(model=model, optimizer=opt, train_sampler=sampler, epoch=0, batch=0)``."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        plain = {k: v for k, v in kwargs.items() if k not in self._samplers}
        self._saved_model: dict | None = None
        self._saved_optimizer: dict | None = None
        self._saved_samplers: dict[str, dict] = {}
        super().__init__(**plain)

    def save(self) -> None:
        if self.model is not None:
            self._saved_model = to_cpu(self.model.state_dict(), copy=True)
        if self.optimizer is not None:
            self._saved_optimizer = to_cpu(self.optimizer.state_dict(), copy=True)
        # a sampler's progress is every rank's batches: gather them so rank 0's commit has all of it
        self._saved_samplers = {name: s._gathered_state_dict() for name, s in self._samplers.items()}
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        for name, sd in self._saved_samplers.items():
            self._samplers[name].load_state_dict(sd)
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for sampler in self._samplers.values():
            sampler.load_state_dict(self._bcast_object(sampler._gathered_state_dict(), 0))
        super().sync()

    def _snapshot(self) -> dict:
        return {**super()._snapshot(), "model": self._saved_model, "optimizer": self._saved_optimizer,
                "samplers": self._saved_samplers}

    def _load_snapshot(self, snapshot: dict) -> None:
        self._saved_model = snapshot["model"]
        self._saved_optimizer = snapshot["optimizer"]
        self._saved_samplers = dict(snapshot["samplers"])
        super()._load_snapshot(snapshot)


class ElasticSampler(torch.utils.data.Sampler):
    """``hvd.elastic.ElasticSampler``: this rank's share of the dataset's indices not yet processed
    in the current epoch, so an epoch resumed after a restart skips what was committed.

    Call :meth:`record_batch` after each batch (or :meth:`record_indices`) and ``state.commit()``
    at the same points on every rank; :meth:`set_epoch` starts a new epoch.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: list[int]) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def _gathered_state_dict(self) -> dict:
        every = allgather_object(sorted(self.processed_indices)) if _world() > 1 else [sorted(self.processed_indices)]
        return {"epoch": self.epoch, "processed_indices": sorted(set().union(*every))}

    def reset(self) -> None:
        """Split the epoch's unprocessed indices over the ranks (padded by repetition to equal shares)."""
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        remaining = [i for i in order if i not in self.processed_indices]
        replicas, me = _world(), _me()
        per_rank = math.ceil(len(remaining) / replicas) if remaining else 0
        padded = remaining + remaining[: per_rank * replicas - len(remaining)] if remaining else []
        self.indices = padded[me:per_rank * replicas:replicas]
        self._split_for = replicas

    def __iter__(self) -> Iterator[int]:
        self.reset()  # the world may have been joined since construction
        return iter(list(self.indices))

    def __len__(self) -> int:
        if getattr(self, "_split_for", None) != _world():  # only then: indices must not move mid-epoch
            self.reset()
        return len(self.indices)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _me() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``@hvd.elastic.run``: call ``func(state, ...)`` with ``state`` restored from the last
    ``commit()`` of an earlier attempt (then its reset callbacks run), synced from rank 0.

    A failure inside ``func`` is not retried in place: it fails the attempt, and
    ``HorovodRunner(max_restarts=N)`` launches the job again, which comes back here.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError("hvd.elastic.run: the first argument must be an hvd.elastic State, "
                            f"got {type(state).__name__}")
        saved = checkpoint.load_checkpoint() if context.in_rank_process() else None
        resumed = isinstance(saved, dict) and _KEY in saved
        if resumed:
            state._load_snapshot(saved[_KEY])
            state._commits = saved.get("commits", 0)
        state.sync()
        if resumed:
            state.on_reset()
        return func(state, *args, **kwargs)

    return wrapper


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]
