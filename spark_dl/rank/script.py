"""Script mode: run a training *script* (path plus argv) on every rank, like ``python train.py``.

The driver reads the script and ships its source with the job, so executors need no shared
storage. A non-zero exit status fails the run (TorchDistributor reports success for a failed
script).
"""
from __future__ import annotations

import linecache
import os
import stat
import sys
import tokenize
import types
from typing import Sequence

from spark_dl.errors import LaunchRefused


class ExitStatus(RuntimeError):
    """``main`` called ``sys.exit`` with a non-zero status. Reported as ``python`` reports an exit:
    by its status alone, in one line, without a traceback (spark-dl's own frames would be all of it)."""

    def __init__(self, message: str, code: object) -> None:
        self.code = code
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        """The process exit status ``python`` would have: ``sys.exit('text')`` is 1."""
        return self.code if isinstance(self.code, int) and not isinstance(self.code, bool) else 1

    def __reduce__(self):  # rebuilt on the driver as the rank's error's __cause__
        return (type(self), (str(self), self.code))


class ScriptExit(ExitStatus):
    """The script called ``sys.exit`` with a non-zero status."""

    def __init__(self, path: str, code: object) -> None:
        self.path = path
        super().__init__(f"{path} exited with status {code!r}", code)

    def __reduce__(self):
        return (type(self), (self.path, self.code))


def read_script(path: str | os.PathLike) -> tuple[str, str]:
    """``(absolute path, source)``, or a refusal naming the problem."""
    full = os.path.abspath(os.fspath(path))
    if os.path.isdir(full):
        raise LaunchRefused(f"training script {os.fspath(path)!r} is a folder ({full}): name the .py file to run")
    if not os.path.isfile(full):
        if os.path.islink(full) and not os.path.exists(full):
            raise LaunchRefused(f"training script {os.fspath(path)!r} is a symbolic link to {os.readlink(full)!r}, "
                                "which does not exist: fix the link or name the .py file itself")
        if os.path.exists(full):  # there, but not a file python could run: /dev/null, a pipe, a socket
            raise LaunchRefused(f"training script {os.fspath(path)!r} is {_what_is(full)} ({full}), not a regular "
                                "file: name the .py file to run")
        raise LaunchRefused(f"training script {os.fspath(path)!r} does not exist (looked for {full})")
    try:
        with tokenize.open(full) as f:  # as python reads it: a coding line or a UTF-8 BOM decides
            source = f.read()
    except (SyntaxError, UnicodeDecodeError) as e:
        raise LaunchRefused(f"training script {full} cannot be read as Python source: {e} (save it as UTF-8, or "
                            "declare its encoding in a '# -*- coding: ... -*-' line)") from e
    except OSError as e:  # a file the driver may not read
        raise LaunchRefused(f"training script {full} cannot be read on the driver ({e.strerror or e}): give the "
                            "driver's user read access to it") from e
    try:
        compile(source, full, "exec")
    except SyntaxError as e:
        raise LaunchRefused(f"training script {full} does not compile: {e}") from e
    return full, source


def _what_is(path: str) -> str:
    """What a path that is neither a folder nor a regular file is, in words."""
    mode = os.stat(path).st_mode
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


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
        # the shipped source, for tracebacks and inspect.getsource (torch.jit.script) where the
        # executor has no copy of the file (mtime None: linecache never reloads it from disk)
        linecache.cache[script] = (len(self.source), None, self.source.splitlines(True), script)
        try:
            exec(compile(self.source, script, "exec"), main.__dict__)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise ScriptExit(script, e.code) from None
        finally:
            if previous is not None:
                sys.modules["__main__"] = previous
