"""What ``compression="auto"`` costs a reduction once it has picked: its bookkeeping (step timing,
sampling, the periodic checks) over the compressor it picked, called directly.

Two local Gloo ranks (loopback, plain ``torch.multiprocessing``: no Spark) reduce one float32 tensor
per size through ``spark_dl.compression.allreduce``. ``Auto`` with the exact candidates
(``NoneCompressor()``, ``FP16()``; its other settings at their defaults) is told heavy-ball momentum
SGD and reduces until it has picked; then, in alternating rounds, it and a fresh copy of its pick
reduce the same tensor ``--calls`` times each. The same tensor over and over is no gradient an
error-feedback compressor could follow (its residual grows without bound, and auto's guard then
switches away from it), hence the exact candidates; a switch during the rounds is printed.
Printed per size: the median over the rounds of the wall-clock time a call, each, and their
ratio (auto over its pick), then the same for rank 0's CPU time (every thread of the process: less
noisy where a call mostly waits on the other rank). Auto's periodic check (one small all-reduce
every ``check_every`` calls) falls inside the rounds, as it does in training.

    python benchmarks/auto_overhead.py [--elements 16384,1048576,10485760] [--rounds 7] [--calls 200]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import join_loopback, machine, start_ranks, timed  # noqa: E402

import spark_dl.compression as C  # noqa: E402
from spark_dl.compression.auto import CHOSEN  # noqa: E402
from spark_dl.compression.stats import label  # noqa: E402


def _timed(t: torch.Tensor, c, calls: int) -> tuple[float, float]:
    """(wall-clock, this process's CPU) seconds a call over ``calls`` reductions of ``t`` through ``c``."""
    return timed(lambda _: C.allreduce(t, c, name="g"), calls)


def rank_main(rank: int, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    join_loopback(rank, 2, port)
    momentum_sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    for n in args.elements:
        t = torch.randn(n, generator=torch.Generator().manual_seed(n))
        auto = C.Auto(candidates=[C.NoneCompressor(), C.FP16()])
        auto.observe_optimizer(momentum_sgd)
        for _ in range(10_000):  # warm-up and probe take tens of calls; a bound, not a hang, if that changes
            if auto.buckets.get("g") is not None and auto.buckets["g"].phase == CHOSEN:
                break
            C.allreduce(t, auto, name="g")
        else:
            raise RuntimeError(f"Auto made no pick for {n:,} elements in 10,000 calls")
        pick = copy.deepcopy(auto.candidates[auto.buckets["g"].chosen])  # its own state, as a user's would be
        _timed(t, pick, 3)  # the pick's first calls pay its allocations
        times: dict[str, list[tuple[float, float]]] = {"auto": [], "pick": []}
        for r in range(args.rounds):  # alternating, so drift in the machine falls on both alike
            for who in (("auto", "pick") if r % 2 == 0 else ("pick", "auto")):
                times[who].append(_timed(t, auto if who == "auto" else pick, args.calls))
        if rank == 0:
            wall = [statistics.median(w for w, _ in times[who]) for who in ("auto", "pick")]
            cpu = [statistics.median(c for _, c in times[who]) for who in ("auto", "pick")]
            now = label(auto.candidates[auto.buckets["g"].chosen])
            queue.put((n, label(pick) + ("" if now == label(pick) else f" (auto switched to {now})"), *wall, *cpu))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", default="16384,1048576,10485760", help="tensor sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds of auto and its pick")
    p.add_argument("--calls", type=int, default=200, help="reductions a round")
    args = p.parse_args()
    try:
        args.elements = [int(x) for x in args.elements.split(",") if x]
    except ValueError:
        p.error(f"--elements: comma-separated integers, got {args.elements!r}")
    if args.rounds < 1 or args.calls < 1:
        p.error("--rounds and --calls must be at least 1")
    floor = C.Auto().min_elements
    if not args.elements or min(args.elements) < floor:
        p.error(f"--elements: each at least {floor:,} (Auto's min_elements: smaller tensors go uncompressed, no pick)")
    print(f"auto's cost a reduction over its pick: 2 Gloo ranks on loopback, {args.rounds} rounds of {args.calls} "
          f"calls each; {machine()}")
    procs, queue = start_ranks(rank_main, 2, args)
    print(f"{'elements':>10}  {'pick':<16}{'auto a call':>13}{'pick a call':>13}{'auto / pick':>13}"
          f"{'auto CPU':>12}{'pick CPU':>12}{'auto / pick':>13}")
    for _ in args.elements:
        n, pick, a, b, ca, cb = queue.get()
        print(f"{n:>10,}  {pick:<16}{a * 1e6:>10.1f} us{b * 1e6:>10.1f} us{a / b:>13.3f}"
              f"{ca * 1e6:>9.1f} us{cb * 1e6:>9.1f} us{ca / cb:>13.3f}")
    for proc in procs:
        proc.join()
        if proc.exitcode:
            sys.exit(f"a rank exited with {proc.exitcode}")


if __name__ == "__main__":
    main()
