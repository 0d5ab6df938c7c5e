"""Ray Train's helpers (``get_device``, ``prepare_model``, ``prepare_data_loader``) in real ranks:
each epoch shared out exactly once, shuffled anew, models identical across ranks after training."""
from __future__ import annotations

import pytest

from spark_dl import HorovodRunner, RankFailed


def epochs_seen(n, shuffle, epochs=3, batch_size=2, user_epochs=None, num_workers=0):
    """The indices this rank saw, per epoch, through a prepared loader of range(n)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import spark_dl

    data = TensorDataset(torch.arange(n))
    loader = spark_dl.prepare_data_loader(
        DataLoader(data, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers))
    out = []
    for e in range(epochs):
        if user_epochs is not None:
            loader.sampler.set_epoch(user_epochs[e])  # Ray Train's idiom: still works
        out.append([int(i) for (batch,) in loader for i in batch])
    return {"epochs": out, "len": len(loader), "device": str(spark_dl.get_device()),
            "batch_size": loader.batch_size}


def test_each_epoch_is_shared_out_once_and_shuffled_anew():
    ranks = HorovodRunner(np=-2).run_all(epochs_seen, 10, True)
    for e in range(3):
        seen = [r["epochs"][e] for r in ranks]
        assert len(seen[0]) == len(seen[1]) == 5
        assert sorted(seen[0] + seen[1]) == list(range(10)), "every sample once per epoch, no overlap"
    orders = [ranks[0]["epochs"][e] for e in range(3)]
    assert orders[0] != orders[1] != orders[2], "the epoch advanced with each pass: a new shuffle each"
    assert ranks[0]["len"] == 3 and ranks[0]["batch_size"] == 2 and ranks[0]["device"] == "cpu"


def test_shuffle_matches_distributed_sampler_at_the_same_epoch():
    """What each pass draws is exactly DistributedSampler(seed 0) at epochs 0, 1, 2, and a user's
    set_epoch overrides the count (a restarted run resuming at epoch 7)."""
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset

    def expected(epoch, rank):
        s = DistributedSampler(TensorDataset(torch.arange(10)), num_replicas=2, rank=rank, shuffle=True)
        s.set_epoch(epoch)
        return list(s)

    auto = HorovodRunner(np=-2).run_all(epochs_seen, 10, True)
    user = HorovodRunner(np=-2).run_all(epochs_seen, 10, True, user_epochs=[7, 8, 3])
    for r in (0, 1):
        assert auto[r]["epochs"] == [expected(e, r) for e in (0, 1, 2)]
        assert user[r]["epochs"] == [expected(e, r) for e in (7, 8, 3)]


def test_unshuffled_loader_deals_in_order_with_padding_and_workers():
    """shuffle=False: rank r gets r, r+2, ...; 9 samples on 2 ranks: the last rank's share is padded
    with the first sample, as DistributedSampler does; DataLoader workers keep working."""
    ranks = HorovodRunner(np=-2).run_all(epochs_seen, 9, False, epochs=1, num_workers=1)
    assert ranks[0]["epochs"] == [[0, 2, 4, 6, 8]]
    assert ranks[1]["epochs"] == [[1, 3, 5, 7, 0]]


def train_prepared(steps):
    import torch
    import torch.distributed as dist

    import spark_dl

    torch.manual_seed(spark_dl.get_context().rank)  # different initial weights per rank...
    model = spark_dl.prepare_model(torch.nn.Linear(3, 1))  # ...made equal by DDP's broadcast from rank 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, 3, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"wrapped": type(model).__name__, "params": [p.detach().tolist() for p in model.parameters()],
            "loss": loss.item()}


def test_prepared_model_trains_with_ddp_and_stays_identical_across_ranks(spark):
    for np in (-2, 2):  # local processes and a barrier stage
        ranks = HorovodRunner(np=np).run_all(train_prepared, 30)
        assert [r["wrapped"] for r in ranks] == ["DistributedDataParallel"] * 2
        assert ranks[0]["params"] == ranks[1]["params"]
        assert ranks[0]["loss"] < 0.1


def test_one_rank_gets_the_plain_model():
    out = HorovodRunner(np=-1).run(train_prepared, 5)
    assert out["wrapped"] == "Linear"


def misuse(what):
    import torch
    from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

    import spark_dl

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    class EveryOther(Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(0, self.n, 2))

        def __len__(self):
            return self.n // 2

    data = TensorDataset(torch.arange(8))
    if what == "iterable":
        spark_dl.prepare_data_loader(DataLoader(Stream(), batch_size=2))
    elif what == "sampler":
        spark_dl.prepare_data_loader(DataLoader(data, sampler=EveryOther(8)))
    elif what == "batch_sampler":
        spark_dl.prepare_data_loader(DataLoader(data, batch_sampler=[[0, 1], [2, 3]]))
    elif what == "fsdp":
        spark_dl.prepare_model(torch.nn.Linear(2, 2), parallel_strategy="fsdp")
    elif what == "not a loader":
        spark_dl.prepare_data_loader([1, 2, 3])
    elif what == "not a model":
        spark_dl.prepare_model(lambda x: x)
    elif what == "iterable, no sampler":  # allowed: the user shards it
        loader = spark_dl.prepare_data_loader(DataLoader(Stream(), batch_size=2), add_dist_sampler=False)
        return [b.tolist() for b in loader]


@pytest.mark.parametrize("what, match", [
    ("iterable", "IterableDataset has no indices.*add_dist_sampler=False"),
    ("sampler", r"sampler \(EveryOther\) cannot be sharded.*add_dist_sampler=False"),
    ("batch_sampler", r"batch_sampler \(list\) decides the batches.*add_dist_sampler=False"),
    ("fsdp", "parallel_strategy must be 'ddp' or None, got 'fsdp'"),
    ("not a loader", "takes a torch.utils.data.DataLoader, got list"),
    ("not a model", "prepare_model takes a torch.nn.Module, got function"),
])
def test_what_cannot_be_prepared_is_refused_with_the_fix(what, match):
    with pytest.raises(RankFailed, match=match):
        HorovodRunner(np=-2).run(misuse, what)


def test_an_iterable_dataset_passes_with_add_dist_sampler_false():
    assert HorovodRunner(np=-2).run(misuse, "iterable, no sampler") == [[0, 1], [2, 3]]


def test_outside_a_rank_the_helpers_say_where_they_belong():
    import torch
    from torch.utils.data import DataLoader

    import spark_dl

    with pytest.raises(RuntimeError, match="not inside a spark-dl rank process"):
        spark_dl.prepare_data_loader(DataLoader(list(range(4))))
    with pytest.raises(RuntimeError, match="not inside a spark-dl rank process"):
        spark_dl.prepare_model(torch.nn.Linear(2, 2))
