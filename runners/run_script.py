"""Run a torchrun-style training script on a Spark cluster: torchrun, with Spark as the cluster.

    spark-submit runners/run_script.py --np 4 train.py --lr 0.1
    python runners/run_script.py --np -2 train.py --lr 0.1     # 2 local processes, no Spark

Every option before the script is this runner's; everything after it is the script's own command
line. Each rank runs the script as ``python train.py --lr 0.1`` would, with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...); its output is streamed to the driver. A script
written for ``horovodrun`` runs too: ``import horovod.torch as hvd`` gives spark_dl.horovod.

Exit codes: 0 every rank finished; 1 the run failed or was refused (a rank raised or exited
non-zero, a task was lost, too few task slots, ...: the reason is on stderr); 2 bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from spark_dl.submit import (
    EXIT_FAILED,
    EXIT_OK,
    add_cluster_options,
    add_stall_options,
    env_pair,
    launch,
    non_negative_int,
    seconds,
    stderr_writer,
)

PROG = "run_script.py"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; argparse exits with code 2 on bad arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run a training script on every rank of a Spark barrier stage (or on local processes), "
                    "as torchrun runs it on one machine. Options go before the script; what follows the "
                    "script is passed to it.",
        epilog="Exit codes: 0 every rank finished; 1 the run failed or was refused (reason on stderr); "
               "2 bad arguments.",
    )
    add_cluster_options(parser)
    parser.add_argument("--env", type=env_pair, action="append", default=[], metavar="NAME=VALUE",
                        help="set an environment variable in every rank (repeatable), e.g. --env NCCL_DEBUG=INFO")
    parser.add_argument("--max-restarts", type=non_negative_int, default=0,
                        help="launch a failed run again up to this many times; the script resumes from "
                             "spark_dl.load_checkpoint() if it saves one (default: %(default)s)")
    parser.add_argument("--run-timeout", type=seconds("no limit"), default=None,
                        help="stop every rank and fail the attempt after this many seconds (a hang) "
                             "(default: no limit)")
    parser.add_argument("--start-timeout", type=seconds("the default, 300"), default=300.0,
                        help="seconds to wait for every barrier task to start (default: %(default)s)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="keep the script's latest spark_dl.save_checkpoint() in this directory on the "
                             "driver; running again with it resumes (default: none)")
    parser.add_argument("--nodes", choices=("hosts", "tasks"), default="hosts",
                        help="what LOCAL_RANK/GROUP_RANK count: ranks per host (Horovod's) or one node per Spark "
                             "task, each seeing only its own GPUs (PySpark TorchDistributor's; for Lightning's "
                             "devices=1, num_nodes=NP) (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true",
                        help="show only what ranks send with spark_dl.log_to_driver, not their stdout/stderr")
    parser.add_argument("--no-tracking", dest="tracking", action="store_false",
                        help="do not log the run to MLflow (default: the current MLflow experiment)")
    add_stall_options(parser)
    parser.add_argument("script", help="the training script (read on the driver and shipped to the ranks)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the script on every rank; return the process exit code. ``prog`` names the runner in
    its messages (horovodrun.py translates its command line into this one's)."""
    args = parse_args(argv)

    from spark_dl import HorovodRunner, LaunchRefused
    from spark_dl.rank.script import read_script

    error = stderr_writer()
    try:
        runner = HorovodRunner(
            np=args.np, driver_log_verbosity="log_callback_only" if args.quiet else "all",
            start_timeout=args.start_timeout, tracking=None if args.tracking else False,
            max_restarts=args.max_restarts, checkpoint_dir=args.checkpoint_dir, run_timeout=args.run_timeout,
            env=dict(args.env), nodes=args.nodes, stall_warning=args.stall_warning, stall_timeout=args.stall_timeout,
        )
        read_script(args.script)  # a missing or broken script is refused before Spark starts
    except LaunchRefused as e:  # the arguments alone are wrong
        error(f"{prog}: run refused: {e}")
        return EXIT_FAILED
    code, _ = launch(prog, args.script, f"spark-dl {args.script}", args.master, args.np, error,
                     lambda: runner.run_script(args.script, *args.script_args))
    if code != EXIT_OK:
        return code
    info = runner.last_run
    restarts = f", {info.attempts - 1} restart(s)" if info is not None and info.attempts > 1 else ""
    error(f"{prog}: {args.script} finished on {abs(args.np)} ranks{restarts}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
