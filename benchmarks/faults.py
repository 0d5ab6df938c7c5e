"""The reliability table: faults between hosts on a real standalone cluster, each timed to its error
(or to completion) with what was left running, printed as the Markdown table docs/reliability.md
quotes.

    sudo python benchmarks/faults.py [--rate-mbit 1000] [--faults cut,cut_rendezvous,...]

Starts ``spark_dl.testing.cluster`` (a master here, two workers in network namespaces of their own,
two task slots each, links shaped to ``--rate-mbit``), runs the fault scenarios of
``tests/multihost/scenarios.py`` (four ranks, two per host, all-reducing in a loop;
``SPARK_DL_SILENCE_TIMEOUT=10`` where a silence is what tells), and tears the cluster down. Needs
root, iproute2 and Java 17.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import commit  # noqa: E402

FAULTS = ["cut", "cut_rendezvous", "loss", "flap", "restart", "kill_host", "driver_killed"]
WHAT = {
    "cut": ("a worker host's link cut mid-collective", "`RankFailed` naming a rank on the cut host, \"went silent\""),
    "cut_rendezvous": ("a worker host's link cut during the rendezvous (as its tasks start their ranks)",
                       "`JobFailed` naming the cut host's task or rank (\"went silent\", or \"never reached the "
                       "driver\"), not a wait for start_timeout"),
    "loss": ("5% packet loss each way on a worker host's link (user space, `spark_dl.testing.lossy`)",
             "the run finishes"),
    "flap": ("a worker host's link down 2 s, three times", "the run finishes"),
    "restart": ("a worker host's executor JVM killed (SIGKILL), `max_restarts=1`",
                "`RankFailed` (\"lost contact with the task\"), then the run resumes from its checkpoint"),
    "kill_host": ("a whole worker host killed (Worker, executor, Python workers, ranks)",
                  "`RankFailed` naming a rank on that host"),
    "driver_killed": ("the driver process killed (SIGKILL)", "every rank on every host ends"),
}


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def row(name: str, r: dict) -> str:
    fault, expected = WHAT[name]
    if r.get("error"):
        return f"| {fault} | {expected} | the scenario failed: {r['error'][:200]} | - |"
    if r.get("unavailable"):
        return f"| {fault} | {expected} | not run: {r['unavailable']} | - |"
    left = r.get("left", []) + r.get("left_on_cut_host", []) + r.get("left_on_other_host", [])
    left_text = "nothing" if not left else f"{len(left)} rank process(es)"
    failure = (r.get("failure") or "").splitlines()[0][:160] if r.get("failure") else None
    if name in ("flap", "loss"):
        measured = (f"finished in {_seconds(r.get('seconds'))}" if failure is None
                    else f"failed: {failure}")
    elif name == "restart":
        measured = f"resumed from step {r['result']['resumed_from']}; whole run {_seconds(r.get('seconds'))}"
    elif name == "driver_killed":
        measured = f"last rank gone {_seconds(r.get('gone_s'))} after the kill"
    else:
        measured = f"{_seconds(r.get('to_error_s'))} to: {failure}"
    return f"| {fault} | {expected} | {measured} | {left_text} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    args = parser.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {FAULTS}")
    faults.sort(key=FAULTS.index)  # driver_killed stops the session: it runs last
    from spark_dl.testing import cluster

    try:
        cluster.check_can_run()
    except cluster.ClusterUnavailable as e:
        print(f"faults.py: no cluster here: {e}", file=sys.stderr)
        return 2
    script = os.path.join(ROOT, "tests", "multihost", "scenarios.py")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_DL_TRACKING": "0"}
    with cluster.running(workers=2, cores=2, memory_mb=1400, rate_mbit=args.rate_mbit) as c:
        proc = subprocess.run([sys.executable, script, c.log_dir, *faults], capture_output=True, text=True, env=env)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["scenario"]] = r
    print(f"{platform.node()}, {os.cpu_count()} cores, {datetime.date.today()}, commit {commit()}; two worker "
          f"hosts (network namespaces), {args.rate_mbit:g} Mbit/s links, four ranks")
    print()
    print("| fault | expected | measured | left behind |")
    print("|---|---|---|---|")
    for name in faults:
        r = results.get(name)
        print(row(name, r) if r is not None else f"| {WHAT[name][0]} | {WHAT[name][1]} | did not run | - |")
    if len(results) < len(faults):
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
