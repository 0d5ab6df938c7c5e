"""What the layout check costs an explicit collective: ``hvd.allreduce`` with it (one all-reduce
of two int64 first, ``spark_dl.horovod.checks``) against the same calls without it
(``SPARK_DL_HVD_CHECKS=0``), in one run.

    python benchmarks/hvd_checks.py [--calls 100] [--rounds 20] [--sizes 1,1048576]

Two local rank processes (np=-2, Gloo) all-reduce a float32 tensor per ``--sizes`` entry; the two
variants alternate ``--rounds`` times inside the same processes (both ranks switch together) and
the medians of their per-call times are compared; then the check is timed alone.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_DL_TRACKING", "0")


def rank_main(sizes: list[int], calls: int, rounds: int) -> tuple[list[tuple[int, float, float]], float]:
    import statistics
    import time

    import spark_dl.horovod as hvd
    import torch
    from spark_dl.horovod.checks import SHAPES, check_same, describe

    hvd.init()
    rows = []
    for numel in sizes:
        x = torch.randn(numel)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for on in (False, True):
                os.environ["SPARK_DL_HVD_CHECKS"] = "1" if on else "0"  # read per call, on both ranks
                for k in range(calls // 10 + calls):  # the first tenth warms up
                    if k == calls // 10:
                        start = time.perf_counter()
                    hvd.allreduce(x)
                times[on].append((time.perf_counter() - start) / calls)
        rows.append((numel, statistics.median(times[False]), statistics.median(times[True])))
    os.environ["SPARK_DL_HVD_CHECKS"] = "1"
    fields = {SHAPES: describe(torch.ones(1)), "op": "Average", "compression": "NoneCompressor"}
    start = time.perf_counter()
    for _ in range(calls):
        check_same("allreduce", hvd.global_process_set, fields)
    return rows, (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sizes", default="1,1048576")
    args = parser.parse_args()
    from spark_dl import HorovodRunner

    sizes = [int(s) for s in args.sizes.split(",")]
    rows, alone = HorovodRunner(np=-2).run(rank_main, sizes=sizes, calls=args.calls, rounds=args.rounds)
    print(f"hvd.allreduce on 2 ranks (Gloo), medians of {args.rounds} rounds of {args.calls} calls")
    print(f"{'float32 elements':<18}{'no check':>14}{'with check':>14}{'ratio':>8}")
    for numel, off, on in rows:
        print(f"{numel:<18,}{off * 1e3:>11.3f} ms{on * 1e3:>11.3f} ms{on / off:>8.2f}")
    print(f"the check alone (an all-reduce of two int64, Gloo): {alone * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
