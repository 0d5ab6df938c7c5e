# Databricks notebook source

# MAGIC %md
# MAGIC # Gradient compression on the digits CNN
# MAGIC
# MAGIC Train the same small CNN (scikit-learn's 8x8 digits, nothing downloaded) on 2 ranks with five
# MAGIC gradient compressors from `spark_dl.compression`, and compare the test accuracy each reaches with
# MAGIC the bytes each rank sent. The training function is the packaged
# MAGIC `spark_dl.examples.digits.train_digits`: Horovod-style, with `spark_dl.horovod`'s
# MAGIC `DistributedOptimizer(compression=...)`.

# COMMAND ----------

from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()                 # on Databricks: the notebook's session
print(spark.version, spark.sparkContext.master)

# COMMAND ----------

# MAGIC %md
# MAGIC ## Count the bytes
# MAGIC
# MAGIC `train_digits` returns accuracy and loss. `spark_dl.compression.stats` counts, per process, the
# MAGIC bytes this rank sent (`bytes_sent`) and what an uncompressed ring all-reduce would have sent
# MAGIC (`bytes_dense`). A small wrapper resets the counters, trains, and returns both together.
# MAGIC It is defined in the notebook, so it is shipped to the ranks by value; `train_digits` is imported
# MAGIC from the installed package on each rank.

# COMMAND ----------

def train_and_count(compression, epochs):
    from spark_dl.compression import stats
    from spark_dl.examples.digits import train_digits

    stats.reset()
    result = train_digits(epochs=epochs, compression=compression)
    return {**result, **stats.snapshot(), "compression": compression}

# COMMAND ----------

# MAGIC %md
# MAGIC ## Train with each compressor
# MAGIC
# MAGIC `none` (fp32), `fp16` (half precision), `qsgd` (4-bit stochastic quantization), `onebit` (1-bit SGD
# MAGIC with error feedback) and `powersgd` (rank-8 low-rank approximation with error feedback). 3 epochs
# MAGIC each keep the whole loop around a minute on 2 cores; accuracies of the lossier compressors catch
# MAGIC up with more epochs.

# COMMAND ----------

# MAGIC %md
# MAGIC `tracking=False` keeps these runs out of MLflow, so running the notebook writes no `mlflow.db` or
# MAGIC `mlruns/`. Drop it (or pass `tracking=True`) to log every `run()` as one MLflow run in the current
# MAGIC experiment; on Databricks that is the notebook's experiment.

# COMMAND ----------

import time

from spark_dl import HorovodRunner

EPOCHS = 3
COMPRESSORS = ["none", "fp16", "qsgd", "onebit", "powersgd"]

results = []
for name in COMPRESSORS:
    start = time.time()
    r = HorovodRunner(np=2, tracking=False).run(train_and_count, compression=name, epochs=EPOCHS)
    results.append(r)
    print(f"{name:9s} accuracy {r['accuracy']:.3f}  sent {r['bytes_sent'] / 1e6:6.2f} MB "
          f"({r['bytes_dense'] / r['bytes_sent']:5.1f}x less than fp32)  {time.time() - start:4.1f} s")

# COMMAND ----------

# MAGIC %md
# MAGIC ## Plot
# MAGIC
# MAGIC Left: test accuracy on the 360 held-out images. Right: megabytes rank 0 sent for all gradient
# MAGIC all-reduces of the run (log scale).

# COMMAND ----------

import matplotlib.pyplot as plt

names = [r["compression"] for r in results]
fig, (ax_acc, ax_bytes) = plt.subplots(1, 2, figsize=(10, 3.5))
ax_acc.bar(names, [r["accuracy"] for r in results], color="tab:blue")
ax_acc.set_ylim(0, 1)
ax_acc.set_ylabel("test accuracy")
ax_acc.set_title(f"accuracy after {EPOCHS} epochs")
ax_bytes.bar(names, [r["bytes_sent"] / 1e6 for r in results], color="tab:orange")
ax_bytes.set_yscale("log")
ax_bytes.set_ylabel("MB sent per rank")
ax_bytes.set_title("gradient bytes sent")
fig.tight_layout()
plt.show()

# COMMAND ----------

import os

# Stop the embedded Spark; on Databricks the session belongs to the cluster, so leave it running.
if "DATABRICKS_RUNTIME_VERSION" not in os.environ:
    spark.stop()
