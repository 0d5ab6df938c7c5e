"""``import horovod.torch as hvd`` without Horovod: the names Horovod code imports resolve to
``spark_dl.horovod`` (its API on torch.distributed), so Horovod code runs with its imports as they are.

Every rank process installs this (``SPARK_DL_HOROVOD_IMPORTS=0`` in the ranks' environment turns it
off); a driver calls :func:`install` to run ``horovod.spark.run`` and friends unchanged. Nothing is
imported until a ``horovod`` module is: the finder only answers for the names below.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

from spark_dl import protocol

# Horovod's module -> ours (None: an empty package)
ALIASES: dict[str, str | None] = {
    "horovod": None,
    "horovod.torch": "spark_dl.horovod",
    "horovod.torch.mpi_ops": "spark_dl.horovod",
    "horovod.torch.elastic": "spark_dl.horovod.elastic",
    "horovod.torch.compression": "spark_dl.horovod.compression",
    "horovod.torch.functions": "spark_dl.horovod.functions",
    "horovod.torch.optimizer": "spark_dl.horovod.optimizer",
    "horovod.torch.sync_batch_norm": "spark_dl.horovod.sync_batch_norm",
    "horovod.spark": "spark_dl.horovod.spark",
    "horovod.spark.torch": "spark_dl.estimator",
    "horovod.spark.lightning": "spark_dl.estimator",
    "horovod.spark.common": None,
    "horovod.common": None,
    "horovod.common.exceptions": "spark_dl.horovod.exceptions",
    "horovod.spark.common.store": "spark_dl.horovod.store",
    "horovod.spark.common.util": "spark_dl.horovod.staging",
}
_PACKAGES = {"horovod", "horovod.torch", "horovod.spark", "horovod.spark.common", "horovod.common"}
_NOTE = ("[spark-dl] `import {name}` gives {target} (Horovod's API on torch.distributed), not the installed "
         "horovod, which cannot join spark-dl's ranks; set SPARK_DL_HOROVOD_IMPORTS=0 to import it instead\n")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        target_name = ALIASES[module.__name__]
        if target_name is None:
            module.__doc__ = "spark-dl's stand-in for Horovod's package (see spark_dl.horovod_imports)"
            return
        target = importlib.import_module(target_name)
        # a module of its own that shares the target's objects: the target's __spec__ and __name__
        # stay its own (pickling by reference still names spark_dl)
        module.__dict__.update({k: v for k, v in vars(target).items() if not (k.startswith("__") and k.endswith("__"))})
        module.__doc__ = target.__doc__
        if hasattr(target, "__all__"):
            module.__all__ = list(target.__all__)

        def __getattr__(name: str) -> Any:  # names the target gains later (submodules imported since)
            return getattr(target, name)

        module.__getattr__ = __getattr__  # type: ignore[attr-defined]
        if module.__name__ == "horovod.torch":
            # as importing Horovod's package does: hvd.mpi_ops is there without an import of its own
            importlib.import_module("horovod.torch.mpi_ops")
        if module.__name__ in ("horovod.torch", "horovod.spark") and _real_horovod():
            sys.stderr.write(_NOTE.format(name=module.__name__, target=target_name))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in ALIASES:
            return None
        return importlib.util.spec_from_loader(name, _Loader(), is_package=name in _PACKAGES)


_finder = _Finder()


def _real_horovod() -> bool:
    spec = importlib.machinery.PathFinder.find_spec("horovod")
    return spec is not None and spec.origin is not None  # a package, not a stray "horovod" directory


def install() -> None:
    """Make ``import horovod.torch`` (``horovod.torch.elastic``, ``horovod.spark``, ...) import
    spark-dl's counterparts in this process. Idempotent."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def enabled() -> bool:
    """Whether ranks install the finder (``SPARK_DL_HOROVOD_IMPORTS`` is not off)."""
    return not protocol.switched_off(os.environ, protocol.HOROVOD_IMPORTS_ENV)


def install_in_rank() -> None:
    """What every rank process does at start, unless ``SPARK_DL_HOROVOD_IMPORTS=0``."""
    if enabled():
        install()
