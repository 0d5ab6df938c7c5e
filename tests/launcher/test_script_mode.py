"""Script mode: a training script (path plus argv) instead of a function, its exit status checked."""
from __future__ import annotations

import os

import pytest

from spark_dl import HorovodRunner, LaunchRefused, RankFailed

SCRIPT = """
import argparse, os, sys
import torch, torch.distributed as dist
from helper_module import double          # a sibling module, importable as under `python train.py`

parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--fail-rank", type=int, default=-1)
args = parser.parse_args()
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
if dist.get_rank() == args.fail_rank:
    print("giving up", flush=True)
    sys.exit(3)
if __name__ == "__main__":
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{double(t.item())} {sys.argv[0]}")
"""


@pytest.fixture
def script(tmp_path):
    (tmp_path / "helper_module.py").write_text("def double(x):\n    return 2 * x\n")
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_script_runs_on_every_rank_with_its_argv(script, tmp_path):
    assert HorovodRunner(np=-2).run_script(script, "--out", str(tmp_path)) is None
    for r in (0, 1):
        value, argv0 = (tmp_path / f"rank{r}.txt").read_text().split()
        assert float(value) == 6.0 and argv0 == str(script)


def test_script_exit_status_fails_the_run(script, tmp_path):
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run_script(script, "--out", str(tmp_path), "--fail-rank", "1")
    assert e.value.rank == 1 and "exited with status 3" in str(e.value)
    assert any("giving up" in line for line in e.value.last_lines)


def test_script_on_spark(spark, script, tmp_path):
    HorovodRunner(np=2).run_script(script, "--out", str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]


def test_missing_or_broken_script_is_refused(tmp_path):
    with pytest.raises(LaunchRefused, match="does not exist"):
        HorovodRunner(np=-2).run_script(tmp_path / "nope.py")
    with pytest.raises(LaunchRefused, match="is a folder .*: name the .py file to run"):
        HorovodRunner(np=-2).run_script(tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("def broken(:\n")
    with pytest.raises(LaunchRefused, match="does not compile"):
        HorovodRunner(np=-2).run_script(bad)


PICKLES_ITS_OWN_CLASS = """
import io, os, pickle, sys
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


buf = io.BytesIO()
torch.save(Net(), buf)  # pickles __main__.Net by reference, as under `python script`
buf.seek(0)
net = torch.load(buf, weights_only=False)
assert type(net).__name__ == "Net" and pickle.loads(pickle.dumps(Net())).layer.in_features == 2
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w").write(type(net).__module__)
"""


def test_what_a_script_defines_pickles_by_reference_as_under_python(tmp_path):
    script = tmp_path / "own_class.py"
    script.write_text(PICKLES_ITS_OWN_CLASS)
    HorovodRunner(np=-2).run_script(script, str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["__main__", "__main__"]


def test_script_arguments_that_are_not_text_are_refused(tmp_path):
    script = tmp_path / "argv.py"
    script.write_text("import sys\nprint(sys.argv)\n")
    with pytest.raises(LaunchRefused,
                       match=r"each must be a str \(or os.PathLike\); got list \['--lr', '1'\]: unpack it"):
        HorovodRunner(np=-2).run_script(str(script), ["--lr", "1"])
    with pytest.raises(LaunchRefused, match=r"got int 1: pass its text, e.g. '1'"):
        HorovodRunner(np=-2).run_script(script, "--lr", 1)
    with pytest.raises(LaunchRefused, match="run_script takes the script's path"):
        HorovodRunner(np=-2).run_script(None)


def test_scripts_in_another_declared_encoding_or_with_a_bom_run_as_python_runs_them(tmp_path):
    latin = tmp_path / "latin.py"
    latin.write_bytes("# -*- coding: latin-1 -*-\nimport os\nassert 'caf\u00e9' == 'caf' + chr(233)\n"
                      .encode("latin-1"))
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbfimport sys\n")
    for script in (latin, bom):
        assert HorovodRunner(np=-1).run_script(script) is None
    undeclared = tmp_path / "undeclared.py"
    undeclared.write_bytes("x = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(LaunchRefused, match=r"cannot be read as Python source.*save it as UTF-8"):
        HorovodRunner(np=-1).run_script(undeclared)


RESUMABLE = """
import os, sys
import torch.distributed as dist
import spark_dl

dist.init_process_group("gloo")
state = spark_dl.load_checkpoint() or {"epoch": -1}
for epoch in range(state["epoch"] + 1, 4):
    dist.barrier()
    spark_dl.save_checkpoint({"epoch": epoch}, step=epoch)
    dist.barrier()  # rank 0's checkpoint of this epoch is stored before anyone fails
    if epoch == 1 and spark_dl.get_context().attempt == 0 and dist.get_rank() == 1:
        sys.exit(5)
    with open(os.path.join(sys.argv[1],
                           f"rank{dist.get_rank()}-attempt{spark_dl.get_context().attempt}-epoch{epoch}"), "w"):
        pass
"""


def test_a_script_restarts_from_its_checkpoint(tmp_path):
    path = tmp_path / "resumable.py"
    path.write_text(RESUMABLE)
    out = tmp_path / "out"
    out.mkdir()
    HorovodRunner(np=-2, max_restarts=1).run_script(path, str(out))
    done = sorted(os.listdir(out))
    # epoch 1 of the first attempt failed on rank 1 after its checkpoint: the restart runs 2 and 3 only
    assert [n for n in done if n.startswith("rank1")] == ["rank1-attempt0-epoch0", "rank1-attempt1-epoch2",
                                                        "rank1-attempt1-epoch3"]


def test_a_path_that_is_there_but_is_not_a_regular_file_says_what_it_is(tmp_path):
    with pytest.raises(LaunchRefused, match=r"^training script '/dev/null' is a character device \(/dev/null\), "
                                            r"not a regular file: name the .py file to run$"):
        HorovodRunner(np=-2).run_script("/dev/null")
    fifo = tmp_path / "train.py"
    os.mkfifo(fifo)
    with pytest.raises(LaunchRefused, match=r"is a named pipe \(.*\), not a regular file: name the .py file to run"):
        HorovodRunner(np=-2).run_script(fifo)
    dangling = tmp_path / "link.py"
    dangling.symlink_to(tmp_path / "gone.py")
    with pytest.raises(LaunchRefused, match=r"is a symbolic link to '.*gone.py', which does not exist: fix the link"):
        HorovodRunner(np=-2).run_script(dangling)


def test_a_script_exit_status_is_the_error_without_a_traceback(script, tmp_path):
    from spark_dl.rank.script import ScriptExit

    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-2).run_script(script, "--out", str(tmp_path), "--fail-rank", "1")
    err = e.value
    assert str(err).startswith(f"rank 1 on localhost failed: {script} exited with status 3\n")
    assert err.exit_code == 3 and err.remote_traceback == "" and "Traceback" not in str(err)
    assert isinstance(err.__cause__, ScriptExit) and err.__cause__.code == 3 and err.__cause__.path == str(script)
    assert not any("exited with status" in line for line in err.last_lines)  # said once, in the summary


def test_a_script_error_shows_the_scripts_frames_once(tmp_path):
    path = tmp_path / "fails.py"
    path.write_text('print("loading", flush=True)\n\ndef load():\n    raise KeyError("no column y")\n\nload()\n')
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-1).run_script(path)
    err = e.value
    frames = [line.strip() for line in err.remote_traceback.splitlines() if line.strip().startswith("File ")]
    assert frames == [f'File "{path}", line 6, in <module>', f'File "{path}", line 4, in load']  # none of ours
    assert err.last_lines == ["[0]<stdout>: loading"]  # the traceback the rank printed is not repeated


def test_an_executor_without_the_scripts_file_still_has_its_source(tmp_path):
    """The source ships with the job; a rank whose host has no copy of the file (run here as a
    path that does not exist) shows the failing line and lets inspect.getsource (torch.jit.script)
    read the script's functions: both said 'source code not available'."""
    from spark_dl.rank.script import Script

    source = ("import inspect\n\ndef step(x):\n    return 1 / x  # the failing line\n\n"
              "print(inspect.getsource(step).splitlines()[0], flush=True)\nstep(0)\n")
    path = str(tmp_path / "elsewhere" / "train.py")  # as on an executor without the driver's file
    with pytest.raises(RankFailed) as e:
        HorovodRunner(np=-1).run(Script(path, source), script=path, argv=[])
    err = e.value
    assert err.last_lines == ["[0]<stdout>: def step(x):"]
    assert "    return 1 / x  # the failing line\n" in err.remote_traceback
    assert err.remote_traceback.rstrip().endswith("ZeroDivisionError: division by zero")
