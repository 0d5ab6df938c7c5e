"""alltoall, reducescatter and grouped_allreduce on two real ranks (Gloo), against exact values.

One launch runs every check; each rank returns what it saw and the driver compares.
"""
from __future__ import annotations

import pytest
import torch

from spark_dl import HorovodRunner


def exchange_main():
    import spark_dl.horovod as hvd
    import torch

    from spark_dl.compression import QSGD

    hvd.init()
    r = hvd.rank()
    out = {}
    x = torch.arange(8.0).view(4, 2) + 100 * r
    out["a2a_equal"] = hvd.alltoall(x).tolist()
    y = torch.arange(4.0 if r == 0 else 2.0).view(-1, 1) + 100 * r  # rank 0: 4 rows, rank 1: 2
    got, received = hvd.alltoall(y, splits=[1, 3] if r == 0 else torch.tensor([2, 0]))
    out["a2a_uneven"], out["a2a_received"] = got.view(-1).tolist(), received.tolist()
    out["a2a_received_dtype"] = str(received.dtype)
    g = y.clone().requires_grad_()
    z, _ = hvd.alltoall(g, splits=[1, 3] if r == 0 else [2, 0])
    (z * (r + 1)).sum().backward()  # rows that went to rank d get gradient d + 1
    out["a2a_grad"] = g.grad.view(-1).tolist()
    # wrong on both ranks: a rank that raised alone would leave the other waiting
    for bad in ([0, 0], [5, -1], [1, 2, 1]):
        try:
            hvd.alltoall(y, splits=bad)
        except ValueError as e:
            out.setdefault("a2a_errors", []).append(str(e))
    try:
        hvd.alltoall(torch.arange(3.0))
    except ValueError as e:
        out["a2a_unequal_error"] = str(e)

    t = torch.arange(10.0).view(5, 2) * (r + 1)
    out["rs_avg"] = hvd.reducescatter(t).tolist()
    out["rs_sum"] = hvd.reducescatter(t, op=hvd.Sum).tolist()
    out["rs_max"] = hvd.reducescatter(t, op=hvd.Max).tolist()
    out["rs_fp16"] = hvd.reducescatter(t, compression=hvd.Compression.fp16, op=hvd.Sum).tolist()
    out["rs_int"] = hvd.reducescatter(torch.arange(6).view(6, 1) * (r + 1), op=hvd.Average).view(-1).tolist()
    out["rs_scaled"] = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist()
    w = t.clone().requires_grad_()
    hvd.reducescatter(w, op=hvd.Sum).sum().backward()
    out["rs_grad_sum"] = w.grad.view(-1).tolist()
    w.grad = None
    hvd.reducescatter(w).sum().backward()
    out["rs_grad_avg"] = w.grad.view(-1).tolist()
    try:
        hvd.reducescatter(t, compression=QSGD())
    except ValueError as e:
        out["rs_compression_error"] = str(e)

    a, b, c = torch.tensor([1.0, 2.0]) * (r + 1), torch.ones(2, 3) * (r + 1), torch.tensor([3, 4]) * (r + 1)
    ga, gb, gc = hvd.grouped_allreduce([a, b, c], op=hvd.Sum)
    out["grouped_sum"] = [ga.tolist(), gb.tolist(), gc.tolist()]
    out["grouped_inputs_kept"] = a.tolist() == [float(r + 1), 2.0 * (r + 1)]
    out["grouped_avg"] = [v.tolist() for v in hvd.grouped_allreduce([a, b], name="g")]
    same = hvd.grouped_allreduce_([a, b, c], op=hvd.Sum)
    out["grouped_inplace"] = [a.tolist(), b.tolist(), c.tolist(), same[0] is a]
    d = (torch.ones(3) * (r + 1)).requires_grad_()
    (hvd.grouped_allreduce([d], op=hvd.Sum)[0] * 2).sum().backward()
    out["grouped_grad"] = d.grad.tolist()
    h1 = hvd.alltoall_async(y, splits=[1, 3] if r == 0 else [2, 0])
    h2 = hvd.reducescatter_async(t, op=hvd.Sum)
    h3 = hvd.grouped_allreduce_async([torch.ones(2) * (r + 1)], op=hvd.Sum)
    e = torch.ones(2) * (r + 1)
    h4 = hvd.grouped_allreduce_async_([e], op=hvd.Sum)
    # not started yet: the first poll starts them (in order) and says False; these run to completion as they start
    assert not any(hvd.poll(h) for h in (h1, h2, h3, h4))
    assert all(hvd.poll(h) for h in (h1, h2, h3, h4))
    rows, counts = hvd.synchronize(h1)
    out["async"] = [rows.view(-1).tolist(), counts.tolist(), hvd.synchronize(h2).tolist(),
                    hvd.synchronize(h3)[0].tolist(), hvd.synchronize(h4)[0] is e, e.tolist()]

    # grouped allgather (first dimensions differ by rank) and reducescatter, sync and async
    rows_r = torch.arange(float(r + 1)).view(-1, 1) + 10 * r  # rank 0: 1 row, rank 1: 2 rows
    out["gag"] = [v.tolist() for v in hvd.grouped_allgather([rows_r, torch.tensor([r])])]
    out["grs"] = [v.tolist() for v in hvd.grouped_reducescatter([t, torch.ones(3, 1) * (r + 1)], op=hvd.Sum)]
    ha = hvd.grouped_allgather_async([rows_r])
    hb = hvd.grouped_reducescatter_async([t], op=hvd.Sum)
    out["grouped_async"] = [hvd.synchronize(ha)[0].tolist(), hvd.synchronize(hb)[0].tolist()]
    q = (torch.ones(2, 1) * (r + 1)).requires_grad_()
    (hvd.grouped_allgather([q])[0] * torch.tensor([[1.0], [2.0], [3.0], [4.0]])).sum().backward()
    out["gag_grad"] = q.grad.view(-1).tolist()
    for key, call in [("gag_one", lambda: hvd.grouped_allgather(t)),
                      ("grs_item", lambda: hvd.grouped_reducescatter([t, "x"]))]:
        try:
            call()
        except TypeError as err:
            out[key] = str(err)

    # sparse: rank r has rows r and 2 of a 4 x 2 matrix; row 2 is on both ranks
    sp = torch.sparse_coo_tensor(torch.tensor([[r, 2]]), torch.tensor([[1.0, 2.0], [10.0, 20.0]]) * (r + 1), (4, 2))
    summed = hvd.synchronize(hvd.sparse_allreduce_async(sp, op=hvd.Sum))
    averaged = hvd.synchronize(hvd.sparse_allreduce_async(sp))
    out["sparse"] = (summed.is_sparse, summed.to_dense().tolist(), averaged.to_dense().tolist(), summed._nnz())
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 2), (4, 2))
    out["sparse_empty"] = hvd.synchronize(hvd.sparse_allreduce_async(empty if r == 0 else sp)).to_dense().tolist()
    try:
        hvd.sparse_allreduce_async(torch.ones(2))
    except ValueError as err:
        out["sparse_dense_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(exchange_main)


def test_alltoall_equal_and_uneven_splits(ranks):
    r0, r1 = ranks
    # equal: rank r receives the r-th half of every rank's rows, in rank order
    assert r0["a2a_equal"] == [[0, 1], [2, 3], [100, 101], [102, 103]]
    assert r1["a2a_equal"] == [[4, 5], [6, 7], [104, 105], [106, 107]]
    assert r0["a2a_uneven"] == [0, 100, 101] and r0["a2a_received"] == [1, 2]
    assert r1["a2a_uneven"] == [1, 2, 3] and r1["a2a_received"] == [3, 0]
    assert r0["a2a_received_dtype"] == "torch.int32"


def test_alltoall_gradient_goes_back_the_way_the_rows_came(ranks):
    r0, r1 = ranks
    assert r0["a2a_grad"] == [1.0, 2.0, 2.0, 2.0]  # row 0 went to rank 0, rows 1-3 to rank 1
    assert r1["a2a_grad"] == [1.0, 1.0]


def test_alltoall_bad_splits_are_clear_errors(ranks):
    for r in ranks:
        errors = r["a2a_errors"]
        assert len(errors) == 3 and all("summing to dimension 0" in e for e in errors)
        assert "divides dimension 0 equally among the 2 ranks" in r["a2a_unequal_error"]


def test_reducescatter_values(ranks):
    r0, r1 = ranks
    full = torch.arange(10.0).view(5, 2)
    # rank 0 gets the first 3 rows (5 = 3 + 2, as torch.tensor_split cuts), rank 1 the last 2
    assert r0["rs_sum"] == (3 * full[:3]).tolist() and r1["rs_sum"] == (3 * full[3:]).tolist()
    assert r0["rs_avg"] == (1.5 * full[:3]).tolist() and r1["rs_avg"] == (1.5 * full[3:]).tolist()
    assert r0["rs_max"] == (2 * full[:3]).tolist() and r1["rs_max"] == (2 * full[3:]).tolist()
    assert r0["rs_fp16"] == r0["rs_sum"] and r1["rs_fp16"] == r1["rs_sum"]  # small integers: exact
    assert r0["rs_scaled"] == r0["rs_sum"]
    assert r0["rs_int"] == [0, 1, 3] and r1["rs_int"] == [4, 6, 7]  # (1 + 2) i / 2, truncated


def test_reducescatter_gradient_is_an_allgather(ranks):
    for r in ranks:
        # Horovod's rule: the gathered gradients, times the number of ranks for Sum
        assert r["rs_grad_sum"] == [2.0] * 10
        assert r["rs_grad_avg"] == [1.0] * 10
        assert "Compression.none or hvd.Compression.fp16" in r["rs_compression_error"]


def test_grouped_allreduce(ranks):
    for r in ranks:
        assert r["grouped_sum"] == [[3.0, 6.0], [[3.0] * 3] * 2, [9, 12]]
        assert r["grouped_inputs_kept"]
        assert r["grouped_avg"] == [[1.5, 3.0], [[1.5] * 3] * 2]
        assert r["grouped_inplace"] == [[3.0, 6.0], [[3.0] * 3] * 2, [9, 12], True]
        # Horovod's rule, as for allreduce: the gradient is the Sum-allreduce of every rank's 2s
        assert r["grouped_grad"] == [4.0] * 3


def test_async_forms_return_what_the_sync_ones_do(ranks):
    for r in ranks:
        rows, counts, rs, grouped, same, inplace = r["async"]
        assert [rows, counts] == [r["a2a_uneven"], r["a2a_received"]]
        assert rs == r["rs_sum"] and grouped == [3.0, 3.0] and same and inplace == [3.0, 3.0]


def test_grouped_allgather_and_reducescatter(ranks):
    out = ranks[0]
    assert out["gag"] == [[[0.0], [10.0], [11.0]], [0, 1]]
    # t summed over ranks is arange(10).view(5, 2) * 3: rank 0 holds rows 0-2, rank 1 rows 3-4
    full = [[3.0 * (2 * i), 3.0 * (2 * i + 1)] for i in range(5)]
    assert out["grs"] == [full[:3], [[3.0], [3.0]]] and ranks[1]["grs"] == [full[3:], [[3.0]]]
    assert out["grouped_async"] == [out["gag"][0], full[:3]]
    # allgather's gradient: the average over ranks of the gathered rows' gradients, this rank's rows
    assert out["gag_grad"] == [1.0, 2.0] and ranks[1]["gag_grad"] == [3.0, 4.0]
    assert "wrap it in a list" in out["gag_one"] and "got a str" in out["grs_item"]


def test_sparse_allreduce_sends_entries_and_sums_where_they_meet(ranks):
    for o in ranks:
        is_sparse, summed, averaged, nnz = o["sparse"]
        assert is_sparse and nnz == 3  # rows 0, 1 and 2 (2 summed from both ranks)
        assert summed == [[1.0, 2.0], [2.0, 4.0], [30.0, 60.0], [0.0, 0.0]]
        assert averaged == [[0.5, 1.0], [1.0, 2.0], [15.0, 30.0], [0.0, 0.0]]
        # rank 0 contributes no entries, rank 1 its own (times 2): the average over 2 ranks
        assert o["sparse_empty"] == [[0.0, 0.0], [1.0, 2.0], [10.0, 20.0], [0.0, 0.0]]
        assert "sparse COO" in o["sparse_dense_error"]
