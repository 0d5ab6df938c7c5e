"""Train a small CNN on scikit-learn's digits across Spark with spark_dl.horovod; print the test accuracy.

    spark-submit runners/train_digits.py --np 2 --compression qsgd
    python runners/train_digits.py --np 2            # no spark-submit: Spark on local[2]

Exit codes: 0 success; 1 the run failed or was refused (a rank raised, a task was lost, the cluster
has too few task slots, ...: the reason is on stderr); 2 bad arguments; 3 the accuracy is below
--min-accuracy.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from spark_dl.examples.digits import COMPRESSIONS

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BELOW_MIN = 0, 1, 2, 3
PROG = "train_digits.py"


def _nonzero_int(text: str) -> int:
    value = int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must not be 0 (N > 0: N ranks on Spark; -N: N local processes)")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; argparse exits with code 2 on bad arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train a small CNN on scikit-learn's bundled 8x8 digits (no download) with HorovodRunner "
                    "and spark_dl.horovod's DistributedOptimizer, and print the final test accuracy.",
        epilog="Exit codes: 0 success; 1 the run failed or was refused (reason on stderr); 2 bad arguments; "
               "3 accuracy below --min-accuracy.",
    )
    parser.add_argument("--np", type=_nonzero_int, default=2,
                        help="number of ranks: N > 0 runs N ranks in a Spark barrier stage (needs N task slots); "
                             "-N runs N local processes on the driver without Spark (default: %(default)s)")
    parser.add_argument("--epochs", type=_positive_int, default=10, help="passes over the training set (default: %(default)s)")
    parser.add_argument("--batch-size", type=_positive_int, default=16, help="batch size per rank (default: %(default)s)")
    parser.add_argument("--lr", type=_positive_float, default=0.002,
                        help="Adam learning rate per rank; the run uses lr * ranks (Horovod's scaling) (default: %(default)s)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none",
                        help="gradient compression for DistributedOptimizer (topk and randomk send 10%% "
                             "of the gradient, with error feedback) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=42, help="seed for weights and data order (default: %(default)s)")
    parser.add_argument("--min-accuracy", type=_fraction, default=0.0,
                        help="exit with code 3 if the final test accuracy is below this (default: %(default)s)")
    parser.add_argument("--max-restarts", type=_non_negative_int, default=0,
                        help="launch a failed run again up to this many times (a lost executor, a killed rank), "
                             "resuming after the last finished epoch (default: %(default)s)")
    parser.add_argument("--run-timeout", type=_positive_float, default=None,
                        help="stop every rank and fail the attempt after this many seconds (a hang); "
                             "retried with --max-restarts (default: no limit)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="keep the latest checkpoint in this directory on the driver; running the job again "
                             "with the same directory resumes after the last finished epoch (default: none)")
    parser.add_argument("--no-tracking", dest="tracking", action="store_false",
                        help="do not log the run to MLflow (default: log params and per-epoch "
                             "train_loss/test_accuracy to the current MLflow experiment)")
    parser.add_argument("--master", default=None,
                        help="Spark master when not launched by spark-submit (default: local[NP]); "
                             "under spark-submit, pass --master to spark-submit instead")
    return parser.parse_args(argv)


def _spark_session(args: argparse.Namespace, error: Callable[[str], None]):
    """The SparkSession to run on: spark-submit's, or one on --master / local[np] under plain python."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("spark-dl train_digits")
    # spark-submit hands its JVM to Python through PYSPARK_GATEWAY_PORT; its --master and --conf
    # are already in that JVM's configuration and must win.
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        spark = builder.getOrCreate()
        configured = spark.sparkContext.master
        if args.master and args.master != configured:
            error(f"{PROG}: ignoring --master {args.master}: spark-submit set the master to {configured}; "
                  "pass --master to spark-submit instead")
        return spark
    return builder.master(args.master or f"local[{args.np}]").getOrCreate()


def _stderr_writer() -> Callable[[str], None]:
    """A function printing a line on the stderr of the command the user ran.

    spark-submit merges the Python driver's stderr into its own stdout, so under spark-submit the
    line goes through the JVM's System.err instead, where `2>` and log collectors expect errors.
    """
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return lambda line: print(line, file=sys.stderr, flush=True)
    from pyspark import SparkContext

    SparkContext._ensure_initialized()
    system_err = SparkContext._jvm.System.err

    def write(line: str) -> None:
        sys.stdout.flush()
        system_err.println(line)
        system_err.flush()

    return write


def main(argv: Sequence[str] | None = None) -> int:
    """Run the training job; return the process exit code."""
    args = parse_args(argv)

    from spark_dl import HorovodRunner, LaunchRefused, SparkDLError
    from spark_dl.examples.digits import train_digits

    error = _stderr_writer()
    spark = _spark_session(args, error) if args.np > 0 else None
    try:
        runner = HorovodRunner(np=args.np, tracking=None if args.tracking else False, max_restarts=args.max_restarts,
                               checkpoint_dir=args.checkpoint_dir, run_timeout=args.run_timeout)
        result = runner.run(
            train_digits, epochs=args.epochs, batch_size=args.batch_size, base_lr=args.lr,
            compression=args.compression, seed=args.seed,
        )
    except LaunchRefused as e:
        error(f"{PROG}: run refused: {e}")
        return EXIT_FAILED
    except SparkDLError as e:
        # RankFailed's message already holds the rank, host, remote traceback and last lines.
        error(f"{PROG}: training failed: {e}")
        return EXIT_FAILED
    finally:
        if spark is not None:
            spark.stop()

    accuracy = result["accuracy"]
    print(f"test accuracy: {accuracy:.4f} ({abs(args.np)} ranks, compression={args.compression}, "
          f"{args.epochs} epochs)")
    if accuracy < args.min_accuracy:
        error(f"{PROG}: test accuracy {accuracy:.4f} is below --min-accuracy {args.min_accuracy}")
        return EXIT_BELOW_MIN
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
