"""The main demo: ``python -m spark_dl.demo [--np 2] [--epochs 5]``.

Starts an embedded local Spark, trains a small classifier with DistributedDataParallel on
``np`` ranks in one barrier stage, and prints rank 0's result. Needs only spark-dl's own
dependencies: the data is generated, not downloaded.
"""
from __future__ import annotations

import argparse
import time


def train(epochs: int, lr: float, batch_size: int, seed: int = 0) -> dict:
    """A training function, written as a user would: plain torch.distributed + DDP."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spark_dl

    spark_dl.init()
    ctx = spark_dl.get_context()
    g = torch.Generator().manual_seed(seed)  # every rank makes the same data set...
    centers = torch.randn(4, 20, generator=g) * 0.7
    labels = torch.randint(0, 4, (4096,), generator=g)
    x = centers[labels] + torch.randn(4096, 20, generator=g)
    train_x, train_y, test_x, test_y = x[:3584], labels[:3584], x[3584:], labels[3584:]
    shard = slice(ctx.rank, None, ctx.world_size)  # ...and trains on its own shard
    xs, ys = train_x[shard], train_y[shard]

    torch.manual_seed(seed)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=lr * ctx.world_size, momentum=0.9)  # linear scaling
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(0, len(xs), batch_size):
            idx = perm[i : i + batch_size]
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            spark_dl.log_metrics({"loss": loss.item()}, step=step)  # to the driver's MLflow run: cheap
            step += 1
        spark_dl.log_to_driver(f"epoch {epoch}: loss {loss.item():.4f}")
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    return {"world_size": ctx.world_size, "final_loss": loss.item(), "test_accuracy": accuracy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks (Spark tasks); negative: local processes")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    from spark_dl import HorovodRunner

    spark = None
    if args.np > 0:
        spark = (
            SparkSession.builder.master(f"local[{max(2, args.np)}]")
            .appName("spark-dl demo")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
    start = time.monotonic()
    result = HorovodRunner(np=args.np).run(train, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size)
    print(f"trained on {result['world_size']} ranks in {time.monotonic() - start:.1f} s: "
          f"final loss {result['final_loss']:.4f}, test accuracy {result['test_accuracy']:.3f}")
    import mlflow

    print(f"params, per-step loss and rank logs are in MLflow at {mlflow.get_tracking_uri()} "
          "(`mlflow ui` to browse; SPARK_DL_TRACKING=0 turns tracking off)")
    if spark is not None:
        spark.stop()
    return 0 if result["test_accuracy"] > 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
