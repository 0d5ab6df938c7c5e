"""End-to-end launch time of a small 2-rank job: spark-dl (HorovodRunner and its TorchDistributor)
vs PySpark's TorchDistributor, and spark-dl with its ranks forked from a warm interpreter (the
default) vs started fresh (``SPARK_DL_ZYGOTE=0``).

    python benchmarks/launch.py [--runs 5] [--master 'local-cluster[2,1,1024]'] [--job trivial|step]
    python benchmarks/launch.py --local [--runs 5] [--job trivial|step]   # np=-2 on this machine, forked vs fresh ranks
    python benchmarks/launch.py --back-to-back 4 [--runs 3]    # np=-2: runs right after a cold one, waiting
                                                               # for the zygote or not

All run on the same warm SparkSession, interleaved, so machine noise hits them alike. The job:
init a Gloo process group, one barrier, return (``trivial``); or init, wrap a small model in DDP
and take one SGD step (``step``: what a training function does first, which imports more of torch).
Prints the medians and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def trivial() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def step() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


JOBS = {"trivial": (trivial, "trivial 2-rank job (init, barrier, return)"),
        "step": (step, "2-rank job of one DDP step (init, wrap, backward, SGD step, return)")}


def _table(title: str, times: dict[str, list[float]]) -> dict[str, float]:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{title}")
    print(f"{'launcher':<26} {'median s':>9} {'min s':>7} {'max s':>7}")
    for k, v in times.items():
        print(f"{k:<26} {med[k]:>9.2f} {min(v):>7.2f} {max(v):>7.2f}")
    return med


def local(runs: int, job: str) -> None:
    """np=-2 on the driver (tracking off): ranks forked from the driver's zygote vs started fresh."""
    os.environ["SPARK_DL_TRACKING"] = "0"
    from spark_dl import HorovodRunner
    from spark_dl.task import zygote

    fn, what = JOBS[job]
    assert HorovodRunner(np=-2).run(fn) == 0
    assert zygote.wait_ready(60), "no zygote within a minute"
    envs = {"spark-dl np=-2 forked": None, "spark-dl np=-2 fresh": {"SPARK_DL_ZYGOTE": "0"}}
    times: dict[str, list[float]] = {name: [] for name in envs}
    for _ in range(runs):
        for name, env in envs.items():
            t = time.perf_counter()
            assert HorovodRunner(np=-2, env=env).run(fn) == 0
            times[name].append(time.perf_counter() - t)
    med = _table(f"{runs} interleaved runs each in local mode, {what}", times)
    forked, fresh = med["spark-dl np=-2 forked"], med["spark-dl np=-2 fresh"]
    print(f"ratio forked / fresh: {forked / fresh:.3f} ({fresh / forked:.1f}x faster)")


def back_to_back(count: int, trials: int, job: str) -> None:
    """np=-2: ``count`` runs one right after the other from a cold start (a zygote of their own),
    the later ones waiting for the zygote still importing (the default) or starting fresh ranks
    beside it (``READY_WAIT_S = 0``, as before the wait); the two interleaved over ``trials``."""
    os.environ["SPARK_DL_TRACKING"] = "0"
    from spark_dl import HorovodRunner
    from spark_dl.task import zygote

    fn, what = JOBS[job]
    waits = {"wait for the zygote": zygote.READY_WAIT_S, "fresh beside it": 0.0}
    times: dict[str, list[list[float]]] = {name: [] for name in waits}
    seeds = iter(range(1000, 2000))
    for _ in range(trials):
        for name, wait in waits.items():
            zygote.READY_WAIT_S = wait
            env = {"PYTHONHASHSEED": str(next(seeds))}  # a start-up variable no zygote has: a cold start
            row = []
            for _ in range(count):
                t = time.perf_counter()
                assert HorovodRunner(np=-2, env=env).run(fn) == 0
                row.append(time.perf_counter() - t)
            times[name].append(row)
    print(f"\n{trials} trials of {count} back-to-back local runs (np=-2), {what}; seconds per run, the first cold")
    for name, rows in times.items():
        med = [statistics.median(r[i] for r in rows) for i in range(count)]
        print(f"{name:<22} median " + " ".join(f"{m:6.2f}" for m in med) + f"   total {sum(med):6.2f}")
    total = {name: sum(statistics.median(r[i] for r in rows) for i in range(count)) for name, rows in times.items()}
    print(f"ratio of the totals, waiting / fresh: {total['wait for the zygote'] / total['fresh beside it']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--local", action="store_true", help="local mode (np=-2, no Spark): forked vs fresh ranks")
    parser.add_argument("--job", choices=sorted(JOBS), default="trivial")
    parser.add_argument("--back-to-back", type=int, default=0, metavar="N",
                        help="local mode: N runs right after a cold one, waiting for the zygote or not (--runs trials)")
    args = parser.parse_args()
    if args.back_to_back:
        back_to_back(args.back_to_back, args.runs, args.job)
        return
    if args.local:
        local(args.runs, args.job)
        return
    fn, what = JOBS[args.job]

    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    import spark_dl
    from spark_dl import HorovodRunner

    spark = (
        SparkSession.builder.master(args.master)
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executor.memory", "768m")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")

    def ours() -> None:
        assert HorovodRunner(np=2).run(fn) == 0

    def ours_fresh() -> None:  # every rank a fresh interpreter that imports torch
        assert HorovodRunner(np=2, env={"SPARK_DL_ZYGOTE": "0"}).run(fn) == 0

    def ours_distributor() -> None:  # the same API as theirs, on spark-dl's launcher
        assert spark_dl.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn) == 0

    def theirs() -> None:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)

    contestants = {"spark-dl HorovodRunner": ours, "spark-dl HorovodRunner fresh": ours_fresh,
                   "spark-dl TorchDistributor": ours_distributor, "PySpark TorchDistributor": theirs}
    for warm in contestants.values():  # executors, Python workers (and their zygotes), page cache warm for all
        warm()
    time.sleep(5)  # the zygotes started after the warm-up runs finish importing torch
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(args.runs):
        for name, contestant in contestants.items():
            t = time.perf_counter()
            contestant()
            times[name].append(time.perf_counter() - t)

    med = _table(f"{args.runs} interleaved runs each on {args.master}, {what}", times)
    base = med["PySpark TorchDistributor"]
    for k in ("spark-dl HorovodRunner", "spark-dl HorovodRunner fresh", "spark-dl TorchDistributor"):
        print(f"ratio {k} / PySpark TorchDistributor: {med[k] / base:.3f} ({base / med[k]:.1f}x faster)")
    fresh = med["spark-dl HorovodRunner fresh"]
    print(f"ratio spark-dl HorovodRunner forked / fresh: {med['spark-dl HorovodRunner'] / fresh:.3f} "
          f"({fresh / med['spark-dl HorovodRunner']:.1f}x faster)")
    spark.stop()


if __name__ == "__main__":
    main()
