"""``spark_dl.compression.allreduce`` through two real rank processes (Gloo).

One launch runs every check; each rank returns what it saw and the test compares the ranks
with each other and with values recomputed here.
"""
from __future__ import annotations

import math

import pytest
import torch

import spark_dl.compression as C
from spark_dl import HorovodRunner

SHAPE = (37, 11)  # 407 elements: uneven chunks (204 + 203)


def grad(rank: int, shape=SHAPE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank))


def compressors() -> dict:
    return {
        # the error-feedback compressors through the scatter-reduce (single_stage_up_to=0), 1-bit with
        # one pair of means per 204-element chunk; "onebit_1stage" is the default, all-gathered
        "none": C.NoneCompressor(), "fp16": C.FP16(), "bf16": C.BF16(),
        "onebit": C.OneBit(1024, single_stage_up_to=0), "efsign": C.EFSign(single_stage_up_to=0),
        "qsgd": C.QSGD(), "topk": C.TopK(0.1, ramp_steps=0),  # k from the first call: the recipe below
        "topk_ef": C.ErrorFeedback(C.TopK(0.1, ramp_steps=0), single_stage_up_to=0), "randomk": C.RandomK(0.1),
        "powersgd": C.PowerSGD(rank=2, start_iter=0), "onebit_1stage": C.OneBit(),
    }


def collective_main():
    import torch
    import torch.distributed as dist

    import spark_dl
    import spark_dl.compression as C

    spark_dl.init()
    r = dist.get_rank()
    out: dict = {"rank": r}
    g = grad(r)
    before = g.clone()
    for key, c in compressors().items():
        out[key] = C.allreduce(g, c, name="g").tolist()
        fresh = compressors()[key] if key not in ("topk", "topk_ef", "randomk", "powersgd") else c
        out[key + "_sum"] = C.allreduce(g, fresh, op="sum", name="gs").tolist()
    out["input_untouched"] = torch.equal(g, before)
    # out=: the result lands in the given tensor, the input itself included, and is the same
    into = {}

    def seeded():  # QSGD draws a random seed unless given one
        return {**compressors(), "qsgd": C.QSGD(seed=3)}
    for op in ("average", "sum"):
        refs, fresh = seeded(), seeded()
        for key in refs:
            want = C.allreduce(g, refs[key], name="o", op=op)
            x = g.clone()
            got = C.allreduce(x, fresh[key], name="o", op=op, out=x)
            other = torch.empty_like(g)
            again = C.allreduce(g, seeded()[key], name="o", op=op, out=other)
            into[key, op] = (got is x, torch.equal(got, want), again is other, torch.equal(again, want))
    out["into"] = into

    # QSGD is unbiased through scatter-reduce + all-gather (quantized twice).
    q = C.QSGD(levels=3, seed=r)
    small = grad(r, (64,))
    out["qsgd_samples"] = torch.stack([C.allreduce(small, q) for _ in range(300)]).tolist()

    # Error feedback through the collective: the running mean converges to the exact average.
    for key, make in [("onebit", C.OneBit), ("efsign", C.EFSign)]:
        c = make(single_stage_up_to=0)
        outs = [C.allreduce(g, c, name="ef") for _ in range(100)]
        out[key + "_ef_mean"] = torch.stack(outs).mean(0).tolist()
        memory = c.residuals.memory
        out[key + "_worker_memory"] = torch.cat([memory["ef", "worker", j] for j in (0, 1)]).tolist()
        out[key + "_server_memory"] = memory["ef", "server"].tolist()  # this rank's chunk
    # One stage (the default up to 8 ranks): the whole tensor, one memory per rank.
    c = C.OneBit()
    outs = [C.allreduce(g, c, name="ef1") for _ in range(100)]
    out["onebit_1stage_ef_mean"] = torch.stack(outs).mean(0).tolist()
    out["onebit_1stage_memory"] = c.residuals.memory["ef1", "worker"].tolist()
    out["onebit_1stage_keys"] = sorted(c.residuals.memory)

    # PowerSGD: a shared column space makes rank 2 exact; before start_iter it is uncompressed.
    u = torch.randn(20, 2, generator=torch.Generator().manual_seed(7))
    low = u @ torch.randn(2, 15, generator=torch.Generator().manual_seed(r))
    p = C.PowerSGD(rank=2, start_iter=0)
    out["psgd_low"] = [C.allreduce(low, p, name="low").tolist() for _ in range(2)]
    p = C.PowerSGD(rank=1, start_iter=2)
    out["psgd_warmup"] = [C.allreduce(g, p, name="w").tolist() for _ in range(3)]
    # A bucket of a rank-2 weight, a bias and a rank-2 conv kernel, each factored on its own:
    # the average is exact, in two all-reduces (all P with the bias, then all Q).
    bucket = torch.cat([low.reshape(-1), grad(r, (15,)),
                        (u[:8] @ torch.randn(2, 27, generator=torch.Generator().manual_seed(9 + r))).reshape(-1)])
    p = C.PowerSGD(rank=2, start_iter=0)
    before_stats = C.stats.snapshot()
    out["psgd_bucket"] = C.allreduce(bucket, p, name="bucket", layout=[(20, 15), (15,), (8, 3, 3, 3)]).tolist()
    out["psgd_bucket_bytes"] = C.stats.snapshot()["bytes_sent"] - before_stats["bytes_sent"]
    out["psgd_bucket_in"] = bucket.tolist()

    # Layer by layer: a bucket of a (20, 15) weight, a bias of 15 and an (8, 27) weight. 1-bit's
    # 64-element buckets (one stage) and EF-sign's scale (through the scatter-reduce, whose chunks
    # cut the bucket again) never span two of them.
    layers = [(20, 15), (15,), (8, 27)]
    packed = grad(r, (531,))
    c = C.OneBit()
    out["layers_onebit"] = C.allreduce(packed, c, name="lay", layout=layers).tolist()
    out["layers_onebit_keys"] = sorted(c.residuals.memory)
    c = C.EFSign(single_stage_up_to=0)
    outs = [C.allreduce(packed, c, name="lay2", layout=layers) for _ in range(50)]
    out["layers_efsign_mean"] = torch.stack(outs).mean(0).tolist()
    memory = c.residuals.memory
    out["layers_efsign_keys"] = sorted(memory)
    out["layers_efsign_worker"] = torch.cat([memory[k] for k in sorted(k for k in memory if k[1] == "worker")]).tolist()
    out["layers_efsign_server"] = torch.cat([memory[k] for k in sorted(k for k in memory if k[1] == "server")]).tolist()

    # Bytes per step, fp32 vs compressed (2**16 elements).
    big = torch.randn(1 << 16, generator=torch.Generator().manual_seed(r))
    for key, c in [("none", C.NoneCompressor()), ("onebit", C.OneBit()), ("qsgd", C.QSGD()),
                   ("fp16", C.FP16()), ("powersgd", C.PowerSGD(rank=4, start_iter=0))]:
        x = big.view(256, 256) if key == "powersgd" else big
        before_stats = C.stats.snapshot()
        C.allreduce(x, c, name="big")
        after = C.stats.snapshot()
        out["bytes_" + key] = after["bytes_sent"] - before_stats["bytes_sent"]
        out["dense_" + key] = after["bytes_dense"] - before_stats["bytes_dense"]
    out["calls"] = C.stats.calls

    # Edge cases through the collective.
    edges = {}
    for key, c in compressors().items():
        base = torch.randn(6, 9, generator=torch.Generator().manual_seed(r))
        cases = {"empty": torch.empty(0), "one": torch.tensor([1.0 + r]), "seven": grad(r, (7,)),
                 "nine": grad(r, (9,)), "noncontig": base.t(), "strided": base[:, ::2],
                 "f64": grad(r, (5,)).double(), "f16": grad(r, (3, 3)).half()}
        for case, t in cases.items():
            o = C.allreduce(t, c, name=case)
            edges[key, case] = (tuple(o.shape), str(o.dtype), o.float().tolist())
    out["edges"] = edges
    # Large chunks travel in pieces through asynchronous collectives (pipelined): force it on a
    # small tensor. Lossless top-k must still give the exact average; lossy ones agree on ranks.
    import spark_dl.compression.collectives as coll

    coll.PIECE_ELEMS = 64
    piecewise = grad(r, (1001,))
    before_stats = C.stats.snapshot()
    out["pieces_exact"] = C.allreduce(piecewise, C.TopK(1.0)).tolist()
    out["pieces_bytes"] = C.stats.snapshot()["bytes_sent"] - before_stats["bytes_sent"]
    out["pieces_onebit"] = C.allreduce(piecewise, C.OneBit(single_stage_up_to=0), name="p").tolist()
    ob = C.OneBit(single_stage_up_to=0)
    C.allreduce(piecewise, ob, name="p")
    out["pieces_onebit_keys"] = sorted(k[1:] for k in ob.residuals.memory)
    q = C.QSGD(seed=r)
    out["pieces_qsgd"] = torch.stack([C.allreduce(piecewise, q) for _ in range(200)]).mean(0).tolist()
    coll.PIECE_ELEMS = 1 << 21
    ints = torch.tensor([3 + r, 10 * (r + 1)])
    out["int_sum"] = C.allreduce(ints, op="sum").tolist()
    out["int_avg"] = C.allreduce(ints).tolist()
    errors = {}
    for key, call in [("int", lambda: C.allreduce(ints, C.QSGD())),
                      ("noname", lambda: C.allreduce(g, C.OneBit())),
                      ("op", lambda: C.allreduce(g, op="max")),
                      ("layout", lambda: C.allreduce(g, C.PowerSGD(), name="l", layout=[(37, 10)])),
                      ("out_dtype", lambda: C.allreduce(g, out=g.double())),
                      ("out_size", lambda: C.allreduce(g, out=torch.empty(5))),
                      ("layout_type", lambda: C.allreduce(g, C.QSGD(), layout=[None]))]:
        try:
            call()
        except (TypeError, ValueError) as e:
            errors[key] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(collective_main)


def exact(op="average", shape=SHAPE) -> torch.Tensor:
    s = grad(0, shape) + grad(1, shape)
    return s / 2 if op == "average" else s


def expected_scatter_reduce(codec, x0, x1):
    """What scatter-reduce + all-gather must return on a first call (empty memories)."""
    parts = []
    for c0, c1 in zip(torch.tensor_split(x0.reshape(-1), 2), torch.tensor_split(x1.reshape(-1), 2)):
        s = codec.decompress(codec.compress(c0)) + codec.decompress(codec.compress(c1))
        parts.append(codec.decompress(codec.compress(s)))
    return torch.cat(parts).reshape(x0.shape)


def test_identical_on_every_rank(ranks):
    a, b = ranks
    assert (a["rank"], b["rank"]) == (0, 1)
    for key in compressors():
        assert a[key] == b[key], key
        assert a[key + "_sum"] == b[key + "_sum"], key
    assert a["edges"] == b["edges"]
    assert a["input_untouched"] and b["input_untouched"]


def test_large_chunks_are_pipelined_in_pieces(ranks):
    a, b = ranks
    x = exact(shape=(1001,))
    # 1001 elements, pieces of >= 64 per rank's chunk of 501: 7 pieces, lossless top-k exact
    assert torch.equal(torch.tensor(a["pieces_exact"]), x) and a["pieces_exact"] == b["pieces_exact"]
    assert a["pieces_onebit"] == b["pieces_onebit"]
    # error feedback is kept per (chunk, piece) on the worker side and per piece on the server side
    assert ("worker", 0, 6) in a["pieces_onebit_keys"] and ("server", 6) in a["pieces_onebit_keys"]
    assert len(a["pieces_onebit_keys"]) == 2 * 7 + 7
    # QSGD stays unbiased through the pipelined path (200 draws, quantized twice): within 5 sigma
    mean = torch.tensor(a["pieces_qsgd"])
    assert (mean - x).abs().max() < 5 * x.abs().max() / 200 ** 0.5
    # bytes: top-k(1.0) sends (values, indices) for half the vector twice: about 2 x 500 x 8 bytes
    assert 7000 < a["pieces_bytes"] < 9000


def test_lossless_and_cast_compressors(ranks):
    out = ranks[0]
    for op, suffix in (("average", ""), ("sum", "_sum")):
        want = exact(op)
        assert torch.allclose(torch.tensor(out["none" + suffix]), want, atol=1e-6)
        assert torch.allclose(torch.tensor(out["fp16" + suffix]), want, rtol=2e-3, atol=2e-3)
        assert torch.allclose(torch.tensor(out["bf16" + suffix]), want, rtol=1.6e-2, atol=1.6e-2)


def test_sign_and_topk_match_the_scatter_reduce_recipe(ranks):
    out = ranks[0]
    for key, codec in [("onebit", C.SignMeans()), ("efsign", C.ScaledSign(64)),  # EFSign()'s 64 a scale
                       ("topk", C.TopK(0.1, ramp_steps=0)), ("topk_ef", C.TopK(0.1, ramp_steps=0))]:
        want = expected_scatter_reduce(codec, grad(0) / 2, grad(1) / 2)
        assert torch.allclose(torch.tensor(out[key]), want, atol=1e-5), key
    want = expected_scatter_reduce(C.SignMeans(), grad(0), grad(1))
    assert torch.allclose(torch.tensor(out["onebit_sum"]), want, atol=1e-5)


def test_error_feedback_through_the_collective_loses_nothing(ranks):
    # Sum over T steps of the outputs = T * exact average minus what both memories still hold:
    # each rank's worker memory for every chunk, and each owner's server memory for its chunk.
    want, T = exact(), 100
    for key in ("onebit", "efsign"):
        mean = torch.tensor(ranks[0][key + "_ef_mean"])
        held = sum(torch.tensor(r[key + "_worker_memory"]) for r in ranks)
        held += torch.cat([torch.tensor(r[key + "_server_memory"]) for r in ranks])
        assert torch.allclose(T * mean + held.reshape(want.shape), T * want, atol=2e-3), key
        first = torch.tensor(ranks[0][key])
        assert (mean - want).norm() < 0.15 * (first - want).norm(), key


def test_one_stage_error_feedback_loses_nothing_and_keeps_one_memory_per_rank(ranks):
    want, T = exact(), 100
    mean = torch.tensor(ranks[0]["onebit_1stage_ef_mean"])
    assert mean.tolist() == ranks[1]["onebit_1stage_ef_mean"]
    held = sum(torch.tensor(r["onebit_1stage_memory"]) for r in ranks)
    assert torch.allclose(T * mean + held.reshape(want.shape), T * want, atol=2e-3)
    assert ranks[0]["onebit_1stage_keys"] == [("ef1", "worker")]
    # one compression of each rank's whole tensor, summed: each decoded with 64-element buckets
    codec = C.SignMeans(64)
    first = sum(codec.decompress(codec.compress(grad(r) / 2)) for r in (0, 1))
    assert torch.allclose(torch.tensor(ranks[0]["onebit_1stage"]), first, atol=1e-5)


def test_a_bucket_is_compressed_layer_by_layer_where_statistics_would_span_two_tensors(ranks):
    a, b = ranks
    assert a["layers_onebit"] == b["layers_onebit"] and a["layers_efsign_mean"] == b["layers_efsign_mean"]
    # one stage: each rank's share of every tensor compressed on its own (300 and 15 are not
    # multiples of 64, so each ends a piece), the two ranks' decodings summed
    codec, at, want = C.SignMeans(64), 0, []
    for n in (300, 15, 216):
        want.append(sum(codec.decompress(codec.compress(grad(r, (531,))[at:at + n] / 2)) for r in (0, 1)))
        at += n
    assert torch.allclose(torch.tensor(a["layers_onebit"]), torch.cat(want), atol=1e-5)
    assert a["layers_onebit_keys"] == [("lay", "worker", "layer", i) for i in range(3)]
    # the scatter-reduce: rank 0's chunk [0, 266) lies inside the first weight (one piece), rank 1's
    # [266, 531) holds its last 34 entries, the bias and the second weight (three pieces)
    workers = [("worker", 0)] + [("worker", 1, "layer", i) for i in range(3)]
    assert [k[1:] for k in a["layers_efsign_keys"]] == [("server",)] + workers
    assert [k[1:] for k in b["layers_efsign_keys"]] == [("server", "layer", i) for i in range(3)] + workers
    # error feedback still loses nothing: T * mean + what every memory holds = T * exact average
    T, x = 50, (grad(0, (531,)) + grad(1, (531,))) / 2
    held = sum(torch.tensor(r["layers_efsign_worker"]) for r in ranks)
    held += torch.cat([torch.tensor(r["layers_efsign_server"]) for r in ranks])
    assert torch.allclose(T * torch.tensor(a["layers_efsign_mean"]) + held, T * x, atol=2e-3)


def test_pieces_cut_a_bucket_only_where_a_statistic_would_span_two_tensors():
    from spark_dl.compression.layers import ByLayer, by_layer, pieces

    # tensors of whole buckets stay together, the bias of 10 ends its piece's last bucket
    assert pieces([64, 64, 10, 640], 64) == [138, 640]
    assert pieces([10, 640, 64], 64) == [10, 704]  # DDP's order: the last layer's bias first
    assert pieces([64, 64, 10, 640], 0) == [64, 64, 10, 640]  # one scale per tensor: every tensor alone
    assert pieces([64, 64, 10, 640], 64, start=100, length=50) == [28, 10, 12]  # a chunk of the bucket
    assert pieces([128, 64], 64) == [192] and pieces([5], 64) == [5] and pieces([0, 7, 0], 0) == [7]
    assert by_layer(C.OneBit(), [128, 64]).__class__ is C.OneBit  # nothing to cut: the compressor itself
    assert isinstance(by_layer(C.EFSign(), [10, 20]), ByLayer)
    assert by_layer(C.QSGD(), [10, 20]).__class__ is C.QSGD  # shares no statistic that needs it
    c = ByLayer(C.OneBit(), [10, 20])
    with pytest.raises(ValueError, match="pieces of 30 elements for a tensor of 31"):
        c.compress(torch.zeros(31), key="k")


def test_qsgd_is_unbiased_through_the_collective(ranks):
    samples = torch.tensor(ranks[0]["qsgd_samples"])
    assert samples.tolist() == ranks[1]["qsgd_samples"]
    se = samples.std(dim=0) / math.sqrt(len(samples))
    assert ((samples.mean(0) - exact(shape=(64,))).abs() <= 5 * se + 1e-6).all()
    # One sample is within the two-stage QSGD variance: sqrt(d)/s per stage, d = 32-element chunks.
    one = torch.tensor(ranks[0]["qsgd"])
    assert (one - exact()).norm() <= 3 * math.sqrt(2 * 512**0.5 / 7) * exact().norm()


def test_random_k_keeps_exact_averages_at_shared_indices(ranks):
    got = torch.tensor(ranks[0]["randomk"])
    want = exact()
    kept = got != 0
    assert 0 < kept.sum() <= math.ceil(0.1 * got.numel())
    assert torch.allclose(got[kept], want[kept], atol=1e-6)


def test_powersgd(ranks):
    out = ranks[0]
    u = torch.randn(20, 2, generator=torch.Generator().manual_seed(7))
    lows = [u @ torch.randn(2, 15, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    for step in out["psgd_low"]:
        assert torch.allclose(torch.tensor(step), (lows[0] + lows[1]) / 2, atol=1e-4)
    warm = [torch.tensor(s) for s in out["psgd_warmup"]]
    assert torch.allclose(warm[0], exact(), atol=1e-6) and torch.allclose(warm[1], exact(), atol=1e-6)
    assert torch.linalg.matrix_rank(warm[2]) == 1
    assert torch.linalg.matrix_rank(torch.tensor(out["powersgd"])) <= 2
    buckets = [torch.tensor(ranks[r]["psgd_bucket_in"]) for r in (0, 1)]
    assert torch.allclose(torch.tensor(out["psgd_bucket"]), (buckets[0] + buckets[1]) / 2, atol=1e-4)
    assert out["psgd_bucket"] == ranks[1]["psgd_bucket"]
    # Round 1: P of 20 x 2 and 8 x 2 with the 15 bias values; round 2: Q of 15 x 2 and 27 x 2.
    assert out["psgd_bucket_bytes"] == 4 * ((40 + 15 + 16) + (30 + 54))


def test_bytes_on_the_wire(ranks):
    out = ranks[0]
    n = 1 << 16
    assert out["bytes_none"] == out["dense_none"] == 4 * n  # ring: 2 (W-1)/W * 4n
    assert out["dense_onebit"] == out["dense_qsgd"] == 4 * n
    # 1 bit per element + two float32 means per 64-element bucket: 32 / 2 = 16x fewer (on 2 ranks
    # the one-stage all-gather sends one copy, as the scatter-reduce's 2 (W-1)/W does)
    assert out["bytes_none"] / out["bytes_onebit"] == pytest.approx(32 / 2, rel=0.01)
    assert out["bytes_none"] / out["bytes_qsgd"] == pytest.approx(8, rel=0.02)
    assert out["bytes_none"] / out["bytes_fp16"] == 2
    # P (256 x 4) and Q (256 x 4) in float32; a 2-rank ring sends each once.
    assert out["bytes_powersgd"] == (256 + 256) * 4 * 4
    assert out["bytes_none"] / out["bytes_powersgd"] == 32 / C.PowerSGD(rank=4).bits_per_element((256, 256))
    assert ranks[1]["bytes_onebit"] == out["bytes_onebit"]
    assert out["calls"] > 0


def test_edge_cases(ranks):
    edges = ranks[0]["edges"]
    for key in compressors():
        assert edges[key, "empty"][:2] == ((0,), "torch.float32")
        assert edges[key, "one"][2] == pytest.approx([1.5], rel=1e-2), key  # a single element is exact
        assert edges[key, "seven"][0] == (7,) and edges[key, "nine"][0] == (9,)
        assert edges[key, "noncontig"][0] == (9, 6) and edges[key, "strided"][0] == (6, 5)
        assert edges[key, "f64"][1] == "torch.float64" and edges[key, "f16"][1] == "torch.float16"
    for key in compressors():
        for case in ("seven", "nine", "noncontig", "strided", "f64", "f16"):
            assert torch.isfinite(torch.tensor(edges[key, case][2])).all(), (key, case)
    base = [torch.randn(6, 9, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    assert torch.allclose(torch.tensor(edges["none", "noncontig"][2]), (base[0].t() + base[1].t()) / 2)
    assert torch.allclose(torch.tensor(edges["none", "strided"][2]), (base[0][:, ::2] + base[1][:, ::2]) / 2)
    assert ranks[0]["int_sum"] == [7, 30] and ranks[0]["int_avg"] == [3, 15]
    errors = ranks[0]["errors"]
    assert errors["int"].startswith("TypeError") and "floating-point" in errors["int"]
    assert errors["noname"].startswith("ValueError") and "name=" in errors["noname"]
    assert errors["op"].startswith("ValueError")
    assert (errors["layout"].startswith("ValueError")
            and "370 elements in 1 tensors but the tensor has 407" in errors["layout"])
    assert errors["layout_type"].startswith("TypeError") and "list of shapes" in errors["layout_type"]
    assert "out must be a contiguous tensor of 407 torch.float32" in errors["out_dtype"]
    assert "got torch.float64" in errors["out_dtype"] and "got torch.float32 (5,)" in errors["out_size"]


def test_out_receives_the_result_even_when_it_is_the_input(ranks):
    for (key, op), (is_x, same, is_other, same_again) in ranks[0]["into"].items():
        assert is_x and is_other, (key, op)
        assert same and same_again, (key, op)


@pytest.mark.parametrize("compression,message", [
    ("qsgd", r"allreduce got 'qsgd', which is not a spark_dl.compression.Compressor: use an instance such as QSGD\(\)"),
    ("top-k", r"such as TopK\(\)"),
    (3, r"allreduce got 3, which is not a spark_dl.compression.Compressor"),
    # a fresh instance every call would drop the state a compressor keeps between calls
    (C.QSGD, r"allreduce got the class QSGD: pass QSGD\(\) \(an instance\), created once and reused"),
    (C.OneBit, r"pass OneBit\(\) \(an instance\)"),
    (C.ErrorFeedback, r"allreduce got the class ErrorFeedback, which takes arguments: pass ErrorFeedback\(...\)"),
])
def test_allreduce_refuses_what_is_not_a_compressor_instance(compression, message):
    # refused before any collective: no process group is needed to see it
    with pytest.raises(TypeError, match=message):
        C.allreduce(grad(0), compression, name="g")


@pytest.mark.parametrize("layout", ["abc", [(2.5, 4)], [("3", 4)], 5, [None], [b"ab"]])
def test_allreduce_refuses_a_layout_that_is_not_a_list_of_shapes(layout):
    with pytest.raises(TypeError, match="layout must be a list of shapes"):
        C.allreduce(grad(0), C.PowerSGD(), name="g", layout=layout)


def powersgd_main():
    import os

    import torch
    import torch.distributed as dist

    import spark_dl
    import spark_dl.compression as C

    spark_dl.init()
    r = dist.get_rank()
    out: dict = {}
    # (1, N) and (N, 1) weights (nn.Linear(d, 1) heads): uncompressed, exact, and bytes as sent.
    for shapes in ([(1, 1000)], [(1000, 1)], [(50, 40), (1, 1000), (40,)]):
        g = grad(r, (sum(math.prod(s) for s in shapes),))
        before = C.stats.snapshot()
        o = C.allreduce(g, C.PowerSGD(rank=4, start_iter=0), name="head", layout=shapes)
        after = C.stats.snapshot()
        out["shapes", str(shapes)] = (o.tolist(), after["bytes_sent"] - before["bytes_sent"],
                                      after["bytes_dense"] - before["bytes_dense"])
    # float64 before start_iter: all-reduced in float64, as dense as it is.
    before = C.stats.snapshot()
    o = C.allreduce(grad(r, (100, 100)).double(), C.PowerSGD(start_iter=10), name="f64")
    after = C.stats.snapshot()
    out["f64"] = (str(o.dtype), o.tolist(), after["bytes_sent"] - before["bytes_sent"],
                  after["bytes_dense"] - before["bytes_dense"])
    # An inf on rank 0 at step 1, on the native and the torch path.
    u = torch.randn(20, 2, generator=torch.Generator().manual_seed(7))
    low = u @ torch.randn(2, 15, generator=torch.Generator().manual_seed(r))
    for native in ("1", "0"):
        os.environ["SPARK_DL_NATIVE"] = native
        p = C.PowerSGD(rank=2, start_iter=0)
        steps = []
        for step in range(5):
            g = low.clone()
            if step == 1 and r == 0:
                g[3, 5] = float("inf")
            steps.append(C.allreduce(g, p, name="low").tolist())
        out["poison", native] = steps
    os.environ.pop("SPARK_DL_NATIVE")
    return out


@pytest.fixture(scope="module")
def powersgd_ranks():
    return HorovodRunner(np=-2).run_all(powersgd_main)


def test_powersgd_sends_row_and_column_weights_exactly(powersgd_ranks):
    a, b = powersgd_ranks
    for shapes, numel, sent in [("[(1, 1000)]", 1000, 4000), ("[(1000, 1)]", 1000, 4000),
                                # P 50 x 4 beside the 1040 sent as they are; Q 40 x 4
                                ("[(50, 40), (1, 1000), (40,)]", 3040, 4 * (1040 + 200 + 160))]:
        got, nbytes, dense = a["shapes", shapes]
        assert got == b["shapes", shapes][0]
        assert (nbytes, dense) == (sent, 4 * numel)  # a 2-rank ring sends each byte once
        want = exact(shape=(numel,))
        if numel == 1000:
            assert torch.allclose(torch.tensor(got), want, atol=1e-6, rtol=0)
        else:  # the (1, 1000) weight and the bias
            assert torch.allclose(torch.tensor(got)[2000:], want[2000:], atol=1e-6, rtol=0)


def test_powersgd_reduces_float64_in_float64(powersgd_ranks):
    dtype, got, nbytes, dense = powersgd_ranks[0]["f64"]
    assert dtype == "torch.float64" and nbytes == dense == 8 * 10_000
    want = (grad(0, (100, 100)).double() + grad(1, (100, 100)).double()) / 2
    assert torch.equal(torch.tensor(got, dtype=torch.float64), want)  # no float32 rounding on the way


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_powersgd_recovers_after_an_inf_on_one_rank(powersgd_ranks, native):
    a, b = powersgd_ranks
    steps = [torch.tensor(s) for s in a["poison", native]]
    for s, t in zip(steps, b["poison", native]):  # identical on both ranks, NaN where NaN
        torch.testing.assert_close(s, torch.tensor(t), rtol=0, atol=0, equal_nan=True)
    u = torch.randn(20, 2, generator=torch.Generator().manual_seed(7))
    want = sum(u @ torch.randn(2, 15, generator=torch.Generator().manual_seed(r)) for r in (0, 1)) / 2
    assert torch.allclose(steps[0], want, atol=1e-4)
    assert not torch.isfinite(steps[1]).all()  # the overflow reaches every rank: GradScaler skips
    for s in steps[2:]:  # then back to the exact average (it stayed NaN for good)
        assert torch.allclose(s, want, atol=1e-4)
