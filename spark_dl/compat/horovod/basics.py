"""Horovod's process-level calls (``init``, ``rank``, ``size``, ...) on ``torch.distributed``.

Inside a :class:`spark_dl.HorovodRunner` rank the world comes from the launcher's environment.
Run anywhere else (a plain ``python train.py``), ``init()`` makes a one-process world, as Horovod
does without ``horovodrun``, so the same script runs on a laptop.
"""
from __future__ import annotations

import enum
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from spark_dl.compat.horovod.handles import clear as clear_handles
from spark_dl.compat.horovod.joining import start as start_join
from spark_dl.compat.horovod.joining import stop as stop_join
from spark_dl.compat.horovod.process_sets import forget as forget_process_sets
from spark_dl.compat.horovod.process_sets import setup as setup_process_sets
from spark_dl.compat.horovod.state import check, is_initialized, set_initialized


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops (``Adasum``: adaptive summation, see :mod:`spark_dl.horovod.adasum`)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

_owns_group = False


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job's process group; idempotent, like ``hvd.init()``.

    ``process_sets``: a list of :class:`~spark_dl.horovod.ProcessSet` to register (every rank
    passes the same list), or ``"dynamic"`` (accepted; sets can always be added later with
    ``add_process_set``). ``comm`` (an MPI communicator) has no counterpart here: passing one
    raises ``NotImplementedError`` rather than silently using the world.
    """
    global _owns_group
    if comm is not None:
        raise NotImplementedError(
            "spark_dl.horovod.init() runs on the whole job: MPI communicators are not supported. "
            "Call init() without comm=; for subsets of ranks use process sets (hvd.ProcessSet([...]))."
        )
    if is_initialized():
        if process_sets is not None and process_sets != "dynamic":
            raise ValueError("hvd.init(process_sets=[...]) after Horovod was initialized: register the sets "
                             "with hvd.add_process_set() instead")
        return
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            from spark_dl.rank.context import init as spark_dl_init

            # kept by shutdown(): a second world would meet through the launcher's store, which
            # still holds the first one's addresses (a rank reading them connects to nothing)
            spark_dl_init()
        else:
            # Outside a launcher Horovod runs as a world of one; an in-memory store needs no ports.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            _owns_group = True
    set_initialized(True)
    try:
        stop_join()  # first: registering the sets gives each its join control (a failed init() left some)
        setup_process_sets(process_sets)
        start_join()
    except BaseException:
        set_initialized(False)  # a bad process_sets= argument: init() may be called again
        raise


def shutdown() -> None:
    """Leave Horovod: unregister the process sets (their groups are destroyed) and forget pending
    async ops. The launcher's process group stays for the next :func:`init`; a world of one that
    :func:`init` made is destroyed. Safe to repeat."""
    global _owns_group
    if is_initialized() and dist.is_initialized():
        forget_process_sets(destroy=True)
        stop_join()
        clear_handles()
    if _owns_group and dist.is_initialized():
        dist.destroy_process_group()
    set_initialized(False)
    _owns_group = False


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    check()
    return dist.get_rank()


def size() -> int:
    """Number of processes in the job."""
    check()
    return dist.get_world_size()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def local_rank() -> int:
    """Rank among the processes on this host."""
    check()
    return _env_int("LOCAL_RANK", 0)


def local_size() -> int:
    """Number of processes on this host."""
    check()
    return _env_int("LOCAL_WORLD_SIZE", 1)


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    check()
    return _env_int("CROSS_RANK", 0)


def cross_size() -> int:
    """Number of hosts in the job."""
    check()
    return _env_int("CROSS_SIZE", 1)


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return size() == local_size() * cross_size()


def nccl_built() -> bool:
    """Whether collectives can use NCCL here (a CUDA build of torch with NCCL)."""
    return dist.is_nccl_available() and torch.cuda.is_available()


def gloo_built() -> bool:
    """Whether collectives can use Gloo (always true for torch builds with distributed)."""
    return dist.is_gloo_available()


def mpi_built() -> bool:
    """Always false: collectives go through torch.distributed, not MPI."""
    return False


def mpi_enabled() -> bool:
    """Always false (no MPI)."""
    return False


def mpi_threads_supported() -> bool:
    """Always false (no MPI)."""
    return False


def gloo_enabled() -> bool:
    """Whether Gloo is there to run collectives (as :func:`gloo_built`)."""
    return gloo_built()


def cuda_built() -> bool:
    """Whether this torch was built with CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Whether this torch was built for ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ccl_built() -> bool:
    """Always false (no oneCCL)."""
    return False


def ddl_built() -> bool:
    """Always false (no IBM DDL)."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline is not recorded here: warns and does nothing, so scripts that call it
    still run. ``torch.profiler`` records collectives and kernels instead."""
    warnings.warn(f"spark_dl.horovod does not record Horovod's timeline ({file_path!r} is not written); "
                  "use torch.profiler to trace collectives.", stacklevel=2)


def stop_timeline() -> None:
    """No-op counterpart of :func:`start_timeline`."""


