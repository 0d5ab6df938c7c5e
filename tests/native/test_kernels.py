"""The C kernels against the torch paths they replace, on the sizes where packing and threads
change (0, 1, byte edges, bucket edges, 1M+ for the two-thread split), both SIMD and scalar C."""
from __future__ import annotations

import math

import pytest
import torch

import spark_dl.compression as C
from spark_dl.compression import native
from spark_dl.compression.bits import pack, unpack
from spark_dl.compression.memory import ErrorFeedback

SIZES = [0, 1, 7, 8, 9, 1023, 1024, 1025, 4097, 1_000_003, (1 << 20) + 13]


@pytest.fixture(params=["simd", "scalar"])
def path(request):
    native.force_scalar(request.param == "scalar")
    yield request.param
    native.force_scalar(False)


@pytest.fixture
def torch_path(monkeypatch):
    """Calls the compressors' torch code in this process (the switch is read per call)."""
    def run(fn, *args):
        monkeypatch.setenv("SPARK_DL_NATIVE", "0")
        try:
            return fn(*args)
        finally:
            monkeypatch.delenv("SPARK_DL_NATIVE")
    return run


def rand(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed + n))


def test_extension_is_built_and_used():
    assert native.available() and native.enabled(torch.zeros(1))
    assert native.features() in ("avx2 f16c", "avx2", "scalar")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bucket", [None, 7, 1024])
def test_onebit_matches_torch(n, bucket, path, torch_path):
    g = rand(n)
    c = C.SignMeans(bucket)
    means, bits = c.compress(g).tensors
    ref_means, ref_bits = torch_path(c.compress, g).tensors
    assert torch.equal(bits, ref_bits)  # bit order and padding exactly as bits.pack
    # Means: both sum in float64 in the order spark_dl/compression/sums.py fixes: bit-for-bit.
    assert torch.equal(means, ref_means)
    # Given the means, decoding is bit-for-bit the torch formula.
    p = C.base.Payload([means, bits], c.compress(g).meta)
    assert torch.equal(c.decompress(p), torch_path(c.decompress, p))


@pytest.mark.parametrize("n", SIZES)
def test_onebit_error_feedback_fused_equals_torch_feedback(n, path, torch_path):
    fused = C.OneBit(bucket_size=1024)
    for step in range(3):
        g = rand(n, seed=step)
        e_before = fused.residuals.memory.get("g")
        e_before = None if e_before is None else e_before.clone()  # the kernel updates it in place
        p = g + e_before if e_before is not None else g.clone()
        payload = fused.compress(g, key="g")
        means, bits = payload.tensors
        assert torch.equal(bits, pack(p >= 0, 1))
        # The stored residual is p - D(C(p)) with torch's own decompression of the payload.
        q = torch_path(fused.decompress, payload)
        assert torch.equal(fused.residuals.memory["g"], p - q)
        # And the whole step is the torch ErrorFeedback's, bit for bit: payload and residual.
        ref = ErrorFeedback(C.SignMeans(1024))
        if e_before is not None:
            ref.residuals.store("g", e_before.clone())
        ref_payload = torch_path(ref.compress, g, "g")
        assert torch.equal(means, ref_payload.tensors[0]) and torch.equal(bits, ref_payload.tensors[1])
        assert torch.equal(ref.residuals.memory["g"], fused.residuals.memory["g"])


@pytest.mark.parametrize("n", [(1 << 20) + 13, 3_000_017])
@pytest.mark.parametrize("bucket", [7, 1000, 65536, 65537, 100_000])
@pytest.mark.parametrize("threads", [1, 3])
def test_onebit_residual_in_the_same_pass_with_buckets_cut_by_threads(n, bucket, threads, path, torch_path):
    """Buckets of up to 65,536 elements get their residual while still in cache (one pass); those
    cut by a thread's share boundary after the join; larger buckets in a second pass. Every way,
    payload and residual are the torch ErrorFeedback's, bit for bit, whatever the threads."""
    native.set_threads(threads)
    try:
        fused, ref = C.OneBit(bucket_size=bucket), ErrorFeedback(C.SignMeans(bucket))
        for step in range(2):
            g = rand(n, seed=step)
            payload = fused.compress(g, key="g")
            ref_payload = torch_path(ref.compress, g, "g")
            assert all(torch.equal(a, b) for a, b in zip(payload.tensors, ref_payload.tensors))
            assert torch.equal(fused.residuals.memory["g"], ref.residuals.memory["g"])
    finally:
        native.set_threads(None)


@pytest.mark.parametrize("bucket", [64, 1000, None])
@pytest.mark.parametrize("n", SIZES)
def test_efsign_matches_torch(n, bucket, path, torch_path):
    ef = C.EFSign(bucket)
    ref = C.EFSign(bucket)
    for step in range(2):
        g = rand(n, seed=step)
        scale, bits = ef.compress(g, key="k").tensors
        ref_scale, ref_bits = torch_path(ref.compress, g, "k").tensors
        assert torch.equal(bits, ref_bits)
        assert torch.equal(scale, ref_scale)
        ref.residuals.store("k", ef.residuals.memory["k"].clone())  # follow the native residual
    payload = ef.compress(rand(n, seed=9), key="k")
    assert torch.equal(ef.decompress(payload), torch_path(ef.decompress, payload))


def _steps(n, steps, seed=0, special=(0.0, -0.0)):
    grads = [rand(n, seed=seed + s) for s in range(steps)]
    if n > len(special):  # signed zeros (or NaN/inf) in g, hence in p and the residual
        grads[0][1:1 + len(special)] = torch.tensor(special)
    return grads


def _same(a, b):
    """Equal, NaN where the other is NaN (a NaN's payload bits aside)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()) \
        and torch.equal(a.signbit() | a.isnan(), b.signbit() | b.isnan())


# The encoders whose residual is deferred to the next step's pass (kept as p and q's values):
# EF-sign always (a scale per 64 elements or per tensor), 1-bit for buckets over 65,536 elements.
# Each with the torch ErrorFeedback it must equal, and whether n elements take the deferred path.
DEFERRED = {
    "efsign": (C.EFSign, lambda: ErrorFeedback(C.ScaledSign(64)), lambda n: True),
    "efsign-whole": (lambda: C.EFSign(None), lambda: ErrorFeedback(C.ScaledSign()), lambda n: True),
    "onebit-whole": (lambda: C.OneBit(None), lambda: ErrorFeedback(C.SignMeans(None)), lambda n: n > 65536),
    "onebit-100000": (lambda: C.OneBit(100_000), lambda: ErrorFeedback(C.SignMeans(100_000)),
                      lambda n: n > 65536),
}


def _payloads_equal(a, b, same=torch.equal):
    return all(same(x, y) for x, y in zip(a.tensors, b.tensors))


@pytest.mark.parametrize("kind", DEFERRED)
@pytest.mark.parametrize("n", SIZES)
def test_deferred_residual_is_torch_error_feedback_bit_for_bit(kind, n, path, torch_path):
    """Steps run back to back keep the residual as p and its pending q (one pass a step); the
    payloads and, once read, the residual are the torch ErrorFeedback's, bit for bit."""
    make, make_ref, deferred = DEFERRED[kind]
    c, ref = make(), make_ref()
    for g in _steps(n, 4):
        payload, ref_payload = c.compress(g, key="k"), torch_path(ref.compress, g, "k")
        assert _payloads_equal(payload, ref_payload)
        assert set(c.residuals.pending) == ({"k"} if deferred(n) else set())  # deferred, not applied
    e = c.residuals.memory["k"]
    assert not c.residuals.pending
    assert _same(e, ref.residuals.memory["k"])  # signed zeros too


@pytest.mark.parametrize("kind", DEFERRED)
@pytest.mark.parametrize("n", [9, 4097, 200_003])
def test_deferred_residual_with_nan_and_inf_is_the_torch_path(kind, n, path, torch_path):
    make, make_ref, _ = DEFERRED[kind]
    c, ref = make(), make_ref()
    for g in _steps(n, 3, special=(float("nan"), float("inf"), -float("inf"))):
        payload, ref_payload = c.compress(g, key="k"), torch_path(ref.compress, g, "k")
        assert _payloads_equal(payload, ref_payload, _same)
    assert _same(c.residuals.memory["k"], ref.residuals.memory["k"])


@pytest.mark.parametrize("kind", DEFERRED)
@pytest.mark.parametrize("threads", [1, 3])
def test_deferred_residual_does_not_depend_on_threads(kind, threads, torch_path):
    """Buckets cut by the threads' shares (100,000 does not divide their 65,536-element blocks)."""
    n = 3_000_017
    make, make_ref, _ = DEFERRED[kind]
    native.set_threads(threads)
    try:
        c, ref = make(), make_ref()
        for g in _steps(n, 3, seed=5):
            assert _payloads_equal(c.compress(g, key="k"), torch_path(ref.compress, g, "k"))
        assert torch.equal(c.residuals.memory["k"], ref.residuals.memory["k"])
    finally:
        native.set_threads(None)


@pytest.mark.parametrize("kind", DEFERRED)
def test_deferred_residual_survives_pickling_switching_paths_and_reshapes(kind, torch_path):
    import pickle
    n = 100_003
    make, make_ref, _ = DEFERRED[kind]
    c, ref = make(), make_ref()
    grads = _steps(n, 6, seed=2)
    for g in grads[:2]:
        c.compress(g, key="k"), torch_path(ref.compress, g, "k")
    assert "k" in c.residuals.pending
    clone = pickle.loads(pickle.dumps(c))  # a checkpoint holds e itself, not p
    assert not clone.residuals.pending and torch.equal(clone.residuals.memory["k"], ref.residuals.memory["k"])
    # the torch path (SPARK_DL_NATIVE=0 mid-run) goes on from the same residual, and back again
    for i, g in enumerate(grads[2:5]):
        run = torch_path if i == 1 else (lambda f, *a: f(*a))
        expected = torch_path(ref.compress, g, "k")
        for x in (c, clone):
            assert _payloads_equal(run(x.compress, g, "k"), expected)
    assert torch.equal(c.residuals.memory["k"], ref.residuals.memory["k"])
    assert torch.equal(clone.residuals.memory["k"], ref.residuals.memory["k"])
    # other keys' pending q stays pending while one key's residual is read
    c.compress(grads[5], key="other")
    c.residuals.get("k")
    assert set(c.residuals.pending) == {"other"}
    # a key whose shape changes starts from zero; reset drops the pending q with the residual
    g2 = rand(64, seed=1).view(8, 8)
    assert torch.equal(c.compress(g2, key="other").tensors[1], make_ref().compressor.compress(g2).tensors[1])
    assert c.residuals.memory["other"].shape == (8, 8)
    c.compress(grads[5], key="k")
    c.reset("k")
    assert "k" not in c.residuals.pending and set(c.residuals.memory) == {"other"}


@pytest.mark.parametrize("kind", DEFERRED)
def test_a_checkpoint_from_before_deferred_residuals_loads_and_goes_on(kind, torch_path):
    """Pickles written when these compressors kept a plain Residuals still load and continue."""
    import pickle

    from spark_dl.compression.memory import Residuals

    make, make_ref, _ = DEFERRED[kind]
    n = 100_003
    c, ref = make(), make_ref()
    e = rand(n, seed=11)
    old = Residuals()
    old.store("k", e.clone())
    c.residuals = old  # the state such a checkpoint holds
    ref.residuals.store("k", e.clone())
    c = pickle.loads(pickle.dumps(c))
    for g in _steps(n, 2, seed=12):
        assert _payloads_equal(c.compress(g, key="k"), torch_path(ref.compress, g, "k"))
    assert torch.equal(c.residuals.memory["k"], ref.residuals.memory["k"])


def test_onebit_bucket_size_changed_mid_run_settles_the_deferred_residual(torch_path):
    n = 300_007
    c, ref = C.OneBit(100_000), ErrorFeedback(C.SignMeans(100_000))
    for step, bucket in enumerate([100_000, 100_000, 70_000, 1024, 200_000]):
        c.compressor.bucket_size = ref.compressor.bucket_size = bucket
        g = rand(n, seed=step)
        assert _payloads_equal(c.compress(g, key="k"), torch_path(ref.compress, g, "k"))
    assert torch.equal(c.residuals.memory["k"], ref.residuals.memory["k"])


@pytest.mark.parametrize("kind", DEFERRED)
def test_native_path_takes_a_residual_it_cannot_write_in_place(kind, torch_path):
    """A residual stored from outside as a non-contiguous view is read, not written over."""
    n = 70_000
    make, make_ref, _ = DEFERRED[kind]
    base = rand(2 * n, seed=3)
    c, ref = make(), make_ref()
    c.residuals.store("k", base[::2])
    ref.residuals.store("k", base[::2].clone())
    before = base.clone()
    for g in _steps(n, 2, seed=4):
        assert _payloads_equal(c.compress(g, key="k"), torch_path(ref.compress, g, "k"))
    assert torch.equal(base, before)
    assert torch.equal(c.residuals.memory["k"], ref.residuals.memory["k"])


def test_onebit_encode_refuses_a_pending_residual_it_would_not_apply():
    g, e = rand(1000), rand(1000, seed=1)
    q = native.onebit_qpairs(native.onebit_encode(g, 100)[0])
    with pytest.raises(ValueError, match="pending residual needs e and p_out"):
        native.onebit_encode(g, 100, e, residual=True, pending=q)
    with pytest.raises(ValueError, match="20 contiguous float32 q pairs"):
        native.onebit_encode(g, 100, e, pending=q[:-2], p_out=torch.empty(1000))
    with pytest.raises(ValueError, match="p_out must be a contiguous float32 CPU tensor of 1000"):
        native.onebit_encode(g, 100, e, pending=q, p_out=torch.empty(999))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("make", [C.FP16, C.BF16])
def test_half_conversion_is_torch_bit_for_bit(n, make, path, torch_path):
    # Wide range: subnormal halves, overflow to inf, bf16 ties.
    g = rand(n) * torch.logspace(-9, 6, max(n, 1))[:n]
    c = make()
    wire = c.compress(g).tensors[0]
    ref = torch_path(c.compress, g).tensors[0]
    assert wire.dtype == ref.dtype and torch.equal(wire.view(torch.int16), ref.view(torch.int16))
    payload = c.compress(g)
    assert torch.equal(c.decompress(payload), torch_path(c.decompress, payload))


def test_half_conversion_divides_before_the_sum(path):
    g = rand(100_003) * 1e5
    for dtype in (torch.float16, torch.bfloat16):
        got = native.to_half(g, dtype, scale=0.25)
        assert torch.equal(got.view(torch.int16), (g * 0.25).to(dtype).view(torch.int16))


def test_half_special_values(path):
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 65504.0,
                      65519.0, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1 + 2.0**-8, 1 + 3 * 2.0**-8] * 3)
    for dtype in (torch.float16, torch.bfloat16):
        got, ref = native.to_half(x, dtype), x.to(dtype)
        nan = ref.isnan()
        assert torch.equal(got.isnan(), nan)  # NaN stays NaN
        assert torch.equal(got[~nan].view(torch.int16), ref[~nan].view(torch.int16))
        assert torch.equal(native.from_half(got).isnan(), nan)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("levels,bucket", [(7, 512), (1, None), (3, 100), (2, 8)])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_qsgd_layout_norms_and_decode_match_torch(n, levels, bucket, norm, path, torch_path):
    g = rand(n)
    c = C.QSGD(levels=levels, bucket_size=bucket, seed=1, norm=norm)
    payload = c.compress(g)
    norms, packed = payload.tensors
    ref = torch_path(C.QSGD(levels=levels, bucket_size=bucket, seed=1, norm=norm).compress, g)
    assert norms.shape == ref.tensors[0].shape and packed.shape == ref.tensors[1].shape
    # Norms: float64 squares summed in the order sums.py fixes, in C and in torch: bit-for-bit,
    # and within float rounding of the exact norm.
    assert torch.equal(norms, ref.tensors[0])
    # Codes: the rounding noise is a hash of (index, seed) on both paths: the same payload.
    assert torch.equal(packed, ref.tensors[1])
    padded = torch.cat([g, g.new_zeros(norms.numel() * payload.meta.bucket - n)]).double()
    exact = torch.linalg.vector_norm(padded.view(norms.numel(), payload.meta.bucket), dim=1,
                                     ord=math.inf if norm == "max" else 2)
    assert torch.allclose(norms.double(), exact, rtol=1e-6)
    # Decoding the native payload: identical floats from both decoders.
    q = c.decompress(payload)
    assert torch.equal(q, torch_path(c.decompress, payload))
    # Each level is floor or ceil of s|v|/||v|| with v's sign: the layout holds the right codes.
    d = payload.meta.bucket
    if n:
        lvl = unpack(packed, n, c.code_bits).float() - levels
        nb = norms.numel()
        r = torch.cat([g, g.new_zeros(nb * d - n)]).view(nb, d).abs() * (levels / norms).unsqueeze(1)
        r = r.view(-1)[:n]
        assert ((lvl.abs() - r).abs() <= 1 + 1e-4).all()
        assert ((lvl == 0) | (torch.sign(lvl) == torch.sign(g))).all()


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_qsgd_is_unbiased_and_reproducible(norm):
    g = rand(64)

    def draws(seed):
        return torch.stack([C.QSGD(7, None, seed=seed, norm=norm).decompress(
            C.QSGD(7, None, seed=seed, norm=norm).compress(g)) for _ in range(1)])

    assert torch.equal(draws(3), draws(3)) and not torch.equal(draws(3), draws(4))
    s = 2
    c = C.QSGD(levels=s, bucket_size=None, seed=5, norm=norm)
    qs = torch.stack([c.decompress(c.compress(g)) for _ in range(3000)])
    # The standard error from the rounding probability itself: a tiny g_i that never rounds
    # up in 3000 draws has a sample std of 0 but is still unbiased.
    scale = g.abs().max() if norm == "max" else g.norm()
    r = g.abs() * s / scale
    frac = r - r.floor()
    se = scale / s * (frac * (1 - frac)).sqrt() / math.sqrt(len(qs))
    assert ((qs.mean(dim=0) - g).abs() <= 5 * se + 1e-6).all()


def test_qsgd_max_norm_has_less_variance_than_the_l2_norm():
    """The reason max is the default: on a bucket of 512 Gaussian entries the l2 scale leaves most
    codes at 0 or 1 (s|v_i|/||v|| is about s/sqrt(512)), the max scale spreads them over the s levels."""
    g = rand(512 * 64)
    err = {}
    for norm in ("max", "l2"):
        c = C.QSGD(seed=2, norm=norm)
        err[norm] = sum(float((c.decompress(c.compress(g)) - g).square().sum()) for _ in range(20)) / 20
    assert err["max"] * 10 < err["l2"], err
    # within the bounds: l2's E||q - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2, max's <= d (max|v| / s)^2 / 4
    assert err["l2"] <= math.sqrt(512) / 7 * float(g.square().sum())
    maxes = g.view(-1, 512).abs().amax(dim=1)
    assert err["max"] <= float((512 * (maxes / 7).square() / 4).sum())


@pytest.mark.parametrize("bucket", [512, 100, 7, 40000])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_qsgd_codes_do_not_depend_on_threads_or_simd(bucket, norm, torch_path):
    """The same seed gives the same codes with 1, 2 or 5 threads, AVX2 or portable C: the random
    streams are per 64K chunk, and norms of buckets cut by a thread or block edge are computed
    alike on both sides."""
    g = rand(3 << 20)
    g[12345] = float("nan")  # a NaN bucket, an infinite one, an all-zero one, signed zeros:
    g[200_000] = float("inf")  # the SIMD lanes take their general path there, the fast one elsewhere
    g[300_000:300_000 + 2 * bucket + 16] = 0.0
    g[500_000:500_016] = -0.0
    g[500_016:500_032] = 1e-30  # tiny but normal: a huge, finite factor
    out = []
    try:
        for t, scalar in ((1, False), (2, False), (5, False), (2, True)):
            native.set_threads(t)
            native.force_scalar(scalar)
            out.append(native.qsgd_encode(g, 7, bucket, 4, seed=11, max_norm=norm == "max"))
    finally:
        native.set_threads(None)
        native.force_scalar(False)
    for norms, packed in out[1:]:
        assert torch.equal(packed, out[0][1])
        assert torch.equal(norms.nan_to_num(-1.0), out[0][0].nan_to_num(-1.0))
    # and, through the compressor, the torch reference's codes, bit for bit
    ref = torch_path(C.QSGD(levels=7, bucket_size=bucket, seed=11, norm=norm).compress, g)
    got = C.QSGD(levels=7, bucket_size=bucket, seed=11, norm=norm).compress(g)
    assert torch.equal(ref.tensors[1], got.tensors[1])
    assert torch.equal(ref.tensors[0].nan_to_num(-1.0), got.tensors[0].nan_to_num(-1.0))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
def test_topk_selects_the_torch_set(n, ratio, torch_path):
    g = rand(n)  # continuous values: no ties
    c = C.TopK(ratio, ramp_steps=0)  # k from the first call
    values, idx = c.compress(g).tensors
    ref_values, ref_idx = torch_path(c.compress, g).tensors
    assert idx.dtype == ref_idx.dtype
    order, ref_order = idx.argsort(), ref_idx.argsort()
    assert torch.equal(idx[order], ref_idx[ref_order])
    assert torch.equal(values[order], ref_values[ref_order])


def _sample_mask(n: int) -> torch.Tensor:
    """Where the native top-k's threshold sample reads: 256 evenly spread runs of 1024."""
    mask = torch.zeros(n, dtype=torch.bool)
    for c in range(256):
        at = int(c * (n - 1024) / 255)
        mask[at:at + 1024] = True
    return mask


@pytest.mark.parametrize("case", ["normal", "sample_too_high", "sample_too_low", "ties", "nan_inf"])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_topk_on_large_vectors_is_exact_whatever_the_sample_says(case, threads, path):
    """Vectors of 1M+ elements go through a threshold estimated from a sample; a sample that
    misleads (too high: fewer than k elements reach it; too low: more than the buffers hold)
    must still give the exact set, and ties at the cut still go to the lower index."""
    n = (1 << 21) + 77
    k = n // 100
    g = rand(n)
    mask = _sample_mask(n)
    if case == "sample_too_high":  # huge values only where the sample looks, half k of them
        where = mask.nonzero().squeeze(1)[:: max(1, int(mask.sum()) // (k // 2))][: k // 2]
        g[where] = 1e6 + torch.arange(len(where), dtype=torch.float32)
    elif case == "sample_too_low":  # the sample sees only tiny values
        g[mask] *= 1e-6
    elif case == "ties":  # far more equal values than k, at the cut
        g[::7] = 5.0
    elif case == "nan_inf":
        g[1000], g[n - 3], g[2_000_000] = float("nan"), float("inf"), -float("inf")
    native.set_threads(threads)
    try:
        idx, val = native.topk(g, k)
    finally:
        native.set_threads(None)
    assert torch.equal(g[idx], val) or case == "nan_inf"
    got = set(idx.tolist())
    assert len(got) == k
    key = g.abs().nan_to_num(nan=float("inf"))
    if case == "ties":
        above = (key > 5.0).nonzero().squeeze(1).tolist()
        tied = (key == 5.0).nonzero().squeeze(1).tolist()  # in index order
        assert got == set(above) | set(tied[: k - len(above)])
    else:
        cut = key.kthvalue(n - k + 1).values  # k-th largest
        assert (key[idx] >= cut).all() and int((key > cut).sum()) <= k
        if case == "nan_inf":
            assert {1000, n - 3, 2_000_000} <= got


def test_topk_ties_and_nan_are_defined():
    x = torch.tensor([1.0, -1.0, 1.0, 0.5, float("nan"), -1.0])
    idx, val = native.topk(x, 3)
    assert sorted(idx.tolist()) == [0, 1, 4]  # NaN first, then equal |x| by lower index
    idx, _ = native.topk(torch.zeros(10), 4)
    assert sorted(idx.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("n", [9, (1 << 20) + 5])
def test_nan_and_inf_give_a_defined_result(n):
    g = rand(n)
    g[3], g[5], g[-1] = float("nan"), float("inf"), -float("inf")
    means, bits, _ = native.onebit_encode(g, 1024)
    assert torch.equal(bits, pack(g >= 0, 1))
    assert means[:2].isnan().all()  # the bucket holding the NaN: both means NaN, as in torch
    norms, packed = native.qsgd_encode(g, 7, 512, 4, seed=0)
    assert norms[0].isnan()
    codes = unpack(packed, n, 4)
    assert (codes <= 14).all() and codes[3] == 7  # NaN quantizes to zero
    assert sorted(native.topk(g, 3)[0].tolist()) == [3, 5, n - 1]  # NaN and +-inf are the largest


def test_non_contiguous_input_is_made_contiguous(torch_path):
    g = rand(4096).view(64, 64).t()
    assert not g.is_contiguous()
    for c in (C.SignMeans(100), C.FP16(), C.BF16()):
        a, b = c.compress(g).tensors, torch_path(c.compress, g).tensors
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    idx = C.TopK(0.1).compress(g).tensors[1]
    ref_idx = torch_path(C.TopK(0.1).compress, g).tensors[1]
    assert torch.equal(idx.sort().values, ref_idx.sort().values)
    with pytest.raises(ValueError, match="contiguous float32"):
        native.onebit_decode(*native.onebit_encode(g, 64)[:2], 4096, 64, out=torch.zeros(4096).view(64, 64).t())


def test_short_payload_is_refused_not_read_past():
    means, bits, _ = native.onebit_encode(rand(100), 10)
    with pytest.raises(ValueError, match="payload does not match"):
        native.onebit_decode(means, bits[:-1], 100, 10)


def test_decode_accumulates(path):
    g = rand(5000)
    means, bits, _ = native.onebit_encode(g, 256)
    q = native.onebit_decode(means, bits, 5000, 256)
    out = torch.ones(5000)
    native.onebit_decode(means, bits, 5000, 256, out=out)
    assert torch.equal(out, 1 + q)


@pytest.mark.parametrize("make", [lambda: C.OneBit(1024), lambda: C.OneBit(100_000), C.EFSign, lambda: C.EFSign(None)],
                         ids=["onebit-one-pass", "onebit-two-passes", "efsign", "efsign-whole"])
def test_out_of_memory_in_an_encoder_is_a_clear_error_and_keeps_the_residual(make):
    n = (1 << 20) + 13
    c = make()
    c.compress(rand(n, seed=1), key="g")  # a residual worth keeping
    before = c.residuals.memory["g"].clone()
    native.fail_allocations(True)
    try:
        with pytest.raises(MemoryError, match="out of memory .*SPARK_DL_NATIVE=0"):
            c.compress(rand(n), key="g")
    finally:
        native.fail_allocations(False)
    assert torch.equal(c.residuals.memory["g"], before)
    ref = ErrorFeedback(type(c.compressor)(c.compressor.bucket_size))
    ref.residuals.store("g", before.clone())
    payload = c.compress(rand(n), key="g")  # the next step is the step that would have run
    assert all(torch.equal(a, b) for a, b in zip(payload.tensors, ref.compress(rand(n), "g").tensors))


@pytest.mark.parametrize("kind", DEFERRED)
def test_out_of_memory_keeps_the_deferred_residual(kind, torch_path):
    n = (1 << 20) + 13
    make, make_ref, _ = DEFERRED[kind]
    c, ref = make(), make_ref()
    for step in range(2):
        c.compress(rand(n, seed=step), key="g"), torch_path(ref.compress, rand(n, seed=step), "g")
    p_before, (q_before, b_before) = c.residuals._memory["g"].clone(), c.residuals.pending["g"]
    native.fail_allocations(True)
    try:
        with pytest.raises(MemoryError, match="out of memory .*SPARK_DL_NATIVE=0"):
            c.compress(rand(n, seed=7), key="g")
    finally:
        native.fail_allocations(False)
    q, b = c.residuals.pending["g"]
    assert torch.equal(q, q_before) and b == b_before and torch.equal(c.residuals._memory["g"], p_before)
    payload = c.compress(rand(n, seed=2), key="g")  # the step that would have run
    assert _payloads_equal(payload, torch_path(ref.compress, rand(n, seed=2), "g"))
    assert torch.equal(c.residuals.memory["g"], ref.residuals.memory["g"])


def test_out_of_memory_in_other_kernels_raises_and_leaves_the_accumulator():
    n = (1 << 20) + 13
    g = rand(n)
    onebit = C.SignMeans(1024)
    payload = onebit.compress(g)
    acc = rand(n, seed=5)
    before = acc.clone()
    native.fail_allocations(True)
    try:
        with pytest.raises(MemoryError, match="onebit_decode: out of memory"):
            onebit.decompress_into(payload, acc, True)
        with pytest.raises(MemoryError, match="qsgd_encode: out of memory"):
            C.QSGD(bucket_size=100_000, seed=1).compress(g)  # big buckets: a norm pass first
        with pytest.raises(MemoryError, match="topk: out of memory"):
            C.TopK(0.01).compress(g)
    finally:
        native.fail_allocations(False)
    assert torch.equal(acc, before)


@pytest.mark.parametrize("rows,cols,numel,r", [(1, 1, 1, 1), (10, 3, 28, 2), (50, 37, 50 * 37, 4),
                                               (64, 64, 4000, 5), (300, 301, 300 * 301 - 5, 9),
                                               (300, 301, 300 * 301 - 5, 8), (1100, 1001, 1100 * 1001, 4),
                                               (1100, 1001, 1100 * 1001, 8)])
def test_powersgd_lowrank_product_is_p_q_transposed_whatever_threads_or_simd(rows, cols, numel, r, path):
    p = rand(rows * r).view(rows, r)
    q = rand(cols * r, seed=7).view(cols, r)
    ref = (p.double() @ q.double().t()).reshape(-1)[:numel]
    outs = []
    for threads in (1, 3):
        native.set_threads(threads)
        try:
            outs.append(native.lowrank_product(p, q, numel))
        finally:
            native.set_threads(None)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0].double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    native.force_scalar(True)  # the same bits as the scalar path, whichever path ran
    try:
        assert torch.equal(outs[0], native.lowrank_product(p, q, numel))
    finally:
        native.force_scalar(path == "scalar")
    with pytest.raises(ValueError, match="do not make"):
        native.lowrank_product(p, q, rows * cols + 1)


@pytest.mark.parametrize("rows,cols,r", [(1, 1, 1), (10, 3, 2), (50, 37, 4), (300, 301, 9), (300, 301, 8),
                                         (1100, 1001, 4)])
def test_powersgd_residual_subtracts_p_q_transposed_in_place(rows, cols, r, path):
    p = rand(rows * r).view(rows, r)
    q = rand(cols * r, seed=7).view(cols, r)
    m0 = rand(rows * cols, seed=3).view(rows, cols)
    ref = m0.double() - p.double() @ q.double().t()
    outs = []
    for threads in (1, 3):
        native.set_threads(threads)
        try:
            m = m0.clone()
            assert native.lowrank_subtract(m, p, q) is m  # in place
            outs.append(m)
        finally:
            native.set_threads(None)
    assert torch.equal(outs[0], outs[1])
    # each element is m - (the product lowrank_product computes), rounded once more
    assert torch.equal(outs[0], m0 - native.lowrank_product(p, q, rows * cols).view(rows, cols))
    assert (outs[0].double() - ref).abs().max() <= 1e-5 * (m0.abs().max() + (p @ q.t()).abs().max())
    with pytest.raises(ValueError, match="do not match"):
        native.lowrank_subtract(m0, p, rand((cols + 1) * r).view(cols + 1, r))
    with pytest.raises(ValueError, match="contiguous float32"):
        native.lowrank_subtract(m0.double(), p, q)


def test_powersgd_output_is_the_same_across_paths_and_out_of_memory_is_clear():
    g = rand(300 * 200).view(300, 200)
    outs = []
    for scalar in (False, True):
        native.force_scalar(scalar)
        try:
            c = C.PowerSGD(rank=4, start_iter=0, seed=1)
            outs.append(c.round(g, "g", world=2, scale=0.5)[0])
        finally:
            native.force_scalar(False)
    assert torch.equal(outs[0], outs[1])  # the rounding order is the kernel's own, on both paths
    native.fail_allocations(True)
    try:
        with pytest.raises(MemoryError, match="lowrank_product: out of memory"):
            native.lowrank_product(rand(8).view(4, 2), rand(6).view(3, 2), 12)
        m = rand(12).view(4, 3)
        before = m.clone()
        with pytest.raises(MemoryError, match="lowrank_subtract: out of memory"):
            native.lowrank_subtract(m, rand(8).view(4, 2), rand(6).view(3, 2))
        assert torch.equal(m, before)  # the residual is left as it was
    finally:
        native.fail_allocations(False)


def test_extension_links_no_torch():
    # One build must serve any torch version: the module may only need libc/pthread/CPython.
    import subprocess

    from spark_dl import _native

    deps = subprocess.run(["ldd", _native.__file__], capture_output=True, text=True, check=True).stdout
    # Only the library names and paths: ldd's load addresses are hex and can spell "c10".
    libs = [line.split("(0x")[0].strip() for line in deps.splitlines() if line.strip()]
    assert libs and not any("torch" in lib or "c10" in lib for lib in libs), deps


DECODERS = [
    ("fp16", lambda: C.FP16()), ("bf16", lambda: C.BF16()), ("onebit", lambda: C.OneBit(256)),
    ("signmeans", lambda: C.SignMeans(100)), ("efsign", lambda: C.EFSign()), ("efsign-whole", lambda: C.EFSign(None)),
    ("scaledsign-b7", lambda: C.ScaledSign(7)),
    ("qsgd", lambda: C.QSGD(levels=7, bucket_size=512, seed=3)),
    ("qsgd-2bit", lambda: C.QSGD(levels=1, bucket_size=64, seed=3)),
    ("qsgd-b100", lambda: C.QSGD(levels=7, bucket_size=100, seed=3)),
    ("qsgd-b3", lambda: C.QSGD(levels=5, bucket_size=3, seed=3)),
    ("qsgd-l2", lambda: C.QSGD(levels=7, bucket_size=512, seed=3, norm="l2")),
]


@pytest.mark.parametrize("n", [1, 9, 1025, (1 << 20) + 13])
@pytest.mark.parametrize("name,make", DECODERS, ids=[d[0] for d in DECODERS])
def test_decompress_into_writes_and_accumulates_like_decompress(name, make, n, path, torch_path):
    """decompress_into (what the collectives sum W payloads with) matches decompress bit-for-bit,
    natively (one fused pass, no temporary) and on the torch path."""
    g = rand(n)
    c = make()
    payload = c.compress(g, key="g")
    ref = torch_path(c.decompress, payload).reshape(-1)
    base = rand(n, seed=99)
    for run in (lambda f, *a: f(*a), torch_path):
        out = torch.full((n,), float("nan"))
        run(c.decompress_into, payload, out)
        assert torch.equal(out, ref)
        acc = base.clone()
        run(c.decompress_into, payload, acc, True)
        assert torch.equal(acc, base + ref)


@pytest.mark.parametrize("make", [C.FP16, C.BF16])
def test_compress_scaled_divides_inside_the_cast(make, path, torch_path):
    g = rand((1 << 20) + 13) * 1000
    native_p = make().compress_scaled(g, 1 / 3)
    torch_p = torch_path(make().compress_scaled, g, 1 / 3)
    assert torch.equal(native_p.tensors[0], torch_p.tensors[0])
    assert torch.equal(native_p.tensors[0], (g * (1 / 3)).to(make.wire_dtype))


@pytest.mark.parametrize("n,bucket", [(3 << 20, 1024), (3 << 20, 100), (3 << 20, 200_000), (3 << 20, None),
                                      ((1 << 20) + 13, 65536 * 3), (1000, 7)])
def test_sums_are_bit_for_bit_with_any_threads_or_simd(n, bucket, torch_path):
    """1-bit means, the EF-sign scales and QSGD norms: the same bits from the torch path and from
    C with 1, 2 or 5 threads, AVX2 or portable (the order of additions is fixed, sums.py)."""
    g = rand(n) * torch.logspace(-3, 3, n)  # magnitudes that make float sums order-sensitive
    ref = [torch_path(C.SignMeans(bucket).compress, g).tensors[0],
           torch_path(C.ScaledSign(bucket).compress, g).tensors[0],
           torch_path(C.QSGD(levels=7, bucket_size=bucket, seed=0).compress, g).tensors[0]]
    try:
        for t, scalar in ((1, False), (2, False), (5, False), (3, True)):
            native.set_threads(t)
            native.force_scalar(scalar)
            got = [C.SignMeans(bucket).compress(g).tensors[0], C.ScaledSign(bucket).compress(g).tensors[0],
                   C.QSGD(levels=7, bucket_size=bucket, seed=0).compress(g).tensors[0]]
            for name, a, b in zip(("means", "scale", "norms"), got, ref):
                assert torch.equal(a, b), (name, t, scalar)
    finally:
        native.set_threads(None)
        native.force_scalar(False)


@pytest.mark.parametrize("bucket", [31, 32, 33, 100, 512])
def test_qsgd_max_scale_is_torchs_amax_wherever_the_largest_entry_or_a_nan_sits(bucket):
    """The max scale, taken 32 elements at a time in four chains (a bucket holding a NaN measured
    again by the scalar loop): torch's ``abs().amax()`` per bucket, bucket j's largest entry at its
    offset j (every offset of the 31- to 33-element buckets), in the 32-element body and in the tail,
    and a NaN in either, SIMD and portable C alike."""
    n = bucket * 40 + 7
    g = rand(n, seed=3) * 0.01
    for j in range(40):  # bucket j's largest entry at offset j (mod the bucket), of either sign
        g[j * bucket + j % bucket] = (-1) ** j * (1.0 + j)
    g[5 * bucket + bucket - 1] = float("nan")  # in a tail where bucket % 32 != 0
    g[9 * bucket + 3] = float("nan")  # in the body
    g[11 * bucket + 2] = -float("inf")
    want = torch.cat([g, g.new_zeros(40 * bucket + bucket - n)]).view(-1, bucket).abs().amax(1)
    try:
        for scalar in (False, True):
            native.force_scalar(scalar)
            norms, _ = native.qsgd_encode(g, 7, bucket, 4, seed=1, max_norm=True)
            assert torch.equal(norms.nan_to_num(-1.0), want.nan_to_num(-1.0)), scalar
    finally:
        native.force_scalar(False)


@pytest.mark.parametrize("make", [C.OneBit, lambda: C.OneBit(bucket_size=None), C.EFSign, lambda: C.EFSign(None)],
                         ids=["onebit", "onebit-deferred", "efsign", "efsign-whole"])
@pytest.mark.parametrize("world", [2, 3])
def test_sign_encoders_divide_by_the_world_size_in_their_pass_as_torch_divides(make, world, path, torch_path):
    """An averaging all-reduce's ``g / world``, taken in the encoder's own pass (no divided copy):
    payloads and residuals bit for bit those of the torch path, which divides first in float32,
    over steps whose residuals carry over (fused, deferred and one-scale encoders; a float16 step)."""
    a, b = make(), make()
    for step in range(4):
        g = rand(70_001, seed=step)
        if step == 2:
            g = g.half()
        pa = a.compress_averaged(g, world, key="w")
        pb = torch_path(b.compress_averaged, g, world, "w")
        for x, y in zip(pa.tensors, pb.tensors):
            assert torch.equal(x, y), step
        assert torch.equal(a.residuals.memory["w"], b.residuals.memory["w"]), step


def test_qsgd_payload_is_the_torch_payload_with_nan_inf_and_many_calls(path, torch_path):
    g = rand((1 << 20) + 13)
    g[[5, 70000, 1 << 19]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    g[1000:1512] = 0.0  # an all-zero bucket
    a, b = C.QSGD(levels=7, bucket_size=512, seed=4), C.QSGD(levels=7, bucket_size=512, seed=4)
    for _ in range(3):  # the call counter moves the seed alike on both paths
        pa, pb = a.compress(g), torch_path(b.compress, g)
        assert torch.equal(pa.tensors[1], pb.tensors[1])
        assert torch.equal(pa.tensors[0].nan_to_num(-1.0), pb.tensors[0].nan_to_num(-1.0))
    assert not torch.equal(C.QSGD(seed=4).compress(g).tensors[1], C.QSGD(seed=5).compress(g).tensors[1])


def _matrix(v: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The first elements of a rows x cols float64 matrix, the rest zero."""
    z = torch.zeros(rows * cols, dtype=torch.float64)
    z[:v.numel()] = v.double()
    return z.view(rows, cols)


PASS_SHAPES = [(1, 1, 1, 1), (10, 3, 28, 2), (7, 9, 5, 3), (50, 37, 50 * 37, 4), (51, 40, 51 * 40 - 3, 4),
               (64, 64, 4000, 5), (300, 301, 300 * 301 - 5, 9), (1100, 1001, 1100 * 1001, 4), (203, 99, 203 * 99, 8)]


@pytest.mark.parametrize("rows,cols,numel,r", PASS_SHAPES)
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_powersgd_first_pass_adds_the_gradient_subtracts_the_pending_product_and_projects(rows, cols, numel, r,
                                                                                          mode):
    g, m0 = rand(numel), rand(numel, seed=1)
    q, pe, qe = rand(cols * r, seed=2).view(cols, r), rand(rows * r, seed=3).view(rows, r), \
        rand(cols * r, seed=4).view(cols, r)
    outs = []
    for scalar in (False, True):
        for threads in (1, 3):
            native.force_scalar(scalar)
            native.set_threads(threads)
            try:
                m, pt = m0.clone(), torch.full((r, rows), float("nan"))
                native.powersgd_project(g, m, q, rows, cols, pt, scale=0.5, mode=mode, pending=(pe, qe))
                outs.append((m, pt))
            finally:
                native.force_scalar(False)
                native.set_threads(None)
    for m, pt in outs[1:]:  # the same bits on the AVX2 and scalar paths, whatever the threads
        assert torch.equal(m, outs[0][0]) and torch.equal(pt, outs[0][1])
    m, pt = outs[0]
    # M rounds once per step (0.5 g is exact): the pending product as lowrank_subtract rounds it
    before = {0: torch.zeros(numel), 1: m0, 2: native.lowrank_subtract(m0.clone(), pe, qe)}[mode]
    assert torch.equal(m, before + 0.5 * g)
    full = 0.5 * _matrix(g, rows, cols) + (0 if mode == 0 else _matrix(m0, rows, cols))
    if mode == 2:
        full -= _matrix((pe.double() @ qe.double().t()).reshape(-1)[:numel], rows, cols)
    assert (m.double() - full.reshape(-1)[:numel]).abs().max() <= 1e-5 * (1 + full.abs().max())
    ref = (_matrix(m, rows, cols) @ q.double()).t()  # P^T of the M it wrote
    assert (pt.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()) * math.sqrt(cols)


@pytest.mark.parametrize("rows,cols,numel,r", PASS_SHAPES)
def test_powersgd_second_pass_is_p_transposed_m_whatever_threads_or_simd(rows, cols, numel, r):
    p, m = rand(rows * r).view(rows, r), rand(numel, seed=5)
    outs = []
    for scalar in (False, True):
        for threads in (1, 3):
            native.force_scalar(scalar)
            native.set_threads(threads)
            try:
                qt = torch.full((r, cols), float("nan"))
                native.powersgd_back(p, m, rows, cols, qt)
                outs.append(qt)
            finally:
                native.force_scalar(False)
                native.set_threads(None)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    ref = p.double().t() @ _matrix(m, rows, cols)
    assert (outs[0].double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()) * math.sqrt(rows)


def test_powersgd_passes_reject_what_does_not_fit_and_leave_m_on_out_of_memory():
    g, m, q, pt = rand(12), rand(12, seed=1), rand(8).view(4, 2), torch.empty(2, 3)
    with pytest.raises(ValueError, match="do not fit a 3 x 4 matrix"):
        native.powersgd_project(g, m, q, 3, 4, torch.empty(2, 4))
    with pytest.raises(ValueError, match="do not fit a 3 x 4 matrix"):
        native.powersgd_project(rand(11), m, q, 3, 4, pt)
    with pytest.raises(ValueError, match="mode 2 needs factors of 3 x 2 and 4 x 2"):
        native.powersgd_project(g, m, q, 3, 4, pt, mode=2)
    with pytest.raises(ValueError, match="mode must be 0, 1 or 2"):
        native.powersgd_project(g, m, q, 3, 4, pt, mode=3)
    with pytest.raises(ValueError, match="contiguous float32"):
        native.powersgd_project(g, m.double(), q, 3, 4, pt)
    with pytest.raises(ValueError, match="do not fit a 3 x 4 matrix"):
        native.powersgd_back(rand(6).view(3, 2), m, 3, 4, torch.empty(2, 3))
    before = m.clone()
    native.fail_allocations(True)
    try:
        with pytest.raises(MemoryError, match="powersgd_project: out of memory"):
            native.powersgd_project(g, m, q, 3, 4, pt, mode=2, pending=(rand(6).view(3, 2), q))
    finally:
        native.fail_allocations(False)
    assert torch.equal(m, before)


@pytest.mark.parametrize("r", [4, 3, 8])
@pytest.mark.parametrize("offset", range(8))
def test_powersgd_output_streamed_from_any_alignment_rounds_as_the_scalar_path(offset, r):
    # 1 MB+ outputs are written with aligned non-temporal stores after a scalar head, at any rank
    rows, cols = 700, 513
    p, q = rand(rows * r).view(rows, r), rand(cols * r, seed=7).view(cols, r)
    buf = torch.zeros(rows * cols + 8)
    native.lowrank_product(p, q, rows * cols, out=buf[offset:offset + rows * cols])
    native.force_scalar(True)
    try:
        ref = native.lowrank_product(p, q, rows * cols)
    finally:
        native.force_scalar(False)
    assert torch.equal(buf[offset:offset + rows * cols], ref)
    assert not buf[:offset].any() and not buf[offset + rows * cols:].any()  # nothing written outside


def _psgd_rounds(c, grads, shapes, key="b"):
    return [c.round_layers(g, shapes, key, lambda t: (lambda: None), world=1, scale=0.5).clone() for g in grads]


def test_powersgd_native_rounds_keep_the_residual_factored_and_match_the_torch_path(torch_path):
    # a bucket as DDP packs it: weights and a bias
    shapes = [(40, 30), (30,), (16, 3, 3, 3), (64, 3, 2, 2)]
    n = sum(math.prod(s) for s in shapes)
    grads = [rand(n, seed=s) for s in range(4)]
    fast = C.PowerSGD(rank=4, start_iter=1, seed=3)
    got = _psgd_rounds(fast, grads, shapes)
    assert sorted(fast.residuals.pending) == [("b", 0), ("b", 2), ("b", 3)]  # e = M - P Qw^T, not applied yet
    ref = C.PowerSGD(rank=4, start_iter=1, seed=3)
    want = torch_path(_psgd_rounds, ref, grads, shapes)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    # reading the residuals applies the pending products: the same e as the eager torch path
    e_fast, e_ref = fast.residuals.memory, ref.residuals.memory
    assert not fast.residuals.pending and sorted(e_fast) == sorted(e_ref)
    for k in e_ref:
        assert e_fast[k].shape == e_ref[k].shape and (e_fast[k] - e_ref[k]).abs().max() <= 1e-4
    # a 1-D tensor alone is a near-square matrix whose last row is short (1000 of 32 x 32)
    vec = [rand(1000, seed=s) for s in range(3)]
    fast, ref = C.PowerSGD(rank=2, start_iter=0), C.PowerSGD(rank=2, start_iter=0)
    got = [fast.round(v, "v")[0] for v in vec]
    want = torch_path(lambda: [ref.round(v, "v")[0] for v in vec])
    assert list(fast.residuals.pending) == ["v"]
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert (fast.residuals.memory["v"] - ref.residuals.memory["v"]).abs().max() <= 1e-4


def test_powersgd_pickled_with_a_pending_residual_continues_bit_for_bit():
    import pickle

    shapes = [(40, 30), (30,), (16, 27)]
    n = sum(math.prod(s) for s in shapes)
    c = C.PowerSGD(rank=4, start_iter=0)
    _psgd_rounds(c, [rand(n), rand(n, seed=1)], shapes)
    twin = pickle.loads(pickle.dumps(c))  # a checkpoint: the pending products are applied first
    assert not twin.residuals.pending and sorted(twin.residuals.memory) == [("b", 0), ("b", 2)]
    nxt = [rand(n, seed=2), rand(n, seed=3)]
    a, b = _psgd_rounds(c, nxt, shapes), _psgd_rounds(twin, nxt, shapes)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_powersgd_factored_residual_reset_and_shape_change_start_from_zero():
    c = C.PowerSGD(rank=2, start_iter=0)
    g = rand(12 * 10)
    _psgd_rounds(c, [g], [(12, 10)], key="w")
    _psgd_rounds(c, [g], [(12, 10)], key="v")
    c.reset("w")
    assert sorted(c.residuals.pending) == [("v", 0)] and sorted(c.residuals.memory) == [("v", 0)]
    # a key whose tensor changed: its old residual (and pending product) is dropped, not misread
    c2 = C.PowerSGD(rank=2, start_iter=0)
    _psgd_rounds(c2, [g], [(12, 10)], key="w")
    fresh = C.PowerSGD(rank=2, start_iter=0)
    h = rand(8 * 5)
    c2.qs.clear()  # same Q draw as the fresh compressor's
    c2.steps.clear()
    assert torch.equal(_psgd_rounds(c2, [h], [(8, 5)], key="w")[0], _psgd_rounds(fresh, [h], [(8, 5)], key="w")[0])


def test_powersgd_pending_residual_of_a_reshaped_tensor_is_dropped_as_on_the_torch_path(torch_path):
    # the same key and element count under another shape: a new tensor, its residual starts at zero
    g1, g2 = rand(12 * 10), rand(12 * 10, seed=1)
    fast, ref = C.PowerSGD(rank=2, start_iter=0), C.PowerSGD(rank=2, start_iter=0)
    fast.round_layers(g1, [(12, 10)], "w", lambda t: (lambda: None))
    a = fast.round_layers(g2, [(10, 12)], "w", lambda t: (lambda: None))

    def ref_rounds():
        return [ref.round_layers(g, [s], "w", lambda t: (lambda: None)) for g, s in
                [(g1, (12, 10)), (g2, (10, 12))]]

    b = torch_path(ref_rounds)[1]
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def _onebit_big(n=(1 << 20) + 9):
    """A 1-bit encode large enough to be split across the kernels' worker threads."""
    g = rand(n, seed=11)
    c = C.SignMeans(1024)
    return c.compress(g).tensors


def test_kernel_threads_are_reused_and_serve_concurrent_callers():
    import threading

    native.set_threads(1)
    try:
        want = _onebit_big()
    finally:
        native.set_threads(None)
    native.set_threads(3)  # parked workers, reused call after call
    try:
        results, errors = [], []

        def work():
            try:
                for _ in range(20):
                    results.append(_onebit_big())
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)
        # the GIL is released inside the kernels: two callers at once, one finds the pool busy
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not errors
    finally:
        native.set_threads(None)
    assert len(results) == 40
    assert all(torch.equal(a, b) for r in results for a, b in zip(r, want))


def _child_encodes(q):
    native.set_threads(2)
    q.put([t.numpy().tobytes() for t in _onebit_big()])  # bytes: no shared-memory handles to outlive


def test_kernel_threads_work_in_a_forked_child_of_a_process_that_used_them():
    # Spark's Python workers fork: the child has none of the parent's parked threads
    import multiprocessing as mp

    native.set_threads(2)
    try:
        want = _onebit_big()  # the pool's workers now exist in this process
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        child = ctx.Process(target=_child_encodes, args=(q,))
        child.start()
        got = q.get(timeout=60)  # a hang here would be a child waiting on threads it lacks
        child.join(timeout=60)
        assert child.exitcode == 0
        assert got == [t.numpy().tobytes() for t in want]
        assert all(torch.equal(a, b) for a, b in zip(_onebit_big(), want))  # the parent's pool still works
    finally:
        native.set_threads(None)


def test_powersgd_torch_path_batches_same_shape_tensors_and_keeps_their_residuals_in_place(torch_path):
    # the GPU's path: three weights of one shape are one (3, 12, 10) M, the fourth its own
    shapes = [(12, 10), (10,), (12, 10), (8, 15), (12, 10)]
    n = sum(math.prod(s) for s in shapes)
    c = C.PowerSGD(rank=2, start_iter=0)
    grads = [rand(n, seed=s) for s in range(3)]

    def rounds():
        outs, bases = [], []
        for g in grads:
            outs.append(c.round_layers(g, shapes, "b", lambda t: (lambda: None)).clone())
            e = c.residuals.memory
            bases.append({e["b", i]._base.data_ptr() for i in (0, 2, 4)})
        return outs, bases
    outs, bases = torch_path(rounds)
    assert all(len(b) == 1 for b in bases) and bases[0] == bases[1] == bases[2]  # one M, reused in place
    e = c.residuals.memory
    at = [0, 120, 130, 250, 370]
    # error feedback per tensor: what was sent plus what is kept is what came in, summed over steps
    for i in (0, 2, 3, 4):
        sent = sum(o[at[i]:at[i] + math.prod(shapes[i])] for o in outs)
        came = sum(g[at[i]:at[i] + math.prod(shapes[i])] for g in grads)
        assert torch.allclose(sent + e["b", i].reshape(-1), came, atol=1e-4)
    assert all(torch.equal(o[120:130], g[120:130]) for o, g in zip(outs, grads))  # the bias as is


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("parts", ["d and v", "d", "v", "neither"])
def test_training_feedback_passes_are_torchs_ops_bit_for_bit(n, parts, path):
    """before: g / d + c v as torch.div then add(alpha=c); after: v_out = r, r = (r - c v) d as
    sub_(alpha=c) then mul_ (one fma where torch's CPU kernels make one, as they do with AVX2)."""
    g, v, r = rand(n), rand(n, 1), rand(n, 2)
    d = rand(n, 3).abs_().add_(0.5) if "d" in parts else None
    v = v if "v" in parts else None
    want = g if d is None else torch.div(g, d)
    want = want if v is None else torch.add(want, v, alpha=0.45)
    assert torch.equal(native.feedback_before(g, d, v, 0.45, torch.empty(n)), want)
    assert torch.equal(native.feedback_before(g.clone(), d, v, 0.45, g), want)  # in place
    kept, r0 = torch.empty(n), r.clone()
    assert native.feedback_after(r, v, 0.9, d, kept) is True
    want = r0.clone() if v is None else r0.clone().sub_(v, alpha=0.9)
    assert torch.equal(kept, r0) and torch.equal(r, want if d is None else want.mul_(d))


@pytest.mark.parametrize("n", [9, (1 << 20) + 13])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_training_feedback_after_flags_a_non_finite_entry_wherever_it_sits(n, bad, path):
    for at in (0, n // 2, n - 1):  # the first vector, a thread's share, the scalar tail
        r = rand(n)
        r[at] = bad
        assert native.feedback_after(r, rand(n, 1), 0.9, None, torch.empty(n)) is False
    assert native.feedback_after(torch.full((n,), 3e38), None, 0.9, None, torch.empty(n)) is True  # sum overflows


def test_training_feedback_passes_refuse_what_does_not_fit():
    g = torch.zeros(8)
    for bad in (torch.zeros(7), torch.zeros(8, dtype=torch.float64), torch.zeros(16)[::2]):
        assert not native.feedback_fits(g, bad)
        with pytest.raises(ValueError, match="contiguous float32 CPU tensors of one size"):
            native.feedback_before(g, bad, None, 1.0, torch.empty(8))
        with pytest.raises(ValueError, match="contiguous float32 CPU tensors of one size"):
            native.feedback_after(g, None, 1.0, None, bad)
    assert native.feedback_fits(g, None, torch.ones(8))
