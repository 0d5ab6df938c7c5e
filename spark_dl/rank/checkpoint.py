"""Checkpoints kept by the driver, the rank's half: :func:`save_checkpoint` and :func:`load_checkpoint`.

Rank 0 sends its state to the driver with :func:`save_checkpoint` (or, with ``sharded=True``, every
rank its own part of it: FSDP's or ZeRO's sharded state); the driver keeps the latest one
(:class:`spark_dl.driver.checkpoint_store.CheckpointStore`). After a failure,
``HorovodRunner(max_restarts=N)`` launches the job again and every rank gets that state back from
:func:`load_checkpoint`. The state travels over the job's authenticated channel, so executors need
no shared storage, and an executor that is lost with its disk loses nothing.
"""
from __future__ import annotations

import operator
import os
import pickle
from typing import Any

from spark_dl import protocol
from spark_dl.rank import context as rank_api
from spark_dl.rank.context import cuda_index
from spark_dl.transport import unpickle


def save_checkpoint(state: Any, step: int | None = None, *, sharded: bool = False) -> bool:
    """Make ``state`` this run's latest checkpoint; returns once the driver has stored it.

    Only rank 0's state is kept: on other ranks (and outside a rank process) this does nothing
    and returns False, so every rank may call it; in a process a rank started, it raises.
    ``state`` is anything cloudpickle can pickle,
    typically ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}``;
    ``step`` is shown in the driver's restart message. Metrics logged before the call reach the
    driver before the checkpoint, so a restart loses none of them. It passes through the driver's memory:
    for checkpoints of several GB, write them to shared storage and save their path here.

    ``sharded=True``: every rank saves its own ``state`` (its shard of a sharded model or
    optimizer: FSDP's ``SHARDED_STATE_DICT``, a ZeRO optimizer's partition) and every rank must
    call it, the same number of times; the rank's shard is stored when this returns (True on
    every rank), and the checkpoint becomes the latest once every rank's shard of that save has
    arrived, so a failure in the middle of a save leaves the previous checkpoint in place.
    :func:`load_checkpoint` then gives each rank its own shard back.
    """
    if step is not None:
        try:
            step = operator.index(step)  # ints, numpy ints; the driver stores it in a JSON header
        except TypeError:
            raise TypeError(f"save_checkpoint: step must be an int or None, got {step!r}") from None
    if not isinstance(sharded, bool):
        raise TypeError(f"save_checkpoint: sharded must be True or False, got {sharded!r}")
    if not _in_rank_process("save_checkpoint"):
        return False
    context = rank_api.get_context()
    if context.rank != 0 and not sharded:
        return False
    import cloudpickle

    try:
        blob = cloudpickle.dumps(state)
    except Exception as e:  # noqa: BLE001 - any pickling failure gets the same advice
        raise TypeError(
            f"save_checkpoint: the state ({type(state).__name__}) cannot be pickled: {type(e).__name__}: {e}. "
            "Save plain data: state_dicts, tensors, numbers (not the model's process group, a DataLoader or a lock)."
        ) from e
    from spark_dl.tracking.rank.buffer import flush_metrics

    flush_metrics()  # the metrics logged so far reach the driver before the checkpoint does
    message: dict[str, Any] = {"blob": pickle.PickleBuffer(blob), "step": step}
    if sharded:
        message.update(sharded=True, world=context.world_size)
    reply = rank_api.request(protocol.CHECKPOINT_SAVE, message)
    if "error" in reply:
        raise RuntimeError(f"the driver could not store the checkpoint: {reply['error']}")
    return True


def load_checkpoint(map_location: Any = None, *, shard: int | str | None = None) -> Any | None:
    """The latest state rank 0 saved with :func:`save_checkpoint` in this run, or None.

    Every rank gets the same state. On a run's first attempt nothing has been saved yet, so
    this returns None, unless ``checkpoint_dir`` holds an earlier run's (outside a rank process,
    always None; in a process a rank started, it raises).

    A checkpoint saved with ``sharded=True`` gives each rank its own shard, when the run has as
    many ranks as saved it; otherwise this raises a ``ValueError`` naming both sizes. ``shard=k``
    loads rank k's shard, ``shard="all"`` the list of every rank's (to re-shard for another
    number of ranks); for a checkpoint saved by rank 0 alone, shard 0 is the only one.

    Tensors saved on a GPU come back on this rank's own GPU (not on the device rank 0 saved them
    from, which every rank would fill), or on the CPU where this rank has none; CPU tensors stay
    on the CPU. ``map_location`` overrides that as ``torch.load``'s does (``"cpu"``, a device, a
    ``{"cuda:0": "cuda:1"}`` dict or a ``(storage, location)`` function) for every tensor.
    """
    unpickle.check_map_location(map_location, "load_checkpoint")
    if shard is not None and not (isinstance(shard, str) and shard == "all"):
        try:
            k = operator.index(shard)
        except TypeError:
            k = -1
        if isinstance(shard, bool) or k < 0:
            raise TypeError(f"load_checkpoint: shard must be None, a rank (an int >= 0) or 'all', got {shard!r}")
        shard = k
    if not _in_rank_process("load_checkpoint"):
        return None
    context = rank_api.get_context()
    reply = rank_api.request(protocol.CHECKPOINT_LOAD, {"shard": shard, "world": context.world_size})
    if "refused" in reply:
        raise ValueError(f"load_checkpoint: {reply['refused']}")
    if "error" in reply:
        raise RuntimeError(f"the driver could not read the checkpoint: {reply['error']}")
    if reply["blob"] is None:
        return None
    location = rank_device if map_location is None else map_location
    if "sizes" not in reply:
        return unpickle.loads(reply["blob"], location)
    view, states, at = memoryview(reply["blob"]), [], 0
    for n in reply["sizes"]:
        states.append(unpickle.loads(view[at:at + n], location))
        at += n
    return states


def _in_rank_process(name: str) -> bool:
    """Whether this is a rank process; outside one the checkpoint functions do nothing. A process
    a rank started (it inherits the rank's environment, not its link to the driver) raises: there,
    doing nothing would lose the checkpoint without a word."""
    if rank_api.in_rank_process():
        return True
    if os.environ.get(protocol.JOB_ID_ENV):
        raise RuntimeError(
            f"{name} was called in a process started by a spark-dl rank (pid {os.getpid()}: a subprocess, or a "
            "DataLoader worker of the 'spawn' start method), which has no link to the driver: call it in the rank's "
            "own process (run a training script with HorovodRunner.run_script, not a subprocess)"
        )
    return False


def rank_device(storage: Any, location: str) -> Any:
    """A map_location for a rank: a GPU-saved storage onto this rank's GPU, or the CPU without one."""
    if not location.startswith("cuda"):
        return None  # torch's own placement: CPU stays CPU
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return storage.cuda(cuda_index())
    return storage  # torch hands a map_location function the storage on the CPU
