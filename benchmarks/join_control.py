"""What ``hvd.join()`` support costs a training step: DistributedOptimizer steps with the per-step
agreement (one two-number Gloo all-reduce, started with the first bucket) against the same steps
without it, in one run.

    python benchmarks/join_control.py [--steps 300] [--rounds 3] [--widths 64,1024]

Two local rank processes (np=-2) train an MLP ``width -> width -> 1`` per ``--widths`` entry; the
two variants alternate ``--rounds`` times inside the same processes (both ranks switch together)
and the medians of their per-step times are compared; then the agreement's all-reduce is timed alone.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_DL_TRACKING", "0")


def rank_main(widths: list[int], steps: int, rounds: int) -> list[tuple[int, int, float, float]]:
    import statistics
    import time

    import spark_dl.horovod as hvd
    import torch
    from spark_dl.horovod import joining

    hvd.init()
    rows = []
    for width in widths:
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
        control = joining._job  # made with the first optimizer
        group = control.group
        x = torch.randn(32, width)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for on in (False, True):
                control.group = group if on else None  # start_control does nothing without the group
                for k in range(steps // 10 + steps):  # the first tenth warms up
                    if k == steps // 10:
                        start = time.perf_counter()
                    opt.zero_grad()
                    model(x).pow(2).mean().backward()
                    opt.step()
                times[on].append((time.perf_counter() - start) / steps)
        control.group = group
        params = sum(p.numel() for p in model.parameters())
        rows.append((width, params, statistics.median(times[False]), statistics.median(times[True])))
    ctrl = torch.zeros(2, dtype=torch.int64)
    start = time.perf_counter()
    for _ in range(steps):
        torch.distributed.all_reduce(ctrl, group=group)
    return rows, (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", default="64,1024")
    args = parser.parse_args()
    from spark_dl import HorovodRunner

    widths = [int(w) for w in args.widths.split(",")]
    rows, alone = HorovodRunner(np=-2).run(rank_main, widths=widths, steps=args.steps, rounds=args.rounds)
    print(f"DistributedOptimizer step on 2 ranks (Gloo), medians of {args.rounds} rounds of {args.steps} steps")
    print(f"{'model':<22}{'params':>12}{'no agreement':>16}{'with agreement':>17}{'ratio':>8}")
    for width, params, off, on in rows:
        print(f"{f'MLP {width}-{width}-1':<22}{params:>12,}{off * 1e3:>13.2f} ms{on * 1e3:>14.2f} ms{on / off:>8.2f}")
    print(f"the agreement's all-reduce alone (16 bytes, Gloo): {alone * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
