"""A rank's exit (spark_dl/rank/main.py): what it leaves in its process group dies with it where its
task, which would otherwise kill them after reading its exit status, is gone. Real processes: a
rank-like process leading its own session, its stdout and stderr a pipe the test holds or closes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from procs import wait_all_dead

RANK = textwrap.dedent("""
    import os, subprocess, sys, time
    os.setsid()  # as a rank: the leader of its own group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a DataLoader worker, say
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    from spark_dl.rank import main
    main._exit(0)
""")


@pytest.mark.parametrize("task", ["alive", "gone"])
def test_a_rank_whose_task_is_gone_takes_its_children_with_it(tmp_path, task):
    child_file, go = tmp_path / "child", tmp_path / "go"
    r, w = os.pipe()
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(child_file), str(go)], stdout=w, stderr=w)
    os.close(w)
    child = None
    try:
        deadline = time.monotonic() + 60
        while not child_file.exists():
            assert rank.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        child = int(child_file.read_text())
        if task == "gone":
            os.close(r)  # what a task's death does to the pipes it reads
        go.touch()
        code = rank.wait(60)
        if task == "alive":
            # the task reads the exit status, then kills the group itself
            assert code == 0 and wait_all_dead([child], timeout=0.5) == [child]
        else:
            assert code == -9 and wait_all_dead([child], timeout=5) == []
    finally:
        rank.kill()
        if child is not None:
            try:
                os.kill(child, 9)
            except ProcessLookupError:
                pass
        if task == "alive":
            os.close(r)
