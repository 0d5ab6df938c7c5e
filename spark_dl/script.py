"""Script mode: run a training *script* (path plus argv) on every rank, like ``python train.py``.

The driver reads the script and ships its source with the job, so executors need no shared
storage. A non-zero exit status fails the run (TorchDistributor reports success for a failed
script).
"""
from __future__ import annotations

import os
import sys
import tokenize
import types
from typing import Sequence

from .errors import LaunchRefused


class ScriptExit(RuntimeError):
    """The script called ``sys.exit`` with a non-zero status."""

    def __init__(self, path: str, code: object) -> None:
        self.path = path
        self.code = code
        super().__init__(f"{path} exited with status {code!r}")


def read_script(path: str | os.PathLike) -> tuple[str, str]:
    """``(absolute path, source)``, or a refusal naming the problem."""
    full = os.path.abspath(os.fspath(path))
    if os.path.isdir(full):
        raise LaunchRefused(f"training script {os.fspath(path)!r} is a folder ({full}): name the .py file to run")
    if not os.path.isfile(full):
        raise LaunchRefused(f"training script {os.fspath(path)!r} does not exist (looked for {full})")
    try:
        with tokenize.open(full) as f:  # as python reads it: a coding line or a UTF-8 BOM decides
            source = f.read()
    except (SyntaxError, UnicodeDecodeError) as e:
        raise LaunchRefused(f"training script {full} cannot be read as Python source: {e} (save it as UTF-8, or "
                            "declare its encoding in a '# -*- coding: ... -*-' line)") from e
    try:
        compile(source, full, "exec")
    except SyntaxError as e:
        raise LaunchRefused(f"training script {full} does not compile: {e}") from e
    return full, source


class Script:
    """The callable a run executes on every rank: the script's source, run as ``__main__`` with
    ``sys.argv = [script, *argv]``. Its kwargs (``script``, ``argv``) are what tracking logs."""

    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.source = source

    def __repr__(self) -> str:
        return f"script {self.path}"

    def __call__(self, script: str, argv: Sequence[str]) -> None:
        sys.argv = [script, *argv]
        directory = os.path.dirname(script)
        if os.path.isdir(directory) and directory not in sys.path:
            sys.path.insert(0, directory)  # sibling imports work as under `python script`
        # a module of its own as __main__, as `python script` has: what the script defines
        # pickles by reference (torch.save of a model class, multiprocessing's spawn)
        main = types.ModuleType("__main__")
        main.__file__ = script
        main.__builtins__ = __builtins__
        previous = sys.modules.get("__main__")
        sys.modules["__main__"] = main
        try:
            exec(compile(self.source, script, "exec"), main.__dict__)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise ScriptExit(script, e.code) from None
        finally:
            if previous is not None:
                sys.modules["__main__"] = previous
