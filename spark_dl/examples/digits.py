"""A small CNN on scikit-learn's bundled 8x8 digits, trained Horovod-style with spark_dl.horovod.

The data ships with scikit-learn, so nothing is downloaded. ``train_digits`` is the training
function ``runners/train_digits.py`` hands to ``HorovodRunner``; it lives in the package (not in
the runner script) so it pickles by reference and every rank imports the same code.

    from spark_dl import HorovodRunner
    from spark_dl.examples.digits import train_digits
    result = HorovodRunner(np=2).run(train_digits, epochs=5, compression="qsgd")
    print(result["accuracy"])
"""
from __future__ import annotations

from typing import Any, Callable

# Gradient compressors by command-line name (see make_compressor).
COMPRESSIONS: tuple[str, ...] = (
    "none", "fp16", "bf16", "onebit", "qsgd", "topk", "randomk", "powersgd", "efsign", "auto",
)

TEST_SIZE = 360


def make_compressor(name: str) -> Any:
    """The ``spark_dl.compression`` compressor for a name in :data:`COMPRESSIONS`."""
    import spark_dl.compression as C

    # TopK and RandomK drop most of each gradient, so they get error feedback (as the compression
    # docs advise); the others carry their own error memory or are unbiased. TopK() keeps 10% under
    # Adam; RandomK keeps 10% rather than its 1%: this CNN has only ~14k parameters, and 1% learns
    # too little in a few epochs (still warned: random-k needs about half the entries to keep up).
    factories: dict[str, Callable[[], Any]] = {
        "none": C.NoneCompressor,
        "auto": C.Auto,
        "fp16": C.FP16,
        "bf16": C.BF16,
        "onebit": C.OneBit,
        "qsgd": C.QSGD,
        "topk": lambda: C.ErrorFeedback(C.TopK()),
        "randomk": lambda: C.ErrorFeedback(C.RandomK(0.1)),
        "powersgd": C.PowerSGD,
        "efsign": C.EFSign,
    }
    if name not in factories:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(COMPRESSIONS)}")
    return factories[name]()


def train_digits(epochs: int = 10, batch_size: int = 16, base_lr: float = 0.002, compression: str = "none",
                 seed: int = 42) -> dict[str, Any]:
    """Train on every rank; return ``{"accuracy", "loss", "epochs", "world_size"}`` (same on all ranks).

    Each rank trains on its shard of the 1437 training images (``batch_size`` per rank) with Adam
    at ``base_lr * size`` (Horovod's linear scaling), gradients all-reduced by
    ``DistributedOptimizer`` through ``compression``. After every epoch the test accuracy on the 360
    held-out images and the mean training loss, averaged over ranks, are logged with
    ``spark_dl.log_metrics`` (and rank 0's ``batch_loss`` every optimizer step). Rank 0 saves a
    checkpoint after every epoch (``spark_dl.save_checkpoint``), so a run restarted by
    ``HorovodRunner(max_restarts=...)`` resumes after the last finished epoch.
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import spark_dl
    import spark_dl.compat.horovod as hvd

    hvd.init()
    torch.manual_seed(seed)
    # OMP_NUM_THREADS is set per rank by the launcher; one thread is fastest for this tiny model.
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    x = (x - x.mean()) / x.std()  # standardized pixels: Adam converges in a few epochs
    y = torch.tensor(digits.target, dtype=torch.int64)
    # A fixed split, independent of --seed, so accuracies of different runs are comparable.
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test_idx, train_idx = order[:TEST_SIZE], order[TEST_SIZE:]
    train_set = TensorDataset(x[train_idx], y[train_idx])
    test_set = TensorDataset(x[test_idx], y[test_idx])

    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler)

    model = nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=base_lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=make_compressor(compression),
    )

    def evaluate() -> float:
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for data, target in test_loader:
                correct += (model(data).argmax(dim=1) == target).sum().item()
                seen += len(target)
        model.train()
        # Equal shards (360 splits evenly), so the mean of the ranks' accuracies is the accuracy.
        return hvd.allreduce(torch.tensor(correct / seen), name="test_accuracy").item()

    accuracy, loss, step, first_epoch = 0.0, float("nan"), 0, 0
    state = spark_dl.load_checkpoint()  # a restarted run (HorovodRunner(max_restarts=...)) resumes
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch, step, loss, accuracy = state["epoch"] + 1, state["step"], state["loss"], state["accuracy"]
    model.train()
    for epoch in range(first_epoch, epochs):
        train_sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            batch_loss = F.cross_entropy(model(data), target)
            batch_loss.backward()
            optimizer.step()
            total += batch_loss.item()
            batches += 1
            # Per optimizer step, so the tracker's steps/s and samples/s are true rates.
            spark_dl.log_metrics({"batch_loss": batch_loss.item()}, step=step)
            step += 1
        loss = hvd.allreduce(torch.tensor(total / max(batches, 1)), name="train_loss").item()
        accuracy = evaluate()
        spark_dl.log_metrics({"train_loss": loss, "test_accuracy": accuracy, "epoch": epoch}, step=step)
        spark_dl.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                                  "step": step, "loss": loss, "accuracy": accuracy}, step=step)
    if epochs == 0:
        accuracy = evaluate()
    return {"accuracy": accuracy, "loss": loss, "epochs": epochs, "world_size": hvd.size()}
