"""Checkpoints written by the workers straight into ``storage_path``, where every worker sees it.

As Ray's workers upload their checkpoint files to the run's storage, a TorchTrainer's workers copy
theirs into ``storage_path/name`` when every one of them can read it (a shared file system: DBFS
or a Unity Catalog volume on Databricks, NFS, one machine). Only the checkpoint's path then goes
to the driver, so a checkpoint of any size passes through no process's memory. Whether they can
is found out, not assumed: the driver writes a probe file with a fresh token at each ``fit()``,
and the workers use the storage only if every one of them reads that token back and can write
beside it. Otherwise (a
Spark Connect client on a laptop, executors with their own disks) the files travel through rank 0
to the driver, as before. ``SPARK_DL_RAY_STORAGE`` on the driver says which: ``auto`` (default),
``shared`` (fail unless every worker sees the storage) or ``driver`` (always through the driver).
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass

from spark_dl import protocol
from spark_dl.errors import env_choice

STORAGE_ENV = protocol.RAY_STORAGE_ENV
STORAGE_MODES = ("auto", "shared", "driver")
PROBE = ".spark_dl_storage_probe"
STAGING = ".staging_checkpoint_"  # hidden: not a checkpoint_<n> folder until it is complete
# Both names end with the fit's token, so a fit cleans up only what it made


def checkpoint_folder(path: str, index: int) -> str:
    """Where checkpoint ``index`` of the run in ``path`` is kept (Ray's ``checkpoint_<n>`` naming)."""
    return os.path.join(path, f"checkpoint_{index:06d}")


def storage_mode() -> str:
    """``SPARK_DL_RAY_STORAGE``, checked (unset: ``"auto"``)."""
    return env_choice(STORAGE_ENV, STORAGE_MODES,
                      "'auto' (default) lets the workers write checkpoints into storage_path when all of them can "
                      "read it, 'shared' requires that, 'driver' always sends them through the driver")


@dataclass(frozen=True)
class Storage:
    """What the workers need to write into the run's folder: made by the driver at ``fit()``."""

    path: str  # storage_path/name, absolute
    mode: str  # "auto" or "shared" ("driver" makes no Storage)
    token: str
    offset: int  # checkpoint numbers go on after those already in the folder

    @classmethod
    def prepare(cls, path: str, offset: int) -> "Storage | None":
        """The probe written into ``path`` (a fresh token), or None when checkpoints go through the driver."""
        mode = storage_mode()
        if mode == "driver":
            return None
        storage = cls(path, mode, uuid.uuid4().hex, offset)
        os.makedirs(path, exist_ok=True)
        _remove_stale(path)
        with open(storage.probe, "w") as f:
            f.write(storage.token)
        return storage

    @property
    def probe(self) -> str:
        return os.path.join(self.path, f"{PROBE}-{self.token}")

    def seen_here(self, rank: int = 0) -> bool:
        """Whether this process reads the probe this ``fit()`` wrote (not another host's file of that
        name) and can write beside it (not a read-only mount, not another user's folder)."""
        mine = f"{self.probe}-rank{rank}"
        try:
            with open(self.probe) as f:
                if f.read() != self.token:
                    return False
            with open(mine, "w") as f:
                f.write(self.token)
            os.remove(mine)
            return True
        except OSError:
            return False

    def final(self, step: int, name: str | None = None) -> str:
        """Where report ``step``'s checkpoint is kept: ``name`` (``checkpoint_dir_name``) if given."""
        return os.path.join(self.path, name) if name else checkpoint_folder(self.path, self.offset + step)

    def staging(self, step: int) -> str:
        return os.path.join(self.path, f"{STAGING}{self.offset + step:06d}-{self.token}")

    def clean(self) -> None:
        """Remove the probe and what a failed report left staged (the driver, after the fit)."""
        if not os.path.isdir(self.path):
            return
        for name in os.listdir(self.path):
            if name.startswith(STAGING) and name.endswith(f"-{self.token}"):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        try:
            os.remove(self.probe)
        except FileNotFoundError:
            pass


def agree(storage: Storage | None, group) -> bool:
    """Every worker's answer to "do you see the storage?", combined: True only if all do.

    Called by every rank at the loop's start. ``SPARK_DL_RAY_STORAGE=shared`` turns a "no" into the
    same error on every rank, naming the ranks that could not read the probe or write beside it."""
    import torch
    import torch.distributed as dist

    if storage is None:  # SPARK_DL_RAY_STORAGE=driver: the same on every rank, nothing to ask
        return False
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = torch.tensor([int(storage.seen_here(rank))], dtype=torch.int32)
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [torch.zeros(1, dtype=torch.int32) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine, group=group)
    blind = [r for r, seen in enumerate(every) if not seen.item()]
    if blind and storage.mode == "shared":
        raise RuntimeError(f"{STORAGE_ENV}=shared, but rank{'s' if len(blind) > 1 else ''} "
                           f"{', '.join(map(str, blind))} cannot read {storage.probe}, which the driver wrote, or "
                           "write beside it: give RunConfig(storage_path=...) a folder every executor mounts at the "
                           f"same path (DBFS, a volume, NFS), or unset {STORAGE_ENV} to send checkpoints through the "
                           "driver")
    return not blind


def stage(directory: str | None, storage: Storage, step: int, rank: int) -> int:
    """Copy this worker's checkpoint files into the report's staging folder; returns what it passed:
    -1 no checkpoint, 0 an empty directory, 1 files."""
    if directory is None:
        return -1
    if not any(os.scandir(directory)):
        return 0
    mine = os.path.join(storage.staging(step), f"rank_{rank}")
    shutil.rmtree(mine, ignore_errors=True)  # a failed attempt's copy of the same report
    shutil.copytree(directory, mine, symlinks=True)  # links stay links, as in the packed (tar) path
    return 1


def publish(storage: Storage, step: int, passed: list[int], name: str | None = None) -> None:
    """Rank 0, once every rank has staged its files and some rank passed a checkpoint: merge them
    (a file several ranks wrote is the lowest rank's, as in Ray) into ``storage.final(step, name)``.
    Moves within the storage's file system: no file is copied twice."""
    staging = storage.staging(step)
    with_files = [r for r, p in enumerate(passed) if p > 0]
    if with_files:
        merged = os.path.join(staging, f"rank_{with_files[0]}")
        for r in with_files[1:]:
            _move_missing(os.path.join(staging, f"rank_{r}"), merged)
    else:  # only empty directories were passed: the checkpoint is an empty one
        merged = os.path.join(staging, "empty")
        os.makedirs(merged, exist_ok=True)
    final = storage.final(step, name)
    shutil.rmtree(final, ignore_errors=True)  # a restart's redo of this report (report() refuses other taken names)
    os.replace(merged, final)
    shutil.rmtree(staging, ignore_errors=True)


def _move_missing(source: str, target: str) -> None:
    """Move what ``target`` lacks from ``source`` into it; directories on both sides merge."""
    for entry in os.scandir(source):
        there = os.path.join(target, entry.name)
        if entry.is_dir(follow_symlinks=False) and os.path.isdir(there) and not os.path.islink(there):
            _move_missing(entry.path, there)
        elif not os.path.lexists(there):
            os.replace(entry.path, there)


STALE_S = 24 * 3600.0  # a report's staging lives seconds; one this old was left by a driver or rank that died


def _remove_stale(path: str) -> None:
    """Remove staged reports a day old or more (a fit removes its own when it ends). Probes are
    left alone, whatever their age: a fit may run for days and reads its probe at each restart."""
    now = time.time()
    for name in os.listdir(path):
        full = os.path.join(path, name)
        try:
            if name.startswith(STAGING) and now - os.path.getmtime(full) >= STALE_S:
                shutil.rmtree(full, ignore_errors=True)
        except OSError:
            continue
