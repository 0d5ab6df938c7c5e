"""World layout: which task runs which ranks, derived from what every task told the others.

Pure functions of the gathered task descriptions, so every barrier task computes the same
layout independently once the driver has sent it every task's description.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from spark_dl import protocol


@dataclass(frozen=True)
class TaskInfo:
    """What one task announces in the rendezvous."""

    partition: int
    host: str
    gpus: tuple[str, ...] = ()
    port: int = 0  # a free port on this host, used as MASTER_PORT if this task hosts rank 0


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to know about its place in the world."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    cross_rank: int  # index of this rank's host (Horovod's cross_rank / torchrun's GROUP_RANK)
    cross_size: int  # number of hosts
    host: str
    master_addr: str
    master_port: int
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES for this rank, ordered by local rank
    cuda_device: int | None = None  # index of this rank's own GPU within ``gpus``
    partition: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    host_size: int = 0  # ranks on this host (sizes OMP_NUM_THREADS); 0: local_size

    def env(self) -> dict[str, str]:
        env = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_size),
            "GROUP_RANK": str(self.cross_rank),
            "NODE_RANK": str(self.cross_rank),
            "CROSS_RANK": str(self.cross_rank),
            "CROSS_SIZE": str(self.cross_size),
            # the rest of torchrun's per-worker variables, read by code written for torchrun
            "GROUP_WORLD_SIZE": str(self.cross_size),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            # what horovodrun sets in its Gloo mode, read by Horovod scripts and tests
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.world_size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
            "HOROVOD_HOSTNAME": self.host,
        }
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
            env[protocol.CUDA_DEVICE_ENV] = str(self.cuda_device)
        env.update(self.extra_env)
        return env


def _unique(items: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for i in items:
        seen.setdefault(i, None)
    return list(seen)


def compute_layout(tasks: list[TaskInfo], ranks_per_task: int = 1,
                   task_nodes: bool = False) -> dict[int, list[RankSpec]]:
    """Assign global ranks to tasks: ranks on one host are consecutive, hosts in order of their
    first task. With ``ranks_per_task > 1`` (several GPUs per task), rank j of a task gets the
    task's j-th GPU. Returns ``{partition: [RankSpec, ...]}``.

    A "node" (local rank and size, cross rank and size, the GPUs a rank sees) is a host, as in
    Horovod; with ``task_nodes`` it is a task, as PySpark's TorchDistributor runs one torchrun per
    task: local ranks count within the task, which sees only its own GPUs.
    """
    if not tasks:
        raise ValueError("no tasks to lay out")
    if ranks_per_task < 1:
        raise ValueError(f"ranks_per_task must be >= 1, got {ranks_per_task}")
    host_order = _unique([t.host for t in sorted(tasks, key=lambda t: t.partition)])
    ordered = sorted(tasks, key=lambda t: (host_order.index(t.host), t.partition))
    world = len(ordered) * ranks_per_task

    # (task, j, own gpus) in global rank order
    slots: list[tuple[TaskInfo, int, tuple[str, ...]]] = []
    for t in ordered:
        for j in range(ranks_per_task):
            if ranks_per_task > 1 and len(t.gpus) >= ranks_per_task:
                own: tuple[str, ...] = (t.gpus[j],)
            else:
                own = t.gpus
            slots.append((t, j, own))

    by_host: dict[str, list[int]] = {}
    for r, (t, _, _) in enumerate(slots):
        by_host.setdefault(t.host, []).append(r)
    host_gpus = {h: _unique([g for r in rs for g in slots[r][2]]) for h, rs in by_host.items()}

    rank0 = ordered[0]
    out: dict[int, list[RankSpec]] = {t.partition: [] for t in ordered}
    for r, (t, j, own) in enumerate(slots):
        if task_nodes:
            local_rank, local_size = j, ranks_per_task
            cross_rank, cross_size = ordered.index(t), len(ordered)
            gpus = tuple(t.gpus) if own else ()
        else:
            local_rank, local_size = by_host[t.host].index(r), len(by_host[t.host])
            cross_rank, cross_size = host_order.index(t.host), len(host_order)
            gpus = tuple(host_gpus[t.host]) if own else ()
        out[t.partition].append(
            RankSpec(
                rank=r,
                world_size=world,
                local_rank=local_rank,
                local_size=local_size,
                cross_rank=cross_rank,
                cross_size=cross_size,
                host=t.host,
                master_addr=rank0.host,
                master_port=rank0.port,
                gpus=gpus,
                cuda_device=gpus.index(own[0]) if own else None,
                partition=t.partition,
                host_size=len(by_host[t.host]),
            )
        )
    return out


def omp_threads(local_size: int) -> str:
    """Threads per rank so that the ranks on one host do not oversubscribe its cores
    (what torchrun does, which TorchDistributor leaves to the user)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return str(max(1, cpus // max(1, local_size)))
