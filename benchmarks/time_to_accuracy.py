"""Time to a target test accuracy, launch included, as a user lives it: PySpark's own
``TorchDistributor`` with DDP fp32 (the peer) against spark-dl's ``HorovodRunner`` with DDP fp32 and
with each compressor's DDP hook, on two hosts joined by a shaped link and on loopback.

    sudo python benchmarks/time_to_accuracy.py [--links 1000,100,loopback] [--configs peer,fp32,fp16,powersgd,qsgd]
                                               [--target 0.75] [--hidden 3072] [--max-seconds 900] [--seeds 0,1,2]
                                               [--max-steps N]

Two ranks, one per host: ``spark_dl.testing.cluster`` (two workers in network namespaces of their
own, one task slot each, links shaped to the rate) or, for ``loopback``, ``local[2]``. The model is
an MLP (``--d-in`` -> ``--hidden`` -> ``--hidden`` -> 10; 10.3M parameters at the defaults) on
generated data with a learnable signal (labels: the argmax of a fixed random linear map of the
inputs); nothing is downloaded. SGD with momentum 0.9, the same hyperparameters for every
configuration (``powersgd`` is ``PowerSGD()`` at its defaults, ``powersgd-r4`` at rank 4 and
``powersgd-r4-w10`` at rank 4 after 10 uncompressed steps: ``benchmarks/powersgd_names.py``). Every ``--eval-every``
steps the ranks measure the test accuracy, each on its share of the 2000 test rows; a run stops at
the target (or after ``--max-seconds``, or ``--max-steps``). The clock runs from the ``run()`` call
to its return. Ratios are against the peer on the same link, measured in the same run. Two untimed
spark-dl runs come first on each link, so that every measured spark-dl run forks its ranks from a
warm zygote, as every run after a session's first does (:func:`warm_up`). A seed (``--seed``, or
each of ``--seeds``) sets the model's initialization and the stream of training batches; the task
(the linear map and the test set) is the same for every seed. With ``--seeds`` every configuration
runs once per seed, and a summary per link gives each one's mean time to target over the seeds, its
spread, and the ratio of the means to fp32's.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_DL_TRACKING", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import powersgd_names  # noqa: E402
from provenance import commit  # noqa: E402

CONFIGS = ("peer", "fp32", "fp16", "bf16", "powersgd", "qsgd", "onebit", "efsign", "topk", "auto")


def train(cfg: dict) -> dict:
    """One rank's training until the target accuracy: under spark-dl or under PySpark's torchrun."""
    import os
    import time

    import torch
    import torch.distributed as dist

    started = time.time()
    if "SPARK_DL_JOB_ID" in os.environ:
        import spark_dl

        spark_dl.init()
    elif not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    g = torch.Generator().manual_seed(1234)  # the task: the same on every rank and in every run
    d_in, hidden = cfg["d_in"], cfg["hidden"]
    teacher = torch.randn(d_in, 10, generator=g)
    x_test = torch.randn(2000, d_in, generator=g)
    y_test = (x_test @ teacher).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
    name = cfg["compression"]
    if name != "fp32":
        from spark_dl.compression import BF16, FP16, QSGD, EFSign, ErrorFeedback, OneBit, PowerSGD, TopK, make_ddp_hook

        if cfg.get("powersgd") is not None:  # its settings, read on the driver (powersgd_names.py)
            compressor = PowerSGD(**cfg["powersgd"])
        else:
            compressor = {"fp16": FP16, "bf16": BF16, "qsgd": QSGD, "onebit": OneBit, "efsign": EFSign,
                          "topk": lambda: ErrorFeedback(TopK()), "auto": lambda: "auto"}[name]()
        ddp.register_comm_hook(*make_ddp_hook(compressor, optimizer=opt))
    # the seed sets the training batches too: with one stream for every seed, every fp32 run crossed the
    # target on the same lucky batch (step 150 on 3 of 4 seeds), and the seeds were not independent samples
    data = torch.Generator().manual_seed(100 + rank + 1000 * cfg["seed"])
    # each rank scores its share of the test set and the counts are summed, as a distributed
    # evaluation does: scored by rank 0 alone, it cost about 1.4 s of one core every 10 steps while
    # the other rank waited, the same in every configuration, which pulled every ratio towards 1
    world = dist.get_world_size()
    x_mine, y_mine = x_test[rank::world], y_test[rank::world]
    steps, accuracy = 0, 0.0
    while True:
        x = torch.randn(cfg["batch"], d_in, generator=data)
        loss = torch.nn.functional.cross_entropy(ddp(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        last = steps == cfg.get("max_steps", 0)
        if steps % cfg["eval_every"] == 0 or last:
            with torch.no_grad():
                correct = (model(x_mine).argmax(1) == y_mine).sum().item()
            # [rows right, ranks out of time]: every rank sees the same sums, so all stop together
            counts = torch.tensor([float(correct), float(time.time() - started > cfg["max_seconds"])])
            dist.all_reduce(counts)
            accuracy = counts[0].item() / len(y_test)
            if accuracy >= cfg["target"] or counts[1].item() > 0 or last:
                break
    out = {"steps": steps, "accuracy": accuracy, "train_s": time.time() - started}
    if name == "auto":  # what it picked per bucket (and its size)
        from spark_dl.compression import stats

        out["picks"] = {k: (row["compressor"], row["elements"], row["times"]) for k, row in stats.choices.items()}
    return out


def _ready() -> int:
    """An untimed run's work: the process group and a DDP model, whose imports a measured run has too."""
    import torch

    import spark_dl

    spark_dl.init()
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    return 0


def warm_up() -> None:
    """Two untimed spark-dl runs before the measured ones. A Spark session's first run starts its
    ranks fresh, imports included; the runs after it fork theirs from a warm zygote, the second
    waiting for it to be ready (docs/guide/launcher.md, "Warm rank starts"). Without these the
    configuration that went first, fp32 in every run, paid for imports that the others did not."""
    from spark_dl import HorovodRunner

    for _ in range(2):
        HorovodRunner(np=2).run(_ready)


def run_config(config: str, cfg: dict) -> tuple[float, dict]:
    started = time.monotonic()
    if config == "peer":
        from pyspark.ml.torch.distributor import TorchDistributor

        out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, {**cfg,
                                                                                            "compression": "fp32"})
    else:
        from spark_dl import HorovodRunner

        out = HorovodRunner(np=2).run(train, {**cfg, "compression": config,
                                              "powersgd": powersgd_names.settings(config)})
    return time.monotonic() - started, out


def measure(link: str, configs: list[str], cfg: dict) -> list[tuple[str, float, dict]]:
    from pyspark.sql import SparkSession

    rows = []
    if link == "loopback":
        # the driver's own address: a cluster's session before (another link) left its bridge's in the conf
        spark = (SparkSession.builder.master("local[2]").appName("time-to-accuracy")
                 .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.ui.enabled", "false").getOrCreate())
        warm_up()
        for c in configs:
            rows.append((c, *run_config(c, cfg)))
        spark.stop()
        return rows
    from spark_dl.testing import cluster

    with cluster.running(workers=2, cores=1, memory_mb=2000, rate_mbit=float(link)) as c:
        # PySpark's ranks resolve the hostname to pick their interface (a loopback address here): as a
        # user of it would, name the interface; spark-dl's ranks find it themselves and keep it
        spark = c.session(**{"spark.executorEnv.GLOO_SOCKET_IFNAME": "eth0", "spark.executor.memory": "1200m",
                             "spark.ui.enabled": "false"})
        spark.sparkContext.setLogLevel("ERROR")
        deadline = time.monotonic() + 120
        while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1 < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        warm_up()
        for conf in configs:
            rows.append((conf, *run_config(conf, cfg)))
        spark.stop()
    return rows


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, data and stopping options every time-to-accuracy run takes."""
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--max-steps", type=_steps, default=0, help="stop a run after this many steps (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)


def _steps(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a whole number of steps >= 0 (0: no limit), got {text!r}")
    return int(text)


def run_settings(args: argparse.Namespace) -> dict:
    """The ranks' settings from those options; prints the header line (machine, date, commit, model)."""
    params = args.d_in * args.hidden + args.hidden * args.hidden + args.hidden * 10 + 2 * args.hidden + 10
    print(f"{platform.node()}, {os.cpu_count()} cores, {datetime.date.today()}, commit {commit()}; 2 ranks, "
          f"MLP {args.d_in}-{args.hidden}-{args.hidden}-10 ({params / 1e6:.1f}M parameters), batch {args.batch} "
          f"a rank, SGD lr {args.lr} momentum 0.9, target test accuracy {args.target}"
          + (f", at most {args.max_steps} steps a run" if args.max_steps else ""), flush=True)
    return {"d_in": args.d_in, "hidden": args.hidden, "batch": args.batch, "lr": args.lr, "target": args.target,
            "eval_every": args.eval_every, "max_seconds": args.max_seconds,
            "max_steps": args.max_steps, "seed": args.seed, "threads": 1}


def print_rows(title: str, rows: list[tuple[str, float, dict]], target: float) -> None:
    """One table: each configuration's time to target, steps, accuracy and ratios to the peer and to fp32."""
    peer = next((t for c, t, _ in rows if c == "peer"), None)
    fp32 = next((t for c, t, _ in rows if c == "fp32"), None)
    print(f"\n{title}:")
    print(f"{'configuration':<28}{'to target':>11}{'in main':>9}{'steps':>7}{'accuracy':>10}{'vs peer':>9}"
          f"{'vs fp32':>9}")
    for c, t, out in rows:
        label = "PySpark TorchDistributor" if c == "peer" else f"spark-dl DDP {c}"
        reached = "" if out["accuracy"] >= target else " (not reached)"
        print(f"{label:<28}{t:>9.1f} s{out['train_s']:>7.1f} s{out['steps']:>7}{out['accuracy']:>10.3f}"
              f"{(f'{peer / t:.2f}x' if peer else '-'):>9}{(f'{t / fp32:.2f}' if fp32 else '-'):>9}{reached}",
              flush=True)
        if out.get("picks"):  # auto: what it picked per bucket (its elements) and the probe's ms a step
            for k, (pick, n, probed) in out["picks"].items():
                timed = ", ".join(f"{cand} {secs * 1e3:.0f}" for cand, secs in probed.items())
                print(f"    {k} ({n / 1e6:.2f}M): {pick}; probe ms a step: {timed}")


def print_summary(title: str, runs: list[list[tuple[str, float, dict]]], target: float) -> None:
    """Per configuration over the seeds: mean time to target and its standard deviation, mean steps,
    the ratio of the mean time to fp32's (and to the peer's), and the range of the per-seed ratios to
    fp32. A run that missed the target counts as not reached: its configuration gets no mean."""
    configs = [c for c, _, _ in runs[0]]
    times = {c: [t if out["accuracy"] >= target else float("inf") for row in runs for c2, t, out in row if c2 == c]
             for c in configs}
    steps = {c: [out["steps"] for row in runs for c2, _, out in row if c2 == c] for c in configs}
    mean = {c: statistics.fmean(v) for c, v in times.items()}
    print(f"\n{title}, {len(runs)} seeds: mean time to target ± standard deviation, mean steps, ratio of the means")
    print(f"{'configuration':<28}{'to target':>19}{'steps':>8}{'vs peer':>9}{'vs fp32':>9}{'per seed vs fp32':>20}")
    for c in configs:
        label = "PySpark TorchDistributor" if c == "peer" else f"spark-dl DDP {c}"
        if mean[c] == float("inf"):
            print(f"{label:<28}{'not reached':>19}")
            continue
        spread = statistics.stdev(times[c]) if len(times[c]) > 1 else 0.0
        vs_peer = f"{mean['peer'] / mean[c]:.2f}x" if "peer" in mean and mean["peer"] < float("inf") else "-"
        vs_fp32, per_seed = "-", ""
        if "fp32" in mean and mean["fp32"] < float("inf"):
            vs_fp32 = f"{mean[c] / mean['fp32']:.2f}"
            ratios = [t / f for t, f in zip(times[c], times["fp32"])]
            per_seed = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(f"{label:<28}{mean[c]:>9.1f} ± {spread:>4.1f} s{statistics.fmean(steps[c]):>8.0f}{vs_peer:>9}"
              f"{vs_fp32:>9}{per_seed:>20}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="1000,100,loopback", help="Mbit/s of the shaped link, or loopback")
    parser.add_argument("--configs", default="peer,fp32,fp16,powersgd,qsgd",
                        help=f"of {','.join(CONFIGS)}; {powersgd_names.SYNTAX} for PowerSGD(rank=R, start_iter=S)")
    parser.add_argument("--seeds", default=None, help="seeds, e.g. 0,1,2: every configuration runs once per seed, "
                        "then a summary over them (default: --seed alone)")
    add_run_arguments(parser)
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if not (c in CONFIGS or powersgd_names.settings(c) is not None)]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {CONFIGS}, and {powersgd_names.SYNTAX} for PowerSGD at "
                     "a rank R >= 1 after S >= 0 uncompressed steps")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x] if args.seeds else [args.seed]
    except ValueError:
        parser.error(f"--seeds takes integers separated by commas, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds names no seed")
    cfg = run_settings(args)
    for link in [x for x in args.links.split(",") if x]:
        title = link if link == "loopback" else link + " Mbit/s"
        runs = []
        for seed in seeds:
            runs.append(measure(link, configs, {**cfg, "seed": seed}))
            print_rows(title if args.seeds is None else f"{title}, seed {seed}", runs[-1], args.target)
        if args.seeds is not None:
            print_summary(title, runs, args.target)
    print("\nin main: rank 0's time in the training function (the rest is the launch and the return); vs peer: how "
          "many times sooner than PySpark's TorchDistributor; vs fp32: time over spark-dl's DDP fp32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
