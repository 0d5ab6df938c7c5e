# Databricks notebook source

# MAGIC %md
# MAGIC # Training on a Spark DataFrame
# MAGIC
# MAGIC Build a DataFrame from scikit-learn's digits (64 pixels as an `array<float>` column, the label as
# MAGIC `long`), and train on it with `spark_dl.data.shards(df, ...)`: each barrier task streams its
# MAGIC partition to its executor's local disk, and its rank gets a `Shards` object whose
# MAGIC `batches(batch_size, epoch)` yields equal, globally shuffled batches of tensors. No detour through
# MAGIC the driver.

# COMMAND ----------

from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()                 # on Databricks: the notebook's session
print(spark.version, spark.sparkContext.master)

# COMMAND ----------

# MAGIC %md
# MAGIC ## The DataFrame
# MAGIC
# MAGIC A fixed train/test split: 1437 training rows for the ranks, 360 test rows evaluated on the driver.

# COMMAND ----------

import numpy as np
from sklearn.datasets import load_digits

digits = load_digits()
pixels = (digits.data / 16.0).astype("float32")            # 8x8 images, scaled to [0, 1]
order = np.random.default_rng(0).permutation(len(pixels))
test_idx, train_idx = order[:360], order[360:]


def to_df(idx):
    rows = [(pixels[i].tolist(), int(digits.target[i])) for i in idx]
    return spark.createDataFrame(rows, "pixels array<float>, label long")


train_df, test_df = to_df(train_idx), to_df(test_idx)
train_df.printSchema()
print(train_df.count(), "training rows,", test_df.count(), "test rows")

# COMMAND ----------

# MAGIC %md
# MAGIC ## The training function
# MAGIC
# MAGIC `data` arrives on each rank as a `spark_dl.data.Shards`: `len(data)` is this rank's number of rows
# MAGIC per epoch (the same on every rank), and `data.batches(...)` yields `{"pixels": float tensor (B, 64),
# MAGIC "label": long tensor (B,)}`. Rank 0 reports each epoch's last batch loss and returns the trained
# MAGIC weights.

# COMMAND ----------

def main(data, epochs, lr):
    import torch
    import torch.nn.functional as F

    import spark_dl

    spark_dl.init()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    ))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        for batch in data.batches(batch_size=32, epoch=epoch):
            loss = F.cross_entropy(model(batch["pixels"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if spark_dl.get_context().rank == 0:
            spark_dl.log_to_driver(f"epoch {epoch}: loss {loss.item():.3f} ({len(data)} rows on this rank)")
    return model.module.state_dict()

# COMMAND ----------

# MAGIC %md
# MAGIC ## Train on 2 ranks
# MAGIC
# MAGIC Pass `shards(df, columns)` as any keyword argument of `run`. `remainder="drop"` (the default) drops
# MAGIC the last `N mod np` rows of each epoch so every rank has the same number of batches.

# COMMAND ----------

# MAGIC %md
# MAGIC `tracking=False` keeps these runs out of MLflow, so running the notebook writes no `mlflow.db` or
# MAGIC `mlruns/`. Drop it (or pass `tracking=True`) to log every `run()` as one MLflow run in the current
# MAGIC experiment; on Databricks that is the notebook's experiment.

# COMMAND ----------

from spark_dl import HorovodRunner
from spark_dl.data import shards

state = HorovodRunner(np=2, tracking=False).run(
    main, data=shards(train_df, ["pixels", "label"], seed=0), epochs=10, lr=0.01,
)

# COMMAND ----------

# MAGIC %md
# MAGIC ## Evaluate on the driver
# MAGIC
# MAGIC Load the returned weights into the same model and score the held-out rows.

# COMMAND ----------

import torch

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
model.load_state_dict(state)
test = test_df.toPandas()
x = torch.tensor(np.stack(test["pixels"].to_numpy()), dtype=torch.float32)
y = torch.tensor(test["label"].to_numpy())
with torch.no_grad():
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
print(f"test accuracy: {accuracy:.4f}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## The same with `TorchEstimator`: fit, early stopping, transform
# MAGIC
# MAGIC Horovod's Spark ML-style estimator does the loop above for you: `fit(df)` trains on the DataFrame's
# MAGIC columns across `num_proc` ranks, here holding a tenth of the rows out and stopping once their loss
# MAGIC has not improved for two epochs (`EarlyStopping`); `transform(df)` adds the model's outputs as a
# MAGIC column, computed on the executors.

# COMMAND ----------

import functools

from spark_dl.estimator import EarlyStopping, TorchEstimator


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


torch.manual_seed(0)
estimator = TorchEstimator(
    model=torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)),
    optimizer=functools.partial(torch.optim.Adam, lr=0.01), loss=torch.nn.functional.cross_entropy,
    feature_cols="pixels", label_cols="label", batch_size=32, epochs=50, num_proc=2,
    validation=0.1, metrics=[accuracy], callbacks=[EarlyStopping(monitor="val_loss", patience=2)],
    tracking=False,
)
fitted = estimator.fit(train_df)
history = fitted.getHistory()
print(f"stopped after {len(history['loss'])} of 50 epochs; held-out accuracy {history['val_accuracy'][-1]:.3f}")
predicted = fitted.transform(test_df).toPandas()
hits = [int(np.argmax(p)) == label for p, label in zip(predicted["prediction"], predicted["label"])]
print(f"estimator test accuracy: {np.mean(hits):.4f}")

# COMMAND ----------

import os

# Stop the embedded Spark; on Databricks the session belongs to the cluster, so leave it running.
if "DATABRICKS_RUNTIME_VERSION" not in os.environ:
    spark.stop()
