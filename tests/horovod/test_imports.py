"""Horovod code with its imports unchanged: ``import horovod.torch as hvd`` in a training function,
in a script, and (after ``spark_dl.horovod_imports.install()`` on the driver) ``horovod.spark.run``.
Real ranks, real Spark; no horovod package is installed here."""
from __future__ import annotations

import importlib
import sys

import pytest

from spark_dl import HorovodRunner, RankFailed


def test_horovod_is_not_installed_here():
    # what makes the tests below meaningful (a bare "horovod" directory, such as this tests/horovod
    # on pytest's path, is a namespace package: no horovod.torch in it)
    try:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("horovod.torch")
    finally:
        sys.modules.pop("horovod", None)


def horovod_main():
    import horovod.torch as hvd  # Horovod's own import, unchanged
    import torch
    from horovod.torch.mpi_ops import allreduce

    hvd.init()
    w = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), compression=hvd.Compression.fp16)
    (w * (hvd.rank() + 1)).sum().backward()
    opt.step()
    total = allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    import spark_dl.horovod

    return hvd.rank(), total, w.tolist(), hvd.allreduce is spark_dl.horovod.allreduce, hvd.elastic.run.__module__


def test_a_function_importing_horovod_torch_runs_unchanged():
    out = HorovodRunner(np=-2).run_all(horovod_main)
    assert [o[:3] for o in out] == [(0, 3.0, [-1.5, -1.5]), (1, 3.0, [-1.5, -1.5])]
    assert all(o[3] is True and o[4] == "spark_dl.compat.horovod.elastic" for o in out)


SCRIPT = """
import sys, torch
import horovod.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
open(sys.argv[1] + f"/rank{hvd.rank()}.txt", "w").write(str(total))
"""


def test_a_horovod_script_runs_unchanged(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    HorovodRunner(np=-2).run_script(script, str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["3.0", "3.0"]


def test_switched_off_the_import_fails_as_without_spark_dl():
    with pytest.raises(RankFailed, match="No module named 'horovod"):
        HorovodRunner(np=-2, env={"SPARK_DL_HOROVOD_IMPORTS": "0"}).run(horovod_main)


def spark_run_main(scale):
    import horovod.torch as hvd
    import torch

    hvd.init()
    return hvd.rank(), hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item() * scale


def test_on_the_driver_install_makes_horovod_spark_run_work(spark):
    from spark_dl import horovod_imports

    horovod_imports.install()
    try:
        import horovod.spark  # Horovod's own import, unchanged

        assert horovod.spark.run(spark_run_main, args=(10.0,), num_proc=2) == [(0, 30.0), (1, 30.0)]
    finally:
        sys.meta_path.remove(horovod_imports._finder)
        for name in [m for m in sys.modules if m == "horovod" or m.startswith("horovod.")]:
            del sys.modules[name]


def logs_as_on_databricks():
    import spark_dl.horovod as hvd
    from spark_dl.horovod import log_to_driver  # sparkdl.horovod.log_to_driver, renamed as the module is

    hvd.init()
    log_to_driver(f"rank {hvd.rank()} says hello")


def test_databricks_log_to_driver_is_in_spark_dl_horovod(capfd):
    HorovodRunner(np=-2).run(logs_as_on_databricks)
    out = capfd.readouterr().out
    assert "[0]<log>: rank 0 says hello" in out and "[1]<log>: rank 1 says hello" in out
