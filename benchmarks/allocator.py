"""A rank's glibc malloc as spark-dl sets it (large freed blocks kept for reuse,
``spark_dl.rank.allocator``) against glibc's defaults (``SPARK_DL_MALLOC=0``): time per training
step, page faults per step and peak resident memory, for DDP fp32 and DDP PowerSGD on the
time-to-accuracy benchmark's MLP (10.3M parameters).

    python benchmarks/allocator.py [--rounds 3] [--steps 40] [--hidden 3072] [--configs fp32,powersgd]

``--configs encode-onebit,encode-efsign`` times the sign encoders alone instead (``OneBit()`` and
``EFSign()`` with error feedback on a gradient of the MLP's size, one native thread): with glibc's
defaults is what a process that spark-dl did not start gets (a ``torchrun`` script with
``make_ddp_hook``), so the two rows should match.

Two local ranks (``np=-2``, no Spark), one intra-op thread each, SGD with momentum and
``zero_grad()`` (which frees the gradients), as in ``benchmarks/time_to_accuracy.py``. The two
settings alternate, round after round, so machine noise hits them alike; prints the medians of rank
0's numbers over rounds and their ratio.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import commit  # noqa: E402


def train(cfg: dict) -> dict:
    """One rank: ``warmup`` steps, then ``steps`` timed ones (:func:`measure`); a training step, or
    for ``encode-*`` one encoder call (:func:`encoder`)."""
    import torch

    import spark_dl

    spark_dl.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    d_in, hidden = 256, cfg["hidden"]
    if cfg["compression"].startswith("encode-"):
        return measure(encoder(cfg["compression"], d_in * hidden + hidden * hidden + hidden * 10), cfg)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if cfg["compression"] == "powersgd":
        from spark_dl.compression import PowerSGD, make_ddp_hook

        ddp.register_comm_hook(*make_ddp_hook(PowerSGD(), optimizer=opt))
    data = torch.Generator().manual_seed(1)
    teacher = torch.randn(d_in, 10, generator=data)

    def one() -> None:
        x = torch.randn(64, d_in, generator=data)
        loss = torch.nn.functional.cross_entropy(ddp(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    return measure(one, cfg)


def encoder(name: str, numel: int):
    """One call of a sign encoder (``OneBit()`` or ``EFSign()``, error feedback included, one native
    thread) on a gradient of ``numel`` elements."""
    import torch

    import spark_dl.compression as C
    from spark_dl.compression import native

    native.set_threads(1)
    compressor = {"encode-onebit": C.OneBit, "encode-efsign": C.EFSign}[name]()
    g = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    return lambda: compressor.compress(g, key="w")


def measure(one, cfg: dict) -> dict:
    """``one()`` ``warmup`` times, then ``steps`` timed times: its ms a step, minor faults a step,
    peak RSS and what the allocator setting did here."""
    import resource
    import time

    from spark_dl.rank import allocator

    for _ in range(cfg["warmup"]):
        one()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        one()
    ms = 1000 * (time.perf_counter() - start) / cfg["steps"]
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / cfg["steps"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"ms": ms, "faults": faults, "peak_mb": peak_mb, "allocator": allocator.choice(os.environ)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--configs", default="fp32,powersgd")
    args = parser.parse_args()
    from spark_dl import HorovodRunner
    from spark_dl.protocol import MALLOC_ENV

    print(f"{platform.node()}, {os.cpu_count()} cores, {datetime.date.today()}, commit {commit()}; 2 local "
          f"ranks, MLP 256-{args.hidden}-{args.hidden}-10, batch 64 a rank, {args.steps} steps after "
          f"{args.warmup}, medians over {args.rounds} rounds")
    settings = {"reuse (default)": {}, "glibc defaults": {MALLOC_ENV: "0"}}
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for config in args.configs.split(","):
            for name, env in settings.items():
                cfg = {"hidden": args.hidden, "steps": args.steps, "warmup": args.warmup, "compression": config}
                out = HorovodRunner(np=-2, env=env).run(train, cfg)
                rows.setdefault((config, name), []).append(out)
    print(f"\n{'config':<14} {'malloc':<16} {'ms/step':>8} {'faults/step':>12} {'peak RSS MB':>12}  in the rank")
    for config in args.configs.split(","):
        med = {}
        for name in settings:
            runs = rows[config, name]
            med[name] = {k: statistics.median(r[k] for r in runs) for k in ("ms", "faults", "peak_mb")}
            print(f"{config:<14} {name:<16} {med[name]['ms']:>8.1f} {med[name]['faults']:>12.0f} "
                  f"{med[name]['peak_mb']:>12.0f}  {runs[0]['allocator']}")
        a, b = med["reuse (default)"], med["glibc defaults"]
        print(f"{config:<14} {'ratio':<16} {a['ms'] / b['ms']:>8.2f} {'':>12} {a['peak_mb'] / b['peak_mb']:>12.2f}")


if __name__ == "__main__":
    main()
