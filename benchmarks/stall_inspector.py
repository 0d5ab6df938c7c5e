"""What the stall inspector costs a training step: DDP steps with every rank reporting its progress
once a second (the default) against the same steps with the inspector and the silence bound off
(no reporting thread), in one run.

    python benchmarks/stall_inspector.py [--seconds 10] [--rounds 3] [--width 512]

Two local rank processes (np=-2) train an MLP ``width -> width -> width -> 1`` under DDP for
``--seconds`` per launch; the variants alternate ``--rounds`` times (a launch each) and the
medians of their per-step times are compared. The launch itself is not timed: only steps are.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_DL_TRACKING", "0")


def rank_main(width: int, seconds: float) -> tuple[float, int, bool]:
    import threading
    import time

    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, width)
    stop = torch.zeros(1)
    steps, start = 0, None
    while True:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        steps += 1
        if steps == 20:  # warmed up
            start = time.perf_counter()
        if start is not None and steps % 20 == 0:  # both ranks stop at the same step
            stop.fill_(float(time.perf_counter() - start > seconds))
            dist.all_reduce(stop)
            if stop.item() > 0:
                break
    elapsed = time.perf_counter() - start
    reporting = any(t.name == "spark-dl-progress" for t in threading.enumerate())
    # what one report costs the rank, timed alone: the thread makes one a second
    from spark_dl.rank.progress import Reporter

    reporter = Reporter(lambda kind, data: None)
    t0 = time.perf_counter()
    for _ in range(1000):
        reporter.report()
    return elapsed / (steps - 20), steps - 20, reporting, (time.perf_counter() - t0) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    from spark_dl import HorovodRunner

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (False, True):
            os.environ["SPARK_DL_SILENCE_TIMEOUT"] = "30" if on else "0"
            runner = HorovodRunner(np=-2, stall_warning=60 if on else None, stall_timeout=300 if on else None)
            per_step, steps, reporting, report_s = runner.run(rank_main, args.width, args.seconds)
            assert reporting == on, "the variant did not switch the reporting thread"
            times[on].append(per_step)
            print(f"  inspector {'on ' if on else 'off'}: {per_step * 1e3:.3f} ms a step over {steps} steps",
                  flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"DDP step on 2 ranks (Gloo), MLP {args.width}-{args.width}-{args.width}-1, medians of {args.rounds} "
          f"launches of {args.seconds:g} s")
    print(f"inspector off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms: ratio on/off {on / off:.4f} "
          f"(launch-to-launch spread: off {min(times[False]) * 1e3:.2f}-{max(times[False]) * 1e3:.2f} ms, "
          f"on {min(times[True]) * 1e3:.2f}-{max(times[True]) * 1e3:.2f} ms)")
    print(f"one progress report, timed alone in a rank: {report_s * 1e6:.0f} us; at one a second that is "
          f"{report_s * 100:.4f}% of one core")


if __name__ == "__main__":
    main()
