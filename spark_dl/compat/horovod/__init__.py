"""Horovod's PyTorch API on ``torch.distributed``: swap ``import horovod.torch as hvd`` for
``import spark_dl.horovod as hvd`` and run the training function with :class:`spark_dl.HorovodRunner`.

Collectives are matched across ranks by call order (not by ``name``); see docs/guide/horovod.md
for what differs from Horovod.
"""
from spark_dl.compat.horovod import elastic
from spark_dl.compat.horovod.basics import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from spark_dl.compat.horovod.compression import Compression
from spark_dl.compat.horovod.exceptions import CollectiveError, HorovodInternalError, HostsUpdatedInterrupt
from spark_dl.compat.horovod.exchange import (
    alltoall,
    alltoall_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from spark_dl.compat.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from spark_dl.compat.horovod.handles import poll, synchronize
from spark_dl.compat.horovod.ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    join,
)
from spark_dl.compat.horovod.optimizer import DistributedOptimizer
from spark_dl.compat.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    ids_and_ranks,
    remove_process_set,
)
from spark_dl.compat.horovod.sync_batch_norm import SyncBatchNorm
from spark_dl.rank.context import log_to_driver  # Databricks' sparkdl.horovod.log_to_driver, under the same import


class _Basics:
    """Horovod's ``mpi_ops._basics``, for code that reaches into it (Horovod's process-set tests do)."""

    _get_process_set_ids_and_ranks = staticmethod(ids_and_ranks)


_basics = _Basics()

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "nccl_built", "gloo_built", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "gloo_enabled", "cuda_built", "rocm_built", "ccl_built",
    "ddl_built", "start_timeline", "stop_timeline",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "elastic", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "allgather", "allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "poll", "synchronize", "barrier", "join",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "SyncBatchNorm", "log_to_driver", "HorovodInternalError", "HostsUpdatedInterrupt",
    "CollectiveError",
]
