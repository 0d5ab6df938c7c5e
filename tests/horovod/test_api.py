"""Every ``spark_dl.horovod`` function on two real ranks (Gloo), against exact values.

One launch runs all the checks; each rank returns what it saw and the driver compares.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from spark_dl import HorovodRunner, RankFailed


def api_main():
    import spark_dl.horovod as hvd
    import torch

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
    hvd.barrier()  # does not start the pending op (Horovod matches it by name, not by order)
    out["poll_before_start"] = hvd.poll(h)  # False, and starts it
    hvd.barrier()  # after the all-reduce on the same group
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
    for kind, t in (("dims", torch.ones(1, 2 + r)),
                    ("dtype", torch.ones(2, 2, dtype=torch.int64 if r else torch.float32))):
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
    out["opt_state"] = {i: {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s.items()}
                        for i, s in sd["state"].items()}

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
        assert o["poll_before_start"] is False
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
    # Row weights 0, 1, 2 across the gathered rows, averaged over both ranks' losses (Horovod's rule).
    assert ranks[0]["allgather_grad"] == [[0.0, 0.0]]
    assert ranks[1]["allgather_grad"] == [[1.0, 1.0], [2.0, 2.0]]


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


def mismatched_model_main(kind):
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    r = hvd.rank()
    if kind == "shape":  # a vocabulary counted on each rank's own shard
        model = torch.nn.Sequential(torch.nn.Embedding(100 + 20 * r, 16), torch.nn.Linear(16, 3))
    elif kind == "count":
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(1 + r)])
    else:
        model = torch.nn.Linear(4, 4).to(torch.float64 if r else torch.float32)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


@pytest.mark.parametrize("kind, difference", [
    ("shape", "rank 1's '0.weight' is float32 [120, 16] but rank 0's is float32 [100, 16]"),
    ("count", "rank 1 has 4 tensors but rank 0 has 2, and rank 1's '1.bias' (float32 [4]) is not among rank 0's"),
    ("dtype", "rank 1's 'bias' is float64 [4] but rank 0's is float32 [4]"),
], ids=["shape", "count", "dtype"])
def test_broadcast_parameters_of_models_that_differ_between_ranks_fails_fast_naming_the_difference(kind, difference):
    # Unchecked, Gloo keeps a prefix of rank 0's bytes (shape, count: silently), fills float64
    # from float32 bytes (garbage), aborts a rank whose buffer is too short, or hangs.
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        HorovodRunner(np=-2, run_timeout=60).run(mismatched_model_main, kind)
    assert time.monotonic() - start < 30
    assert (f"broadcast_parameters: {difference}: every rank must build the same model (a size such as a "
            "vocabulary or a number of classes, if computed from each rank's own data, differs between ranks: "
            "compute it on one rank and hvd.broadcast_object it to the others)") in str(failed.value)


def layout_checks_main():
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    r = hvd.rank()
    out = {}

    def refused(label, call):
        try:
            call()
        except ValueError as e:  # every rank sees every rank's fingerprint: all raise, and stay in step
            out[label] = str(e)

    counted = [torch.ones(4, 4) * r for _ in range(1 + r)]
    refused("parameters", lambda: hvd.broadcast_parameters(counted, root_rank=0))
    out["untouched"] = all(torch.equal(t, torch.ones(4, 4) * r) for t in counted)
    layers = {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 3)}
    built = torch.nn.ModuleDict({k: layers[k] for k in (("a", "b") if r == 0 else ("b", "a"))})
    refused("order", lambda: hvd.broadcast_parameters(built.named_parameters(), root_rank=0))
    hvd.broadcast_parameters(built.state_dict(), root_rank=0)  # sorted by name: the order does not matter
    classes = torch.nn.Linear(4, 3 + r)
    refused("optimizer", lambda: hvd.broadcast_optimizer_state(torch.optim.SGD(classes.parameters(), lr=0.1), 0))
    pair = hvd.add_process_set([1, 2])
    if r in pair.ranks:
        head = torch.nn.Linear(4, 2 + r, bias=False)
        refused("process_set", lambda: hvd.broadcast_parameters(head.state_dict(), root_rank=2, process_set=pair))
        same = torch.nn.Linear(4, 2).to(torch.float64)
        hvd.broadcast_parameters(same.state_dict(), root_rank=2, process_set=pair)
        out["set_after"] = {k: v.tolist() for k, v in same.state_dict().items()}

    torch.manual_seed(100 + r)  # the same model, different initial weights per rank
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2))
    out["before"] = {k: v.tolist() for k, v in model.state_dict().items()}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out["after"] = {k: v.tolist() for k, v in model.state_dict().items()}
    return out


def test_layouts_that_differ_are_refused_on_every_rank_and_equal_ones_still_broadcast():
    ranks = HorovodRunner(np=-3, run_timeout=60).run_all(layout_checks_main)
    for o in ranks:
        assert o["parameters"].startswith(
            "broadcast_parameters: rank 1 has 2 tensors but rank 0 has 1, and rank 1's tensor #1 (float32 [4, 4]) "
            "is not among rank 0's: every rank must build the same model")
        assert o["untouched"] is True  # refused before any tensor was overwritten
        assert o["order"].startswith("broadcast_parameters: rank 1 passes 'b.weight' where rank 0 passes "
                                     "'a.weight' (the same names in another order): ")
        assert o["optimizer"].startswith("broadcast_optimizer_state: rank 1's param_groups[0]['params'][0] is "
                                         "float32 [4, 4] but rank 0's is float32 [3, 4]: ")
    for o in ranks[1:]:  # ranks are global in the message: the set's root is rank 2
        assert o["process_set"].startswith(
            "broadcast_parameters: rank 1's 'weight' is float32 [3, 4] but rank 2's is float32 [4, 4]: ")
    assert "process_set" not in ranks[0]
    assert ranks[1]["set_after"] == ranks[2]["set_after"]
    assert ranks[0]["before"] != ranks[1]["before"]
    for o in ranks:
        assert o["after"] == ranks[0]["before"]


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
