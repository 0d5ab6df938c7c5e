# Databricks notebook source

# MAGIC %md
# MAGIC # spark-dl quick start
# MAGIC
# MAGIC Write one training function, run it on `np` ranks in a Spark **barrier stage** with
# MAGIC `HorovodRunner(np=2).run(main, **kwargs)`, and get rank 0's return value back. This notebook runs
# MAGIC as-is on an embedded local Spark (`local[2]`), and on a Databricks cluster with `spark-dl`
# MAGIC installed (`%pip install spark-dl`) and at least 2 task slots.

# COMMAND ----------

# MAGIC %md
# MAGIC ## A SparkSession
# MAGIC
# MAGIC `HorovodRunner` launches on the active SparkSession. Here: an embedded Spark with 2 cores, so 2
# MAGIC task slots, enough for `np=2`. Each rank is a fresh Python process started by its Spark task.

# COMMAND ----------

from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()                 # on Databricks: the notebook's session
print(spark.version, spark.sparkContext.master)

# COMMAND ----------

# MAGIC %md
# MAGIC ## A training function
# MAGIC
# MAGIC `main` runs on every rank. `spark_dl.init()` sets up the default `torch.distributed` process group
# MAGIC (Gloo on CPU, NCCL on a GPU) from the environment the launcher gives each rank; DDP all-reduces
# MAGIC the gradients. `spark_dl.log_to_driver` shows a message on the driver, here below the cell.

# COMMAND ----------

def main(lr, steps=100):
    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr * dist.get_world_size())
    for step in range(steps):
        x = torch.randn(32, 10)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    spark_dl.log_to_driver(f"rank {dist.get_rank()} done, loss {loss.item():.4f}")
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "loss": loss.item()}

# COMMAND ----------

# MAGIC %md
# MAGIC ## Run it on 2 ranks
# MAGIC
# MAGIC `run` blocks until every rank has finished and returns rank 0's return value (`run_all` returns
# MAGIC every rank's, in rank order).

# COMMAND ----------

# MAGIC %md
# MAGIC `tracking=False` keeps these runs out of MLflow, so running the notebook writes no `mlflow.db` or
# MAGIC `mlruns/`. Drop it (or pass `tracking=True`) to log every `run()` as one MLflow run in the current
# MAGIC experiment; on Databricks that is the notebook's experiment.

# COMMAND ----------

from spark_dl import HorovodRunner

result = HorovodRunner(np=2, tracking=False).run(main, lr=0.05)
print("result:", result)

# COMMAND ----------

# MAGIC %md
# MAGIC ## Every rank's output on the driver
# MAGIC
# MAGIC By default the driver shows only `spark_dl.log_to_driver` messages. With
# MAGIC `driver_log_verbosity="all"` every line a rank prints to stdout or stderr is streamed live, tagged
# MAGIC `[rank]<stdout>:` / `[rank]<stderr>:`.

# COMMAND ----------

def chatty(n):
    import spark_dl
    spark_dl.init()
    ctx = spark_dl.get_context()
    for i in range(n):
        print(f"hello {i} from rank {ctx.rank} of {ctx.world_size}")
    return ctx.rank

print("returned:", HorovodRunner(np=2, driver_log_verbosity="all", tracking=False).run(chatty, n=3))

# COMMAND ----------

# MAGIC %md
# MAGIC ## Coming from PySpark's `TorchDistributor`
# MAGIC
# MAGIC `spark_dl.TorchDistributor` takes PySpark's arguments (`num_processes`, `local_mode`, `use_gpu`)
# MAGIC and runs the same training functions (positional arguments, `init_process_group` from torchrun's
# MAGIC environment) and scripts: switch the import. Every process's output is streamed, as PySpark does.

# COMMAND ----------

from spark_dl import TorchDistributor  # was: from pyspark.ml.torch.distributor import TorchDistributor


def train(learning_rate):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()}: all-reduced {t.item()}")
    dist.destroy_process_group()
    return t.item() * learning_rate


print("returned:", TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking=False).run(train, 0.5))

# COMMAND ----------

# MAGIC %md
# MAGIC ## When a rank fails
# MAGIC
# MAGIC An exception in any rank stops the other ranks and is raised on the driver as
# MAGIC `spark_dl.RankFailed`, carrying the failed rank, its host, the exception type, the remote traceback
# MAGIC and the rank's last output lines.

# COMMAND ----------

import spark_dl


def flaky():
    import spark_dl
    spark_dl.init()
    rank = spark_dl.get_context().rank
    print(f"rank {rank} starting")
    if rank == 1:
        raise ValueError("rank 1 ran out of luck")
    return rank


try:
    HorovodRunner(np=2, tracking=False).run(flaky)
except spark_dl.RankFailed as e:
    print("failed rank:", e.rank, "| exception:", e.exc_type)
    print("its last lines:")
    print("\n".join(e.last_lines))
    print("cause:", repr(e.__cause__))

# COMMAND ----------

import os

# Stop the embedded Spark; on Databricks the session belongs to the cluster, so leave it running.
if "DATABRICKS_RUNTIME_VERSION" not in os.environ:
    spark.stop()
