"""The driver of the multi-host tests: one SparkSession on a spark_dl.testing.cluster, the scenarios
named on the command line run in turn, one JSON line of results each (``{"scenario": ..., ...}``).

    python scenarios.py CLUSTER_LOG_DIR layout compression ...
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from spark_dl.testing.cluster import Cluster, namespace_pids

CLUSTER = Cluster.load(sys.argv[1])


def place() -> dict:
    import os

    import spark_dl.horovod as hvd

    hvd.init()
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                          "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    import socket as s

    import psutil

    addresses = [a.address for a in psutil.net_if_addrs().get(env["GLOO_SOCKET_IFNAME"] or "", [])]
    interfaces = list(psutil.net_if_addrs())
    return {**env, "addresses": addresses, "interfaces": interfaces, "hostname_ip": s.gethostbyname(s.gethostname()),
            "local_rank": hvd.local_rank(), "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "sum": hvd.allreduce(__import__("torch").ones(2), op=hvd.Sum).tolist()}


def layout(spark) -> dict:
    from spark_dl import HorovodRunner

    return {"hosts": HorovodRunner(np=4).run_all(place),
            "tasks": HorovodRunner(np=4, nodes="tasks").run_all(place)}


def train_digits(compression: str) -> dict:
    import numpy as np
    import spark_dl.horovod as hvd
    import torch
    from sklearn.datasets import load_digits

    from spark_dl.compression import QSGD, PowerSGD

    hvd.init()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    rng = np.random.default_rng(0)
    order = torch.tensor(rng.permutation(len(x)))
    train, test = order[:1400], order[1400:]
    mine = train[hvd.rank()::hvd.size()]
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    c = {"qsgd": QSGD(), "powersgd": PowerSGD(), "none": None}[compression]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   **({"compression": c} if c is not None else {}))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(150):
        idx = mine[torch.randint(len(mine), (32,), generator=g)]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    return {"accuracy": acc, "rank": hvd.rank()}


def compression(spark) -> dict:
    from spark_dl import HorovodRunner

    return {c: HorovodRunner(np=4).run(train_digits, c) for c in ("none", "qsgd", "powersgd")}


def auto_trains(marker: str, steps: int) -> dict:
    """DDP with compression="auto" (checks every 10 reductions, so a run of a few hundred steps
    sees them): per step, what rank 0 reduces each bucket with; a marker once every bucket has its
    first pick and that pick's time on the link."""
    import os

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spark_dl
    from spark_dl.compression import Auto, make_ddp_hook, stats

    spark_dl.init()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state, hook = make_ddp_hook(Auto(check_every=10, sample_every=2), optimizer=opt)
    model.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    picks, told = [], False
    for _ in range(steps):
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        buckets = state.compressor.buckets
        picks.append({k: (b.phase, type(state.compressor.candidates[b.chosen]).__name__) for k, b in buckets.items()})
        # every bucket picked, and its time on this link known (what a slower link is compared with)
        if not told and buckets and all(b.phase == "chosen" and b.baseline for b in buckets.values()):
            told = True
            open(f"{marker}.{os.environ['RANK']}", "w").close()
    return {"picks": picks, "choices": dict(stats.choices), "switches": stats.switches}


def auto(spark) -> dict:
    """compression="auto" across hosts: on 100 Mbit/s links from the start; then a run that starts
    on 1 Gbit/s links, slowed to 100 Mbit/s once every bucket has its first pick and its time."""
    from spark_dl import HorovodRunner

    out = {}
    try:
        for i in range(len(CLUSTER.workers)):
            CLUSTER.shape(i, rate_mbit=100)
        out["slow"] = HorovodRunner(np=4).run_all(auto_trains, os.path.join(tempfile.mkdtemp(), "m"), 60)
        for i in range(len(CLUSTER.workers)):
            CLUSTER.shape(i, rate_mbit=1000)
        marker = os.path.join(tempfile.mkdtemp(), "decided")
        slowed: list[float] = []

        def slow_down() -> None:
            if all_started(marker, limit=600):
                for i in range(len(CLUSTER.workers)):
                    CLUSTER.shape(i, rate_mbit=100)
                slowed.append(time.monotonic())

        threading.Thread(target=slow_down, daemon=True).start()
        out["slowed"] = HorovodRunner(np=4).run(auto_trains, marker, 160)
        out["was_slowed"] = bool(slowed)
    finally:
        for i in range(len(CLUSTER.workers)):
            CLUSTER.shape(i, rate_mbit=CLUSTER.rate_mbit)
    return out


def distributor(spark) -> dict:
    from spark_dl import TorchDistributor

    out = TorchDistributor(num_processes=4, local_mode=False, use_gpu=False).run(place)
    return {"rank0": out}


def horovod_spark(spark) -> dict:
    import spark_dl.horovod.spark as horovod_spark

    return {"all": horovod_spark.run(place, num_proc=4)}


def count_rows(data) -> dict:
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    seen = sum(len(b["id"]) for b in data.batches(16, epoch=0))
    total = [0]
    t = __import__("torch").tensor([seen])
    dist.all_reduce(t)
    total[0] = int(t)
    return {"mine": seen, "total": total[0]}


def shards(spark) -> dict:
    from spark_dl import HorovodRunner
    from spark_dl.data import shards

    df = spark.range(400).selectExpr("id", "cast(id % 10 as int) as label")
    return {"all": HorovodRunner(np=4).run_all(count_rows, data=shards(df, ["id", "label"]))}


def resumes(marker: str) -> dict:
    import os
    import time

    import torch

    import spark_dl

    spark_dl.init()
    state = spark_dl.load_checkpoint()
    start = 0 if state is None else state["step"] + 1
    for step in range(start, 6):
        torch.distributed.all_reduce(torch.ones(1))
        if step == 2:
            spark_dl.save_checkpoint({"step": step}, step=step)
            if state is None:
                open(marker, "w").close()
                time.sleep(300)  # attempt 0 waits here until a host's executor is killed
    return {"resumed_from": None if state is None else state["step"], "attempt": os.environ["SPARK_DL_ATTEMPT"]}


def executor_pids(worker: int) -> list[int]:
    out = []
    for pid in namespace_pids(CLUSTER.workers[worker].namespace):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"CoarseGrainedExecutorBackend" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def restart(spark) -> dict:
    from spark_dl import HorovodRunner

    marker = os.path.join(tempfile.mkdtemp(), "checkpointed")
    killed: list[int] = []

    def kill_when_checkpointed() -> None:
        deadline = time.monotonic() + 240
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in executor_pids(1):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    threading.Thread(target=kill_when_checkpointed, daemon=True).start()
    runner = HorovodRunner(np=4, max_restarts=1, start_timeout=180)
    started = time.monotonic()
    result = runner.run(resumes, marker)
    return {"result": result, "killed": killed, "attempts": runner.last_run.attempts,
            "failure": str(runner.last_run.failures[0])[:2000] if runner.last_run.failures else None,
            "seconds": time.monotonic() - started}


def all_reduces(marker: str) -> None:
    import os
    import time

    import torch

    import spark_dl

    spark_dl.init()
    open(f"{marker}.{os.environ['RANK']}", "w").close()
    while True:
        torch.distributed.all_reduce(torch.ones(1000))
        time.sleep(0.01)


def all_started(marker: str, ranks: int = 4, limit: float = 240.0) -> bool:
    """Wait until every rank has left its marker (``all_reduces`` and the like write one), at most
    ``limit`` seconds; whether they all did."""
    deadline = time.monotonic() + limit
    while not all(os.path.exists(f"{marker}.{r}") for r in range(ranks)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def rank_processes(worker: int) -> list[int]:
    """The rank processes on worker ``worker``'s host: started fresh (``-m spark_dl.rank.main``) or
    forked from a zygote (a zygote's command line, under a zygote); not the zygotes themselves,
    which wait for the next run by design and die with their task process."""
    zygote = b"spark_dl.task.zygote"
    out = []
    for pid in namespace_pids(CLUSTER.workers[worker].namespace):
        cmd = cmdline(pid)
        if b"spark_dl.rank.main" in cmd or (zygote in cmd and zygote in cmdline(parent(pid))):
            out.append(pid)
    return out


def cut(spark) -> dict:
    """Worker 1's link cut while its ranks are in collectives: the run fails naming a rank on that
    host within the silence bound, and once the link is back no rank is left running there."""
    from spark_dl import HorovodRunner, JobFailed

    os.environ["SPARK_DL_SILENCE_TIMEOUT"] = "10"
    marker = os.path.join(tempfile.mkdtemp(), "started")
    cut_at: list[float] = []

    def cut_when_started() -> None:
        all_started(marker)
        time.sleep(1.0)
        CLUSTER.cut(1)
        cut_at.append(time.monotonic())

    threading.Thread(target=cut_when_started, daemon=True).start()
    error = None
    try:
        HorovodRunner(np=4).run(all_reduces, marker)
    except JobFailed as e:
        error = str(e)
    to_error = time.monotonic() - cut_at[0] if cut_at else None
    CLUSTER.restore(1)
    restored = time.monotonic()
    left = rank_processes(1)
    while left and time.monotonic() - restored < 60:
        time.sleep(0.5)
        left = rank_processes(1)
    del os.environ["SPARK_DL_SILENCE_TIMEOUT"]
    return {"error": None, "failure": error, "to_error_s": to_error, "left_on_cut_host": left,
            "left_on_other_host": rank_processes(0), "cut_host": CLUSTER.workers[1].address,
            "gone_after_restore_s": time.monotonic() - restored}


def wait_gone(started: float, limit: float = 60.0) -> tuple[list[int], float]:
    """Ranks still running on any worker host once they are all gone or ``limit`` s have passed, and
    when that was (seconds after ``started``)."""
    left = [p for w in range(len(CLUSTER.workers)) for p in rank_processes(w)]
    while left and time.monotonic() - started < limit:
        time.sleep(0.2)
        left = [p for w in range(len(CLUSTER.workers)) for p in rank_processes(w)]
    return left, time.monotonic() - started


def cut_rendezvous(spark) -> dict:
    """Worker 1's link cut as its tasks start their ranks, during the rendezvous: the start fails
    within the silence bound instead of waiting out start_timeout, and nothing is left running."""
    from spark_dl import HorovodRunner, JobFailed

    os.environ["SPARK_DL_SILENCE_TIMEOUT"] = "10"
    cut_at: list[float] = []

    before = set(rank_processes(1))  # a zygote's ranks of an earlier run may still be going

    def cut_now() -> None:  # once worker 1's tasks start their ranks, which happens while they rendezvous
        deadline = time.monotonic() + 120
        while not set(rank_processes(1)) - before and time.monotonic() < deadline:
            time.sleep(0.02)
        CLUSTER.cut(1)
        cut_at.append(time.monotonic())

    threading.Thread(target=cut_now, daemon=True).start()
    error = None
    try:
        HorovodRunner(np=4, start_timeout=300).run(all_reduces, os.path.join(tempfile.mkdtemp(), "started"))
    except JobFailed as e:
        error = str(e)
    finally:
        to_error = time.monotonic() - cut_at[0] if cut_at else None
        time.sleep(0.5)  # the cut has happened, whatever ended the run
        CLUSTER.restore(1)
    left, gone = wait_gone(time.monotonic())
    del os.environ["SPARK_DL_SILENCE_TIMEOUT"]
    return {"failure": error, "to_error_s": to_error, "left": left, "gone_after_restore_s": gone}


def run_once_started(marker: str, fn, *args) -> tuple[object, str | None, int]:
    """``HorovodRunner(np=4).run(fn, marker, *args)``: ``(result, failure, retries)``. A run whose
    ranks all failed to start (no rank left its marker) before the fault under test began is run
    once more: a host cut by the scenario before loses its executor some seconds after its link is
    back, and a run starting then fails on that, not on this scenario's fault."""
    from spark_dl import HorovodRunner, JobFailed

    for attempt in range(2):
        try:
            return HorovodRunner(np=4).run(fn, marker, *args), None, attempt
        except JobFailed as e:
            if attempt or any(os.path.exists(f"{marker}.{r}") for r in range(4)):
                return None, str(e)[:3000], attempt
            print(f"a run of {fn.__name__} did not start, run again: {str(e)[:300]}", file=sys.stderr, flush=True)
            time.sleep(5.0)
            wait_for_executors(CLUSTER.session())
    raise AssertionError("unreachable")


def counted_all_reduces(marker: str, steps: int) -> int:
    import os
    import time

    import torch

    import spark_dl

    spark_dl.init()
    open(f"{marker}.{os.environ['RANK']}", "w").close()
    t = torch.ones(1000)
    for _ in range(steps):
        torch.distributed.all_reduce(t)
        time.sleep(0.02)
    return steps


def flap(spark) -> dict:
    """Worker 1's link down for 2 s, three times, while the ranks all-reduce: TCP and Gloo ride it
    out (the silence bound, 10 s here, is longer than each outage), and the run finishes."""
    os.environ["SPARK_DL_SILENCE_TIMEOUT"] = "10"
    marker = os.path.join(tempfile.mkdtemp(), "started")
    flaps: list[float] = []

    def flap_when_started() -> None:
        all_started(marker)
        for _ in range(3):
            time.sleep(2.0)
            if not marker:
                return
            CLUSTER.cut(1)
            flaps.append(time.monotonic())
            time.sleep(2.0)
            CLUSTER.restore(1)

    threading.Thread(target=flap_when_started, daemon=True).start()
    started = time.monotonic()
    try:
        result, error, retries = run_once_started(marker, counted_all_reduces, 600)
    finally:
        marker = ""  # the flapping thread stops at its next check
        time.sleep(4.5)
        CLUSTER.restore(1)
    del os.environ["SPARK_DL_SILENCE_TIMEOUT"]
    return {"result": result, "failure": error, "flaps": len(flaps), "seconds": time.monotonic() - started,
            "start_retries": retries, "left": wait_gone(time.monotonic(), 30)[0]}


def loss(spark) -> dict:
    """5% of worker 1's frames lost each way while the ranks all-reduce: TCP retransmits, the run
    finishes. The kernel here may lack netem: the loss is made in user space (spark_dl.testing.lossy)."""
    from spark_dl.testing.lossy import lossy

    marker = os.path.join(tempfile.mkdtemp(), "started")
    started = time.monotonic()
    with lossy(CLUSTER, 1, 5.0):
        result, error, retries = run_once_started(marker, counted_all_reduces, 150)
    return {"result": result, "failure": error, "seconds": time.monotonic() - started,
            "start_retries": retries, "left": wait_gone(time.monotonic(), 30)[0]}


def kill_host(spark) -> dict:
    """Every process of worker 1's host killed (its Worker and executor JVMs, Python workers, ranks)
    mid-collective: the run fails naming a rank of that host, the ranks of the other host go, and the
    host is started again for what follows."""
    from spark_dl import HorovodRunner, JobFailed

    marker = os.path.join(tempfile.mkdtemp(), "started")
    killed_at: list[float] = []

    def kill_when_started() -> None:
        all_started(marker)
        time.sleep(1.0)
        CLUSTER.kill_worker(1)
        killed_at.append(time.monotonic())

    threading.Thread(target=kill_when_started, daemon=True).start()
    error = None
    try:
        HorovodRunner(np=4).run(all_reduces, marker)
    except JobFailed as e:
        error = str(e)[:3000]
    to_error = time.monotonic() - killed_at[0] if killed_at else None
    left, _ = wait_gone(time.monotonic(), 30)
    CLUSTER.start_worker(1)
    return {"failure": error, "to_error_s": to_error, "left": left, "killed_host": CLUSTER.workers[1].address}


def driver_killed(spark) -> dict:
    """The driver process killed (SIGKILL) while ranks on both hosts all-reduce: no rank outlives it.
    Runs a second driver (this script, ``victim``) after this one's session is stopped: the
    standalone master gives one application the cores at a time."""
    spark.stop()
    marker = os.path.join(tempfile.mkdtemp(), "started")
    env = {**os.environ, "SPARK_DL_TRACKING": "0"}
    victim = subprocess.Popen([sys.executable, __file__, sys.argv[1], "--victim", marker], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = all_started(marker)
    time.sleep(1.0)
    victim.kill()
    killed = time.monotonic()
    victim.wait()
    left, gone = wait_gone(killed, 60)
    return {"started": started, "left": left, "gone_s": gone}


def victim(marker: str) -> None:
    """A driver to be killed: four ranks all-reducing until it dies."""
    from spark_dl import HorovodRunner

    spark = CLUSTER.session(**{"spark.executor.memory": "640m", "spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    wait_for_executors(spark)
    HorovodRunner(np=4).run(all_reduces, marker)


def wait_for_executors(spark, limit: float = 180.0) -> None:
    """Until every worker host has an executor: on a loaded machine the second one registers late."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1 >= len(CLUSTER.workers):
            return
        time.sleep(0.5)


def main() -> None:
    if sys.argv[2:3] == ["--victim"]:
        victim(sys.argv[3])
        return
    spark = CLUSTER.session(**{"spark.executor.memory": "640m", "spark.ui.enabled": "false",
                               "spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    for name in sys.argv[2:]:
        wait_for_executors(spark)  # a host killed or cut before loses its executor for a while
        started = time.monotonic()
        try:
            out = {"scenario": name, **globals()[name](spark)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out = {"scenario": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out["seconds"] = out.get("seconds", time.monotonic() - started)
        out["driver"] = {"host": CLUSTER.driver_host, "hostname": socket.gethostname()}
        print("RESULT " + json.dumps(out), flush=True)
    spark.stop()  # a second time after driver_killed: nothing happens


if __name__ == "__main__":
    main()
