"""Every ``spark_dl.horovod`` function on two real ranks (Gloo), against exact values.

One launch runs all the checks; each rank returns what it saw and the driver compares.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from spark_dl import HorovodRunner


def api_main():
    import torch

    import spark_dl.horovod as hvd

    out = {"initialized_before": hvd.is_initialized()}
    try:
        hvd.rank()
    except ValueError as e:
        out["uninitialized_error"] = str(e)
    hvd.init()
    hvd.init()  # idempotent, as in Horovod
    r, n = hvd.rank(), hvd.size()
    out.update(
        initialized=hvd.is_initialized(), rank=r, size=n, local_rank=hvd.local_rank(),
        local_size=hvd.local_size(), cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(),
        homogeneous=hvd.is_homogeneous(),
    )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.start_timeline("/tmp/timeline.json")
        hvd.stop_timeline()
    out["timeline_warning"] = [str(w.message) for w in caught]
    out["built"] = dict(cuda=hvd.cuda_built(), rocm=hvd.rocm_built(), ccl=hvd.ccl_built(), ddl=hvd.ddl_built(),
                        mpi_enabled=hvd.mpi_enabled(), mpi_threads=hvd.mpi_threads_supported(),
                        gloo_enabled=hvd.gloo_enabled(), nccl=hvd.nccl_built(), gloo=hvd.gloo_built())

    t = torch.tensor([1.0, 2.0, 3.0]) * (r + 1)  # rank 0: [1, 2, 3], rank 1: [2, 4, 6]
    before = t.clone()
    out["avg"] = hvd.allreduce(t, name="t").tolist()
    out["sum"] = hvd.allreduce(t, op=hvd.Sum).tolist()
    out["max"] = hvd.allreduce(t, op=hvd.Max).tolist()
    out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist()
    out["deprecated_average_false"] = hvd.allreduce(t, average=False).tolist()
    out["fp16"] = hvd.allreduce(t, compression=hvd.Compression.fp16).tolist()
    out["fp16_dtype"] = str(hvd.allreduce(t, compression=hvd.Compression.fp16).dtype)
    out["input_untouched"] = torch.equal(t, before)
    inplace = t.clone()
    out["allreduce_returns_same_object"] = hvd.allreduce_(inplace, op=hvd.Sum) is inplace
    out["allreduce_"] = inplace.tolist()
    ints = torch.tensor([r + 1, 10 * (r + 1)])
    out["int_sum"] = hvd.allreduce(ints, op=hvd.Sum).tolist()
    # Horovod's Compression.fp16 casts floating-point tensors only: a count passes as it is
    fp16 = hvd.Compression.fp16
    out["int_fp16"] = [hvd.allreduce(ints, op=hvd.Sum, compression=fp16).tolist(),
                       str(hvd.allreduce(ints, compression=fp16).dtype),
                       [x.tolist() for x in hvd.grouped_allreduce([ints, t], op=hvd.Sum, compression=fp16)],
                       hvd.reducescatter(torch.tensor([[r + 1], [5 * (r + 1)]]), op=hvd.Sum, compression=fp16).tolist()]
    out["max_fp16"] = hvd.allreduce(t + 1e-3, op=hvd.Max, compression=fp16).tolist()  # in float16, as Horovod
    h = hvd.allreduce_async(t)
    out["async"] = hvd.synchronize(h).tolist()
    h = hvd.allreduce_async_(t.clone(), op=hvd.Sum)
    hvd.barrier()
    out["poll_after_barrier"] = hvd.poll(h)
    out["async_"] = hvd.synchronize(h).tolist()

    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x * (r + 1), op=hvd.Sum) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    out["allreduce_grad"] = x.grad.tolist()

    # Rank r contributes r + 1 rows filled with r: different first dimensions.
    rows = torch.full((r + 1, 2), float(r))
    out["allgather"] = hvd.allgather(rows, name="rows").tolist()
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(rows)).tolist()
    g = torch.full((r + 1, 2), 1.0, requires_grad=True)
    (hvd.allgather(g) * torch.arange(3.0).unsqueeze(1)).sum().backward()
    out["allgather_grad"] = g.grad.tolist()
    for kind, t in (("dims", torch.ones(1, 2 + r)), ("dtype", torch.ones(2, 2, dtype=torch.int64 if r else torch.float32))):
        try:
            hvd.allgather(t)
        except ValueError as e:  # both ranks see every layout, so both raise and stay in step
            out[f"allgather_{kind}_mismatch"] = str(e)

    b = torch.tensor([float(r), float(r)])
    out["broadcast"] = hvd.broadcast(b, root_rank=1).tolist()
    out["broadcast_input_untouched"] = b.tolist()
    hvd.broadcast_(b, root_rank=0)
    out["broadcast_"] = b.tolist()

    out["broadcast_object"] = hvd.broadcast_object({"from": r, "fn": (lambda v: v + r)}, root_rank=1)["fn"](10)
    out["allgather_object"] = hvd.allgather_object({"rank": r, "payload": "x" * (r * 1000)})

    torch.manual_seed(100 + r)  # different initial weights per rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(5, 4))  # moves BatchNorm running stats away from their init
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out["state_after_broadcast"] = {k: v.tolist() for k, v in model.state_dict().items()}
    other = torch.nn.Linear(2, 2)
    with torch.no_grad():
        other.weight.fill_(r)
        other.bias.fill_(r)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=1)
    out["named_params_after_broadcast"] = [p.tolist() for p in other.parameters()]

    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.8, 0.9))
    model(torch.randn(6, 4) * (r + 1)).pow(2).sum().backward()
    opt.step()  # per-rank Adam moments
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    out["opt_lr"] = sd["param_groups"][0]["lr"]
    out["opt_state"] = {i: {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s.items()} for i, s in sd["state"].items()}

    for label, call in [("op_and_average", lambda: hvd.allreduce(t, op=hvd.Sum, average=True)),
                        ("bad_compression", lambda: hvd.allreduce(t, compression="fp16"))]:
        try:
            call()
        except Exception as e:
            out[f"error_{label}"] = type(e).__name__
    hvd.shutdown()
    out["after_shutdown"] = hvd.is_initialized()
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(api_main)


def test_topology(ranks):
    assert [o["rank"] for o in ranks] == [0, 1]
    for i, o in enumerate(ranks):
        assert o["initialized_before"] is False and o["initialized"] is True and o["after_shutdown"] is False
        assert "hvd.init()" in o["uninitialized_error"]
        assert (o["size"], o["local_rank"], o["local_size"], o["cross_rank"], o["cross_size"]) == (2, i, 2, 0, 1)
        assert o["homogeneous"] is True


def test_build_queries_and_timeline(ranks):
    import torch

    for o in ranks:
        b = o["built"]
        assert b["cuda"] == torch.backends.cuda.is_built() and b["rocm"] == (torch.version.hip is not None)
        assert (b["ccl"], b["ddl"], b["mpi_enabled"], b["mpi_threads"]) == (False, False, False, False)
        assert b["gloo_enabled"] is True and b["gloo"] is True
        assert len(o["timeline_warning"]) == 1 and "torch.profiler" in o["timeline_warning"][0]


def test_allreduce(ranks):
    for o in ranks:
        assert o["avg"] == [1.5, 3.0, 4.5]
        assert o["sum"] == [3.0, 6.0, 9.0]
        assert o["max"] == [2.0, 4.0, 6.0]
        assert o["scaled"] == [3.0, 6.0, 9.0]  # 0.5 * sum(2 * t)
        assert o["deprecated_average_false"] == [3.0, 6.0, 9.0]
        assert o["fp16"] == [1.5, 3.0, 4.5] and o["fp16_dtype"] == "torch.float32"
        assert o["input_untouched"] is True
        assert o["allreduce_returns_same_object"] is True and o["allreduce_"] == [3.0, 6.0, 9.0]
        assert o["int_sum"] == [3, 30]
        assert o["int_fp16"][0] == [3, 30] and o["int_fp16"][1] == "torch.int64"
        assert o["int_fp16"][2] == [[3, 30], [3.0, 6.0, 9.0]]
        assert o["int_fp16"][3] == [[3] if o["rank"] == 0 else [15]]
        assert o["max_fp16"] == torch.tensor([2.001, 4.001, 6.001]).half().float().tolist()
        assert o["async"] == [1.5, 3.0, 4.5]
        assert o["poll_after_barrier"] is True and o["async_"] == [3.0, 6.0, 9.0]
        assert o["error_op_and_average"] == "ValueError"
        assert o["error_bad_compression"] == "TypeError"


def test_allreduce_is_differentiable(ranks):
    # d/dx_r of sum_k w_k * sum_r (r + 1) x_r  =  (r + 1) * (w summed over both ranks' losses).
    assert ranks[0]["allreduce_grad"] == [2.0, 4.0, 6.0]
    assert ranks[1]["allreduce_grad"] == [4.0, 8.0, 12.0]


def test_allgather_with_different_first_dims(ranks):
    for o in ranks:
        assert o["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert o["allgather_async"] == o["allgather"]
    # Row weights 0, 1, 2 across the gathered rows, summed over both ranks' losses.
    assert ranks[0]["allgather_grad"] == [[0.0, 0.0]]
    assert ranks[1]["allgather_grad"] == [[2.0, 2.0], [4.0, 4.0]]


def test_allgather_of_tensors_that_differ_beyond_the_first_dimension_is_refused_on_every_rank(ranks):
    for o in ranks:
        assert o["allgather_dims_mismatch"] == (
            "allgather: every rank must pass the same dtype and the same sizes of every dimension but the first, "
            "got rank 0: float32 [rows, 2], rank 1: float32 [rows, 3]")
        assert o["allgather_dtype_mismatch"].endswith("got rank 0: float32 [rows, 2], rank 1: int64 [rows, 2]")


def test_broadcast(ranks):
    for i, o in enumerate(ranks):
        assert o["broadcast"] == [1.0, 1.0]
        assert o["broadcast_input_untouched"] == [float(i), float(i)]
        assert o["broadcast_"] == [0.0, 0.0]


def test_broadcast_and_allgather_objects(ranks):
    for o in ranks:
        assert o["broadcast_object"] == 11  # rank 1's closure: v + 1
        assert o["allgather_object"] == [{"rank": 0, "payload": ""}, {"rank": 1, "payload": "x" * 1000}]


def test_broadcast_parameters(ranks):
    assert ranks[0]["state_after_broadcast"] == ranks[1]["state_after_broadcast"]
    assert ranks[0]["state_after_broadcast"]["1.num_batches_tracked"] == 1
    for o in ranks:
        assert o["named_params_after_broadcast"] == [[[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]]


def test_broadcast_optimizer_state(ranks):
    for o in ranks:
        assert o["opt_lr"] == 0.01
    assert ranks[0]["opt_state"] == ranks[1]["opt_state"]
    assert ranks[0]["opt_state"][0]["step"] == 1.0


def run_plain_script(code: str) -> subprocess.CompletedProcess:
    """``code`` under plain python, outside any launcher (none of its variables set); it must succeed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_a_plain_script_is_a_world_of_one():
    code = (
        "import torch, spark_dl.horovod as hvd\n"
        "hvd.init()\n"
        "print(hvd.rank(), hvd.size(), hvd.local_size(), hvd.allreduce(torch.tensor([4.0])).item())\n"
        "w = torch.nn.Parameter(torch.ones(2))\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0))\n"
        "w.sum().backward(); opt.step()\n"
        "print(hvd.join(), w.tolist())\n"
    )
    out = run_plain_script(code)
    assert out.stdout.split() == ["0", "1", "1", "4.0", "0", "[0.0,", "0.0]"]


def test_compression_that_is_not_a_usable_compressor_is_refused_by_name():
    """A name, a class that needs arguments, and (for a collective called every step) a class that
    keeps state between calls: each a TypeError naming what to pass; a stateless class is fine."""
    code = (
        "import torch, spark_dl.horovod as hvd\n"
        "from spark_dl.compression import ErrorFeedback, OneBit, QSGD, RandomK\n"
        "hvd.init()\n"
        "print(hvd.allreduce(torch.tensor([4.0]), compression=QSGD).item())\n"
        "for c in ('fp16', ErrorFeedback, OneBit, RandomK):\n"
        "    try:\n"
        "        hvd.allreduce(torch.tensor([4.0]), name='g', compression=c)\n"
        "    except TypeError as e:\n"
        "        print('REFUSED', e)\n"
        "w = torch.nn.Parameter(torch.ones(2))\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), compression=OneBit)  # built once: fine\n"
        "w.sum().backward(); opt.step()\n"
        "print(w.tolist())\n"
    )
    out = run_plain_script(code)
    lines = out.stdout.splitlines()
    assert lines[0] == "4.0" and lines[-1] == "[0.0, 0.0]"
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 4, out.stdout
    assert "got 'fp16', which is not a spark_dl.compression.Compressor: use an instance such as FP16()" in refused[0]
    assert "the class ErrorFeedback, which takes arguments: pass ErrorFeedback(...)" in refused[1]
    assert "compression=OneBit keeps state between calls" in refused[2] and "create OneBit() once" in refused[2]
    # its step counter: a fresh instance per call drew the same indices every time (2% of entries ever sent)
    assert "compression=RandomK keeps state between calls" in refused[3]
