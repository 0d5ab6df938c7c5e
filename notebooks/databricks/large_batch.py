# Databricks notebook source

# MAGIC %md
# MAGIC # Error vs minibatch size: linear scaling and gradual warmup, at small scale
# MAGIC
# MAGIC Goyal et al. ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017, Figure 1 and
# MAGIC Table 2a) train ResNet-50 for a fixed number of epochs at growing minibatch sizes. With the learning
# MAGIC rate scaled linearly with the batch and a gradual warmup, the error stays flat up to 8k images per
# MAGIC batch; without them it climbs. This notebook reproduces the *shape* of that curve on a laptop:
# MAGIC scikit-learn's bundled 8x8 digits (nothing downloaded), a small MLP, 2 ranks, global batches of
# MAGIC 32, 128 and 512 images.

# COMMAND ----------

from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()                 # on Databricks: the notebook's session
print(spark.version, spark.sparkContext.master)

# COMMAND ----------

# MAGIC %md
# MAGIC ## The experiment
# MAGIC
# MAGIC Every configuration trains for the same number of **epochs**, so a batch 16x larger takes 16x fewer
# MAGIC optimizer steps, as in the paper. The base is `lr = 0.03` at a batch of 32 (momentum SGD, 0.9).
# MAGIC Three methods, from `spark_dl.train`:
# MAGIC
# MAGIC - **no-scaling**: `lr = base_lr` at every batch size (`rule="none"`);
# MAGIC - **linear**: `lr = base_lr * k` with `k = batch / 32` (`rule="linear"`), from the first step;
# MAGIC - **linear+warmup**: the same peak lr, reached by a linear ramp from `base_lr` over the first 2
# MAGIC   epochs (`LargeBatchRecipe(..., warmup_epochs=2)`, Goyal et al. §2.2).
# MAGIC
# MAGIC None of them decays the lr (`decay="none"`): each method runs at its peak lr to the end.
# MAGIC
# MAGIC Each (method, batch) runs with 2 seeds (initialization and data order). All 18 runs happen inside
# MAGIC **one** `HorovodRunner` call: the training function loops over the configurations, so Spark and the
# MAGIC process group are set up once. Each rank takes half of every global batch; `DistributedOptimizer`
# MAGIC averages the two halves' gradients, so one step is one step on the whole batch.

# COMMAND ----------

def sweep(configs, base_lr, base_batch, epochs, warmup_epochs):
    import spark_dl.horovod as hvd
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    from spark_dl.train import LargeBatchRecipe

    hvd.init()
    torch.set_num_threads(1)                                # a tiny model: one thread per rank is fastest
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]                  # a fixed split: 1437 train, 360 test
    rank, size = hvd.rank(), hvd.size()

    results = []
    for method, batch, seed in configs:
        per_rank = batch // size
        steps_per_epoch = (len(train) // size) // per_rank   # fewer steps for larger batches
        recipe = LargeBatchRecipe(
            base_lr, base_batch, per_rank_batch=per_rank, world_size=size,
            steps_per_epoch=steps_per_epoch, decay="none",   # after any warmup, peak_lr to the end
            rule="none" if method == "no-scaling" else "linear",
            warmup_epochs=warmup_epochs if method == "linear+warmup" else 0,
        )
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=recipe.peak_lr, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        scheduler = recipe.scheduler(optimizer)
        shuffle = torch.Generator().manual_seed(seed)       # the same permutation on every rank
        for epoch in range(epochs):
            mine = train[torch.randperm(len(train), generator=shuffle)][rank::size]
            for step in range(steps_per_epoch):
                idx = mine[step * per_rank:(step + 1) * per_rank]
                optimizer.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                optimizer.step()
                scheduler.step()
        with torch.no_grad():
            error = (model(x[test]).argmax(dim=1) != y[test]).float().mean().item()
        results.append({"method": method, "batch": batch, "seed": seed, "peak_lr": recipe.peak_lr,
                        "steps": steps_per_epoch * epochs,
                        "error": error if error == error else 1.0})   # a diverged (NaN) run counts as 100%
    return results

# COMMAND ----------

# MAGIC %md
# MAGIC ## Run all 18 configurations on 2 ranks
# MAGIC
# MAGIC 10 epochs each; about a minute on 2 cores.

# COMMAND ----------

# MAGIC %md
# MAGIC `tracking=False` keeps these runs out of MLflow, so running the notebook writes no `mlflow.db` or
# MAGIC `mlruns/`. Drop it (or pass `tracking=True`) to log every `run()` as one MLflow run in the current
# MAGIC experiment; on Databricks that is the notebook's experiment.

# COMMAND ----------

import time

from spark_dl import HorovodRunner

METHODS = ["no-scaling", "linear", "linear+warmup"]
BATCHES = [32, 128, 512]
SEEDS = [0, 1]
configs = [(m, b, s) for m in METHODS for b in BATCHES for s in SEEDS]

start = time.time()
runs = HorovodRunner(np=2, tracking=False).run(
    sweep, configs=configs, base_lr=0.03, base_batch=32, epochs=10, warmup_epochs=2,
)
print(f"{len(runs)} runs in {time.time() - start:.1f} s")

# COMMAND ----------

# MAGIC %md
# MAGIC ## The table
# MAGIC
# MAGIC Test error on the 360 held-out images, mean and standard deviation over the 2 seeds.

# COMMAND ----------

import numpy as np

table = {}
print(f"{'method':14s} {'batch':>5s} {'steps':>5s} {'peak lr':>7s}   test error (mean ± std)")
for m in METHODS:
    for b in BATCHES:
        rs = [r for r in runs if r["method"] == m and r["batch"] == b]
        errors = np.array([r["error"] for r in rs])
        table[m, b] = (errors.mean(), errors.std())
        print(f"{m:14s} {b:5d} {rs[0]['steps']:5d} {rs[0]['peak_lr']:7.3f}   "
              f"{errors.mean():.3f} ± {errors.std():.3f}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## The plot
# MAGIC
# MAGIC What to look for (Goyal et al., Figure 1): at batch 32 the three methods coincide (`k = 1`). As the
# MAGIC batch grows with the epochs fixed, **no-scaling** takes fewer steps of the same size and its error
# MAGIC climbs. **Linear** scaling gives back the step size, but at the largest batch the big lr from step
# MAGIC 0 can hurt. **Linear+warmup** keeps the error close to the small-batch error.

# COMMAND ----------

import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 4))
for m in METHODS:
    mean = [table[m, b][0] for b in BATCHES]
    std = [table[m, b][1] for b in BATCHES]
    ax.errorbar(BATCHES, mean, yerr=std, marker="o", capsize=4, label=m)
ax.set_xscale("log", base=2)
ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
ax.set_xlabel("global minibatch size")
ax.set_ylabel("test error")
ax.set_title("digits MLP, 10 epochs, 2 ranks")
ax.legend()
fig.tight_layout()
plt.show()

# COMMAND ----------

import os

# Stop the embedded Spark; on Databricks the session belongs to the cluster, so leave it running.
if "DATABRICKS_RUNTIME_VERSION" not in os.environ:
    spark.stop()
