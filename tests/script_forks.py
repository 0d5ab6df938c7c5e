"""Run Python scripts as ``python script.py`` would, each in a fork of one process that has already
imported torch, pyspark, mlflow and spark_dl: a fresh interpreter pays ~3 s of imports per script.

Each script gets its own process (forked before any thread or JVM exists), session, working
directory, environment, argv, stdin from /dev/null and stdout/stderr files; its atexit handlers
run at its end, as at an interpreter's exit. Protocol, one JSON line each way: a request
``{"path", "cwd", "env", "stdout", "stderr"}``, then the replies ``{"pid"}`` and ``{"status"}``.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import traceback

PRELOAD = ("torch", "torch.distributed", "numpy", "pandas", "pyarrow", "pyspark.sql", "mlflow", "cloudpickle",
           "spark_dl", "spark_dl.horovod")


def _child(req: dict) -> int:
    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, target, mode in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                             (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(target, mode, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [req["path"]]
    sys.path[0] = os.path.dirname(os.path.abspath(req["path"]))  # as python puts the script's folder first
    code = 0
    try:
        runpy.run_path(req["path"], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as python reports an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                code = _child(req)
            finally:
                os._exit(code)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


class ScriptForks:
    """Test side: a running server; :meth:`run` is ``subprocess.run([python, path], ...)`` for it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)

    def run(self, path: str, cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        out, err = os.path.join(cwd, ".stdout"), os.path.join(cwd, ".stderr")
        self.proc.stdin.write(json.dumps({"path": path, "cwd": cwd, "env": env, "stdout": out, "stderr": err}) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        timer = _Timer(timeout, lambda: os.killpg(pid, signal.SIGKILL))
        try:
            reply = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if timer.fired:
            raise subprocess.TimeoutExpired([path], timeout)
        status = json.loads(reply)["status"]
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess([path], status, o.read(), e.read())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class _Timer:
    def __init__(self, seconds: float, action) -> None:
        import threading

        self.fired = False

        def fire() -> None:
            self.fired = True
            try:
                action()
            except ProcessLookupError:
                pass

        self._t = threading.Timer(seconds, fire)
        self._t.daemon = True
        self._t.start()

    def cancel(self) -> None:
        self._t.cancel()


if __name__ == "__main__":
    serve()
