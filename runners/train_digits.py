"""Train a small CNN on scikit-learn's digits across Spark with spark_dl.horovod; print the test accuracy.

    spark-submit runners/train_digits.py --np 2 --compression qsgd
    python runners/train_digits.py --np 2            # no spark-submit: Spark on local[2]

Exit codes: 0 success; 1 the run failed or was refused (a rank raised, a task was lost, the cluster
has too few task slots, ...: the reason is on stderr); 2 bad arguments; 3 the accuracy is below
--min-accuracy.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from spark_dl.submit import (
    EXIT_OK,
    add_cluster_options,
    fraction,
    launch,
    non_negative_int,
    positive_float,
    positive_int,
    seconds,
    stderr_writer,
)

from spark_dl.examples.digits import COMPRESSIONS

EXIT_BELOW_MIN = 3
PROG = "train_digits.py"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; argparse exits with code 2 on bad arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train a small CNN on scikit-learn's bundled 8x8 digits (no download) with HorovodRunner "
                    "and spark_dl.horovod's DistributedOptimizer, and print the final test accuracy.",
        epilog="Exit codes: 0 success; 1 the run failed or was refused (reason on stderr); 2 bad arguments; "
               "3 accuracy below --min-accuracy.",
    )
    add_cluster_options(parser)
    parser.add_argument("--epochs", type=positive_int, default=10,
                        help="passes over the training set (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="batch size per rank (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=0.002,
                        help="Adam learning rate per rank; the run uses lr * ranks (Horovod's scaling) "
                             "(default: %(default)s)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none",
                        help="gradient compression for DistributedOptimizer (topk and randomk send 10%% "
                             "of the gradient, with error feedback) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=42, help="seed for weights and data order (default: %(default)s)")
    parser.add_argument("--min-accuracy", type=fraction, default=0.0,
                        help="exit with code 3 if the final test accuracy is below this (default: %(default)s)")
    parser.add_argument("--max-restarts", type=non_negative_int, default=0,
                        help="launch a failed run again up to this many times (a lost executor, a killed rank), "
                             "resuming after the last finished epoch (default: %(default)s)")
    parser.add_argument("--run-timeout", type=seconds("no limit"), default=None,
                        help="stop every rank and fail the attempt after this many seconds (a hang); "
                             "retried with --max-restarts (default: no limit)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="keep the latest checkpoint in this directory on the driver; running the job again "
                             "with the same directory resumes after the last finished epoch (default: none)")
    parser.add_argument("--no-tracking", dest="tracking", action="store_false",
                        help="do not log the run to MLflow (default: log params and per-epoch "
                             "train_loss/test_accuracy to the current MLflow experiment)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the training job; return the process exit code."""
    args = parse_args(argv)

    from spark_dl import HorovodRunner
    from spark_dl.examples.digits import train_digits

    def train() -> dict:
        runner = HorovodRunner(np=args.np, tracking=None if args.tracking else False, max_restarts=args.max_restarts,
                               checkpoint_dir=args.checkpoint_dir, run_timeout=args.run_timeout)
        return runner.run(train_digits, epochs=args.epochs, batch_size=args.batch_size, base_lr=args.lr,
                          compression=args.compression, seed=args.seed)

    error = stderr_writer()
    code, result = launch(PROG, "training", "spark-dl train_digits", args.master, args.np, error, train)
    if code != EXIT_OK:
        return code

    accuracy = result["accuracy"]
    print(f"test accuracy: {accuracy:.4f} ({abs(args.np)} ranks, compression={args.compression}, "
          f"{args.epochs} epochs)")
    if accuracy < args.min_accuracy:
        error(f"{PROG}: test accuracy {accuracy:.4f} is below --min-accuracy {args.min_accuracy}")
        return EXIT_BELOW_MIN
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
