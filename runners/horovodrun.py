"""``horovodrun`` on a Spark cluster: the same command line, Spark in place of the host list.

    spark-submit runners/horovodrun.py -np 4 python train.py --lr 0.1
    python runners/horovodrun.py -np -2 python train.py --lr 0.1    # 2 local processes, no Spark

The script runs unchanged: in every rank ``import horovod.torch as hvd`` gives spark_dl.horovod
(Horovod's API on torch.distributed). This is ``run_script.py`` with horovodrun's spelling:
``-np``/``--num-proc``, the command as ``python train.py ...`` (or just ``train.py ...``),
``--gloo`` and ``--verbose`` accepted, ``--no-tracking`` as run_script.py's. Spark places the ranks,
so host lists (``-H``, ``--hostfile``) are refused, and so is ``--mpi`` (no MPI here). Exit codes as
run_script.py: 0 every rank finished; 1 the run failed or was refused; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_script  # noqa: E402  (the runner next to this one)
from spark_dl.submit import non_negative_int, nonzero_int, seconds  # noqa: E402

PROG = "horovodrun.py"
HARMLESS_INTERPRETER_FLAGS = ("-u", "-B", "-O", "-OO", "-s", "-E")


def translate(argv: Sequence[str]) -> list[str]:
    """horovodrun's command line as run_script.py's; argparse exits with code 2 when it is wrong."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a Horovod training script on a Spark barrier stage, as horovodrun runs it "
                               "on hosts. Options go before the command; the command is `python script.py ...`.")
    parser.add_argument("-np", "--num-proc", dest="np", type=nonzero_int, required=True,
                        help="number of ranks: N > 0 in a Spark barrier stage, -N local processes without Spark")
    parser.add_argument("--master", default=None, help="Spark master when not launched by spark-submit")
    parser.add_argument("-H", "--hosts", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hostfile", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mpi", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--start-timeout", type=seconds("the default, 300"), default=None,
                        help="seconds to wait for every rank to start (as horovodrun's)")
    parser.add_argument("-p", "--ssh-port", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--min-np", "--max-np", "--host-discovery-script", dest="elastic", default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--no-tracking", dest="tracking", action="store_false",
                        help="log nothing to MLflow (as run_script.py's --no-tracking)")
    parser.add_argument("--gloo", action="store_true",
                        help="accepted (collectives always go through torch.distributed)")
    parser.add_argument("--verbose", action="store_true", help="accepted")
    parser.add_argument("--no-stall-check", action="store_true",
                        help="no stall warnings or stall time-out (as horovodrun's)")
    parser.add_argument("--stall-check-warning-time-seconds", type=non_negative_int, default=None,
                        help="warn when ranks have waited this long for one that has not joined a collective "
                             "(default 60)")
    parser.add_argument("--stall-check-shutdown-time-seconds", type=non_negative_int, default=None,
                        help="fail the run, with every rank's stack, when such a wait lasts this long (0: never; "
                             "default 300)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="python script.py [args...]")
    args = parser.parse_args(argv)
    if args.hosts or args.hostfile:
        parser.error("Spark places the ranks: drop -H/--hosts/--hostfile (use -np and the cluster's task slots)")
    if args.mpi:
        parser.error("--mpi: there is no MPI here; collectives go through torch.distributed (Gloo or NCCL)")
    if args.ssh_port:
        parser.error("-p/--ssh-port: Spark starts the ranks, with no ssh; drop it")
    if args.elastic:
        parser.error("--min-np/--max-np/--host-discovery-script: elastic runs on Spark are "
                     "spark_dl.horovod.spark.run_elastic(fn, num_proc=..., min_num_proc=..., max_num_proc=...) "
                     "(the free task slots are the hosts); this runner runs a fixed -np")
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if command and os.path.basename(command[0]).startswith("python") and not command[0].endswith(".py"):
        command = command[1:]  # the interpreter is the ranks' own (PYSPARK_PYTHON)
        # its flags: -u and the like change nothing that matters here (rank output is streamed)
        while command and command[0] in HARMLESS_INTERPRETER_FLAGS:
            command = command[1:]
        if command and command[0] in ("-m", "-c"):
            parser.error(f"python {command[0]}: the command must be a script file, python train.py [args...]; "
                         "for a module, name its .py file")
        if command and command[0].startswith("-"):
            parser.error(f"python {command[0]}: interpreter options cannot be passed to the ranks' Python; drop it "
                         f"(accepted and ignored: {' '.join(HARMLESS_INTERPRETER_FLAGS)})")
    if not command or not command[0].endswith(".py"):
        parser.error("the command must be a Python script: python train.py [args...] (not another program)")
    out = ["--np", str(args.np)]
    if args.master:
        out += ["--master", args.master]
    if args.start_timeout is not None:
        out += ["--start-timeout", str(args.start_timeout)]
    if not args.tracking:
        out.append("--no-tracking")
    warning, shutdown = args.stall_check_warning_time_seconds, args.stall_check_shutdown_time_seconds
    if args.no_stall_check:
        warning = shutdown = 0
    for flag, value in (("--stall-warning", warning), ("--stall-timeout", shutdown)):
        if value is not None:  # horovodrun's 0 is "never"
            out += [flag, str(value) if value > 0 else "off"]
    return out + command


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script on every rank; return the process exit code."""
    return run_script.main(translate(sys.argv[1:] if argv is None else argv), prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
