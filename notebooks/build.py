"""Build the example notebooks and their Databricks source exports from one definition.

    python notebooks/build.py

writes ``notebooks/<name>.ipynb`` (no outputs) and ``notebooks/databricks/<name>.py`` (Databricks
source format: ``# Databricks notebook source``, cells separated by ``# COMMAND ----------``,
markdown as ``# MAGIC %md`` lines). A code cell may carry a Databricks variant: there the notebook
already has a SparkSession, so the export gets it with ``SparkSession.builder.getOrCreate()``.
IPython magics (``%matplotlib inline``) are dropped from the exports; Databricks shows figures
without them. Every notebook and its export have the same code cells, in the same order.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
DATABRICKS_HEADER = "# Databricks notebook source"
DATABRICKS_SEP = "# COMMAND ----------"


@dataclass
class Cell:
    kind: str                     # "markdown" or "code"
    source: str
    databricks: str | None = None  # the export's source, when it differs


def md(text: str) -> Cell:
    return Cell("markdown", text.strip("\n"))


def code(text: str, databricks: str | None = None) -> Cell:
    """A code cell; its Databricks variant is ``databricks``, or by default the same code without
    IPython magics (``%matplotlib inline``), which a Databricks source file cannot hold."""
    text = text.strip("\n")
    if databricks is None and any(line.startswith("%") for line in text.splitlines()):
        databricks = "\n".join(line for line in text.splitlines() if not line.startswith("%"))
    return Cell("code", text, databricks.strip("\n") if databricks is not None else None)


def session_cell(app: str) -> Cell:
    """Local: an embedded Spark on 2 cores. Databricks: the notebook's own session."""
    return code(
        f'''
import os, sys
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)   # ranks run this kernel's Python
from pyspark.sql import SparkSession

spark = (
    SparkSession.builder.master("local[2]")                # 2 task slots: room for np=2
    .appName("{app}")
    .config("spark.ui.showConsoleProgress", "false")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
print(spark.version, spark.sparkContext.master)
''',
        databricks='''
from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()                 # on Databricks: the notebook's session
print(spark.version, spark.sparkContext.master)
''',
    )


TRACKING_NOTE = md('''
`tracking=False` keeps these runs out of MLflow, so running the notebook writes no `mlflow.db` or
`mlruns/`. Drop it (or pass `tracking=True`) to log every `run()` as one MLflow run in the current
experiment; on Databricks that is the notebook's experiment.
''')

STOP_CELL = code('''
# Stop the embedded Spark; on Databricks the session belongs to the cluster, so leave it running.
if "DATABRICKS_RUNTIME_VERSION" not in os.environ:
    spark.stop()
''', databricks='''
import os

# Stop the embedded Spark; on Databricks the session belongs to the cluster, so leave it running.
if "DATABRICKS_RUNTIME_VERSION" not in os.environ:
    spark.stop()
''')


QUICKSTART = [
    md('''
# spark-dl quick start

Write one training function, run it on `np` ranks in a Spark **barrier stage** with
`HorovodRunner(np=2).run(main, **kwargs)`, and get rank 0's return value back. This notebook runs
as-is on an embedded local Spark (`local[2]`), and on a Databricks cluster with `spark-dl`
installed (`%pip install spark-dl`) and at least 2 task slots.
'''),
    md('''
## A SparkSession

`HorovodRunner` launches on the active SparkSession. Here: an embedded Spark with 2 cores, so 2
task slots, enough for `np=2`. Each rank is a fresh Python process started by its Spark task.
'''),
    session_cell("spark-dl quickstart"),
    md('''
## A training function

`main` runs on every rank. `spark_dl.init()` sets up the default `torch.distributed` process group
(Gloo on CPU, NCCL on a GPU) from the environment the launcher gives each rank; DDP all-reduces
the gradients. `spark_dl.log_to_driver` shows a message on the driver, here below the cell.
'''),
    code('''
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
'''),
    md('''
## Run it on 2 ranks

`run` blocks until every rank has finished and returns rank 0's return value (`run_all` returns
every rank's, in rank order).
'''),
    TRACKING_NOTE,
    code('''
from spark_dl import HorovodRunner

result = HorovodRunner(np=2, tracking=False).run(main, lr=0.05)
print("result:", result)
'''),
    md('''
## Every rank's output on the driver

By default the driver shows only `spark_dl.log_to_driver` messages. With
`driver_log_verbosity="all"` every line a rank prints to stdout or stderr is streamed live, tagged
`[rank]<stdout>:` / `[rank]<stderr>:`.
'''),
    code('''
def chatty(n):
    import spark_dl
    spark_dl.init()
    ctx = spark_dl.get_context()
    for i in range(n):
        print(f"hello {i} from rank {ctx.rank} of {ctx.world_size}")
    return ctx.rank

print("returned:", HorovodRunner(np=2, driver_log_verbosity="all", tracking=False).run(chatty, n=3))
'''),
    md('''
## Coming from PySpark's `TorchDistributor`

`spark_dl.TorchDistributor` takes PySpark's arguments (`num_processes`, `local_mode`, `use_gpu`)
and runs the same training functions (positional arguments, `init_process_group` from torchrun's
environment) and scripts: switch the import. Every process's output is streamed, as PySpark does.
'''),
    code('''
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
'''),
    md('''
## When a rank fails

An exception in any rank stops the other ranks and is raised on the driver as
`spark_dl.RankFailed`, carrying the failed rank, its host, the exception type, the remote traceback
and the rank's last output lines.
'''),
    code('''
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
    print("\\n".join(e.last_lines))
    print("cause:", repr(e.__cause__))
'''),
    STOP_CELL,
]


COMPRESSION = [
    md('''
# Gradient compression on the digits CNN

Train the same small CNN (scikit-learn's 8x8 digits, nothing downloaded) on 2 ranks with five
gradient compressors from `spark_dl.compression`, and compare the test accuracy each reaches with
the bytes each rank sent. The training function is the packaged
`spark_dl.examples.digits.train_digits`: Horovod-style, with `spark_dl.horovod`'s
`DistributedOptimizer(compression=...)`.
'''),
    session_cell("spark-dl compression"),
    md('''
## Count the bytes

`train_digits` returns accuracy and loss. `spark_dl.compression.stats` counts, per process, the
bytes this rank sent (`bytes_sent`) and what an uncompressed ring all-reduce would have sent
(`bytes_dense`). A small wrapper resets the counters, trains, and returns both together.
It is defined in the notebook, so it is shipped to the ranks by value; `train_digits` is imported
from the installed package on each rank.
'''),
    code('''
def train_and_count(compression, epochs):
    from spark_dl.compression import stats
    from spark_dl.examples.digits import train_digits

    stats.reset()
    result = train_digits(epochs=epochs, compression=compression)
    return {**result, **stats.snapshot(), "compression": compression}
'''),
    md('''
## Train with each compressor

`none` (fp32), `fp16` (half precision), `qsgd` (4-bit stochastic quantization), `onebit` (1-bit SGD
with error feedback) and `powersgd` (rank-8 low-rank approximation with error feedback). 3 epochs
each keep the whole loop around a minute on 2 cores; accuracies of the lossier compressors catch
up with more epochs.
'''),
    TRACKING_NOTE,
    code('''
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
'''),
    md('''
## Plot

Left: test accuracy on the 360 held-out images. Right: megabytes rank 0 sent for all gradient
all-reduces of the run (log scale).
'''),
    code('''
%matplotlib inline
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
'''),
    STOP_CELL,
]


DATAFRAME = [
    md('''
# Training on a Spark DataFrame

Build a DataFrame from scikit-learn's digits (64 pixels as an `array<float>` column, the label as
`long`), and train on it with `spark_dl.data.shards(df, ...)`: each barrier task streams its
partition to its executor's local disk, and its rank gets a `Shards` object whose
`batches(batch_size, epoch)` yields equal, globally shuffled batches of tensors. No detour through
the driver.
'''),
    session_cell("spark-dl dataframe"),
    md('''
## The DataFrame

A fixed train/test split: 1437 training rows for the ranks, 360 test rows evaluated on the driver.
'''),
    code('''
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
'''),
    md('''
## The training function

`data` arrives on each rank as a `spark_dl.data.Shards`: `len(data)` is this rank's number of rows
per epoch (the same on every rank), and `data.batches(...)` yields `{"pixels": float tensor (B, 64),
"label": long tensor (B,)}`. Rank 0 reports each epoch's last batch loss and returns the trained
weights.
'''),
    code('''
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
'''),
    md('''
## Train on 2 ranks

Pass `shards(df, columns)` as any keyword argument of `run`. `remainder="drop"` (the default) drops
the last `N mod np` rows of each epoch so every rank has the same number of batches.
'''),
    TRACKING_NOTE,
    code('''
from spark_dl import HorovodRunner
from spark_dl.data import shards

state = HorovodRunner(np=2, tracking=False).run(
    main, data=shards(train_df, ["pixels", "label"], seed=0), epochs=10, lr=0.01,
)
'''),
    md('''
## Evaluate on the driver

Load the returned weights into the same model and score the held-out rows.
'''),
    code('''
import torch

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
model.load_state_dict(state)
test = test_df.toPandas()
x = torch.tensor(np.stack(test["pixels"].to_numpy()), dtype=torch.float32)
y = torch.tensor(test["label"].to_numpy())
with torch.no_grad():
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
print(f"test accuracy: {accuracy:.4f}")
'''),
    md('''
## The same with `TorchEstimator`: fit, early stopping, transform

Horovod's Spark ML-style estimator does the loop above for you: `fit(df)` trains on the DataFrame's
columns across `num_proc` ranks, here holding a tenth of the rows out and stopping once their loss
has not improved for two epochs (`EarlyStopping`); `transform(df)` adds the model's outputs as a
column, computed on the executors.
'''),
    code('''
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
'''),
    STOP_CELL,
]

LARGE_BATCH = [
    md("""
# Error vs minibatch size: linear scaling and gradual warmup, at small scale

Goyal et al. ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017, Figure 1 and
Table 2a) train ResNet-50 for a fixed number of epochs at growing minibatch sizes. With the learning
rate scaled linearly with the batch and a gradual warmup, the error stays flat up to 8k images per
batch; without them it climbs. This notebook reproduces the *shape* of that curve on a laptop:
scikit-learn's bundled 8x8 digits (nothing downloaded), a small MLP, 2 ranks, global batches of
32, 128 and 512 images.
"""),
    session_cell("spark-dl large batch"),
    md("""
## The experiment

Every configuration trains for the same number of **epochs**, so a batch 16x larger takes 16x fewer
optimizer steps, as in the paper. The base is `lr = 0.03` at a batch of 32 (momentum SGD, 0.9).
Three methods, from `spark_dl.train`:

- **no-scaling**: `lr = base_lr` at every batch size (`rule="none"`);
- **linear**: `lr = base_lr * k` with `k = batch / 32` (`rule="linear"`), from the first step;
- **linear+warmup**: the same peak lr, reached by a linear ramp from `base_lr` over the first 2
  epochs (`LargeBatchRecipe(..., warmup_epochs=2)`, Goyal et al. §2.2).

None of them decays the lr (`decay="none"`): each method runs at its peak lr to the end.

Each (method, batch) runs with 2 seeds (initialization and data order). All 18 runs happen inside
**one** `HorovodRunner` call: the training function loops over the configurations, so Spark and the
process group are set up once. Each rank takes half of every global batch; `DistributedOptimizer`
averages the two halves' gradients, so one step is one step on the whole batch.
"""),
    code("""
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
"""),
    md("""
## Run all 18 configurations on 2 ranks

10 epochs each; about a minute on 2 cores.
"""),
    TRACKING_NOTE,
    code("""
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
"""),
    md("""
## The table

Test error on the 360 held-out images, mean and standard deviation over the 2 seeds.
"""),
    code("""
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
"""),
    md("""
## The plot

What to look for (Goyal et al., Figure 1): at batch 32 the three methods coincide (`k = 1`). As the
batch grows with the epochs fixed, **no-scaling** takes fewer steps of the same size and its error
climbs. **Linear** scaling gives back the step size, but at the largest batch the big lr from step
0 can hurt. **Linear+warmup** keeps the error close to the small-batch error.
"""),
    code("""
%matplotlib inline
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
"""),
    STOP_CELL,
]

NOTEBOOKS: dict[str, list[Cell]] = {
    "quickstart": QUICKSTART,
    "compression": COMPRESSION,
    "dataframe": DATAFRAME,
    "large_batch": LARGE_BATCH,
}


def to_ipynb(cells: list[Cell]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, c in enumerate(cells):
        new = nbformat.v4.new_markdown_cell if c.kind == "markdown" else nbformat.v4.new_code_cell
        cell = new(c.source)
        cell["id"] = f"cell-{i}"  # stable ids: rebuilding leaves unchanged notebooks byte-identical
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def to_databricks(cells: list[Cell]) -> str:
    blocks = []
    for c in cells:
        if c.kind == "markdown":
            blocks.append("\n".join(["# MAGIC %md"] + [f"# MAGIC {line}".rstrip() for line in c.source.splitlines()]))
        else:
            src = c.databricks if c.databricks is not None else c.source
            lines = [line for line in src.splitlines() if not line.lstrip().startswith("%")]
            blocks.append("\n".join(lines).strip("\n"))
    return DATABRICKS_HEADER + "\n\n" + f"\n\n{DATABRICKS_SEP}\n\n".join(blocks) + "\n"


def build(out: Path = HERE) -> list[Path]:
    written = []
    (out / "databricks").mkdir(parents=True, exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        ipynb = out / f"{name}.ipynb"
        nbformat.write(to_ipynb(cells), str(ipynb))
        py = out / "databricks" / f"{name}.py"
        py.write_text(to_databricks(cells))
        written += [ipynb, py]
    return written


if __name__ == "__main__":
    for path in build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
