"""compression="auto" against fp32 and against the best hand-picked compressor, as time to a target
test accuracy (launch included), on each link: two hosts joined by a shaped link at 10 Gbit/s,
1 Gbit/s and 100 Mbit/s, and loopback.

    sudo python benchmarks/auto_compression.py [--links 10000,1000,100,loopback]
                                               [--hand-picked fp16,powersgd] [--target 0.75] [--hidden 3072]

The runs, the model (an MLP, 10.3M parameters at the defaults, SGD with momentum 0.9) and the clock
are those of ``benchmarks/time_to_accuracy.py``; on each link this script runs spark-dl's DDP fp32,
each ``--hand-picked`` compressor and ``auto`` in one go, and prints, per link, auto's time over fp32's
and over the best hand-picked one's (goals: never more than 5% slower than fp32 on loopback, within
10% of the best hand-picked choice on every link), its accuracy at the target, and what it picked per
bucket. Final accuracy after a fixed number of steps, with seeds, is ``benchmarks/convergence.py
--compressors none,auto``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cloudpickle  # noqa: E402
import time_to_accuracy as tta  # noqa: E402  (the same runs, model and clock)

cloudpickle.register_pickle_by_value(tta)  # its train() runs on ranks that cannot import this folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="10000,1000,100,loopback", help="Mbit/s of the shaped link, or loopback")
    parser.add_argument("--hand-picked", default="fp16,powersgd", help="compressors to compare auto with")
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    hand = [c for c in args.hand_picked.split(",") if c]
    unknown = set(hand) - (set(tta.CONFIGS) - {"peer", "fp32", "auto"})
    if unknown or not hand:
        parser.error(f"--hand-picked takes compressors of {sorted(set(tta.CONFIGS) - {'peer', 'fp32', 'auto'})}, "
                     f"got {args.hand_picked!r}")
    cfg = {"d_in": args.d_in, "hidden": args.hidden, "batch": args.batch, "lr": args.lr, "target": args.target,
           "eval_every": args.eval_every, "max_seconds": args.max_seconds, "seed": args.seed, "threads": 1}
    params = args.d_in * args.hidden + args.hidden * args.hidden + args.hidden * 10 + 2 * args.hidden + 10
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tta.ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"{platform.node()}, {os.cpu_count()} cores, {datetime.date.today()}, commit {commit or '?'}; 2 ranks, "
          f"MLP {args.d_in}-{args.hidden}-{args.hidden}-10 ({params / 1e6:.1f}M parameters), batch {args.batch} "
          f"a rank, SGD lr {args.lr} momentum 0.9, target test accuracy {args.target}", flush=True)
    summary = []
    for link in [x for x in args.links.split(",") if x]:
        rows = tta.measure(link, ["fp32", *hand, "auto"], cfg)
        name = link if link == "loopback" else f"{link} Mbit/s"
        print(f"\n{name}:")
        print(f"{'configuration':<22}{'to target':>11}{'steps':>7}{'accuracy':>10}{'vs fp32':>9}")
        times = {}
        for c, t, out in rows:
            reached = out["accuracy"] >= args.target
            times[c] = t if reached else float("inf")
            print(f"{'DDP ' + c:<22}{t:>9.1f} s{out['steps']:>7}{out['accuracy']:>10.3f}"
                  f"{t / rows[0][1]:>8.2f}x{'' if reached else ' (not reached)'}", flush=True)
        picks = next(out for c, _, out in rows if c == "auto").get("picks", {})
        print("auto picked: " + ", ".join(f"{k} ({n / 1e6:.2f}M) {c}" for k, (c, n) in picks.items()))
        best = min(hand, key=lambda c: times[c])
        summary.append((name, times["auto"] / times["fp32"], best, times["auto"] / times[best]))
    print(f"\n{'link':<16}{'auto / fp32':>12}{'best hand-picked':>18}{'auto / best':>13}")
    for name, vs_fp32, best, vs_best in summary:
        print(f"{name:<16}{vs_fp32:>12.2f}{best:>18}{vs_best:>13.2f}")
    print("\nratios of time to the target accuracy, measured in this run; below 1: auto was sooner")
    return 0


if __name__ == "__main__":
    sys.exit(main())
