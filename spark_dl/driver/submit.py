"""What the ``spark-submit`` entry points in ``runners/`` share: argument types, the SparkSession
(spark-submit's, or one of their own under plain ``python``), and error lines on the right stderr."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from spark_dl.driver.stalls import DEFAULT
from spark_dl.errors import in_range

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def nonzero_int(text: str) -> int:
    value = int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must not be 0 (N > 0: N ranks on Spark; -N: N local processes)")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not in_range(value, low=0.0, low_open=True):  # inf is refused too: a learning rate of inf trains nothing
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def seconds(unset: str) -> Callable[[str], float]:
    """An argparse type for a time limit: a finite number of seconds > 0, as ``HorovodRunner``'s
    ``run_timeout``/``start_timeout`` take (``inf``, ``nan`` and negatives are refused, naming the
    value and the fix; argparse adds the option's name). ``unset``: what leaving the option out means."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if not in_range(value, low=0.0, low_open=True):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}: pass one, "
                                             f"e.g. 600, or leave the option out for {unset}")
        return value

    parse.__name__ = "seconds"  # argparse names the type in some messages
    return parse


def stall_seconds(text: str) -> float | None:
    """An argparse type for ``--stall-warning``/``--stall-timeout``: seconds > 0, or ``off``."""
    if text.strip().lower() in ("off", "none"):
        return None
    return seconds("the default")(text)


def add_stall_options(parser: argparse.ArgumentParser) -> None:
    """``--stall-warning`` and ``--stall-timeout``: ``HorovodRunner``'s stall inspector."""
    parser.add_argument("--stall-warning", type=stall_seconds, default=DEFAULT, metavar="SECONDS",
                        help="warn when ranks have waited this long in a collective for a rank that has not joined "
                             "it, naming both (default: 60, or HOROVOD_STALL_CHECK_TIME_SECONDS; 'off': never)")
    parser.add_argument("--stall-timeout", type=stall_seconds, default=DEFAULT, metavar="SECONDS",
                        help="fail the attempt, with every rank's stack, when such a wait lasts this long (default: "
                             "300, or HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; 'off': never)")


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def env_pair(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` from the command line."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"must be NAME=VALUE, got {text!r}")
    return name, value


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """``--np`` and ``--master``, which :func:`launch` takes: where the ranks run."""
    parser.add_argument("--np", type=nonzero_int, default=2,
                        help="number of ranks: N > 0 runs N ranks in a Spark barrier stage (needs N task slots); "
                             "-N runs N local processes on the driver without Spark (default: %(default)s)")
    parser.add_argument("--master", default=None,
                        help="Spark master when not launched by spark-submit (default: local[NP]); "
                             "under spark-submit, pass --master to spark-submit instead")


def spark_session(prog: str, app_name: str, master: str | None, np: int, error: Callable[[str], None]):
    """The SparkSession to run on: spark-submit's, or one on ``master`` / ``local[np]`` under plain python."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    # spark-submit hands its JVM to Python through PYSPARK_GATEWAY_PORT; its --master and --conf
    # are already in that JVM's configuration and must win.
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        spark = builder.getOrCreate()
        configured = spark.sparkContext.master
        if master and master != configured:
            error(f"{prog}: ignoring --master {master}: spark-submit set the master to {configured}; "
                  "pass --master to spark-submit instead")
        return spark
    return builder.master(master or f"local[{np}]").getOrCreate()


def unreachable_master(master: str | None, timeout_s: float = 3.0) -> str | None:
    """Why no master of a standalone ``spark://h1:p1,h2:p2`` URL takes a connection, or None (some
    does, or the master is not a standalone one). Spark itself would start and then wait out its
    registration retries and the barrier stage's start timeout before saying so."""
    import socket

    if not master or not master.startswith("spark://"):
        return None
    reasons = []
    for hostport in master[len("spark://"):].split(","):
        host, _, port = hostport.strip().rpartition(":") if ":" in hostport else (hostport, "", "7077")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return None
        except (OSError, ValueError) as e:
            reasons.append(f"{hostport}: {type(e).__name__}: {e}")
    return "; ".join(reasons)


def stderr_writer() -> Callable[[str], None]:
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


def launch(prog: str, what: str, app_name: str, master: str | None, np: int, error: Callable[[str], None],
           run: Callable[[], Any]) -> tuple[int, Any]:
    """``(exit code, run()'s value)``: Spark started first when ``np > 0`` and stopped after; a
    refusal or a failed run is one message on ``error`` (``"prog: what failed: ..."``) and exit 1."""
    from spark_dl.errors import LaunchRefused, SparkDLError

    unreachable = unreachable_master(master) if np > 0 and "PYSPARK_GATEWAY_PORT" not in os.environ else None
    if unreachable:
        error(f"{prog}: could not start Spark: no Spark master answers at {master} ({unreachable}); start it "
              "(sbin/start-master.sh) or fix --master (spark://host:port, as the master's web UI shows it)")
        return EXIT_FAILED, None
    try:
        spark = spark_session(prog, app_name, master, np, error) if np > 0 else None
    except Exception as e:  # noqa: BLE001 - Spark's own start-up errors: one line, not a JVM trace
        text = str(e).strip().splitlines()
        error(f"{prog}: could not start Spark on master {master or f'local[{np}]'!r} ({type(e).__name__}: "
              f"{text[0] if text else ''}); check --master (local[N], spark://host:port, yarn, k8s://...) and the "
              "JVM's message above")
        return EXIT_FAILED, None
    try:
        return EXIT_OK, run()
    except LaunchRefused as e:
        error(f"{prog}: run refused: {e}")
    except SparkDLError as e:
        # RankFailed's message already holds the rank, host, remote traceback and last lines.
        error(f"{prog}: {what} failed: {e}")
    finally:
        if spark is not None:
            spark.stop()
    return EXIT_FAILED, None
