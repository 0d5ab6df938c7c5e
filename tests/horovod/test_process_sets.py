"""Horovod's process sets on four real ranks (Gloo): an even and an odd set registered at init,
a set added and removed later, every collective with ``process_set=``, DistributedOptimizer on a
set, and the misuses, each a clear error on the rank that made it."""
from __future__ import annotations

import pytest

from spark_dl import HorovodRunner


def process_sets_main():
    import spark_dl.horovod as hvd
    import torch

    out = {}
    even, odd = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1, 3])
    out["before_init"] = (even.size(), even.rank(), even.included(), str(even))
    hvd.init(process_sets=[even, odd])
    r = hvd.rank()
    mine = even if r % 2 == 0 else odd
    out["sets"] = [str(p) for p in (hvd.global_process_set, even, odd)]
    out["mine"] = (mine.size(), mine.rank(), mine.included(), (odd if mine is even else even).rank())

    t = torch.tensor([float(r + 1)])
    out["sum"] = hvd.allreduce(t, op=hvd.Sum, process_set=mine).item()
    out["avg"] = hvd.allreduce(t, process_set=mine).item()
    out["async_avg"] = hvd.synchronize(hvd.allreduce_async(t, process_set=mine)).item()
    x = t.clone()
    hvd.allreduce_(x, op=hvd.Max, process_set=mine)
    out["max_"] = x.item()
    out["fp16"] = hvd.allreduce(t, compression=hvd.Compression.fp16, process_set=mine).item()
    out["adasum"] = hvd.allreduce(torch.eye(2)[mine.rank()], op=hvd.Adasum, process_set=mine).tolist()
    out["grouped"] = [g.tolist() for g in hvd.grouped_allreduce([t, t * 10], op=hvd.Sum, process_set=mine)]
    out["allgather"] = hvd.allgather(torch.full((r + 1, 1), float(r)), process_set=mine).view(-1).tolist()
    root = mine.ranks[-1]
    out["broadcast"] = hvd.broadcast(t, root_rank=root, process_set=mine).item()
    b = t.clone()
    hvd.broadcast_(b, root_rank=root, process_set=mine)
    out["broadcast_"] = b.item()
    out["alltoall"] = hvd.alltoall(torch.tensor([10.0 * r, 10.0 * r + 1]), process_set=mine).tolist()
    out["reducescatter"] = hvd.reducescatter(torch.tensor([[1.0 * r], [2.0 * r]]), op=hvd.Sum,
                                             process_set=mine).view(-1).tolist()
    out["objects"] = (hvd.broadcast_object({"from": r}, root_rank=root, process_set=mine),
                      hvd.allgather_object(r * r, process_set=mine))
    hvd.barrier(process_set=mine)
    g = torch.ones(2, requires_grad=True)
    (hvd.allreduce(g * (r + 1), op=hvd.Sum, process_set=mine) * torch.tensor([1.0, 2.0])).sum().backward()
    out["allreduce_grad"] = g.grad.tolist()  # the gradient is reduced over the set too

    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=mine.ranks[0], process_set=mine)
    out["params_from_set_root"] = model.weight.view(-1).tolist()
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), process_set=mine)
    (w * (r + 1)).sum().backward()
    opt.step()
    out["optimizer"] = w.detach().tolist()

    # added later, every rank calls add/remove; only its members run collectives on it
    low = hvd.add_process_set([0, 1, 2])
    out["low"] = str(low)
    if low.included():
        out["low_sum"] = hvd.allreduce(t, op=hvd.Sum, process_set=low).item()
    else:
        try:
            hvd.allreduce(t, process_set=low)
        except ValueError as e:
            out["not_a_member"] = str(e)
    errors = {}
    for label, call in [
        ("root_outside",
         lambda: hvd.broadcast(t, root_rank=(odd if mine is even else even).ranks[0], process_set=mine)),
        ("duplicate", lambda: hvd.add_process_set([1, 3])),
        ("out_of_range", lambda: hvd.add_process_set([0, 4])),
        ("not_ranks", lambda: hvd.ProcessSet("0,1")),
        ("unregistered", lambda: hvd.allreduce(t, process_set=hvd.ProcessSet([0, 1, 2, 3]))),
        ("init_again", lambda: hvd.init(process_sets=[hvd.ProcessSet([0, 1])])),
        ("comm", lambda: hvd.init(comm=object())),
        ("not_a_set", lambda: hvd.allreduce(t, process_set=[0, 1])),
    ]:
        try:
            call()
        except Exception as e:
            errors[label] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    out["removed"] = (hvd.remove_process_set(low), hvd.remove_process_set(low),
                      hvd.remove_process_set(hvd.global_process_set), low.process_set_id)
    try:
        hvd.allreduce(t, process_set=low)
    except ValueError as e:
        out["after_remove"] = str(e)
    out["world_sum_after"] = hvd.allreduce(t, op=hvd.Sum).item()
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-4).run_all(process_sets_main)


def test_sets_registered_at_init(ranks):
    for r, o in enumerate(ranks):
        assert o["before_init"] == (None, None, None, "ProcessSet(process_set_id=None, ranks=[0, 2], mpi_comm=None)")
        assert o["sets"] == ["ProcessSet(process_set_id=0, ranks=[0, 1, 2, 3], mpi_comm=None)",
                             "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)",
                             "ProcessSet(process_set_id=2, ranks=[1, 3], mpi_comm=None)"]
        assert o["mine"] == (2, r // 2, True, -1)


def test_collectives_stay_within_the_set(ranks):
    for r, o in enumerate(ranks):
        members = [0, 2] if r % 2 == 0 else [1, 3]
        total = sum(m + 1 for m in members)
        assert o["sum"] == total and o["avg"] == total / 2 and o["async_avg"] == total / 2
        assert o["max_"] == members[-1] + 1 and o["fp16"] == total / 2
        assert o["adasum"] == [1.0, 1.0]
        assert o["grouped"] == [[total], [10.0 * total]]
        assert o["allgather"] == [float(m) for m in members for _ in range(m + 1)]
        assert o["broadcast"] == o["broadcast_"] == members[-1] + 1
        # alltoall and reducescatter slice by position in the set
        me = members.index(r)
        assert o["alltoall"] == [10.0 * m + me for m in members]
        assert o["reducescatter"] == [sum(m * (me + 1) for m in members)]
        assert o["objects"] == ({"from": members[-1]}, [m * m for m in members])
        # backward sums the upstream gradient [1, 2] over the set's two members, times r + 1
        assert o["allreduce_grad"] == [2.0 * (r + 1), 4.0 * (r + 1)]
        assert o["params_from_set_root"] == [members[0]] * 2


def test_distributed_optimizer_on_a_set(ranks):
    for r, o in enumerate(ranks):
        members = [0, 2] if r % 2 == 0 else [1, 3]
        assert o["optimizer"] == [-sum(m + 1 for m in members) / 2] * 3


def test_added_set_and_its_removal(ranks):
    for r, o in enumerate(ranks):
        assert o["low"] == "ProcessSet(process_set_id=3, ranks=[0, 1, 2], mpi_comm=None)"
        if r < 3:
            assert o["low_sum"] == 6.0
        else:
            assert "rank 3 is not in ProcessSet(process_set_id=3" in o["not_a_member"]
        assert o["removed"] == (True, False, False, None)
        assert "not registered" in o["after_remove"]
        assert o["world_sum_after"] == 10.0


def test_misuse_is_a_clear_error(ranks):
    for o in ranks:
        e = o["errors"]
        assert e["root_outside"].startswith("ValueError: root_rank=") and "is not in" in e["root_outside"]
        assert "already registered" in e["duplicate"]
        assert "0..3" in e["out_of_range"]
        assert "list of ranks" in e["not_ranks"] and "MPI" in e["not_ranks"]
        assert "not registered" in e["unregistered"] and "add_process_set" in e["unregistered"]
        assert "add_process_set" in e["init_again"]
        assert e["comm"].startswith("NotImplementedError") and "ProcessSet" in e["comm"]
        assert e["not_a_set"].startswith("TypeError")
