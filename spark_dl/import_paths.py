"""Import paths that name a module by where it is used from, not where it lives.

``spark_dl.horovod`` is :mod:`spark_dl.compat.horovod`, ``spark_dl.ray_train`` is
:mod:`spark_dl.compat.ray_train`, and so on for every name in :data:`ALIASES`: the same module
object under both names (and every submodule, ``spark_dl.horovod.spark`` included), so state such
as Horovod's process sets exists once whichever name imported it. Installed by ``import spark_dl``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

# the public name -> the module behind it (a package's submodules follow it)
ALIASES: dict[str, str] = {
    "spark_dl.horovod": "spark_dl.compat.horovod",
    "spark_dl.horovod_imports": "spark_dl.compat.horovod_imports",
    "spark_dl.ray_train": "spark_dl.compat.ray_train",
    "spark_dl.estimator": "spark_dl.compat.estimator",
    "spark_dl.callbacks": "spark_dl.compat.estimator.callbacks",
    "spark_dl.distributor": "spark_dl.compat.distributor",
    "spark_dl.submit": "spark_dl.driver.submit",
    "spark_dl.tracking.lightning": "spark_dl.tracking.rank.lightning",
}


def target_of(name: str) -> str | None:
    """The module that ``name`` stands for, or None when it is not an alias."""
    for alias, target in ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            return target + name[len(alias):]
    return None


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # the import system stamped the alias's spec on the module: it keeps its own
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        real = target_of(name)
        if real is None:
            return None
        found = importlib.util.find_spec(real)
        if found is None:
            return None
        return importlib.util.spec_from_loader(name, _Loader(real),
                                               is_package=found.submodule_search_locations is not None)


_finder = _Finder()


def install() -> None:
    """Answer for the names in :data:`ALIASES` in this process (first, before the path finders,
    which would load a second copy of a submodule through the package's ``__path__``). Idempotent."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
