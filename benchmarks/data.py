"""Training on a DataFrame's shards: what reading ``spark_dl.data.shards`` costs a training loop.

On ``--np`` ranks (2) of an embedded ``local[2]`` Spark, each epoch of ``data.batches`` is timed in three
ways, interleaved in one run: reading only, and a small MLP's training steps on every batch, with
the next batch fetched in the background (``prefetch=True``, the default) and without. A fourth
loop runs the same steps on batches already in memory: the time the data costs is the difference.

    python benchmarks/data.py [--np 2] [--rows 100000] [--width 64] [--batch 256] [--rounds 5]

With ``--np 1`` the rank has a core to spare for the background fetch; with 2 on this 2-core
machine, none.
"""
from __future__ import annotations

import argparse
import statistics


def main(data, batch_size: int, rounds: int):
    import time

    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    torch.manual_seed(0)
    width = len(next(iter(data.batches(batch_size, prefetch=False)))["x"][0])
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(width, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch):
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()

    in_memory = list(data.batches(batch_size, epoch=0, prefetch=False))

    def timed(kind: str, epoch: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        if kind == "in memory":
            for batch in in_memory:
                step(batch)
        else:
            train = kind.startswith("train")
            for batch in data.batches(batch_size, epoch=epoch, prefetch=kind.endswith("prefetch")):
                if train:
                    step(batch)
        dist.barrier()
        return time.perf_counter() - start

    kinds = ["read", "read, prefetch", "train", "train, prefetch", "in memory"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for k in kinds:
            times[k].append(timed(k, r + 1))
    return {"times": times, "batches": len(in_memory), "rows": len(data)}


def run(rows: int, width: int, batch: int, rounds: int, np: int = 2) -> str:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from spark_dl import HorovodRunner
    from spark_dl.data import shards

    spark = SparkSession.builder.master("local[2]").getOrCreate()
    df = spark.range(rows).select(
        F.array(*[F.rand(i).cast("float") for i in range(width)]).alias("x"), (F.col("id") % 10).alias("y"))
    out = HorovodRunner(np=np, tracking=False).run(main, data=shards(df, ["x", "y"]), batch_size=batch, rounds=rounds)
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    lines = [f"{np} rank(s) (Gloo), {out['rows']:,} rows per rank per epoch of {width} float32 + a label, "
             f"batch {batch} ({out['batches']} batches), median of {rounds} interleaved epochs",
             f"{'epoch':<22}{'seconds':>9}{'rows/s per rank':>18}"]
    for k, v in med.items():
        lines.append(f"{k:<22}{v:>9.3f}{out['rows'] / v:>18,.0f}")
    lines.append(f"ratio read / read, prefetch: {med['read'] / med['read, prefetch']:.2f}")
    lines.append(f"ratio train / train, prefetch: {med['train'] / med['train, prefetch']:.2f}")
    data_cost = med["train, prefetch"] - med["in memory"]
    lines.append(f"the data's share of a training epoch with prefetch: {data_cost / med['train, prefetch']:.0%} "
                 f"(without: {(med['train'] - med['in memory']) / med['train']:.0%})")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    print(run(a.rows, a.width, a.batch, a.rounds, a.np))
