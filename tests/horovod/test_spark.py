"""The Horovod API inside a real Spark barrier stage (local[4])."""
from __future__ import annotations

from spark_dl import HorovodRunner


def barrier_main():
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    torch.manual_seed(hvd.rank())  # different weights per rank until the broadcast
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size()),
                                   named_parameters=model.named_parameters())
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(8, 4)  # each rank its own data
        model(x).pow(2).mean().backward()
        opt.step()
    return {
        "rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(),
        "sum_of_ranks": hvd.allreduce(torch.tensor(float(hvd.rank())), op=hvd.Sum).item(),
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def test_distributed_optimizer_in_a_barrier_stage(spark):
    ranks = HorovodRunner(np=2).run_all(barrier_main)
    assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert all(r["sum_of_ranks"] == 1.0 for r in ranks)
    assert ranks[0]["params"].equal(ranks[1]["params"])
