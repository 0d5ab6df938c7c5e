"""Every rank must pass the same shapes, dtypes and arguments to an explicit collective, as
Horovod's coordinator requires: a mismatch is a ``ValueError`` on every rank naming each rank's,
where Gloo aborted a rank, hung, or silently gave wrong numbers (``spark_dl.horovod.checks``)."""
from __future__ import annotations

import time

import pytest

from spark_dl import HorovodRunner, RankFailed


def mismatched_main(op):
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    t = torch.ones(4 + 2 * hvd.rank())  # rank 0: 4 elements, rank 1: 6
    calls = {
        "allreduce": lambda: hvd.allreduce(t),  # unchecked: SIGABRT on rank 0
        "broadcast": lambda: hvd.broadcast(t, root_rank=0),  # rank 1 kept 4 of its 6 values: silently
        "alltoall": lambda: hvd.alltoall(t.view(2, -1)),  # SIGABRT
        "reducescatter": lambda: hvd.reducescatter(t),  # SIGABRT
        "grouped_allreduce": lambda: hvd.grouped_allreduce([torch.ones(2), t]),  # hung
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter([t]),  # SIGABRT
    }
    calls[op]()


SHAPE = "every rank must pass the same shape and dtype, got rank 0: float32 [4], rank 1: float32 [6]"
ERRORS = {
    "allreduce": f"allreduce: {SHAPE}",
    "broadcast": f"broadcast: {SHAPE}",
    "alltoall": ("alltoall: every rank must pass the same dtype and the same sizes of every dimension but the "
                 "first, got rank 0: float32 [rows, 2], rank 1: float32 [rows, 3]"),
    "reducescatter": f"reducescatter: {SHAPE}",
    "grouped_allreduce": ("grouped_allreduce: every rank must pass the same shapes and dtypes, got rank 0: "
                          "[float32 [2], float32 [4]], rank 1: [float32 [2], float32 [6]]"),
    "grouped_reducescatter": ("grouped_reducescatter: every rank must pass the same shapes and dtypes, got "
                              "rank 0: [float32 [4]], rank 1: [float32 [6]]"),
}


@pytest.mark.parametrize("op", list(ERRORS))
def test_a_collective_of_different_shapes_fails_fast_naming_every_ranks(op):
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        HorovodRunner(np=-2, run_timeout=60).run(mismatched_main, op)
    assert time.monotonic() - start < 30
    # a CollectiveError: a ValueError, and the RuntimeError Horovod raises
    assert f"CollectiveError: {ERRORS[op]}\n" in str(failed.value)


def checks_main():
    import os

    import spark_dl.horovod as hvd
    import torch
    from spark_dl.horovod import handles

    from spark_dl.compression import QSGD

    hvd.init()
    r = hvd.rank()
    odd = r == 1  # rank 1 passes something else; ranks 0 and 2 agree
    out = {}

    def refused(label, call):
        try:
            call()
        except ValueError as e:  # every rank sees that some rank differs: all raise, and stay in step
            out[label] = str(e)

    x = torch.arange(4.0) + r  # [0, 1, 2, 3] + r
    fp16 = hvd.Compression.fp16
    # what each did unchecked, on Gloo: garbage from the same bytes in another dtype, the two ops'
    # results mixed, SIGABRT, a hang (both ranks sending), garbage, a hang (different collectives)
    refused("dtype", lambda: hvd.allreduce(x.long() if odd else x.double()))
    refused("op", lambda: hvd.allreduce(x, op=hvd.Max if odd else hvd.Sum))
    refused("compression", lambda: hvd.allreduce(x, compression=fp16 if odd else hvd.Compression.none))
    refused("qsgd", lambda: hvd.allreduce(torch.ones(1000 + 500 * odd), compression=QSGD(), name="q"))
    refused("async", lambda: hvd.synchronize(hvd.allreduce_async_(torch.ones(4 + 2 * odd))))  # checked as it starts
    out["no_handle_left"] = not handles._ops
    refused("root", lambda: hvd.broadcast(x, root_rank=r))
    refused("broadcast_dtype", lambda: hvd.broadcast_(x.int() if odd else x, root_rank=0))
    refused("collective", lambda: hvd.broadcast(x, 0) if odd else hvd.allreduce(x))
    refused("alltoall_dtype", lambda: hvd.alltoall(torch.ones(3, 2, dtype=torch.int32 if odd else torch.float32)))
    refused("reducescatter_op", lambda: hvd.reducescatter(torch.ones(3), op=hvd.Max if odd else hvd.Sum))
    refused("grouped_count", lambda: hvd.grouped_allreduce_([torch.ones(4)] * (1 + odd)))
    refused("requires_grad", lambda: hvd.grouped_allreduce([torch.ones(2, requires_grad=odd)]))
    refused("prescale", lambda: hvd.allreduce(x, prescale_factor=0.5 if odd else 1.0))
    refused("qsgd_levels", lambda: hvd.allreduce(torch.ones(1000), compression=QSGD(levels=3 if odd else 7), name="l"))
    refused("object_root", lambda: hvd.broadcast_object({"from": r}, root_rank=r))  # unchecked: a hang

    def sparse(n):  # entries at 0 and 2 of a vector of n
        return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (n,))

    refused("sparse_op", lambda: hvd.sparse_allreduce_async(sparse(4), op=hvd.Sum if odd else hvd.Average)())
    refused("sparse_shape", lambda: hvd.sparse_allreduce_async(sparse(4 + 2 * odd))())
    pair = hvd.add_process_set([1, 2])
    if r in pair.ranks:
        refused("process_set", lambda: hvd.allreduce(torch.ones(2 + r), process_set=pair))
        out["set_sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=pair).item()

    # the same calls, matching: checked, and correct
    out["allreduce"] = hvd.allreduce(x).tolist()
    out["fp16"] = hvd.allreduce(x, op=hvd.Sum, compression=fp16).tolist()
    # the same factor as a float, a numpy float and a tensor: one value, so it agrees
    import numpy as np

    half = [0.5, np.float64(0.5), torch.tensor(0.5)][r]
    out["prescaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=half, postscale_factor=2.0).tolist()
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["sparse"] = hvd.synchronize(hvd.sparse_allreduce_async(sparse(4), op=hvd.Sum)).to_dense().tolist()
    # allreduce and allreduce_async send the same numbers: one rank may call either
    out["mixed_forms"] = (hvd.synchronize(hvd.allreduce_async(x)) if odd else hvd.allreduce(x)).tolist()
    out["broadcast"] = hvd.broadcast(x, root_rank=2).tolist()
    rows, splits = hvd.alltoall(torch.full((3 + r, 2), float(r)), splits=[1, 1, 1 + r])
    out["alltoall"] = (rows[:, 0].tolist(), splits.tolist())
    out["reducescatter"] = hvd.reducescatter(torch.ones(3) * r, op=hvd.Sum).tolist()
    out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce([x, torch.tensor([r])], op=hvd.Sum)]
    g = torch.ones(2, requires_grad=True)
    (hvd.grouped_allreduce([g * (r + 1)], op=hvd.Sum)[0] * torch.tensor([1.0, 2.0])).sum().backward()
    out["grouped_grad"] = g.grad.tolist()
    out["grouped_reducescatter"] = [t.tolist() for t in hvd.grouped_reducescatter([torch.ones(3), torch.ones(6)])]

    os.environ["SPARK_DL_HVD_CHECKS"] = "0"  # on every rank: no check, so no refusal of a mere reshape
    out["unchecked"] = hvd.allreduce(torch.ones(6).view((3, 2) if odd else (2, 3)), op=hvd.Sum).sum().item()
    return out


def test_collectives_that_differ_are_refused_on_every_rank_and_equal_ones_still_reduce():
    ranks = HorovodRunner(np=-3, run_timeout=90).run_all(checks_main)
    got = "got rank 0: {}, rank 1: {}, rank 2: {}".format
    shapes = "shape and dtype"
    # label -> the collective, what must agree, and what ranks 0, 1 and 2 passed
    refused = {
        "dtype": ("allreduce", shapes, ["float64 [4]", "int64 [4]", "float64 [4]"]),
        "op": ("allreduce", "op", ["op=Sum", "op=Max", "op=Sum"]),
        "compression": ("allreduce", "compression", [f"compression={c}()" for c in ("NoneCompressor", "FP16",
                                                                                   "NoneCompressor")]),
        "qsgd_levels": ("allreduce", "compression",
                        [f"compression=QSGD(levels={s}, bucket_size=512, norm='max')" for s in (7, 3, 7)]),
        "prescale": ("allreduce", "prescale_factor", [f"prescale_factor={f}" for f in (1.0, 0.5, 1.0)]),
        "qsgd": ("allreduce", shapes, ["float32 [1000]", "float32 [1500]", "float32 [1000]"]),
        "async": ("allreduce", shapes, ["float32 [4]", "float32 [6]", "float32 [4]"]),
        "root": ("broadcast", "root_rank", ["root_rank=0", "root_rank=1", "root_rank=2"]),
        "object_root": ("broadcast_object", "root_rank", ["root_rank=0", "root_rank=1", "root_rank=2"]),
        "broadcast_dtype": ("broadcast", shapes, ["float32 [4]", "int32 [4]", "float32 [4]"]),
        "sparse_op": ("sparse_allreduce_async", "op", ["op=Average", "op=Sum", "op=Average"]),
        "sparse_shape": ("sparse_allreduce_async", shapes, ["float32 [4]", "float32 [6]", "float32 [4]"]),
        "alltoall_dtype": ("alltoall", "dtype and the same sizes of every dimension but the first",
                           ["float32 [rows, 2]", "int32 [rows, 2]", "float32 [rows, 2]"]),
        "reducescatter_op": ("reducescatter", "op", ["op=Sum", "op=Max", "op=Sum"]),
        "grouped_count": ("grouped_allreduce", "shapes and dtypes",
                          ["[float32 [4]]", "[float32 [4], float32 [4]]", "[float32 [4]]"]),
        "requires_grad": ("grouped_allreduce", "requires_grad",
                          ["requires_grad=False", "requires_grad=True", "requires_grad=False"]),
    }
    for o in ranks:
        for label, (collective, what, passed) in refused.items():
            assert o[label] == f"{collective}: every rank must pass the same {what}, " + got(*passed), label
        assert o["no_handle_left"] is True
        assert o["allreduce"] == [1.0, 2.0, 3.0, 4.0]
        assert o["fp16"] == [3.0, 6.0, 9.0, 12.0]
        assert o["mixed_forms"] == [1.0, 2.0, 3.0, 4.0]
        assert o["broadcast"] == [2.0, 3.0, 4.0, 5.0]
        assert o["grouped"] == [[3.0, 6.0, 9.0, 12.0], [3]]
        assert o["unchecked"] == 18.0
        assert o["prescaled"] == [3.0, 6.0, 9.0, 12.0]  # 2 * sum(0.5 * x)
        assert o["object"] == {"from": 1}
        assert o["sparse"] == [3.0, 0.0, 6.0, 0.0]
    assert ranks[1]["collective"] == ("broadcast: every rank must call the same collectives in the same order, "
                                      + got("allreduce", "broadcast", "allreduce"))
    assert ranks[0]["collective"].startswith("allreduce: every rank must call the same collectives")
    for o in ranks[1:]:  # ranks are global in the message
        assert o["process_set"] == ("allreduce: every rank must pass the same shape and dtype, got rank 1: "
                                    "float32 [3], rank 2: float32 [4]")
        assert o["set_sum"] == 3.0
    assert "process_set" not in ranks[0]
    assert [o["alltoall"] for o in ranks] == [([0.0, 1.0, 2.0], [1, 1, 1]), ([0.0, 1.0, 2.0], [1, 1, 1]),
                                              ([0.0, 1.0, 1.0, 2.0, 2.0, 2.0], [1, 2, 3])]
    assert [o["reducescatter"] for o in ranks] == [[3.0], [3.0], [3.0]]
    # rank r's (r + 1) * g, summed, times [1, 2] on each of the 3 ranks
    assert [o["grouped_grad"] for o in ranks] == [[3.0, 6.0], [6.0, 12.0], [9.0, 18.0]]
    assert [o["grouped_reducescatter"] for o in ranks] == [[[1.0], [1.0, 1.0]]] * 3
