"""What the training feedback costs a reduction: the shared velocity under momentum SGD, the
preconditioning under Adam, and Adam's shared first moment, each against the same compressor told
no optimizer.

Two local Gloo ranks (loopback, plain ``torch.multiprocessing``: no Spark) reduce one float32
tensor per size through ``spark_dl.compression.allreduce``, with each compressor in four modes,
each its own instance, told its optimizer before every call (``observe_optimizer``, as
``DistributedOptimizer`` and the DDP hook tell it once a step):

* ``plain``: no optimizer told: each rank compresses its own gradient;
* ``momentum``: ``SGD(momentum=0.9)``: the shared velocity;
* ``adam-own``: ``Adam`` with ``compress_momentum=False``: the preconditioning by the held second
  moment only;
* ``adam``: ``Adam``: the preconditioning and the shared first moment.

Four gradients, drawn once per size, are reduced in turn. Every instance first reduces 10 times
(past the preconditioning's 5 uncompressed reductions); then, in rounds, the modes take turns, each
reducing ``--calls`` times. Printed per size and compressor: the median over the rounds of the
wall-clock time a call in each mode and its ratio to ``plain``, then the same for rank 0's CPU time
(every thread of the process: less noisy where a call mostly waits on the other rank).

    python benchmarks/feedback_overhead.py [--elements 1048576,10485760] [--rounds 7] [--calls 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path

# As in the launcher's rank processes (inherited by this script's ranks): huge pages for big CPU
# tensors, without which each new gradient-sized tensor costs its page faults. Read by torch at its
# first big allocation, so before the import.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import join_loopback, machine, start_ranks, timed  # noqa: E402

import spark_dl.compression as C  # noqa: E402

MODES = ("plain", "momentum", "adam-own", "adam")
COMPRESSORS = {"onebit": C.OneBit, "efsign": C.EFSign}


def _instance(name: str, mode: str):
    """A fresh compressor for ``mode`` and the optimizer it is told (None: told nothing)."""
    c = COMPRESSORS[name](compress_momentum=mode != "adam-own")
    w = [torch.zeros(1, requires_grad=True)]
    opt = None if mode == "plain" else torch.optim.SGD(w, lr=0.1, momentum=0.9) if mode == "momentum" \
        else torch.optim.Adam(w, lr=0.001)
    return c, opt


def _reduce(grads: list[torch.Tensor], c, opt, calls: int, start: int) -> tuple[float, float]:
    """(wall-clock, this process's CPU) seconds a call over ``calls`` reductions, ``grads`` in turn
    from ``start``, ``opt`` told before each."""
    def once(i: int) -> None:
        if opt is not None:
            c.observe_optimizer(opt)
        C.allreduce(grads[(start + i) % len(grads)], c, name="g")

    return timed(once, calls)


def rank_main(rank: int, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    join_loopback(rank, 2, port)
    warnings.simplefilter("ignore")  # the same four gradients over and over: no training to warn about
    for n in args.elements:
        gen = torch.Generator().manual_seed(1000 * n + rank)
        grads = [torch.randn(n, generator=gen) for _ in range(4)]
        for name in args.compressors:
            made = {mode: _instance(name, mode) for mode in MODES}
            for c, opt in made.values():
                _reduce(grads, c, opt, 10, 0)
            times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]  # neither mode always goes first
                for mode in order:
                    times[mode].append(_reduce(grads, *made[mode], args.calls, r * args.calls))
            if rank == 0:
                queue.put((n, name, {m: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
                                     for m, t in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated integers, e.g. 1048576,10485760") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("comma-separated integers >= 1, e.g. 1048576,10485760")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=_ints, default=[1 << 20, 10 << 20], help="tensor sizes, comma-separated")
    p.add_argument("--compressors", default=",".join(COMPRESSORS), help=f"from {', '.join(COMPRESSORS)}")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="reductions a mode makes in a round")
    args = p.parse_args()
    args.compressors = [v for v in args.compressors.split(",") if v]
    bad = [v for v in args.compressors if v not in COMPRESSORS]
    if bad or not args.compressors:
        p.error(f"--compressors: unknown {bad or 'none given'}; choose from {', '.join(COMPRESSORS)}")
    if args.rounds < 1 or args.calls < 1:
        p.error("--rounds and --calls must be at least 1")
    print(f"feedback overhead: 2 ranks, loopback, rounds={args.rounds} calls={args.calls}")
    print(f"machine: {machine()}")
    procs, queue = start_ranks(rank_main, 2, args)
    rows = [queue.get() for _ in range(len(args.elements) * len(args.compressors))]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            sys.exit(f"a rank exited with {proc.exitcode}")
    for i, what in enumerate(("wall-clock", "rank 0's CPU")):
        print(f"\n{what} ms a call (ratio to plain)")
        print(f"{'elements':>11}  {'compressor':<10}" + "".join(f"  {m:>18}" for m in MODES))
        for n, name, t in rows:
            base = t["plain"][i]
            cells = "".join(f"  {t[m][i] * 1e3:9.2f} ({t[m][i] / base:5.3f})" for m in MODES)
            print(f"{n:>11,}  {name:<10}{cells}")


if __name__ == "__main__":
    main()
