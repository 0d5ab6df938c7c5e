"""Cost of tracking to a training loop: 3 metrics logged every step at ~200 steps/s.

    python benchmarks/tracking.py [--steps 1000] [--reps 3]

Starts a real local ``mlflow server`` (SQLite backend, in a temp dir), then runs the same
2-rank loop (``HorovodRunner(np=-2)``; each step is a fixed amount of matrix work calibrated to
about 5 ms) in three ways:

- ``off``: no logging, tracking and progress bar off;
- ``spark_dl``: ``spark_dl.log_metrics`` every step, the driver writing to the server;
- ``spark_dl, ranks only``: the same calls with the driver not writing (``tracking=False``): the
  rank-side cost alone, which is what remains when the driver and server have their own cores;
- ``mlflow direct``: rank 0 calls ``MlflowClient.log_metric`` three times a step against the server
  (what ``mlflow.log_metric`` does, and what a rank must not do).

Each configuration's loop time is measured inside the ranks (launch excluded); the best of
``--reps`` runs is compared with the best ``off`` run. Prints a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import free_port  # noqa: E402

import spark_dl  # noqa: E402
from spark_dl import HorovodRunner, Tracking


def _work(a, b, reps: int) -> None:
    import torch

    for _ in range(reps):
        torch.mm(a, b)


def calibrate(target_s: float = 0.005) -> int:
    """Matrix products per step for ~``target_s`` of single-threaded work."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    _work(a, b, 50)
    t = time.perf_counter()
    _work(a, b, 500)
    per = (time.perf_counter() - t) / 500
    return max(1, round(target_s / per))


def loop(steps: int, reps: int, mode: str, uri: str | None = None, run_id: str | None = None,
         pin: bool = False) -> float:
    import torch
    import torch.distributed as dist

    spark_dl.init()
    if pin:  # this rank gets a core of its own, as on an executor
        os.sched_setaffinity(0, {dist.get_rank()})
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    client = None
    if mode == "direct" and dist.get_rank() == 0:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
    dist.barrier()
    t = time.perf_counter()
    for step in range(steps):
        _work(a, b, reps)
        loss, acc, lr = 1.0 / (step + 1), step / steps, 0.1
        if mode == "spark_dl":
            spark_dl.log_metrics({"loss": loss, "acc": acc, "lr": lr}, step=step)
        elif client is not None:
            for k, v in (("loss", loss), ("acc", acc), ("lr", lr)):
                client.log_metric(run_id, k, v, step=step)
    elapsed = time.perf_counter() - t
    dist.barrier()
    return elapsed


def start_server(root: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", f"{root}/artifacts"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return proc, uri
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("mlflow server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--direct-steps", type=int, default=200, help="steps of the (slow) direct-MLflow loop")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--np", type=int, default=2, help="ranks; on a 2-core machine --np 1 leaves a core "
                    "to the driver and the server, as a cluster's driver has its own")
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r and the driver and the "
                    "server to the last core (needs np + 1 cores): what a cluster gives them")
    args = ap.parse_args()

    import mlflow

    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < args.np + 1:
            raise SystemExit(f"--pin needs {args.np + 1} cores, this machine has {len(cores)}")
        os.sched_setaffinity(0, {cores[-1]})  # the server, started below, inherits it

    work = calibrate()
    root = tempfile.mkdtemp(prefix="spark-dl-bench-")
    server, uri = start_server(root)
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("tracking-benchmark")
        off = HorovodRunner(np=-args.np, tracking=False, progress=False)
        on = HorovodRunner(np=-args.np, tracking=Tracking(system_metrics=False, rank_logs=False), progress=False)
        times: dict[str, list[float]] = {"off": [], "spark_dl": [], "ranks_only": []}
        for _ in range(args.reps):  # interleaved, so load changes on the machine hit both alike
            times["off"].append(off.run(loop, steps=args.steps, reps=work, mode="off", pin=args.pin))
            times["spark_dl"].append(on.run(loop, steps=args.steps, reps=work, mode="spark_dl", pin=args.pin))
            times["ranks_only"].append(off.run(loop, steps=args.steps, reps=work, mode="spark_dl", pin=args.pin))
        with mlflow.start_run() as run:
            direct = off.run(loop, steps=args.direct_steps, reps=work, mode="direct", uri=uri, run_id=run.info.run_id,
                         pin=args.pin)
        runs = mlflow.search_runs(experiment_names=["tracking-benchmark"], output_format="list")
        logged = max(len(mlflow.MlflowClient().get_metric_history(r.info.run_id, "loss")) for r in runs)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()

    base = min(times["off"]) / args.steps
    rows = [
        ("off", min(times["off"]) / args.steps, times["off"]),
        ("spark_dl.log_metrics", min(times["spark_dl"]) / args.steps, times["spark_dl"]),
        ("  same, ranks only", min(times["ranks_only"]) / args.steps, times["ranks_only"]),
        ("mlflow.log_metric direct", direct / args.direct_steps, [direct]),
    ]
    print(f"\n{args.np} rank(s), {args.steps} steps ({args.direct_steps} direct), 3 metrics/step, {work} matmuls/step, "
          f"best of {args.reps}; server: local `mlflow server` (SQLite)"
          + ("; ranks pinned to their own cores, driver and server to another" if args.pin else ""))
    print(f"{'mode':<26}{'ms/step':>10}{'steps/s':>10}{'slowdown':>10}{'median ms':>11}")
    for name, per, all_t in rows:
        n = args.direct_steps if "direct" in name else args.steps
        print(f"{name:<26}{per * 1e3:>10.3f}{1 / per:>10.1f}{per / base:>9.3f}x"
              f"{statistics.median(all_t) / n * 1e3:>11.3f}")
    print(f"points of 'loss' in the run: {logged}")


if __name__ == "__main__":
    main()
