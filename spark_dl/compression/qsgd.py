"""QSGD (Alistarh et al., 2017): stochastic, unbiased quantization to ``s`` levels per bucket."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from spark_dl.compression import native
from spark_dl.compression.base import Compressor, Key, Meta, Payload, check_float, flat32, int_param, restore
from spark_dl.compression.bits import pack, unpack
from spark_dl.compression.rng import counter_uniform, generator, process_rank
from spark_dl.compression.sums import bucket_sums

MAX_LEVELS = 127  # the most levels whose 2s + 1 signed codes fit in 8 bits


@dataclass
class _QMeta(Meta):
    bucket: int


class QSGD(Compressor):
    """Per bucket v of ``bucket_size`` elements (the whole tensor when ``bucket_size`` is None),
    with the bucket's scale m = max_i |v_i| (``norm="max"``, the default) or ||v||_2 (``"l2"``):

        q_i(v) = m * sgn(v_i) * xi_i / s,   xi_i = l + Bernoulli(s|v_i|/m - l),   l = floor(s|v_i| / m)

    Unbiased, E[q(v)] = v. With the l2 scale (the QSGD paper's) E||q(v) - v||^2 <=
    min(d/s^2, sqrt(d)/s) ||v||^2 for a bucket of d elements: with d = 512 and s = 7 most entries
    sit below one level and are sent as 0 or 1. The max scale (QSGDinf in Ramezani-Kebrya et al.,
    NUQSGD, 2019) uses all s levels: E||q(v) - v||^2 <= d m^2 / (4 s^2), tens of times less on
    gradients, and training under momentum SGD keeps uncompressed accuracy where l2 loses a
    point or two (README's convergence table). The same bytes either way.
    Wire: one float32 scale per bucket + the signed level in [-s, s] packed in
    ceil(log2(2s+1)) bits (4 bits for the default s = 7: about 8x fewer bytes than fp32).
    Not summable. Every rank draws its own noise (seeded by ``seed``, rank and call count).
    ``levels`` s is 1..127: the 2s + 1 signed codes fit in at most 8 bits.
    """

    norm = "l2"  # an instance pickled before the scale was a choice (a checkpointed hook state) keeps its own

    def __init__(self, levels: int = 7, bucket_size: int | None = 512, seed: int | None = None,
                 norm: str = "max") -> None:
        # 2s + 1 codes must fit the 8-bit codes bits.pack and the native kernels handle: s <= 127.
        levels = int_param(levels, "QSGD", "levels", 1, MAX_LEVELS, why=" (a code has at most 8 bits)")
        bucket_size = int_param(bucket_size, "QSGD", "bucket_size", 1, none=True)
        seed = int_param(seed, "QSGD", "seed", none=True)
        if norm not in ("max", "l2"):
            raise ValueError(f"QSGD norm must be 'max' (each bucket scaled by its largest |entry|) or 'l2' "
                             f"(by its Euclidean norm, as the QSGD paper), got {norm!r}")
        self.norm = norm
        self.levels = levels
        self.bucket_size = bucket_size
        self.seed = int.from_bytes(os.urandom(7), "little") if seed is None else seed
        self.code_bits = math.ceil(math.log2(2 * levels + 1))
        self._calls = 0

    def _params(self) -> dict:
        return {"levels": self.levels, "bucket_size": self.bucket_size, "norm": self.norm}

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "QSGD")
        n, s = tensor.numel(), self.levels
        d = max(min(self.bucket_size or n, n), 1)
        self._calls += 1
        # Rounding noise: a hash of (element index, seed), the same on both paths (rng.py).
        seed = generator(torch.device("cpu"), "qsgd", self.seed, process_rank(), self._calls).initial_seed()
        if native.enabled(tensor) and self.code_bits <= 8:
            norms, packed = native.qsgd_encode(tensor, s, d, self.code_bits, seed, self.norm == "max")
            return Payload([norms, packed], _QMeta(tensor.shape, tensor.dtype, d))
        flat = flat32(tensor)
        nb = -(-n // d)
        x = torch.cat([flat, flat.new_zeros(nb * d - n)]) if nb * d != n else flat
        v = x.view(nb, d)
        if self.norm == "max":
            norms = v.abs().amax(dim=1)
        else:  # float64 squares summed in the order sums.py fixes (the C kernel's too): bit-for-bit norms
            norms = bucket_sums(flat.double().square(), d).sqrt().float()
        # |v_i| s / m in [0, s]; an all-zero bucket quantizes to zero.
        # s / norm as a true division, as the kernel's: torch's scalar / tensor multiplies by a
        # reciprocal, an ulp off, which moves a rounding now and then
        factor = norms.new_full(norms.shape, float(s)).div_(norms.clamp_min(torch.finfo(torch.float32).tiny))
        scaled = v.abs().mul_(factor.unsqueeze(1))
        u = torch.empty(nb * d, dtype=torch.float32, device=x.device)
        for start in range(0, nb * d, 1 << 20):  # in slices: the hash's int64 temporaries stay small
            part = u[start:start + (1 << 20)]
            part.copy_(counter_uniform(start, part.numel(), seed, x.device))
        # floor(r + u), u ~ U[0, 1): rounds r up with probability frac(r), so E = r; NaN -> 0.
        level = scaled.add_(u.view(nb, d)).floor_().clamp_(max=s).nan_to_num_(nan=0.0)
        # Signed level in [-s, s], shifted to a code in [0, 2s]; copysign keeps it one pass.
        code = level.copysign_(v).add_(s).to(torch.uint8)
        wire = [norms, pack(code.view(-1)[:n], self.code_bits)]
        return Payload(wire, _QMeta(tensor.shape, tensor.dtype, d))

    def decompress(self, payload: Payload) -> torch.Tensor:
        norms, packed = payload.tensors
        meta: _QMeta = payload.meta
        n, s, d = meta.numel, self.levels, meta.bucket
        if native.enabled(norms, packed) and self.code_bits <= 8:
            return restore(native.qsgd_decode(norms, packed, n, s, d, self.code_bits), meta)
        level = unpack(packed, n, self.code_bits).to(torch.float32).sub_(s)
        nb = norms.numel()
        if nb * d != n:
            level = torch.cat([level, level.new_zeros(nb * d - n)])
        out = level.view(nb, d).mul_((norms / s).unsqueeze(1)).view(-1)[:n]
        return restore(out, meta)

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        norms, packed = payload.tensors
        meta: _QMeta = payload.meta
        if native.enabled(norms, packed, out) and self.code_bits <= 8:
            native.qsgd_decode(norms, packed, meta.numel, self.levels, meta.bucket, self.code_bits, out, accumulate)
        else:
            super().decompress_into(payload, out, accumulate)

    def bits_per_element(self) -> float:
        return self.code_bits + (32.0 / self.bucket_size if self.bucket_size else 0.0)
