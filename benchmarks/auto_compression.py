"""compression="auto" against fp32 and against the best hand-picked compressor, as time to a target
test accuracy (launch included), on each link: two hosts joined by a shaped link at 10 Gbit/s,
1 Gbit/s and 100 Mbit/s, and loopback.

    sudo python benchmarks/auto_compression.py [--links 10000,1000,100,loopback] [--seeds 0,1,2]
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
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cloudpickle  # noqa: E402
import time_to_accuracy as tta  # noqa: E402  (the same runs, model and clock)

cloudpickle.register_pickle_by_value(tta)  # its train() runs on ranks that cannot import this folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="10000,1000,100,loopback", help="Mbit/s of the shaped link, or loopback")
    parser.add_argument("--hand-picked", default="fp16,powersgd", help="compressors to compare auto with")
    parser.add_argument("--seeds", default=None, help="model seeds, e.g. 0,1,2: each runs every configuration "
                        "(default: --seed alone)")
    tta.add_run_arguments(parser)
    args = parser.parse_args()
    hand = [c for c in args.hand_picked.split(",") if c]
    unknown = set(hand) - (set(tta.CONFIGS) - {"peer", "fp32", "auto"})
    if unknown or not hand:
        parser.error(f"--hand-picked takes compressors of {sorted(set(tta.CONFIGS) - {'peer', 'fp32', 'auto'})}, "
                     f"got {args.hand_picked!r}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x] if args.seeds else [args.seed]
    except ValueError:
        parser.error(f"--seeds takes integers separated by commas, got {args.seeds!r}")
    cfg = tta.run_settings(args)
    summary = []
    for link in [x for x in args.links.split(",") if x]:
        name = link if link == "loopback" else f"{link} Mbit/s"
        vs_fp32, vs_best, accuracy, per_step, to_target = [], [], [], {}, {}
        for seed in seeds:
            rows = tta.measure(link, ["fp32", *hand, "auto"], {**cfg, "seed": seed})
            print(f"\n{name}, seed {seed}:")
            print(f"{'configuration':<22}{'to target':>11}{'steps':>7}{'accuracy':>10}{'s a step':>10}{'vs fp32':>9}")
            times = {}
            for c, t, out in rows:
                reached = out["accuracy"] >= args.target
                times[c] = t if reached else float("inf")
                # the ranks' own time over their steps: what the choice changes, without the launch
                step = out["train_s"] / out["steps"]
                per_step.setdefault(c, []).append(step)
                print(f"{'DDP ' + c:<22}{t:>9.1f} s{out['steps']:>7}{out['accuracy']:>10.3f}{step:>10.3f}"
                      f"{t / rows[0][1]:>8.2f}x{'' if reached else ' (not reached)'}", flush=True)
            auto = next(out for c, _, out in rows if c == "auto")
            picks = auto.get("picks", {})
            print("auto picked: " + ", ".join(f"{k} ({n / 1e6:.2f}M) {c}" for k, (c, n, _) in picks.items()))
            for k, (_, _, probed) in picks.items():  # what the probe measured: the step times behind each pick
                probe_line = ", ".join(f"{cand} {secs * 1e3:.0f}" for cand, secs in probed.items())
                print(f"  {k} probe, ms a step: {probe_line}")
            for c, t in times.items():
                to_target.setdefault(c, []).append(t)
            best = min(hand, key=lambda c: times[c])
            vs_fp32.append(times["auto"] / times["fp32"])
            vs_best.append((best, times["auto"] / times[best]))
            accuracy.append(auto["accuracy"])
        # the one compressor a user would pick for this link: the lowest median time over the seeds
        medians = {c: statistics.median(to_target[c]) for c in [*hand, "auto"]}
        pick = min(hand, key=lambda c: medians[c])
        summary.append((name, vs_fp32, vs_best, {c: statistics.median(v) for c, v in per_step.items()},
                        (pick, medians["auto"] / medians[pick])))
    print(f"\n{'link':<16}{'auto / fp32':>22}{'auto / best hand-picked':>34}{'auto / best by median':>28}")
    for name, vs_fp32, vs_best, _, (pick, ratio) in summary:
        print(f"{name:<16}{_spread(vs_fp32):>22}{_spread([r for _, r in vs_best]):>22}  "
              f"({', '.join(b for b, _ in vs_best)}){_ratio(ratio):>10} ({pick})")
    print(f"\nratios of time to the target accuracy (launch included), measured in the same run per link and seed "
          f"(seeds {','.join(map(str, seeds))}: median [lowest, highest]); below 1: auto was sooner. "
          f"Best hand-picked: per seed, the fastest of {', '.join(hand)} in that seed; best by median: the one "
          f"of them whose median time over the seeds is lowest, against auto's median time")
    print("median seconds a step over the seeds (the ranks' time over their steps): " + "; ".join(
        f"{name}: " + ", ".join(f"{c} {s:.3f}" for c, s in steps.items()) for name, _, _, steps, _ in summary))
    return 0


def _ratio(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "n/a"  # a median that did not reach the target


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


if __name__ == "__main__":
    sys.exit(main())
