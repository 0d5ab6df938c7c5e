"""Thin wrapper over the C kernels of ``spark_dl._native`` (built from ``native/`` by pip).

The compressors call these when :func:`enabled` says so (the extension imported, the tensor is
on the CPU, ``SPARK_DL_NATIVE`` is not ``0``) and their torch code otherwise. The kernels work
on tensor memory through ``data_ptr()``; this module makes inputs contiguous float32 (a copy
only when they are not already) and allocates every output, so the C side never sees a size it
was not promised.
"""
from __future__ import annotations

import os

import torch

from spark_dl import protocol

try:
    from spark_dl import _native as _ext
except ImportError:  # no compiler at install time: the torch paths serve
    _ext = None


def available() -> bool:
    """The extension was built and imported."""
    return _ext is not None


_pinned: int | None = None  # threads fixed by set_threads(n); None: follow torch


def enabled(*tensors: torch.Tensor) -> bool:
    """Use the kernels for these tensors: extension present, not switched off, all on the CPU."""
    if _ext is None or protocol.switched_off(os.environ, protocol.NATIVE_ENV):
        return False
    if _pinned is None:
        # as many threads as torch's intra-op pool: the launcher sizes it per rank to the host's
        # cores / local ranks, so kernels and torch ops never oversubscribe the machine
        _ext.set_threads(torch.get_num_threads())
    return all(t.device.type == "cpu" for t in tensors)


def features() -> str:
    """The SIMD paths this CPU runs ("avx2 f16c", "avx2" or "scalar")."""
    return _ext.features() if _ext is not None else "none"


def set_threads(n: int | None) -> int:
    """Threads for vectors of 1M elements or more; ``None`` (the default) follows
    ``torch.get_num_threads()``. Returns the count now in effect (at most 32)."""
    global _pinned
    _pinned = n
    return _ext.set_threads(torch.get_num_threads() if n is None else n)


def force_scalar(on: bool) -> None:
    """Skip the AVX2/F16C paths: lets tests hold them against the portable C."""
    _ext.force_scalar(on)


def fail_allocations(on: bool) -> None:
    """Make every allocation inside the kernels fail: lets tests reach the out-of-memory paths,
    which raise MemoryError and leave residuals and accumulators as they were."""
    _ext.fail_allocations(on)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).to(torch.float32).contiguous()


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _residual_in(e: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if e is None or e.numel() != n or e.dtype != torch.float32 or e.device.type != "cpu":
        return None
    return e.reshape(-1).contiguous()


def onebit_encode(g: torch.Tensor, bucket: int, e: torch.Tensor | None = None, residual: bool = False,
                  pending: torch.Tensor | None = None, p_out: torch.Tensor | None = None, divide: int = 1):
    """SignMeans of p = g / divide + e: (means[2 * buckets], bits, new residual or None). ``g /
    divide`` is rounded first, as torch's ``g / world`` is: an averaging all-reduce's division
    without a divided copy of g.

    With ``residual`` the new residual p - q(p) is written over ``e`` when ``e`` is a usable
    contiguous float32 tensor of n elements (one pass fewer, no allocation), else into a new one.
    With ``p_out`` (a contiguous float32 tensor of n; may be ``e``) the residual is deferred: p is
    written there in the same pass and returned; its q is :func:`onebit_qpairs` of the means.
    ``pending`` (such q pairs from the last step, same bucket) says ``e`` holds a deferred
    residual, e - q(e); it needs ``p_out``.
    """
    x = _f32(g)
    n = x.numel()
    b = max(1, min(bucket, n)) if n else 1
    nb = -(-n // b)
    means = torch.empty(2 * nb, dtype=torch.float32)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
    e_in = _residual_in(e, n)
    e_out = None
    if p_out is not None:
        _out(p_out, n, "p_out")
        e_out = p_out
    elif residual:
        e_out = e_in if e_in is not None and e_in.data_ptr() == _ptr(e) else torch.empty(n, dtype=torch.float32)
    if pending is not None:
        if p_out is None or e_in is None:
            raise ValueError("onebit_encode: a pending residual needs e and p_out")
        if pending.dtype != torch.float32 or pending.numel() != 2 * nb or not pending.is_contiguous():
            raise ValueError(f"onebit_encode: pending must be {2 * nb} contiguous float32 q pairs")
    _ext.onebit_encode(x.data_ptr(), _ptr(e_in), _ptr(pending if e_in is not None else None), _ptr(e_out),
                       p_out is not None, n, b, means.data_ptr(), bits.data_ptr(), float(divide))
    return means, bits, e_out


def onebit_qpairs(means: torch.Tensor) -> torch.Tensor:
    """The two values q takes per bucket, (qp, qn) flat, rounded as SignMeans.decompress and the C
    kernels round them: fl(fl(b * (mp - mn)) + mn) for b = 1 and b = 0."""
    m = means.reshape(-1, 2)
    d = m[:, 0] - m[:, 1]
    return torch.stack([d * 1.0 + m[:, 1], d * 0.0 + m[:, 1]], 1).reshape(-1)


def onebit_decode(means: torch.Tensor, bits: torch.Tensor, n: int, bucket: int,
                  out: torch.Tensor | None = None, accumulate: bool | None = None) -> torch.Tensor:
    """q as float32, written into ``out`` (a contiguous float32 tensor of n) when given, or
    added to it with ``accumulate`` (the default when ``out`` is given)."""
    b = max(1, min(bucket, n)) if n else 1
    _check_sizes(means, 2 * (-(-n // b)), bits, (n + 7) // 8)
    acc = out is not None if accumulate is None else accumulate
    out = _out(out, n)
    _ext.onebit_decode(means.data_ptr(), bits.data_ptr(), n, b, out.data_ptr(), acc)
    return out


def _scale_count(n: int, bucket: int | None) -> tuple[int, int]:
    """(elements a scale covers, scales) for ScaledSign of n elements; one scale where n is 0."""
    b = n if bucket is None else max(1, min(bucket, n))
    return b, max(1, -(-n // b)) if n else 1


def scaled_sign_encode(g: torch.Tensor, e: torch.Tensor | None = None, pending: torch.Tensor | None = None,
                       p_out: torch.Tensor | None = None, divide: int = 1, bucket: int | None = None):
    """ScaledSign of p = g / divide + e (``divide`` as :func:`onebit_encode`'s), one scale per
    ``bucket`` elements (None: the whole tensor): (scales, bits). ``e`` is the residual, or with
    ``pending`` (one (s, -s) pair per bucket, float32) the residual EF-sign deferred, ``e - q(e)``
    with q = +-s. With ``p_out`` (a contiguous float32 tensor of n elements; may be ``e``) p is
    written there in the same pass."""
    x = _f32(g)
    n = x.numel()
    b, nb = _scale_count(n, bucket)
    scales = torch.empty(nb, dtype=torch.float32)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
    e_in = _residual_in(e, n)
    if e is not None and e_in is None:
        raise ValueError("scaled_sign_encode: e must be a float32 CPU tensor of g's size")
    if p_out is not None:
        _out(p_out, n, "p_out")
    if pending is not None and e_in is not None:
        if pending.dtype != torch.float32 or pending.numel() != 2 * nb or not pending.is_contiguous():
            raise ValueError(f"scaled_sign_encode: pending must be {2 * nb} contiguous float32 (s, -s) pairs")
    else:
        pending = None
    _ext.scaled_sign_encode(x.data_ptr(), _ptr(e_in), _ptr(pending), _ptr(p_out), n, b, bits.data_ptr(),
                            scales.data_ptr(), float(divide))
    return scales, bits


def scaled_sign_decode(scale: torch.Tensor, bits: torch.Tensor, n: int, out: torch.Tensor | None = None,
                       accumulate: bool | None = None, bucket: int | None = None) -> torch.Tensor:
    """+-scale of each element's bucket (``bucket`` as :func:`scaled_sign_encode`'s), into ``out``
    or added to it, as :func:`onebit_decode`."""
    b, nb = _scale_count(n, bucket)
    _check_sizes(scale, nb, bits, (n + 7) // 8)
    acc = out is not None if accumulate is None else accumulate
    out = _out(out, n)
    _ext.scaled_sign_decode(scale.data_ptr(), bits.data_ptr(), n, b, out.data_ptr(), acc)
    return out


def to_half(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """1-D float16/bfloat16 of x * scale (round to nearest even), e.g. scale = 1/world."""
    src = _f32(x)
    h = torch.empty(src.numel(), dtype=dtype)
    _ext.convert(src.data_ptr(), h.data_ptr(), src.numel(), float(scale), _bf16(dtype), True)
    return h


def from_half(h: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """1-D float32 of a float16/bfloat16 tensor (exact), into ``out`` or added to it."""
    src = h.reshape(-1).contiguous()
    out = _out(out, src.numel())
    _ext.convert(src.data_ptr(), out.data_ptr(), src.numel(), 1.0, _bf16(src.dtype), False, accumulate)
    return out


def _bf16(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"half conversion is to/from float16 or bfloat16, got {dtype}")
    return dtype == torch.bfloat16


def qsgd_encode(x: torch.Tensor, levels: int, bucket: int, code_bits: int, seed: int, max_norm: bool = False):
    """(norms[buckets], packed codes) as QSGD.compress lays them out; ``bucket`` already <= n;
    ``max_norm``: each bucket's scale is max |v| rather than ||v||_2."""
    v = _f32(x)
    n = v.numel()
    nb = -(-n // bucket) if n else 0
    norms = torch.empty(nb, dtype=torch.float32)
    nbytes = (n + 8 // code_bits - 1) // (8 // code_bits) if 8 % code_bits == 0 else code_bits * ((n + 7) // 8)
    packed = torch.empty(nbytes, dtype=torch.uint8)
    _ext.qsgd_encode(v.data_ptr(), n, bucket, levels, code_bits, seed & (2**64 - 1), norms.data_ptr(),
                     packed.data_ptr(), max_norm)
    return norms, packed


def qsgd_decode(norms: torch.Tensor, packed: torch.Tensor, n: int, levels: int, bucket: int, code_bits: int,
                out: torch.Tensor | None = None, accumulate: bool | None = None) -> torch.Tensor:
    """(code - s) * (norm / s) per element, rounded as QSGD.decompress."""
    # The kernel divides norm / s itself, in float32 as torch does: a torch op here would wake
    # torch's thread pool, whose spinning threads then compete with the kernel's own.
    per = 8 // code_bits if 8 % code_bits == 0 else 0
    _check_sizes(norms, -(-n // bucket) if n else 0, packed,
                 (n + per - 1) // per if per else code_bits * ((n + 7) // 8))
    acc = out is not None if accumulate is None else accumulate
    out = _out(out, n)
    _ext.qsgd_decode(norms.contiguous().data_ptr(), packed.contiguous().data_ptr(), n, bucket, levels, code_bits,
                     out.data_ptr(), acc)
    return out


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indices, values) of the k largest |x| (NaN largest; ties to the lower index)."""
    v = _f32(x)
    k = max(0, min(k, v.numel()))
    idx = torch.empty(k, dtype=torch.int64)
    val = torch.empty(k, dtype=torch.float32)
    _ext.topk(v.data_ptr(), v.numel(), k, idx.data_ptr(), val.data_ptr())
    return idx, val


def lowrank_product(p: torch.Tensor, q: torch.Tensor, numel: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``numel`` elements of ``p @ q.T`` (PowerSGD's output), flat, into ``out`` when
    given: one streaming write where torch's GEMM with an inner dimension of 4 runs far below
    memory speed. Rounds as p0 q0 then fused multiply-adds in k order, whatever the threads."""
    rows, r = p.shape
    cols = q.shape[0]
    if q.shape[1] != r or not 0 <= numel <= rows * cols:
        raise ValueError(f"lowrank_product: P {tuple(p.shape)} and Q {tuple(q.shape)} do not make "
                         f"{numel} elements")
    a, b = _f32(p), _f32(q)
    out = _out(out, numel)
    if numel:
        _ext.lowrank_product(a.data_ptr(), b.data_ptr(), numel, rows, cols, r, out.data_ptr())
    return out


def lowrank_subtract(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``m -= p @ q.T`` in place (PowerSGD's residual: one read and one write of ``m``, where
    torch's ``addmm_`` with an inner dimension of 4 is far slower); each product rounded as in
    :func:`lowrank_product`. ``m``: a contiguous float32 CPU matrix of ``p``'s rows and ``q``'s
    rows, or the first elements of one, flat. Returns ``m``."""
    rows, r = p.shape
    cols = q.shape[0]
    flat = m.dim() == 1 and m.numel() <= rows * cols  # the first numel elements of the matrix
    if q.shape[1] != r or not (flat or tuple(m.shape) == (rows, cols)):
        raise ValueError(f"lowrank_subtract: M {tuple(m.shape)}, P {tuple(p.shape)} and Q {tuple(q.shape)} "
                         "do not match (M is rows x cols, or flat with at most that many elements; "
                         "P rows x r, Q cols x r)")
    _out(m.view(-1) if m.is_contiguous() else m, m.numel())
    a, b = _f32(p), _f32(q)
    if m.numel():
        _ext.lowrank_subtract(a.data_ptr(), b.data_ptr(), m.numel(), rows, cols, r, m.data_ptr())
    return m


def powersgd_project(g: torch.Tensor, m: torch.Tensor, q: torch.Tensor, rows: int, cols: int,
                     pt: torch.Tensor, scale: float = 1.0, mode: int = 1,
                     pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """PowerSGD's first pass, in place in ``m`` (numel elements of a ``rows`` x ``cols`` matrix,
    the rest zero): ``mode`` 0 ``M = scale G``, 1 ``M += scale G``, 2 ``M = (M - Pe Qe^T) +
    scale G`` with ``pending = (Pe, Qe)`` (rows x r, cols x r); then ``pt = (M Q)^T`` (r x rows)
    for ``q`` cols x r. One read of G and one read and write of M (see kernels.h for rounding)."""
    r = q.shape[1] if q.dim() == 2 else -1
    numel = m.numel()
    if q.shape != (cols, r) or pt.numel() != r * rows or g.numel() != numel or not 0 <= numel <= rows * cols:
        raise ValueError(f"powersgd_project: G of {g.numel()}, M of {numel}, Q {tuple(q.shape)} and P^T of "
                         f"{pt.numel()} elements do not fit a {rows} x {cols} matrix")
    if mode == 2 and (pending is None or pending[0].shape != (rows, r) or pending[1].shape != (cols, r)):
        raise ValueError(f"powersgd_project: mode 2 needs factors of {rows} x {r} and {cols} x {r}")
    if mode not in (0, 1, 2):
        raise ValueError(f"powersgd_project: mode must be 0, 1 or 2, got {mode}")
    _out(m.view(-1) if m.is_contiguous() else m, numel)
    _out(pt.view(-1) if pt.is_contiguous() else pt, r * rows)
    gf, qf = _f32(g), _f32(q)
    pe, qe = (_f32(pending[0]), _f32(pending[1])) if mode == 2 else (None, None)
    if numel:
        _ext.powersgd_project(gf.data_ptr(), scale, m.data_ptr(), mode, _ptr(pe), _ptr(qe), qf.data_ptr(),
                              numel, rows, cols, r, pt.data_ptr())
    elif rows * r:
        pt.zero_()


def powersgd_back(p: torch.Tensor, m: torch.Tensor, rows: int, cols: int, qt: torch.Tensor) -> None:
    """``qt = P^T M`` (r x cols) for ``p`` rows x r and ``m`` numel elements of a ``rows`` x ``cols``
    matrix (the rest zero), M streamed once; sums in row order (see kernels.h)."""
    r = p.shape[1] if p.dim() == 2 else -1
    numel = m.numel()
    if p.shape != (rows, r) or qt.numel() != r * cols or not 0 <= numel <= rows * cols:
        raise ValueError(f"powersgd_back: P {tuple(p.shape)}, M of {numel} and Q^T of {qt.numel()} "
                         f"elements do not fit a {rows} x {cols} matrix")
    _out(qt.view(-1) if qt.is_contiguous() else qt, r * cols)
    mf = m if (m.is_contiguous() and m.dtype == torch.float32) else _f32(m)
    if numel:
        _ext.powersgd_back(_f32(p).data_ptr(), mf.data_ptr(), numel, rows, cols, r, qt.data_ptr())
    elif cols * r:
        qt.zero_()


def _plain(t: torch.Tensor | None, n: int) -> bool:
    return t is None or (t.dtype == torch.float32 and t.numel() == n and t.is_contiguous() and t.device.type == "cpu")


def _out(out: torch.Tensor | None, n: int, what: str = "out") -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=torch.float32)
    if not _plain(out, n):
        raise ValueError(f"{what} must be a contiguous float32 CPU tensor of {n} elements, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _check_sizes(a: torch.Tensor, na: int, b: torch.Tensor, nb: int) -> None:
    # The C side trusts sizes: a short payload must fail here, not read past its end.
    if a.numel() != na or b.numel() != nb or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError(f"payload does not match its meta: expected {na} and {nb} elements, "
                         f"got {a.numel()} and {b.numel()}")
    if a.dtype != torch.float32 or b.dtype != torch.uint8:
        raise ValueError(f"payload dtypes must be float32 and uint8, got {a.dtype} and {b.dtype}")


def feedback_fits(*tensors: torch.Tensor | None) -> bool:
    """Whether :func:`feedback_before` / :func:`feedback_after` take these tensors (None: left out):
    the kernels enabled, and every one a contiguous float32 CPU tensor of the first one's size."""
    n = tensors[0].numel()
    return enabled(tensors[0]) and all(_plain(t, n) for t in tensors)


def feedback_before(g: torch.Tensor, d: torch.Tensor | None, v: torch.Tensor | None, c: float,
                    out: torch.Tensor) -> torch.Tensor:
    """``out = g / d + c * v`` in one pass (``d`` or ``v`` None: left out), the bits of
    ``torch.div(g, d)`` then ``.add_(v, alpha=c)``. Every tensor as :func:`feedback_fits` takes."""
    if not feedback_fits(g, d, v, out):
        raise ValueError("feedback_before: g, d, v and out must be contiguous float32 CPU tensors of one size")
    _ext.feedback_before(g.data_ptr(), _ptr(d), _ptr(v), float(c), out.data_ptr(), g.numel())
    return out


def feedback_after(r: torch.Tensor, v: torch.Tensor | None, c: float, d: torch.Tensor | None,
                   v_out: torch.Tensor) -> bool:
    """``v_out = r``, then ``r = (r - c * v) * d`` in place, in one pass (``v`` or ``d`` None: left
    out), the bits of ``r.sub_(v, alpha=c).mul_(d)``. True when every element of ``r`` was finite
    (``r`` is written either way; ``v_out`` holds it as it was)."""
    if not feedback_fits(r, v, d, v_out):
        raise ValueError("feedback_after: r, v, d and v_out must be contiguous float32 CPU tensors of one size")
    return _ext.feedback_after(r.data_ptr(), _ptr(v), float(c), _ptr(d), v_out.data_ptr(), r.numel())
