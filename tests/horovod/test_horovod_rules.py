"""Behaviours Horovod's own test suite expects of ``horovod.torch`` (measured with
``scripts/horovod_conformance.py``), on two real Gloo ranks: the gradients of allgather, broadcast
and reducescatter, init after shutdown, the error types, the dtypes Gloo lacks, async ops matched
by name, join() during all-reduces, and the optimizer on a set this rank is not in.

One launch runs every check; each rank returns what it saw and the driver compares.
"""
from __future__ import annotations

import time

import pytest

from spark_dl import HorovodRunner, RankFailed


def rules_main():
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    r = hvd.rank()
    out = {}

    # ---- gradients, with Horovod 0.28.1's rules -----------------------------------------------
    g = torch.ones(2, 3, requires_grad=True)
    hvd.allgather(g).backward(torch.ones(4, 3))  # averaged over the ranks, then this rank's rows
    out["allgather_grad"] = g.grad.tolist()
    b = torch.ones(3, requires_grad=True)
    hvd.broadcast(b, root_rank=0).backward(torch.ones(3))  # the root gets the average, the others 0
    out["broadcast_grad"] = b.grad.tolist()
    for op in (hvd.Sum, hvd.Average):
        w = torch.ones(4, 2, requires_grad=True)
        hvd.reducescatter(w, op=op).backward(torch.ones(2, 2))  # gathered, times the size for Sum
        out[f"reducescatter_grad_{op.name}"] = w.grad.tolist()

    # ---- error types: both ValueError and RuntimeError ----------------------------------------
    try:
        hvd.allreduce(torch.ones(3 + r))
    except RuntimeError as e:
        out["mismatch"] = (type(e).__name__, isinstance(e, ValueError), str(e))
    try:
        hvd.allgather(torch.ones(2, 2, dtype=torch.int32 if r else torch.float32))
    except RuntimeError as e:
        out["allgather_mismatch"] = isinstance(e, ValueError)
    try:
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)
    except RuntimeError as e:
        out["reducescatter_adasum"] = isinstance(e, ValueError)
    try:
        hvd.alltoall(torch.ones(2), splits=torch.tensor([1.0, 1.0]))
    except ValueError as e:
        out["float_splits"] = str(e)

    # ---- a rank that goes on to another collective: both raise at once, naming both ------------
    start = time.monotonic()
    try:
        hvd.allgather(torch.ones(1)) if r == 0 else hvd.barrier()
    except RuntimeError as e:
        out["different_collectives"] = (str(e), time.monotonic() - start)

    # ---- dtypes Gloo lacks, and integer scaling -----------------------------------------------
    short = torch.tensor([[r + 1, 300 * (r + 1)]], dtype=torch.int16)
    out["int16"] = [hvd.allgather(short).tolist(), str(hvd.allgather(short).dtype),
                    hvd.broadcast(short, root_rank=1).tolist(),
                    hvd.alltoall(torch.cat([short, short])).tolist(),
                    hvd.allreduce(short, op=hvd.Sum).tolist()]
    ints = torch.tensor([5, -5, 7]) * (r + 1)
    # each rank's tensor times 0.5 in float64, truncated (2, -2, 3 and 5, -5, 7), then summed
    out["int_prescale"] = [hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.5).tolist(),
                           hvd.synchronize(hvd.allreduce_async(ints, op=hvd.Sum, prescale_factor=0.5)).tolist(),
                           hvd.allreduce(ints, op=hvd.Sum, postscale_factor=0.5).tolist(),
                           hvd.reducescatter(ints.repeat(2), op=hvd.Sum, prescale_factor=0.5).tolist()]
    out["grouped_reducescatter_dtypes"] = [
        str(t.dtype) for t in hvd.grouped_reducescatter(
            [torch.ones(2, dtype=d) for d in (torch.uint8, torch.int8, torch.int32, torch.bool)], op=hvd.Sum)]

    # ---- async ops: started late, matched by name ---------------------------------------------
    x = torch.ones(3) * (r + 1)
    if r == 0:
        h = hvd.allreduce_async(x, name="dup", op=hvd.Sum)
        try:
            hvd.allreduce_async(x, name="dup")
        except ValueError as e:
            out["duplicate"] = str(e)
    hvd.barrier()  # rank 0 has an op pending here, rank 1 not yet
    if r == 1:
        h = hvd.allreduce_async(x, name="dup", op=hvd.Sum)
    out["poll"] = [hvd.poll(h), hvd.synchronize(h).tolist()]
    handle = hvd.sparse_allreduce_async(torch.eye(3)[r].to_sparse(), name="sparse", op=hvd.Sum)
    out["sparse_handle"] = handle().to_dense().tolist()
    compressed, ctx = hvd.Compression.fp16.compress(torch.ones(2, dtype=torch.float64))  # Horovod's (tensor, ctx)
    out["fp16_tuple"] = [str(compressed.dtype), str(hvd.Compression.fp16.decompress(compressed, ctx).dtype)]

    # ---- join(): all-reduces count the joined rank as zeros, other collectives are refused -----
    if r == 0:
        out["join"] = hvd.join()
    else:
        out["allreduce_while_joined"] = hvd.allreduce(torch.tensor([4.0])).item()
        try:
            hvd.broadcast(torch.ones(1), root_rank=1)
        except RuntimeError as e:
            out["broadcast_while_joined"] = str(e)
        out["join"] = hvd.join()

    # ---- optimizers -------------------------------------------------------------------------
    first = hvd.add_process_set([0])
    model = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(model.weight, 1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=first)
    model(torch.ones(1, 2) * (r + 1)).sum().backward()
    opt.step()  # rank 1 is not in the set: it steps on its own gradient, as in Horovod
    out["non_member_step"] = model.weight.detach().tolist()
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sparse_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                          sparse_as_dense=True)
    emb(torch.tensor([r, 2])).sum().backward()
    sparse_opt.step()
    out["sparse_as_dense"] = emb.weight.grad.is_sparse
    fresh = torch.nn.Linear(2, 1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(fresh_opt, root_rank=0)
    out["grads_after_broadcast_state"] = [p.grad.tolist() for p in fresh.parameters()]

    # ---- init again after shutdown, with a set still registered --------------------------------
    hvd.add_process_set([1])
    hvd.shutdown()
    hvd.init()
    out["reinit"] = [hvd.global_process_set.process_set_id, hvd.global_process_set.ranks,
                     hvd.synchronize(hvd.allreduce_async(torch.tensor([2.0]))).item(),
                     hvd.add_process_set([1]).process_set_id, hvd.add_process_set([]).ranks]
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    out["reinit_optimizer"] = True
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2, run_timeout=240).run_all(rules_main)


def test_gradients_follow_horovods_rules(ranks):
    r0, r1 = ranks
    assert r0["allgather_grad"] == [[1.0] * 3] * 2  # a sum over the ranks would give 2.0
    assert r0["broadcast_grad"] == [1.0] * 3 and r1["broadcast_grad"] == [0.0] * 3  # not 2.0 at the root
    for o in ranks:
        assert o["reducescatter_grad_Sum"] == [[2.0, 2.0]] * 4  # times the 2 ranks
        assert o["reducescatter_grad_Average"] == [[1.0, 1.0]] * 4  # not divided by them


def test_refusals_are_both_value_and_runtime_errors(ranks):
    for o in ranks:
        name, is_value_error, message = o["mismatch"]
        assert name == "CollectiveError" and is_value_error
        assert message == ("allreduce: every rank must pass the same shape and dtype, got rank 0: float32 [3], "
                           "rank 1: float32 [4]")
        assert o["allgather_mismatch"] and o["reducescatter_adasum"]
        assert "splits must be integers" in o["float_splits"]


def test_a_rank_going_on_to_another_collective_fails_fast_naming_both(ranks):
    for o in ranks:
        message, seconds = o["different_collectives"]
        assert "got rank 0: allgather, rank 1: barrier" in message
        assert seconds < 10


def test_dtypes_gloo_lacks_and_integer_scaling(ranks):
    r0, r1 = ranks
    gathered, dtype, broadcast, exchanged, summed = r0["int16"]
    assert gathered == [[1, 300], [2, 600]] and dtype == "torch.int16"
    assert broadcast == [[2, 600]] and exchanged == [[1, 300], [2, 600]] and summed == [[3, 900]]
    for o in ranks:
        assert o["int_prescale"][:3] == [[7, -7, 10], [7, -7, 10], [7, -7, 10]]  # 15 * 0.5 truncated: 7
        assert o["grouped_reducescatter_dtypes"] == ["torch.uint8", "torch.int8", "torch.int32", "torch.bool"]
    assert r0["int_prescale"][3] == [7, -7, 10] and r1["int_prescale"][3] == [7, -7, 10]


def test_async_ops_start_late_and_are_matched_by_name(ranks):
    r0, _ = ranks
    assert "'dup' was submitted and not synchronized yet" in r0["duplicate"]
    for o in ranks:
        assert o["poll"] == [False, [3.0, 3.0, 3.0]]  # rank 0's op waited for rank 1's, past a barrier
        assert o["sparse_handle"] == [1.0, 1.0, 0.0]  # rank 0's entry 0 and rank 1's entry 1
        assert o["fp16_tuple"] == ["torch.float16", "torch.float64"]


def test_join_counts_the_joined_rank_in_allreduces_and_refuses_the_rest(ranks):
    r0, r1 = ranks
    assert r1["allreduce_while_joined"] == 2.0  # (4 + 0) / 2
    assert r1["broadcast_while_joined"].startswith("broadcast: a rank has called hvd.join()")
    assert r0["join"] == r1["join"] == 1  # the last to join


def test_optimizers(ranks):
    r0, r1 = ranks
    # 1 - 0.1 * x, x = 1 on the set's one member; rank 1, outside it, steps on its own x = 2
    assert r0["non_member_step"] == [[pytest.approx(0.9)] * 2] and r1["non_member_step"] == [[pytest.approx(0.8)] * 2]
    for o in ranks:
        assert o["sparse_as_dense"] is True
        assert o["grads_after_broadcast_state"] == [[[0.0, 0.0]], [0.0]]


def test_init_after_shutdown(ranks):
    for o in ranks:
        assert o["reinit"] == [0, [0, 1], 2.0, 1, []]
        assert o["reinit_optimizer"]


def test_a_rank_that_fails_leaves_no_hang():
    start = time.monotonic()
    with pytest.raises(RankFailed):
        HorovodRunner(np=-2, run_timeout=60).run(_fails_on_rank_1)
    assert time.monotonic() - start < 40


def _fails_on_rank_1():
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    if hvd.rank() == 1:
        hvd.barrier()  # as Horovod's tests do in tearDown after a failed assertion
    hvd.allgather(torch.ones(1))

