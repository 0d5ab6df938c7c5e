"""Runs HorovodRunner on a SparkSession whose configuration the shared test sessions cannot have.
Each mode starts its own JVM, so it runs as a subprocess: python special_sessions.py MODE."""
import json
import os
import sys
import tempfile

from pyspark.sql import SparkSession

from spark_dl import HorovodRunner, LaunchRefused, TorchDistributor


def gpu_discovery_script(n: int = 2) -> str:
    """Spark runs this on the worker to find its GPUs: ``n`` pretend GPUs, '0', '1', ..."""
    fd, path = tempfile.mkstemp(suffix=".sh")
    addresses = json.dumps({"name": "gpu", "addresses": [str(i) for i in range(n)]})
    with os.fdopen(fd, "w") as f:
        f.write(f"#!/bin/sh\necho '{addresses}'\n")
    os.chmod(path, 0o755)
    return path


def session(**conf):
    b = (SparkSession.builder.master(conf.pop("master"))
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.executor.memory", "768m"))
    for k, v in conf.items():
        b = b.config(k.replace("_", "."), v)
    s = b.getOrCreate()
    s.sparkContext.setLogLevel("ERROR")
    return s


def gpu_env():
    import os

    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "SPARK_DL_CUDA_DEVICE",
            "OMP_NUM_THREADS")
    return {**{k: os.environ.get(k) for k in keys}, "task_pid": int(os.environ["SPARK_DL_TASK_PID"])}


def make_train_ddp():
    """Nested, so both launchers pickle it by value (PySpark's workers cannot import this module)."""

    def train_ddp(lr, steps=20):
        """A deterministic DDP run: the same parameters whichever launcher runs it."""
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for _ in range(steps):
            x = torch.randn(8, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        state = [p.detach().tolist() for p in model.parameters()]
        dist.destroy_process_group()
        return state

    return train_ddp


def gathered_gpu_env():
    """Every rank's gpu_env(), gathered over the process group the TorchDistributor way."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, gpu_env())
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("gpu"):
        script = gpu_discovery_script()
        session(**{"master": "local-cluster[1,2,1024]",
                   "spark.worker.resource.gpu.amount": "2",
                   "spark.worker.resource.gpu.discoveryScript": script,
                   "spark.executor.resource.gpu.amount": "2",
                   "spark.task.resource.gpu.amount": mode[3:]})
        print("RESULT " + json.dumps(HorovodRunner(np=2).run_all(gpu_env)), flush=True)
    elif mode == "distributor":  # two tasks' worth of GPUs each (4 pretend GPUs, 2 per task)
        session(**{"master": "local-cluster[1,2,1024]",
                   "spark.worker.resource.gpu.amount": "4",
                   "spark.worker.resource.gpu.discoveryScript": gpu_discovery_script(4),
                   "spark.executor.resource.gpu.amount": "4",
                   "spark.task.resource.gpu.amount": "2"})
        on_gpus = TorchDistributor(num_processes=2, local_mode=False, use_gpu=True).run(gathered_gpu_env)
        on_cpus = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(gathered_gpu_env)
        print("RESULT " + json.dumps({"use_gpu": on_gpus, "no_gpu": on_cpus}), flush=True)
    elif mode == "pyspark-distributor":
        # PySpark's own class runs here, not in the shared test session: a torchrun worker of theirs
        # that aborts at exit leaves torchrun in its 300 s exit barrier, and the test's timeout
        # would then interrupt a py4j call of the shared gateway (every later Spark test failing).
        from pyspark.ml.torch.distributor import TorchDistributor as PySparkTorchDistributor

        session(master="local[2]")
        train_ddp = make_train_ddp()
        theirs = PySparkTorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train_ddp, 0.05)
        print("THEIRS " + json.dumps(theirs), flush=True)
        ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train_ddp, 0.05)
        print("RESULT " + json.dumps({"theirs": theirs, "ours": ours}), flush=True)
    elif mode == "dynalloc":
        session(**{"master": "local-cluster[1,1,1024]",
                   "spark.dynamicAllocation.enabled": "true",
                   "spark.dynamicAllocation.shuffleTracking.enabled": "true"})
        try:
            HorovodRunner(np=1).run(gpu_env)
        except LaunchRefused as e:
            print("REFUSED " + str(e), flush=True)
