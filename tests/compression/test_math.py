"""The maths of each compressor, in one process: lecture examples, QSGD's bounds, error feedback."""
from __future__ import annotations

import math
import pickle

import pytest
import torch

import spark_dl.compression as C
from spark_dl.compression.bits import pack, packed_nbytes, unpack


def test_one_bit_worked_example():
    # Lecture 000, "1-bit SGD example". The slide prints the reconstruction with five entries
    # (the fifth, 15.3 -> 8.8875, is missing); g has six, so q(g) has six.
    g = torch.tensor([0.1, 0.15, -0.2, 20.0, 15.3, -1.222])
    c = C.SignMeans()
    payload = c.compress(g)
    means, bits = payload.tensors
    assert means.tolist() == pytest.approx([8.8875, -0.711], abs=1e-5)
    q = c.decompress(payload)
    assert q.tolist() == pytest.approx([8.8875, 8.8875, -0.711, 8.8875, 8.8875, -0.711], abs=1e-5)
    # Signs (1, 1, -1, 1, 1, -1) in one byte, plus two float32 means: n + 2F bits.
    assert unpack(bits, 6, 1).tolist() == [1, 1, 0, 1, 1, 0]
    assert bits.dtype == torch.uint8 and payload.nbytes == 1 + 8
    # OneBit is the same quantizer with error feedback: the first step has no memory yet.
    assert C.OneBit().decompress(C.OneBit().compress(g, key="g")).tolist() == pytest.approx(q.tolist())


def test_one_bit_all_negative_uses_zero_for_the_empty_mean():
    g = torch.tensor([-1.0, -3.0])
    assert C.SignMeans().decompress(C.SignMeans().compress(g)).tolist() == [-2.0, -2.0]


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_round_trips_at_exact_size(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 9, 1000):
        codes = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.uint8)
        packed = pack(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits)
        assert packed.numel() <= bits * math.ceil(n / 8)
        assert torch.equal(unpack(packed, n, bits), codes)


def _samples(c, g, n):
    return torch.stack([c.decompress(c.compress(g)) for _ in range(n)])


@pytest.mark.parametrize("levels,bucket", [(1, None), (2, None), (7, None), (4, 16)])
def test_qsgd_unbiased_and_second_moment_bound(levels, bucket):
    """The QSGD paper's scale (norm="l2") and its bound."""
    g = torch.randn(64, generator=torch.Generator().manual_seed(levels))
    qs = _samples(C.QSGD(levels=levels, bucket_size=bucket, seed=levels, norm="l2"), g, 3000)
    # Unbiased: each coordinate's sample mean within 5 standard errors of g_i.
    se = qs.std(dim=0) / math.sqrt(len(qs))
    assert ((qs.mean(dim=0) - g).abs() <= 5 * se + 1e-6).all()
    # E||q||^2 <= (1 + min(d/s^2, sqrt(d)/s)) ||g||^2, d the bucket size (Alistarh et al.).
    d = bucket or g.numel()
    bound = (1 + min(d / levels**2, math.sqrt(d) / levels)) * g.square().sum()
    second = qs.square().sum(dim=1)
    assert second.mean() + 3 * second.std() / math.sqrt(len(qs)) <= bound
    # Every value is a multiple of ||v|| / s.
    levels_seen = qs * levels / g.norm() if bucket is None else None
    if levels_seen is not None:
        assert torch.allclose(levels_seen, levels_seen.round(), atol=1e-4)


@pytest.mark.parametrize("levels,bucket", [(1, None), (2, None), (7, None), (4, 16)])
def test_qsgd_max_scale_unbiased_and_variance_bound(levels, bucket):
    """The default scale, max |v| per bucket: unbiased, each entry rounds between two adjacent
    levels m/s apart, so E||q - v||^2 <= sum over buckets of d m^2 / (4 s^2)."""
    g = torch.randn(64, generator=torch.Generator().manual_seed(levels))
    qs = _samples(C.QSGD(levels=levels, bucket_size=bucket, seed=levels), g, 3000)
    se = qs.std(dim=0) / math.sqrt(len(qs))
    assert ((qs.mean(dim=0) - g).abs() <= 5 * se + 1e-6).all()
    d = bucket or g.numel()
    m = g.view(-1, d).abs().amax(dim=1)
    bound = float((d * (m / levels).square() / 4).sum())
    err = (qs - g).square().sum(dim=1)
    assert err.mean() + 3 * err.std() / math.sqrt(len(qs)) <= bound
    # every value a multiple of m / s, and the largest entry is sent exactly (it sits on level s)
    steps = (qs.view(len(qs), -1, d) * levels / m.unsqueeze(1)).reshape(len(qs), -1)
    assert torch.allclose(steps, steps.round(), atol=1e-4)
    top = g.abs().argmax()
    assert torch.allclose(qs[:, top], g[top].expand(len(qs)), rtol=1e-5)


def test_qsgd_s1_expected_nonzeros_at_most_sqrt_n():
    n = 400
    for g in (torch.randn(n, generator=torch.Generator().manual_seed(0)), torch.ones(n)):
        qs = _samples(C.QSGD(levels=1, bucket_size=None, seed=3, norm="l2"), g, 2000)
        nnz = (qs != 0).sum(dim=1).double()
        expected = (g.abs().sum() / g.norm()).item()  # sum_i P[xi_i = 1] <= sqrt(n)
        assert expected <= math.sqrt(n) + 1e-6
        assert abs(nnz.mean().item() - expected) <= 5 * nnz.std().item() / math.sqrt(len(qs)) + 1e-9
        # g = (1, ..., 1) meets the bound with equality: every run keeps exactly sqrt(n) = 20.
        assert nnz.mean().item() <= math.sqrt(n) + 5 * nnz.std().item() / math.sqrt(len(qs))


def test_a_qsgd_pickled_before_the_scale_was_a_choice_keeps_the_l2_scale():
    import pickle

    old = C.QSGD(seed=1, norm="l2")
    del old.__dict__["norm"]  # as an instance pickled by a version without the attribute
    restored = pickle.loads(pickle.dumps(old))
    assert restored.norm == "l2" and C.QSGD().norm == "max"
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(restored.compress(g).tensors[0], C.QSGD(seed=1, norm="l2").compress(g).tensors[0])


def test_qsgd_per_rank_noise_is_seeded():
    g = torch.randn(100)
    a, b = C.QSGD(seed=5), C.QSGD(seed=5)
    assert torch.equal(a.decompress(a.compress(g)), b.decompress(b.compress(g)))
    assert not torch.equal(a.decompress(a.compress(g)), C.QSGD(seed=6).decompress(C.QSGD(seed=6).compress(g)))


def _least_squares(make, workers=2, steps=1500):
    """Distributed GD on least squares: each worker compresses its own gradient, the
    decompressed gradients are averaged. Returns ||x - x*|| / ||x*||."""
    gen = torch.Generator().manual_seed(0)
    m, d = 30, 12
    A = [torch.randn(m, d, generator=gen) for _ in range(workers)]
    # Different targets per worker: the optimum does not zero any single worker's gradient,
    # which is exactly what biased compression without error feedback gets wrong.
    b = [torch.randn(m, generator=gen) + 3 * w for w in range(workers)]
    x_star = torch.linalg.lstsq(torch.cat(A), torch.cat(b).unsqueeze(1)).solution.squeeze(1)
    L = (torch.linalg.matrix_norm(torch.cat(A), 2) ** 2 / (workers * m)).item()
    comps = [make() for _ in range(workers)]
    x = torch.zeros(d)
    for t in range(steps):
        lr = (0.3 if t < steps // 3 else 0.05 if t < 2 * steps // 3 else 0.01) / L
        grads = [A[w].t() @ (A[w] @ x - b[w]) / m for w in range(workers)]
        sent = [g if c is None else c.decompress(c.compress(g, key="x")) for c, g in zip(comps, grads)]
        x = x - lr * torch.stack(sent).mean(0)
    return ((x - x_star).norm() / x_star.norm()).item()


def test_error_feedback_reaches_the_exact_optimum():
    exact = _least_squares(lambda: None)
    one_bit = _least_squares(C.OneBit)
    ef_sign = _least_squares(C.EFSign)
    topk_ef = _least_squares(lambda: C.ErrorFeedback(C.TopK(0.2)))
    topk = _least_squares(lambda: C.TopK(0.2))
    assert exact < 1e-5
    for err in (one_bit, ef_sign, topk_ef):
        assert err < 0.01
    # Without memory, top-k settles at a biased point, far from the optimum.
    assert topk > 0.1 and topk > 20 * topk_ef


def test_error_feedback_loses_nothing_only_delays_it():
    ef = C.ErrorFeedback(C.TopK(0.1))
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(50, generator=gen) for _ in range(20)]
    sent = sum(ef.decompress(ef.compress(g, key="w")) for g in grads)
    assert torch.allclose(sent + ef.residuals.memory["w"], sum(grads), atol=1e-5)
    ef.reset("w")
    assert len(ef.residuals) == 0


@pytest.mark.parametrize("make", [lambda: C.TopK(0.1), lambda: C.RandomK(0.3, seed=3),
                                  lambda: C.RandomK(0.3, seed=3, scale=True)],
                         ids=["topk", "randomk", "randomk-scaled"])
@pytest.mark.parametrize("n", [0, 1, 9, 1000, 70_001])
def test_sparse_error_feedback_touches_only_the_kept_entries_and_equals_p_minus_q(make, n):
    """Sparse compressors update the residual at their k entries only; bit for bit the general
    rule e = p - D(C(p)) over several steps (a step with NaN or inf in p leaves none, see
    test_an_inf_or_nan_gradient_does_not_poison_the_steps_after_it)."""
    ef, twin = C.ErrorFeedback(make()), make()
    gen = torch.Generator().manual_seed(n)
    e_ref = torch.zeros(n)
    for step in range(4):
        g = torch.randn(n, generator=gen)
        if n > 4 and step == 1:
            g[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        payload = ef.compress(g, key="w")
        p = g + e_ref
        ref_payload = twin.compress(p, key="w")
        assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(payload.tensors, ref_payload.tensors))
        e_ref = p - twin.decompress(ref_payload)
        if not torch.isfinite(e_ref).all():
            assert "w" not in ef.residuals.memory
            e_ref = torch.zeros(n)
            continue
        e = ef.residuals.memory["w"]
        assert torch.equal(e.isnan(), e_ref.isnan()) and torch.equal(e.nan_to_num(), e_ref.nan_to_num())
        assert torch.equal(e.signbit(), e_ref.signbit())


@pytest.mark.parametrize("n", [0, 1, 1000, 70_001])
def test_topk_decompress_into_scatters_only_the_kept_entries(n):
    c = C.TopK(0.05)
    gen = torch.Generator().manual_seed(n)
    payload = c.compress(torch.randn(n, generator=gen))
    dense = c.decompress(payload)
    base = torch.randn(n, generator=gen)
    written, added = torch.full((n,), 7.0), base.clone()
    c.decompress_into(payload, written)
    c.decompress_into(payload, added, accumulate=True)
    assert torch.equal(written, dense) and torch.equal(written.signbit(), dense.signbit())
    assert torch.equal(added, base + dense)
    # through error feedback, as the compressed collectives call it
    ef = C.ErrorFeedback(C.TopK(0.05))
    p2 = ef.compress(torch.randn(n, generator=gen), key="w")
    acc = base.clone()
    ef.decompress_into(p2, acc, accumulate=True)
    assert torch.equal(acc, base + ef.decompress(p2))


def test_randomk_decompress_into_writes_or_adds_the_kept_entries():
    c, twin = C.RandomK(0.9, seed=1), C.RandomK(0.9, seed=1)
    g = torch.randn(100, generator=torch.Generator().manual_seed(0))
    payload = c.compress(g, key="w")
    assert payload.meta.indices.unique().numel() == payload.meta.indices.numel() == 90  # k distinct indices
    dense = twin.decompress(twin.compress(g, key="w"))
    written, added = torch.full((100,), 3.0), torch.ones(100)
    c.decompress_into(payload, written)
    c.decompress_into(payload, added, accumulate=True)
    assert torch.equal(written, dense) and torch.equal(added, 1 + dense)


@pytest.mark.parametrize("make", [lambda: C.ErrorFeedback(C.TopK(0.1)), lambda: C.ErrorFeedback(C.RandomK(0.2)),
                                  lambda: C.ErrorFeedback(C.QSGD(seed=1)), C.OneBit, C.EFSign, lambda: C.QSGD(seed=1)],
                         ids=["topk-ef", "randomk-ef", "qsgd-ef", "onebit", "efsign", "qsgd"])
@pytest.mark.parametrize("world", [2, 4, 3])
def test_compress_averaged_is_compress_of_the_divided_tensor(make, world):
    """What an averaging all-reduce calls: error feedback divides inside its own add (one
    rounding, in float32 also for a half-precision gradient), the others divide first; the same
    bits as dividing in float32 first when the world size is a power of two."""
    c, ref = make(), make()
    gen = torch.Generator().manual_seed(world)
    for step in range(3):
        g = torch.randn(5000, generator=gen)
        if step == 1:
            g = g.half()  # fp16 gradients too
        got = c.compress_averaged(g, world, key="w")
        want = ref.compress(g.float() / world if isinstance(c, C.ErrorFeedback) else g / world, key="w")
        for a, b in zip(got.tensors, want.tensors):
            if world & (world - 1) == 0:
                assert torch.equal(a, b)
            elif a.is_floating_point():
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        if hasattr(c, "residuals") and world & (world - 1) == 0:
            assert torch.equal(c.residuals.memory["w"], ref.residuals.memory["w"])


def test_sparse_error_feedback_on_a_non_contiguous_float16_gradient():
    ef = C.ErrorFeedback(C.TopK(0.25))
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).half().t()
    payload = ef.compress(g, key="w")
    assert ef.decompress(payload).dtype == torch.float16
    e_ref = g.float() - C.TopK(0.25).decompress(C.TopK(0.25).compress(g.float()))
    assert torch.equal(ef.residuals.memory["w"], e_ref)


def test_bytes_on_the_wire_match_bits_per_element():
    n = 1 << 16
    g = torch.randn(n)
    fp32 = C.NoneCompressor().compress(g).nbytes
    assert fp32 == 4 * n
    for c, ratio in [(C.FP16(), 2), (C.BF16(), 2), (C.OneBit(bucket_size=None), 32), (C.OneBit(), 32 / 2),
                     (C.OneBit(1024), 32 / 1.0625), (C.EFSign(), 32 / 1.5), (C.EFSign(None), 32),
                     (C.QSGD(), 8), (C.TopK(0.01, ramp_steps=0), 50), (C.RandomK(0.01), 100)]:
        nbytes = c.compress(g, key="g").nbytes
        assert nbytes * 8 / n == pytest.approx(c.bits_per_element(), rel=0.01), c
        assert fp32 / nbytes == pytest.approx(ratio, rel=0.02), c
    p = C.PowerSGD(rank=4, start_iter=0)
    m = torch.randn(1024, 1024)
    assert p.compress(m, key="m").nbytes * 8 / m.numel() == pytest.approx(p.bits_per_element())
    assert p.bits_per_element() == pytest.approx(0.25)


def test_top_k_keeps_more_at_first_and_shrinks_geometrically_to_its_ratio():
    """Deep Gradient Compression's sparsity warm-up: ratio_t = ratio * (start / ratio) ** (1 - t / ramp)."""
    c = C.TopK(0.01)
    assert (c.ramp_steps, c.start_ratio) == (60, 0.25) and repr(c) == "TopK(ratio=0.01)"
    for t in (0, 1, 17, 30, 59):
        assert c.ratio_at(t) == pytest.approx(0.01 * 25 ** (1 - t / 60), rel=1e-12), t
    assert c.ratio_at(30) == pytest.approx(0.05) and c.ratio_at(60) == c.ratio_at(10**6) == 0.01
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    kept = [c.compress(g, key="w").tensors[0].numel() for _ in range(62)]
    assert kept[:3] == [2500, math.ceil(10_000 * c.ratio_at(1)), math.ceil(10_000 * c.ratio_at(2))]
    assert all(a >= b for a, b in zip(kept, kept[1:])) and kept[59] == 106 and kept[60:] == [100, 100]
    assert c.compress(g, key="other").tensors[0].numel() == 2500  # counted per tensor
    c.reset("w")
    assert c.compress(g, key="w").tensors[0].numel() == 2500
    # what an entry's top-k selection is does not change: the largest |g_i| of the k kept
    values = c.compress(g, key="fresh").tensors[0]
    assert torch.equal(values.abs().sort().values, g.abs().sort().values[-2500:])
    assert C.TopK(0.01, ramp_steps=0).compress(g, key="w").tensors[0].numel() == 100
    assert C.TopK(0.5).compress(g, key="w").tensors[0].numel() == 5000  # start_ratio below ratio: no ramp
    assert repr(C.TopK(0.1, ramp_steps=0)) == "TopK(ratio=0.1, ramp_steps=0, start_ratio=0.25)"


def test_top_k_at_its_default_ratio_keeps_one_percent_and_ten_under_an_adam_style_optimizer():
    import pickle

    w = [torch.zeros(3, requires_grad=True)]
    sgd, adam = torch.optim.SGD(w, lr=0.1, momentum=0.9), torch.optim.AdamW(w, lr=0.001)
    c = C.TopK(ramp_steps=0)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert repr(C.TopK()) == "TopK()" and c.ratio == 0.01 and c.compress(g, key="w").tensors[0].numel() == 10
    c.observe_optimizer(adam)
    assert c.ratio == 0.1 and c.compress(g, key="w").tensors[0].numel() == 100 and c.bits_per_element() == 6.4
    c.observe_optimizer(sgd)
    assert c.ratio == 0.01 and (c.ratio_for(True), c.ratio_for(False)) == (0.1, 0.01)
    # told through the error feedback that wraps it, as DistributedOptimizer and the DDP hook tell it
    ef = C.ErrorFeedback(C.TopK())
    ef.observe_optimizer(adam)
    assert ef.compressor.ratio == 0.1 and ef.bits_per_element() == pytest.approx(6.4)
    assert pickle.loads(pickle.dumps(ef)).compressor.ratio == 0.1
    # a ratio given is kept whatever the optimizer
    fixed = C.ErrorFeedback(C.TopK(0.01))
    fixed.observe_optimizer(adam)
    assert fixed.compressor.ratio == 0.01 and repr(fixed) == "ErrorFeedback(TopK(ratio=0.01))"
    # pickled when the ratio was always given (an attribute): it keeps that ratio under Adam
    old = C.TopK(0.05)
    old.__dict__["ratio"] = old.__dict__.pop("requested")
    back = pickle.loads(pickle.dumps(old))
    back.observe_optimizer(adam)
    assert back.ratio == 0.05 and back.requested == 0.05


def test_a_top_k_pickled_before_its_ramp_keeps_its_ratio_from_the_start():
    import pickle

    old = C.TopK(0.01)
    del old.__dict__["ramp_steps"], old.__dict__["start_ratio"], old.__dict__["compressions"]
    back = pickle.loads(pickle.dumps(old))
    assert back.compress(torch.randn(1000), key="w").tensors[0].numel() == 10


def test_random_k_is_shared_by_seed_and_step_and_unbiased_when_scaled():
    g = torch.randn(200)
    a, b = C.RandomK(0.1, seed=7), C.RandomK(0.1, seed=7)
    pa, pb = a.compress(g, key="g"), b.compress(g * 2, key="g")
    assert torch.equal(pa.meta.indices, pb.meta.indices)  # same seed and step: same indices
    # Summable: all-reducing the values equals summing the decompressions.
    summed = C.RandomK(0.1).decompress(type(pa)([pa.tensors[0] + pb.tensors[0]], pa.meta))
    assert torch.allclose(summed, a.decompress(pa) + b.decompress(pb))
    assert not torch.equal(a.compress(g, key="g").meta.indices, pa.meta.indices)  # next step
    scaled = C.RandomK(0.1, seed=1, scale=True)
    qs = _samples(scaled, g, 4000)
    se = qs.std(dim=0) / math.sqrt(len(qs))
    assert ((qs.mean(dim=0) - g).abs() <= 5 * se + 1e-6).all()


@pytest.mark.parametrize("n, ratio", [(40, 0.1), (40, 0.5), (1000, 0.01), (1000, 0.3)])
def test_random_k_keeps_each_entry_with_probability_k_over_n(n, ratio):
    """k distinct indices, each kept with probability k/n, so scale=True is unbiased at any ratio
    (drawn with replacement, an entry was kept with 1 - (1 - 1/n)^k: 0.63 at ratio 1, and the
    scaled mean fell short by as much)."""
    c = C.RandomK(ratio, seed=5)
    k = math.ceil(ratio * n)
    kept = torch.zeros(n)
    draws = 3000
    for _ in range(draws):
        idx = c.compress(torch.ones(n), key="w").meta.indices
        assert idx.numel() == k and idx.unique().numel() == k
        kept[idx] += 1
    p = k / n
    se = math.sqrt(p * (1 - p) / draws)
    assert ((kept / draws - p).abs() <= 5 * se).all()
    assert kept.sum() == k * draws  # exactly k per draw
    scaled = C.RandomK(ratio, seed=5, scale=True)
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    qs = _samples(scaled, g, 3000)
    assert ((qs.mean(dim=0) - g).abs() <= 5 * qs.std(dim=0) / math.sqrt(len(qs)) + 1e-6).all()


def test_random_k_at_ratio_one_sends_the_tensor_whole():
    g = torch.randn(1000)
    c = C.RandomK(1.0)
    for step in range(3):
        assert torch.equal(c.decompress(c.compress(g, key="w")), g)


def test_powersgd_exact_on_low_rank_and_uncompressed_before_start():
    gen = torch.Generator().manual_seed(2)
    low = torch.randn(40, 2, generator=gen) @ torch.randn(2, 30, generator=gen)
    p = C.PowerSGD(rank=2, start_iter=1)
    first = p.compress(low, key="w")
    assert first.nbytes == low.numel() * 4 and torch.equal(p.decompress(first), low)
    second = p.compress(low, key="w")
    assert second.nbytes == 2 * (40 + 30) * 4
    assert torch.allclose(p.decompress(second), low, atol=1e-4)
    # Full rank input: error feedback keeps exactly what the projection dropped.
    full = torch.randn(40, 30, generator=gen)
    q = C.PowerSGD(rank=3, start_iter=0)
    out = q.decompress(q.compress(full, key="f"))
    assert torch.allclose(out + q.residuals.memory["f"], full, atol=1e-4)
    assert torch.linalg.matrix_rank(out) == 3



def _local(t: torch.Tensor):
    return lambda: None  # one process: the sum over ranks is the tensor itself


def test_powersgd_factors_each_tensor_of_a_bucket_as_its_own_matrix():
    # A bucket packing two rank-2 weights and a bias, as DDP and the fusion buckets do.
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(20, 2, generator=gen) @ torch.randn(2, 15, generator=gen)
    bias = torch.randn(15, generator=gen)
    w2 = torch.randn(8, 2, generator=gen) @ torch.randn(2, 3, 3, 3, generator=gen).reshape(2, 27)
    shapes = [(20, 15), (15,), (8, 3, 3, 3)]
    flat = torch.cat([w1.reshape(-1), bias, w2.reshape(-1)])
    p = C.PowerSGD(rank=2, start_iter=0)
    out = p.round_layers(flat, shapes, "bucket", _local)
    # Per tensor, rank 2 holds each weight exactly and the bias goes uncompressed...
    assert torch.allclose(out, flat, atol=1e-4)
    assert sorted(p.qs) == [("bucket", 0), ("bucket", 2)]
    assert p.qs["bucket", 0].shape == (15, 2) and p.qs["bucket", 2].shape == (27, 2)
    assert sorted(p.residuals.memory) == [("bucket", 0), ("bucket", 2)]
    # ...where one matrix of the whole flat bucket (what a layout-blind compressor sees) is not.
    blind = C.PowerSGD(rank=2, start_iter=0).round(flat, "flat")[0]
    assert (blind - flat).norm() > 0.1 * flat.norm()
    # Error feedback per tensor: output + residual = input, tensor by tensor, on full-rank data.
    full = torch.randn(flat.numel(), generator=gen)
    q = C.PowerSGD(rank=1, start_iter=0)
    got = q.round_layers(full, shapes, "b", _local)
    e = q.residuals.memory
    assert torch.allclose(got[:300] + e["b", 0].reshape(-1), full[:300], atol=1e-5)
    assert torch.equal(got[300:315], full[300:315])
    assert torch.allclose(got[315:] + e["b", 2].reshape(-1), full[315:], atol=1e-5)
    q.reset("b")
    assert not q.residuals.memory and not q.qs and not q.steps


def test_powersgd_bucket_with_a_wrong_layout_says_so():
    p = C.PowerSGD(rank=2, start_iter=0)
    with pytest.raises(ValueError, match="holds 12 elements but the bucket has 13"):
        p.round_layers(torch.randn(13), [(3, 4)], "b", _local)
    assert p.round_layers(torch.randn(0), [], "b", _local).numel() == 0
    x = torch.randn(6)  # an empty tensor in a bucket takes no elements
    assert torch.equal(p.round_layers(x, [(0, 5), (2, 3)], "z", _local), x)

ALL = [C.NoneCompressor, C.FP16, C.BF16, C.OneBit, C.EFSign, C.QSGD, lambda: C.TopK(0.3),
       lambda: C.RandomK(0.3), lambda: C.PowerSGD(rank=2, start_iter=0),
       lambda: C.ErrorFeedback(C.TopK(0.3))]


@pytest.mark.parametrize("make", ALL)
def test_edge_cases(make):
    c = make()
    base = torch.randn(6, 9)
    cases = [torch.empty(0), torch.tensor([2.5]), torch.randn(7), torch.randn(9),
             base.t(), base[:, ::2], torch.randn(3, 5, dtype=torch.float64),
             torch.randn(4, 4).half()]
    for i, t in enumerate(cases):
        out = c.decompress(c.compress(t, key=i))
        assert out.shape == t.shape and out.dtype == t.dtype, (c, i)
        assert torch.isfinite(out).all()
    one = c.decompress(c.compress(torch.tensor([2.5]), key="one"))
    assert one.item() == pytest.approx(2.5, rel=1e-2)  # a single element survives every codec


@pytest.mark.parametrize("make", ALL[1:])
def test_non_float_input_is_a_clear_type_error(make):
    with pytest.raises(TypeError, match="floating-point"):
        make().compress(torch.arange(5), key="i")


def test_state_pickles():
    for c in (C.OneBit(), C.QSGD(), C.RandomK(), C.PowerSGD(start_iter=0), C.ErrorFeedback(C.TopK())):
        c.compress(torch.randn(20, 10), key="w")
        back = pickle.loads(pickle.dumps(c))
        assert repr(back) == repr(c)
        g = torch.randn(20, 10)
        # The restored copy continues exactly where the original is (memory, counters, seeds).
        assert torch.equal(back.decompress(back.compress(g, key="w")), c.decompress(c.compress(g, key="w")))


def _two_identical_ranks(sent: list, record):
    """``round_layers``' all-reduce for two ranks holding the same tensors: the sum doubles each
    (``scale=0.5`` halves it back, exactly); ``record(t)`` of each tensor sent goes to ``sent``."""
    def reduce(t):
        sent.append(record(t))
        t.mul_(2)
        return lambda: None
    return reduce


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_powersgd_bucket_sends_its_uncompressed_tensors_together_and_puts_them_back(dtype):
    # several biases and norms between the weights: one gather into the first all-reduce, one
    # scatter back, each element where it came from (two identical ranks: the average is exact)
    shapes = [(20, 15), (15,), (15,), (8, 27), (8,), (3,), (30, 20)]
    n = sum(math.prod(s) for s in shapes)
    flat = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(dtype)
    sent = []
    two_ranks = _two_identical_ranks(sent, torch.Tensor.clone)
    p = C.PowerSGD(rank=2, start_iter=0)
    out = p.round_layers(flat, shapes, "b", two_ranks, world=2, scale=0.5)
    raw = [(300, 315), (315, 330), (546, 554), (554, 557)]
    want = torch.cat([flat[a:b].float() * 0.5 for a, b in raw])
    assert torch.equal(sent[0][:want.numel()], want)  # uncompressed first, in bucket order, scaled
    for a, b in raw:
        assert torch.equal(out[a:b], flat[a:b].float() * 0.5)
    into = torch.full((n,), float("nan"))
    p.round_layers(flat, shapes, "b", two_ranks, world=2, scale=0.5, into=into)
    assert not into.isnan().any() and all(torch.equal(into[a:b], flat[a:b].float() * 0.5) for a, b in raw)


LEVELS = "QSGD levels must be an int in 1..127"


@pytest.mark.parametrize("make,message", [
    (lambda: C.QSGD(levels=128), LEVELS + r".*got 128"),  # 2s + 1 = 257 codes: 9 bits
    (lambda: C.QSGD(levels=10**6), LEVELS),
    (lambda: C.QSGD(levels=0), LEVELS),
    (lambda: C.QSGD(levels=2.5), LEVELS + r".*got 2.5"),
    (lambda: C.QSGD(levels=float("nan")), LEVELS),
    (lambda: C.QSGD(levels=float("inf")), LEVELS),
    (lambda: C.QSGD("4"), LEVELS + r".*got '4'"),
    (lambda: C.QSGD(levels=True), LEVELS),
    (lambda: C.QSGD(bucket_size=2.5), "QSGD bucket_size must be an int >= 1 or None, got 2.5"),
    (lambda: C.QSGD(bucket_size=0), "QSGD bucket_size must be an int >= 1 or None"),
    (lambda: C.QSGD(seed="a"), "QSGD seed must be an int or None, got 'a'"),
    (lambda: C.OneBit(bucket_size=2.5), "OneBit bucket_size must be an int >= 1 or None, got 2.5"),
    (lambda: C.OneBit(bucket_size="8"), "OneBit bucket_size must be an int"),
    (lambda: C.SignMeans(0), "SignMeans bucket_size must be an int >= 1 or None, got 0"),
    (lambda: C.EFSign(0), "EFSign bucket_size must be an int >= 1 or None, got 0"),
    (lambda: C.EFSign(bucket_size=2.5), "EFSign bucket_size must be an int >= 1 or None, got 2.5"),
    (lambda: C.ScaledSign(-3), "ScaledSign bucket_size must be an int >= 1 or None, got -3"),
    (lambda: C.PowerSGD(rank=2.5), "PowerSGD rank must be an int >= 1, got 2.5"),
    (lambda: C.PowerSGD(None), "PowerSGD rank must be an int >= 1, got None"),
    (lambda: C.PowerSGD(rank=0), "PowerSGD rank must be an int >= 1, got 0"),
    (lambda: C.PowerSGD(start_iter=-1), "PowerSGD start_iter must be an int >= 0, got -1"),
    (lambda: C.PowerSGD(start_iter=1.5), "PowerSGD start_iter must be an int >= 0"),
    (lambda: C.PowerSGD(min_compression_rate=float("nan")), "PowerSGD min_compression_rate must be a finite real"),
    (lambda: C.PowerSGD(min_compression_rate="2"), "PowerSGD min_compression_rate must be a finite real"),
    (lambda: C.PowerSGD(min_compression_rate=-1.0), r"PowerSGD min_compression_rate must be .* >= 0, got -1.0"),
    (lambda: C.PowerSGD(seed=0.5), "PowerSGD seed must be an int, got 0.5"),
    (lambda: C.PowerSGD(warm_start="False"), "PowerSGD warm_start must be True or False, got 'False'"),
    (lambda: C.RandomK(0.1, scale=1), "RandomK scale must be True or False, got 1"),
    (lambda: C.TopK([0.1]), r"TopK ratio must be a finite real number in \(0, 1\], got \[0.1\]"),
    (lambda: C.TopK(0), r"TopK ratio must be a finite real number in \(0, 1\], got 0"),
    (lambda: C.TopK(1.5), r"TopK ratio must be .*got 1.5"),
    (lambda: C.TopK(float("nan")), "TopK ratio must be a finite real"),
    (lambda: C.TopK(True), "TopK ratio must be a finite real"),
    (lambda: C.TopK("0.1"), "TopK ratio must be a finite real"),
    (lambda: C.TopK(0.01, ramp_steps=-1), r"TopK ramp_steps must be .*got -1"),
    (lambda: C.TopK(0.01, ramp_steps=2.5), "TopK ramp_steps must be"),
    (lambda: C.TopK(0.01, start_ratio=0), r"TopK start_ratio must be a finite real number in \(0, 1\], got 0"),
    (lambda: C.RandomK(float("inf")), "RandomK ratio must be a finite real"),
    (lambda: C.RandomK(seed="a"), "RandomK seed must be an int, got 'a'"),
    (lambda: C.RandomK(seed=1.0), "RandomK seed must be an int, got 1.0"),
])
def test_bad_constructor_parameters_are_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_numpy_integers_and_the_largest_qsgd_level_count_work(monkeypatch):
    np = pytest.importorskip("numpy")
    q = C.QSGD(levels=np.int64(5), bucket_size=np.int32(8), seed=np.int64(3))
    assert (q.levels, q.bucket_size, q.seed) == (5, 8, 3) and type(q.levels) is int
    assert C.PowerSGD(rank=np.int64(2), start_iter=np.int16(0), min_compression_rate=np.float32(1)).rank == 2
    assert C.RandomK(np.float64(0.5), seed=np.uint8(7)).seed == 7 and C.TopK(1).ratio == 1.0
    assert C.OneBit(np.int64(16)).compressor.bucket_size == 16
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for native_switch in ("1", "0"):  # the C kernels and the torch path: 2 * 127 + 1 codes fit 8 bits
        monkeypatch.setenv("SPARK_DL_NATIVE", native_switch)
        q = C.QSGD(levels=127, bucket_size=64, seed=1)
        assert q.code_bits == 8
        assert torch.allclose(q.decompress(q.compress(g)), g, atol=0.1)


@pytest.mark.parametrize("inner,message", [
    ("topk", r"ErrorFeedback got 'topk', which is not a spark_dl.compression.Compressor: use an instance "
             r"such as TopK\(\)"),
    (None, "ErrorFeedback got None, which is not a spark_dl.compression.Compressor"),
    (0.01, "ErrorFeedback got 0.01, which is not"),
    (C.ErrorFeedback, r"ErrorFeedback got the class ErrorFeedback, which takes arguments: pass ErrorFeedback\(...\)"),
])
def test_error_feedback_refuses_what_is_not_a_compressor(inner, message):
    with pytest.raises(TypeError, match=message):
        C.ErrorFeedback(inner)


def test_error_feedback_instantiates_a_compressor_class_that_takes_no_arguments():
    ef = C.ErrorFeedback(C.TopK)  # as hvd's compression= does with a class
    assert isinstance(ef.compressor, C.TopK) and ef.compressor.ratio == 0.01
    g = torch.randn(50)
    assert ef.decompress(ef.compress(g, key="w")).shape == g.shape


@pytest.mark.parametrize("make", [C.OneBit, lambda: C.OneBit(bucket_size=None), C.EFSign,
                                  lambda: C.ErrorFeedback(C.TopK(0.1, ramp_steps=0)),
                                  lambda: C.ErrorFeedback(C.RandomK(0.1)), lambda: C.ErrorFeedback(C.QSGD(seed=1))],
                         ids=["onebit", "onebit-whole", "efsign", "topk-ef", "randomk-ef", "qsgd-ef"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("native_switch", ["1", "0"], ids=["native", "torch"])
def test_an_inf_or_nan_gradient_does_not_poison_the_steps_after_it(make, bad, native_switch, monkeypatch):
    """A step AMP's loss scaling skips (an inf or NaN gradient) sends non-finite values, so the
    skip still happens, but leaves no residual: the next steps are finite, starting from e = 0
    (the residual kept inf or NaN, and every later step of that key was non-finite)."""
    monkeypatch.setenv("SPARK_DL_NATIVE", native_switch)
    c = make()
    n = 70_001  # over the 1-bit kernels' fused bucket: OneBit(None) and EFSign defer their residual
    gen = torch.Generator().manual_seed(1)
    c.compress(torch.randn(n, generator=gen), key="w")
    poisoned = torch.randn(n, generator=gen)
    poisoned[3] = bad
    sent = c.decompress(c.compress(poisoned, key="w"))
    if not isinstance(getattr(c, "compressor", None), C.RandomK):  # random-k may not draw the entry
        assert not torch.isfinite(sent).all()
    assert "w" not in c.residuals.memory
    g = torch.randn(n, generator=gen)
    after = c.decompress(c.compress(g, key="w"))
    assert torch.isfinite(after).all() and torch.isfinite(c.residuals.memory["w"]).all()
    if isinstance(c, (C.OneBit, C.EFSign)) or isinstance(c.compressor, C.TopK):  # deterministic: as a fresh one
        assert torch.equal(after, make().decompress(make().compress(g, key="w")))
    for _ in range(3):
        assert torch.isfinite(c.decompress(c.compress(torch.randn(n, generator=gen), key="w"))).all()


@pytest.mark.parametrize("native_switch", ["1", "0"], ids=["native", "torch"])
def test_a_finite_residual_whose_sum_overflows_is_kept(native_switch, monkeypatch):
    """Only a residual holding an inf or NaN is dropped: one of finite entries whose float32 sum
    overflows (two of 3.2e38) is kept and sent later (it was dropped, and that update lost)."""
    monkeypatch.setenv("SPARK_DL_NATIVE", native_switch)
    c = C.ErrorFeedback(C.TopK(0.25))  # the two largest of 8
    g = torch.tensor([3.2e38, 3.2e38, 3.3e38, 3.3e38, 0.0, 0.0, 0.0, 0.0])
    assert not torch.isfinite(torch.tensor([3.2e38, 3.2e38]).sum())
    sent = c.decompress(c.compress(g, key="w"))
    assert torch.equal(sent, torch.tensor([0.0, 0.0, 3.3e38, 3.3e38, 0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(c.residuals.memory["w"], torch.tensor([3.2e38, 3.2e38, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    later = c.decompress(c.compress(torch.zeros(8), key="w"))  # the kept update goes out next
    assert torch.equal(later, torch.tensor([3.2e38, 3.2e38, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))


def test_powersgd_sends_a_row_or_column_weight_uncompressed_and_exact():
    """A (1, N) or (N, 1) weight (an ``nn.Linear(d, 1)`` head) is viewed as torch's hook views it,
    1 x N or N x 1, whose rank-1 factors hold N + 1 numbers: it goes uncompressed and exact
    (it was a zero-padded near-square matrix, 90-100% off each step)."""
    shapes = [(1, 1000), (1000, 1), (50, 40), (40,)]
    n = sum(math.prod(s) for s in shapes)
    flat = torch.randn(n, generator=torch.Generator().manual_seed(5))
    sent = []
    two_ranks = _two_identical_ranks(sent, torch.Tensor.numel)
    p = C.PowerSGD(rank=4, start_iter=0)
    out = p.round_layers(flat, shapes, "b", two_ranks, world=2, scale=0.5)
    assert torch.equal(out[:2000], flat[:2000] * 0.5) and torch.equal(out[4000:], flat[4000:] * 0.5)
    assert sorted(p.qs) == [("b", 2)]  # only the 50 x 40 weight is factored
    assert sent == [2040 + 4 * 50, 4 * 40]  # round 1: the 2040 sent as is, then P; round 2: Q
    for shape in [(1, 1000), (1000, 1)]:  # without a layout too
        t = torch.randn(shape)
        payload = p.compress(t, key=shape)
        assert payload.nbytes == t.numel() * 4 and torch.equal(p.decompress(payload), t)
    # Factors that save no bytes are not sent, whatever min_compression_rate allows: 3 x (3 + 1000)
    # numbers for a 3 x 1000 weight.
    q = C.PowerSGD(rank=4, start_iter=0, min_compression_rate=0.0)
    t = torch.randn(3, 1000)
    assert torch.equal(q.decompress(q.compress(t, key="t")), t) and not q.qs


def test_powersgd_keeps_float64_where_it_sends_uncompressed():
    """torch's hook reduces a bucket in its own dtype: float64 tensors sent uncompressed (before
    ``start_iter``, biases) travel and come back in float64 (they went through float32)."""
    w = torch.full((100, 100), 1.0 + 1e-12, dtype=torch.float64)
    b = torch.full((7,), 1.0 + 3e-12, dtype=torch.float64)
    p = C.PowerSGD(rank=2, start_iter=1)
    payload = p.compress(w, key="w")
    assert payload.tensors[0].dtype == torch.float64 and payload.nbytes == w.numel() * 8
    assert torch.equal(p.decompress(payload), w)
    sent = []
    two_ranks = _two_identical_ranks(sent, lambda t: (t.dtype, t.numel()))
    flat = torch.cat([w.flatten(), b])
    out = p.round_layers(flat, [w.shape, b.shape], "b", two_ranks, world=2, scale=0.5)
    assert out.dtype == torch.float64 and torch.equal(out, flat * 0.5)
    assert sent[0] == (torch.float64, 10_007)  # everything uncompressed, in one float64 all-reduce
    sent.clear()
    out = p.round_layers(flat, [w.shape, b.shape], "b", two_ranks, world=2, scale=0.5)
    assert out.dtype == torch.float64 and torch.equal(out[10_000:], b * 0.5)  # the bias, exactly
    assert torch.allclose(out[:10_000], w.flatten() * 0.5, rtol=1e-5)  # the factored weight, float32
    assert sent == [(torch.float64, 7), (torch.float32, 200), (torch.float32, 200)]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("native_switch", ["1", "0"], ids=["native", "torch"])
def test_powersgd_an_inf_or_nan_gradient_does_not_poison_the_steps_after_it(bad, native_switch, monkeypatch):
    """The overflowed step's output is non-finite (AMP's GradScaler sees it and skips the step),
    but that weight's residual and warm-start Q are dropped: the next steps are finite and, on
    rank-2 weights, exact again (they stayed NaN for good). Two weights of one shape: one batched
    M on the torch path, of which only the poisoned one loses its state."""
    monkeypatch.setenv("SPARK_DL_NATIVE", native_switch)
    gen = torch.Generator().manual_seed(6)
    u = torch.randn(20, 2, generator=gen)
    shapes = [(20, 15), (15,), (20, 15)]

    g = torch.cat([(u @ torch.randn(2, 15, generator=gen)).reshape(-1), torch.randn(15, generator=gen),
                   (u @ torch.randn(2, 15, generator=gen)).reshape(-1)])
    p = C.PowerSGD(rank=2, start_iter=0)
    assert torch.allclose(p.round_layers(g, shapes, "b", _local), g, atol=1e-4)
    poisoned = g.clone()
    poisoned[3] = bad
    out = p.round_layers(poisoned, shapes, "b", _local)
    assert not torch.isfinite(out[:300]).all()
    assert torch.allclose(out[300:], g[300:], atol=1e-4)
    assert sorted(p.residuals.memory) == sorted(p.qs) == [("b", 2)]
    for _ in range(3):
        assert torch.allclose(p.round_layers(g, shapes, "b", _local), g, atol=1e-4)
    assert all(torch.isfinite(e).all() for e in p.residuals.memory.values())
