"""What checkpoints and restarts cost: ``spark_dl.save_checkpoint`` against ``torch.save`` to local
disk, and a run that loses a rank and restarts against the same run with no failure.

    python benchmarks/checkpoint.py [--mb 1,100] [--reps 5] [--runs 3] [--steps 60] [--master local[2]]

Part 1 runs in one rank process (np=-1): a float32 tensor of each size saved alternately through the
driver (pickled, sent over the job's channel, written by the driver) and with ``torch.save`` to a
file in the rank's temporary directory; medians of ``--reps``. Part 2 trains ``--steps`` steps of a
2-rank all-reduce (10 ms of work each) with a checkpoint every 10 steps; the failing variant loses
rank 1 (``os._exit``) at 55% of the steps on its first attempt and resumes with ``max_restarts=1``.
The two variants alternate; the difference of their medians is what the failure cost end to end
(the steps redone since the checkpoint, detection, stopping the other rank, and the relaunch).
Without ``--master`` the ranks are local processes (np=-2); with it, a Spark barrier stage.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_DL_TRACKING", "0")


def save_costs(sizes_mb: list[int], reps: int) -> list[tuple[int, float, float]]:
    import tempfile

    import torch

    import spark_dl

    rows = []
    path = os.path.join(tempfile.mkdtemp(prefix="spark-dl-bench-"), "state.pt")
    for mb in sizes_mb:
        state = {"w": torch.randn(mb * 262_144)}  # mb MB of float32
        ours, disk = [], []
        for _ in range(reps):
            t = time.perf_counter()
            assert spark_dl.save_checkpoint(state, step=0)
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            torch.save(state, path)
            disk.append(time.perf_counter() - t)
        rows.append((mb, statistics.median(ours), statistics.median(disk)))
    os.unlink(path)
    return rows


def train(steps: int, fail_at: int | None) -> dict:
    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    ctx = spark_dl.get_context()
    state = spark_dl.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    for step in range(start, steps):
        g = torch.ones(1000)
        dist.all_reduce(g)
        time.sleep(0.01)
        if step % 10 == 9:
            spark_dl.save_checkpoint({"step": step}, step=step)
        if fail_at is not None and ctx.attempt == 0 and step == fail_at and ctx.rank == 1:
            os._exit(1)
    return {"attempt": ctx.attempt, "resumed_at": start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="1,100", help="checkpoint sizes in MB, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--master", default=None, help="Spark master for part 2 (default: local processes)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.mb.split(",")]

    from spark_dl import HorovodRunner

    rows = HorovodRunner(np=-1, progress=False).run(save_costs, sizes_mb=sizes, reps=args.reps)
    print(f"save_checkpoint (through the driver) vs torch.save to local disk, one rank, median of {args.reps}")
    print(f"{'state MB':>8} {'save_checkpoint ms':>19} {'torch.save ms':>14} {'ratio':>6}")
    for mb, ours, disk in rows:
        print(f"{mb:>8} {ours * 1e3:>19.1f} {disk * 1e3:>14.1f} {ours / disk:>5.2f}x")

    np_ = -2
    if args.master:
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.master(args.master).config("spark.ui.showConsoleProgress", "false").getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        np_ = 2
    fail_at = int(args.steps * 0.55)
    times: dict[str, list[float]] = {"no failure": [], "rank 1 lost, restarted": []}
    for _ in range(args.runs):
        for name, fail in (("no failure", None), ("rank 1 lost, restarted", fail_at)):
            t = time.perf_counter()
            out = HorovodRunner(np=np_, max_restarts=1, progress=False).run(train, steps=args.steps, fail_at=fail)
            times[name].append(time.perf_counter() - t)
            assert out["attempt"] == (0 if fail is None else 1), out
    ok, failed = (statistics.median(v) for v in times.values())
    redo = fail_at - (fail_at + 1) // 10 * 10 + 1
    where = args.master or "local processes"
    print(f"\n{args.steps} steps of a 2-rank all-reduce (10 ms each), checkpoint every 10, on {where}; "
          f"median of {args.runs} alternating runs")
    print(f"{'run':<24} {'median s':>9}")
    for name, v in times.items():
        print(f"{name:<24} {statistics.median(v):>9.2f}")
    print(f"a lost rank cost {failed - ok:.2f} s end to end ({failed / ok:.2f}x the run), {redo} steps redone "
          f"(about {redo * 0.01:.2f} s of work)")
    if args.master:
        spark.stop()


if __name__ == "__main__":
    main()
