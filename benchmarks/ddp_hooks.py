"""DDP training steps with spark-dl's compression hooks against torch's own hooks, 2 ranks, one run.

    sudo python benchmarks/ddp_hooks.py [--model mlp|resnet50] [--device cpu|cuda] [--rate-mbit 1000]

Each rank trains the same model under ``DistributedDataParallel`` with: no hook (DDP's own fp32
all-reduce), torch's ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4), and spark-dl's
``make_ddp_hook`` with ``FP16()``, ``PowerSGD(rank=4)``, ``QSGD()`` and ``ErrorFeedback(TopK(0.01))``
(FP16 and PowerSGD also with ``overlap=True``: buckets reduced on a background thread),
one after the other in the same processes (torch's PowerSGD hook waited for bucket by bucket, as
spark-dl's hook is: its second all-reduce is launched from a callback and, over Gloo with several
buckets, races the next bucket's), and prints the median step time (forward, backward
with the hook's communication, optimizer step) against DDP's own, next to the step without any
communication. As root with iproute2 the two ranks talk over a veth pair shaped to
``--rate-mbit`` (``shaped_link.py``); otherwise over loopback, which says so. ``--model resnet50``
needs torchvision (the GPU host has it); ``mlp`` is a stack of square linear layers with about as
many parameters as ResNet-50 (25M) and DDP buckets of ``--bucket-mb``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

VARIANTS = ["ddp fp32", "torch fp16_compress_hook", "spark-dl FP16", "spark-dl FP16 overlap=True",
            "torch powerSGD_hook r4", "spark-dl PowerSGD r4", "spark-dl PowerSGD r4 overlap=True",
            "spark-dl QSGD 4-bit", "spark-dl top-k 1% + EF"]


def make_model(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (the same initial weights on both ranks), a batch of inputs and targets (each
    rank its own)."""
    torch.manual_seed(0)
    if args.model == "resnet50":
        import torchvision

        model = torchvision.models.resnet50()
        gen = torch.Generator().manual_seed(1 + args.rank)
        x = torch.randn(args.batch, 3, 224, 224, generator=gen)
        y = torch.randint(0, 1000, (args.batch,), generator=gen)
    elif args.model.startswith("mlp"):
        width, depth = args.width, args.depth
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
        gen = torch.Generator().manual_seed(1 + args.rank)
        x = torch.randn(args.batch, width, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
    else:
        raise SystemExit(f"--model must be mlp or resnet50, got {args.model!r}")
    return model.to(args.device), x.to(args.device), y.to(args.device)


def register(name: str, ddp: torch.nn.Module) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import spark_dl.compression as C

    if name == "ddp fp32":
        return
    if name == "torch fp16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "torch powerSGD_hook r4":
        # start_powerSGD_iter must be > 1 with error feedback and warm start (torch's own check)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2)

        def waited(state, bucket):
            # Run as is over Gloo, the hook's second all-reduce (Q), launched from the first one's
            # callback, races the next bucket's first one: ranks enqueue them in different orders
            # (a collective mismatch: "Received data size doesn't match expected size" here).
            fut = powerSGD_hook.powerSGD_hook(state, bucket)
            fut.wait()
            return fut
        ddp.register_comm_hook(state, waited)
    else:
        base, _, flag = name.partition(" overlap=")
        compressor = {"spark-dl FP16": lambda: C.FP16(),
                      "spark-dl PowerSGD r4": lambda: C.PowerSGD(rank=4, start_iter=2),
                      "spark-dl QSGD 4-bit": lambda: C.QSGD(levels=7, bucket_size=512, seed=0),
                      "spark-dl top-k 1% + EF": lambda: C.ErrorFeedback(C.TopK(0.01, ramp_steps=0))}[base]()
        ddp.register_comm_hook(*C.make_ddp_hook(compressor, overlap=flag == "True"))


def rank_main(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=2, timeout=timedelta(seconds=600))
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(step) -> float:
        for _ in range(args.warmup):  # PowerSGD's uncompressed start, DDP's bucket rebuild
            step()
        dist.barrier()
        sync()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    results = {}
    model, x, y = make_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def local_step() -> None:
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    results["compute only (no communication)"] = timed(local_step)
    for name in args.variants.split(","):
        model, x, y = make_model(args)
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
        register(name, ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        results[name] = timed(step)
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from shaped_link import add_rank_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="mlp (needs nothing) or resnet50 (torchvision)")
    parser.add_argument("--width", type=int, default=2048, help="mlp: layer width")
    parser.add_argument("--depth", type=int, default=6, help="mlp: square layers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rate-mbit", type=int, default=1000)
    parser.add_argument("--loopback", action="store_true", help="no shaped link, even as root")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    add_rank_arguments(parser)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if args.rank is not None:
        rank_main(args)
        return

    from shaped_link import Unavailable, run_ranks, shaped_link

    rank_args = ["--model", args.model, "--width", str(args.width), "--depth", str(args.depth),
                 "--batch", str(args.batch), "--bucket-mb", str(args.bucket_mb), "--device", args.device,
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
                 "--variants", args.variants]
    try:
        if args.loopback:
            raise Unavailable("--loopback")
        with shaped_link(args.rate_mbit) as link:
            results = run_ranks(__file__, rank_args, link, 29541)
            where = f"a {args.rate_mbit} Mbit/s veth (tc tbf)"
    except Unavailable as e:
        print(f"No shaped link ({e}): the ranks talk over loopback.")
        results = run_ranks(__file__, rank_args, None, 29541)
        where = "loopback"
    size = sum(p.numel() for p in make_model(argparse.Namespace(**{**vars(args), "device": "cpu", "rank": 0}))[0]
               .parameters())
    model = f"{args.model} ({size / 1e6:.1f}M parameters, batch {args.batch} per rank)"
    print(f"2 ranks, DDP, {model} on {args.device}, Gloo over {where}, buckets of {args.bucket_mb:g} MB, "
          f"median of {args.steps} steps after {args.warmup}")
    base = results.get("ddp fp32")
    print(f"{'variant':<34}{'step ms':>10}{'vs DDP fp32':>13}")
    for name, s in results.items():
        ratio = f"{base / s:>12.2f}x" if base else f"{'':>13}"
        print(f"{name:<34}{s * 1e3:>10.1f}{ratio}")
    pairs = [("spark-dl FP16", "torch fp16_compress_hook"), ("spark-dl FP16 overlap=True", "torch fp16_compress_hook"),
             ("spark-dl PowerSGD r4", "torch powerSGD_hook r4"),
             ("spark-dl PowerSGD r4 overlap=True", "torch powerSGD_hook r4")]
    for ours, theirs in pairs:
        if ours in results and theirs in results:
            print(f"{ours} against {theirs}: {results[theirs] / results[ours]:.2f}x as fast")


if __name__ == "__main__":
    main()
