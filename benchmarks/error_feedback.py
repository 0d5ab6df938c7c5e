"""Error feedback and compressed all-reduce compute, on one machine, in one run.

Times (best of --repeats, after a warm-up call) on an --numel float32 gradient:
  - compress() of the error-feedback compressors against a plain copy_ of the same bytes:
    the sign encoders that keep their residual pending (OneBit with whole-tensor means or
    1,024-element buckets, EFSign), and top-k / random-k with ErrorFeedback against the bare
    compressor (what the feedback itself costs);
  - allreduce(..., out=buf) against allreduce(...) then buf.copy_ (world size 1, Gloo: compute
    only, no wire), for fp16, bf16 and random-k;
  - one averaging allreduce(out=) step of ErrorFeedback(TopK(0.01)) on two local Gloo ranks
    (--skip-ranks leaves it out).
The before/after figures for these paths in docs/benchmarks.md were measured with this script against the
commit before each change (``git stash`` / ``git checkout``), alternating builds.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the launcher's rank processes run

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from kernels import best  # noqa: E402  (benchmarks/kernels.py, beside this script)
from provenance import join_loopback  # noqa: E402

import spark_dl.compression as C  # noqa: E402


def encoders(g: torch.Tensor, repeats: int) -> None:
    dst = torch.empty_like(g)
    t_copy = best(lambda: dst.copy_(g), repeats)
    print(f"compress() of {g.numel() / 1e6:.1f}M float32, best of {repeats}; copy_ {t_copy * 1e3:.1f} ms")
    print(f"{'compressor':<24}{'ms':>8}{'vs copy_':>10}")
    rows = [("OneBit(None)", C.OneBit(None)), ("OneBit(1024)", C.OneBit(1024)), ("EFSign()", C.EFSign()),
            ("EFSign(None)", C.EFSign(None)),
            # top-k's steady state: no sparsity warm-up
            ("TopK(0.01)", C.TopK(0.01, ramp_steps=0)),
            ("ErrorFeedback(TopK)", C.ErrorFeedback(C.TopK(0.01, ramp_steps=0))),
            ("RandomK(0.01)", C.RandomK(0.01)), ("ErrorFeedback(RandomK)", C.ErrorFeedback(C.RandomK(0.01)))]
    for name, c in rows:
        t = best(lambda: c.compress(g, key="g"), repeats)
        print(f"{name:<24}{t * 1e3:>8.1f}{t / t_copy:>9.1f}x")


def into_out(g: torch.Tensor, repeats: int, port: int) -> None:
    join_loopback(0, 1, port)
    buf = torch.empty_like(g)
    print(f"\nallreduce of {g.numel() / 1e6:.1f}M float32 at world size 1 (compute only), best of {repeats}")
    print(f"{'compressor':<12}{'out= ms':>9}{'copy ms':>9}{'ratio':>8}")
    for name, make in [("fp16", C.FP16), ("bf16", C.BF16), ("randomk", lambda: C.RandomK(0.01))]:
        c = make()
        t_out = best(lambda: C.allreduce(g, c, name="g", out=buf), repeats)
        t_copy = best(lambda: buf.copy_(C.allreduce(g, c, name="g")), repeats)
        print(f"{name:<12}{t_out * 1e3:>9.1f}{t_copy * 1e3:>9.1f}{t_copy / t_out:>7.2f}x")
    dist.destroy_process_group()


def _rank(rank: int, numel: int, repeats: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    join_loopback(rank, 2, port)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    out = torch.empty_like(g)
    c = C.ErrorFeedback(C.TopK(0.01))
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        t = time.perf_counter()
        C.allreduce(g, c, name="g", out=out)
        if i >= 2:
            times.append(time.perf_counter() - t)
    if rank == 0:
        queue.put(sorted(times))
    dist.destroy_process_group()


def two_ranks(numel: int, repeats: int, port: int) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, numel, repeats, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    times = queue.get()
    for p in procs:
        p.join()
    print(f"\n2 local Gloo ranks, 1 thread each, averaging allreduce(out=) of ErrorFeedback(TopK(0.01)) "
          f"on {numel / 1e6:.1f}M float32: median {times[len(times) // 2] * 1e3:.1f} ms, "
          f"min {times[0] * 1e3:.1f} ms over {len(times)} steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--port", type=int, default=29641)
    ap.add_argument("--skip-ranks", action="store_true")
    args = ap.parse_args()
    g = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    encoders(g, args.repeats)
    into_out(g, args.repeats, args.port)
    if not args.skip_ranks:
        two_ranks(args.numel, args.repeats, args.port + 1)


if __name__ == "__main__":
    main()
