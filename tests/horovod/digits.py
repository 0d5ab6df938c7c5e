"""A Horovod PyTorch training script in the style of Horovod's MNIST example, on sklearn's digits.

The only spark-dl specific line is the import of ``spark_dl.horovod as hvd``; everything else is
what a Horovod user already has. Shared by the end-to-end tests.
"""
from __future__ import annotations

from typing import Any


def train_digits(epochs: int = 12, batch_size: int = 32, base_lr: float = 0.15, compression: Any = None,
                 seed: int = 42) -> dict:
    import hashlib

    import numpy as np
    import spark_dl.horovod as hvd
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    hvd.init()
    torch.manual_seed(seed)
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test_idx, train_idx = order[:360], order[360:]
    train_set = TensorDataset(x[train_idx], y[train_idx])
    test_set = TensorDataset(x[test_idx], y[test_idx])

    # Horovod: each rank reads its own shard.
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
            self.fc1 = nn.Linear(32 * 2 * 2, 64)
            self.fc2 = nn.Linear(64, 10)

        def forward(self, t):
            t = F.max_pool2d(F.relu(self.conv1(t)), 2)
            t = F.max_pool2d(F.relu(self.conv2(t)), 2)
            t = F.relu(self.fc1(t.flatten(1)))
            return F.log_softmax(self.fc2(t), dim=1)

    model = Net()
    # Horovod: scale the learning rate by the number of ranks.
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size(), momentum=0.5)
    # Horovod: start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.none if compression is None else compression,
    )

    for epoch in range(epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()

    def metric_average(value: float, name: str) -> float:
        return hvd.allreduce(torch.tensor(value), name=name).item()

    model.eval()
    correct, seen = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            correct += (model(data).argmax(dim=1) == target).sum().item()
            seen += len(target)
    accuracy = metric_average(correct / seen, "avg_accuracy")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return {
        "rank": hvd.rank(),
        "accuracy": accuracy,
        "params_sha1": hashlib.sha1(np.ascontiguousarray(flat).tobytes()).hexdigest(),
        # PowerSGD's warm-started Q per gradient it factored (layer-wise state)
        "q_shapes": sorted(tuple(q.shape) for q in getattr(compression, "qs", {}).values()),
    }
