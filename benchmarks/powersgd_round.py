"""PowerSGD's round in one process (no peers), where its time goes: for a bucket with ResNet-50's
layers (or one square matrix), the round's wall time against the CPU time it takes to issue it
and, on a GPU, the device's busy time; the profiler's top operators; and the orthonormalization
of P done four ways (one batched QR per shape group on the device, batched Gram-Schmidt, batched
Cholesky-QR, and QR on the host with the copies there and back), all in one run.

    python benchmarks/powersgd_round.py [--device cuda] [--layout resnet50] [--rank 4]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression import gradient, layout_of, powersgd_round  # noqa: E402

import spark_dl.compression as C  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def groups_of(layout, rank: int) -> dict[tuple[int, int], int]:
    """The compressed matrices' (rows, cols) and how many share each, as PowerSGD groups them."""
    out: dict[tuple[int, int], int] = {}
    for shape in layout:
        if len(shape) < 2:
            continue
        rows, cols = shape[0], math.prod(shape[1:])
        r = min(rank, rows, cols)
        if r * (rows + cols) < rows * cols and rows * cols >= 2.0 * r * (rows + cols):
            out[rows, cols] = out.get((rows, cols), 0) + 1
    return out


def gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    p = p.clone()
    for i in range(p.shape[2]):
        col = p[:, :, i:i + 1]
        if i:
            prev = p[:, :, :i]
            col -= prev @ (prev.transpose(1, 2) @ col)
        col /= torch.linalg.vector_norm(col, dim=1, keepdim=True).clamp_min(1e-30)
    return p


def cholesky_qr(p: torch.Tensor) -> torch.Tensor:
    gram = p.transpose(1, 2) @ p
    low = torch.linalg.cholesky(gram)
    return torch.linalg.solve_triangular(low.transpose(1, 2), p, upper=True, left=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layout", default="resnet50")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    layout, shape = layout_of(args.layout, args.numel)
    g = gradient(shape).to(device)
    out = torch.empty(g.numel(), dtype=torch.float32, device=device)
    c = C.PowerSGD(rank=args.rank, start_iter=0)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU thread(s)"
    tensors = len(layout) if layout else 1
    print(f"PowerSGD rank {args.rank}, one round in one process, {g.numel() / 1e6:.1f}M float32 "
          f"({args.layout}, {tensors} tensors), {where}, torch {torch.__version__}")

    def one() -> None:
        powersgd_round(c, g, layout, into=out)

    wall = median_ms(one, device, args.repeats)
    issue = []
    for _ in range(args.repeats):  # the CPU's part: until the call returns, before the device finishes
        sync(device)
        t0 = time.perf_counter()
        one()
        issue.append(time.perf_counter() - t0)
    sync(device)
    print(f"round: {wall:.2f} ms wall (synchronized), {statistics.median(issue) * 1e3:.2f} ms until the call returns")

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rounds = 5
    with profile(activities=acts) as prof:
        for _ in range(rounds):
            one()
        sync(device)
    events = prof.key_averages()
    if device.type == "cuda":
        busy = sum(e.self_device_time_total for e in events) / rounds / 1e3
        launches = sum(e.count for e in events if e.key.startswith("cuda") and "Launch" in e.key) / rounds
        print(f"device busy {busy:.2f} ms a round, {launches:.0f} kernel launches a round")
        print(events.table(sort_by="self_device_time_total", row_limit=12))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))

    if not layout:
        return
    groups = groups_of(layout, args.rank)
    ps = {key: torch.randn(k, key[0], min(args.rank, *key), device=device) for key, k in groups.items()}
    print(f"orthonormal P for {sum(groups.values())} matrices in {len(groups)} shape groups, median ms")
    ways = {
        "batched QR on the device": lambda: [torch.linalg.qr(p, mode="reduced").Q for p in ps.values()],
        "batched Gram-Schmidt": lambda: [gram_schmidt(p) for p in ps.values()],
        "batched Cholesky-QR": lambda: [cholesky_qr(p) for p in ps.values()],
    }
    if device.type == "cuda":
        host = {key: torch.empty(p.shape, pin_memory=True) for key, p in ps.items()}

        def on_host() -> None:
            for key, p in ps.items():
                host[key].copy_(p, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            for key, p in ps.items():
                p.copy_(torch.linalg.qr(host[key], mode="reduced").Q, non_blocking=True)
        ways["QR on the host, copies both ways"] = on_host
    for name, fn in ways.items():
        print(f"  {name:<36}{median_ms(fn, device, args.repeats):>8.2f}")
    q = ps[next(iter(ps))]
    err = (gram_schmidt(q).transpose(1, 2) @ gram_schmidt(q) - torch.eye(q.shape[2], device=device)).abs().max()
    print(f"  (Gram-Schmidt's largest |P^T P - I| on the first group: {err:.1e})")


if __name__ == "__main__":
    main()
