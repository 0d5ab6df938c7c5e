"""Sign compressors: 1 bit per element plus one or two floats, with error feedback built in."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_dl.compression import native
from spark_dl.compression.base import Compressor, Key, Meta, Payload, check_float, flat32, int_param, restore
from spark_dl.compression.bits import pack, unpack
from spark_dl.compression.memory import SINGLE_STAGE_UP_TO, WARMUP_STEPS, EFMeta, ErrorFeedback, PendingResiduals
from spark_dl.compression.sums import bucket_counts, bucket_lengths, bucket_sums
from spark_dl.compression.training import all_finite


@dataclass
class _SignMeta(Meta):
    pass


def _signs(x: torch.Tensor) -> torch.Tensor:
    # g_i >= 0 counts as positive, as in Seide et al.'s threshold at zero.
    return pack(x >= 0, 1)


class SignMeans(Compressor):
    """1-bit quantization of Seide et al. (2014), without memory.

    q_i(g) = mean{g_j : g_j >= 0} if g_i >= 0 else mean{g_j : g_j < 0} (an empty mean is 0), the
    means taken over the bucket of ``bucket_size`` consecutive elements that holds i (the whole
    tensor when ``bucket_size`` is None). Seide et al. quantize each matrix column with its own
    means; buckets do the same for a fused gradient, whose layers differ in scale.
    Wire: n sign bits packed 8 per byte + two float32 means per bucket: n + 64 * buckets bits.
    """

    def __init__(self, bucket_size: int | None = None) -> None:
        self.bucket_size = int_param(bucket_size, type(self).__name__, "bucket_size", 1, none=True)

    def _bucket(self, n: int) -> int:
        return max(1, n if self.bucket_size is None else min(self.bucket_size, n))

    @property
    def span(self) -> int:  # type: ignore[override]
        return self.bucket_size or 0

    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` as rows of one bucket each: the full buckets as one 2-D view, then the tail."""
        b = self._bucket(x.numel())
        full = x.numel() // b * b
        parts = [x[:full].view(-1, b)] if full else []
        if full < x.numel():
            parts.append(x[full:].view(1, -1))
        return parts

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "OneBit")
        if native.enabled(tensor):
            means, bits, _ = native.onebit_encode(tensor, self._bucket(tensor.numel()))
            return Payload([means, bits], _SignMeta(tensor.shape, tensor.dtype))
        x = flat32(tensor)
        pos = x >= 0
        n, b = x.numel(), self._bucket(x.numel())
        # Sums in float64 in the order sums.py fixes (the C kernel's too): bit-for-bit means.
        xd = x.double()
        s_pos = bucket_sums(xd.clamp(min=0), b)  # the sum over g_i >= 0 (zeros add nothing; NaN kept)
        s_neg = bucket_sums(xd, b) - s_pos
        n_pos = bucket_counts(pos, b)
        lengths = bucket_lengths(n, b, n_pos.device)
        means = torch.stack([(s_pos / n_pos.clamp(min=1)).float(),
                             (s_neg / (lengths - n_pos).clamp(min=1)).float()], 1)
        return Payload([means.reshape(-1), pack(pos, 1)], _SignMeta(tensor.shape, tensor.dtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        means, bits = payload.tensors
        meta = payload.meta
        if native.enabled(means, bits):
            return restore(native.onebit_decode(means, bits, meta.numel, self._bucket(meta.numel)), meta)
        out = unpack(bits, meta.numel, 1).to(torch.float32)
        pairs = means.view(-1, 2)
        row = 0
        for rows in self._split(out):  # views into out: filled in place, no per-element means
            mp, mn = pairs[row:row + rows.shape[0]].unbind(1)
            rows.mul_((mp - mn).unsqueeze(1)).add_(mn.unsqueeze(1))
            row += rows.shape[0]
        return restore(out, meta)

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        means, bits = payload.tensors
        n = payload.meta.numel
        if native.enabled(means, bits, out):
            native.onebit_decode(means, bits, n, self._bucket(n), out, accumulate)
        else:
            super().decompress_into(payload, out, accumulate)

    def bits_per_element(self) -> float:
        return 1.0 if self.bucket_size is None else 1.0 + 64.0 / self.bucket_size

    def __repr__(self) -> str:
        return f"SignMeans(bucket_size={self.bucket_size})"


class ScaledSign(Compressor):
    """Scaled sign of Karimireddy et al. (2019), without memory: q(p) = (||p||_1 / n) sign(p), n
    the length of p, or with ``bucket_size``, the same per bucket of that many consecutive
    elements (the last may be shorter).

    Wire: n sign bits + one float32 scale per bucket (per tensor when ``bucket_size`` is None).
    """

    bucket_size: int | None = None  # class default: pickles from before buckets had one scale a tensor

    def __init__(self, bucket_size: int | None = None) -> None:
        self.bucket_size = int_param(bucket_size, type(self).__name__, "bucket_size", 1, none=True)

    @property
    def span(self) -> int:  # type: ignore[override]
        return self.bucket_size or 0  # 0: one scale per tensor, per layer where a bucket packs several

    def _bucket(self, n: int) -> int:
        return max(1, n if self.bucket_size is None else min(self.bucket_size, n))

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "EFSign")
        if native.enabled(tensor):
            scale, bits = native.scaled_sign_encode(tensor, bucket=self.bucket_size)
            return Payload([scale, bits], Meta(tensor.shape, tensor.dtype))
        x = flat32(tensor)
        n = x.numel()
        if not n:
            return Payload([x.new_zeros(1), pack(x >= 0, 1)], Meta(tensor.shape, tensor.dtype))
        b = self._bucket(n)
        scale = (bucket_sums(x.double().abs(), b) / bucket_lengths(n, b, x.device)).float()  # the C kernels' bits
        return Payload([scale, pack(x >= 0, 1)], Meta(tensor.shape, tensor.dtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        scale, bits = payload.tensors
        meta = payload.meta
        if native.enabled(scale, bits):
            return restore(native.scaled_sign_decode(scale, bits, meta.numel, bucket=self.bucket_size), meta)
        signs = unpack(bits, meta.numel, 1).to(torch.float32).mul_(2).sub_(1)
        if scale.numel() > 1:
            lengths = bucket_lengths(meta.numel, self._bucket(meta.numel), scale.device)
            scale = scale.repeat_interleave(lengths, output_size=meta.numel)
        return restore(signs.mul_(scale), meta)

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        scale, bits = payload.tensors
        if native.enabled(scale, bits, out):
            native.scaled_sign_decode(scale, bits, payload.meta.numel, out, accumulate, bucket=self.bucket_size)
        else:
            super().decompress_into(payload, out, accumulate)

    def bits_per_element(self) -> float:
        return 1.0 if self.bucket_size is None else 1.0 + 32.0 / self.bucket_size

    def __repr__(self) -> str:
        return f"ScaledSign(bucket_size={self.bucket_size})"


def _fused_ef(ef: ErrorFeedback, tensor: torch.Tensor, key: Key, encode) -> Payload:
    """ErrorFeedback.compress in the C kernels: p = g + e, signs and sums, and the new residual
    p - q(p) written over the old one, in the same pass (1-bit's buckets of up to 65,536
    elements). The torch path's payload and residual, bit for bit (both sum
    the means in the order sums.py fixes). Out of memory in a kernel raises MemoryError before
    anything is written: the residual stays."""
    check_float(tensor, type(ef).__name__)
    e = ef.residuals.get(key)
    if e is not None and (e.shape != tensor.shape or e.device != tensor.device):
        e = None  # as Residuals.add: a key whose shape changed starts from zero
    head, bits, residual = encode(tensor, e)
    if all_finite(head):  # the sums behind the means see every element of p
        ef.residuals.store(key, residual.view(tensor.shape))
    else:
        ef.residuals.drop(key)  # p held an inf or NaN: see memory.py
    return Payload([head, bits], EFMeta(_SignMeta(tensor.shape, torch.float32), tensor.shape, tensor.dtype))


class DeferredResiduals(PendingResiduals):
    """The sign compressors' residuals. With the native kernels the residual ``e = p - q(p)`` is
    kept as p and q's two values per bucket (``pending``: (qp, qn) pairs and the bucket size);
    the next step's encoder subtracts q while it adds the gradient, so a step makes one pass over
    memory even where q needs sums over more than the cache holds (EF-sign's whole-tensor scale,
    1-bit's large buckets). Reading :attr:`memory` (or pickling) applies the pending q first, so
    the residuals seen from outside are always ``e``, bit for bit the torch path's."""

    def _settle(self, p: torch.Tensor, pending: tuple[torch.Tensor, int]) -> None:
        """p - q(p) in place, q's values as the decompressors give them (p >= 0: qp, else qn)."""
        qpairs, bucket = pending
        flat, pairs = p.view(-1), qpairs.view(-1, 2)
        if pairs.shape[0] == 1:
            flat.sub_(torch.where(flat >= 0, pairs[0, 0], pairs[0, 1]))
            return
        counts = bucket_lengths(flat.numel(), bucket)
        flat.sub_(torch.where(flat >= 0, pairs[:, 0].repeat_interleave(counts), pairs[:, 1].repeat_interleave(counts)))

    def encode(self, g: torch.Tensor, key: Key, bucket: int, kernel) -> tuple[torch.Tensor, torch.Tensor]:
        """``kernel(g, e, pending, p_out) -> (head, bits, qpairs)`` on ``p = g + e[key]`` in one
        native pass; p, written over e's memory when it fits, becomes the residual with its q
        pending. A residual of another shape is dropped (as :class:`Residuals` does)."""
        e, pend = self._memory.get(key), self.pending.get(key)
        if e is not None and (e.shape != g.shape or e.device != g.device):
            e, pend = None, None
        if pend is not None and pend[1] != bucket:  # the bucket size changed: settle e first
            e, pend = self.get(key), None
        if e is not None and not (e.dtype == torch.float32 and e.is_contiguous()):
            e = e.to(torch.float32, copy=True).contiguous()  # stored from outside: read, not written over
        p = e.view(-1) if e is not None else torch.empty(g.numel(), dtype=torch.float32)
        # raises MemoryError before writing anything: e and its pending q stay as they were
        head, bits, qpairs = kernel(g, e, None if pend is None else pend[0], p)
        if all_finite(head):  # the sums behind the means or scale see every element of p
            self._memory[key] = p.view(g.shape)
            self.pending[key] = (qpairs, bucket)
        else:
            self.drop(key)  # p held an inf or NaN: see memory.py
        return head, bits


class _DeferredEF(ErrorFeedback):
    """Error feedback whose residuals are :class:`DeferredResiduals`, encoded in one native pass
    (:meth:`_encode`) where the kernels run."""

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        if not native.enabled(tensor):
            return super().compress(tensor, key)
        return self._encode(tensor, key, 1)

    def compress_averaged(self, tensor: torch.Tensor, world: int, key: Key = None) -> Payload:
        if native.enabled(tensor):  # the kernel divides as it reads g: no divided copy
            return self._encode(tensor, key, world)
        # divided in float32 first, as the kernels divide
        return super().compress(tensor.to(torch.float32) / world, key)

    def _encode(self, tensor: torch.Tensor, key: Key, world: int) -> Payload:
        """``compress(tensor / world)`` in the native kernels (``tensor / world`` rounded as torch's)."""
        raise NotImplementedError

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if not isinstance(self.residuals, DeferredResiduals):  # pickled before residuals were deferred
            residuals = DeferredResiduals()
            residuals.memory = self.residuals.memory
            self.residuals = residuals


# EFSign's scale measured within a point of uncompressed on digits under a decaying lr up to this many
# elements (10 seeds: 64 to 256 at most 0.9 below; 1024 and a scale per tensor 1.0-1.1 below). Under
# Adam, with the shared first moment, one scale per tensor is within a point too; without it (each
# rank's own gradient, compress_momentum=False) 0.9-1.1 below at lr 0.002 x 2 and 9.8-11.6 at 0.016 x 2.
EFSIGN_MEASURED_UP_TO = 256

# EFSign() under momentum SGD with the shared velocity (6 seeds, 1.6M-parameter MLP, LargeBatchRecipe's cosine
# decay) was 1.6 points below uncompressed where the lr came to half its peak at step 181 (a 300-step run), 0.8 below
# at step 226 (375 steps), 0.6 at 271, 0.3 at 361: its decay warning is for a lr halved within this many steps.
EFSIGN_SHORT_RUN = 200

# OneBit's feedback.own_below: under momentum SGD, each rank's own gradient once the lr has fallen below
# this fraction of its peak (the measurements: spark_dl.compression.training).
ONEBIT_OWN_BELOW = 0.95

# 1-bit buckets up to this size get their residual in the encoder's pass, while still in cache
# (the C kernels' RBLOCK); larger ones defer it to the next step's pass.
FUSED_BUCKET = 65536


class OneBit(_DeferredEF):
    """1-bit SGD: :class:`SignMeans` with error feedback per tensor name. Not summable.

    ``bucket_size``: elements that share one pair of means (None: the whole tensor, exactly
    1 bit per element plus two floats). The default, 64, costs one bit per element more (16x
    fewer bytes than fp32 instead of 32x): with error feedback, how long a residual waits depends
    on how far its entries are from their bucket's means. With 64, on digits (2 ranks), it is within
    0.7 points of fp32 under heavy-ball and Nesterov momentum, Adam (at lrs 0.002 to 0.016 x 2) and
    the large-batch recipe (docs/guide/compression.md); in a bucket of several tensors no 64 span two
    (:mod:`spark_dl.compression.layers`).
    ``warmup_steps``, ``compress_momentum``, ``single_stage_up_to``: as :class:`ErrorFeedback`'s.
    Under momentum SGD it compresses the shared velocity while the lr is at its peak and each rank's
    own gradient once the lr has fallen below 95% of it (``feedback.own_below``; set 0 to keep the
    shared velocity through a decay): over a decay of 300 steps on a 1.6M-parameter MLP that is
    0.7 points below uncompressed where the shared velocity throughout was 1.3 below.
    """

    def __init__(self, bucket_size: int | None = 64, warmup_steps: int = WARMUP_STEPS,
                 compress_momentum: bool = True, single_stage_up_to: int = SINGLE_STAGE_UP_TO) -> None:
        super().__init__(SignMeans(int_param(bucket_size, "OneBit", "bucket_size", 1, none=True)), warmup_steps,
                         compress_momentum, single_stage_up_to)
        self.residuals = DeferredResiduals()
        self.feedback.first_moment = True
        self.feedback.own_below = ONEBIT_OWN_BELOW

    def _encode(self, tensor: torch.Tensor, key: Key, world: int) -> Payload:
        bucket = self.compressor._bucket(tensor.numel())
        if bucket <= FUSED_BUCKET:
            return _fused_ef(self, tensor, key,
                             lambda g, e: native.onebit_encode(g, bucket, e, residual=True, divide=world))
        check_float(tensor, "OneBit")

        def kernel(g, e, pending, p):
            means, bits, _ = native.onebit_encode(g, bucket, e, pending=pending, p_out=p, divide=world)
            return means, bits, native.onebit_qpairs(means)
        means, bits = self.residuals.encode(tensor, key, bucket, kernel)
        return Payload([means, bits], EFMeta(_SignMeta(tensor.shape, torch.float32), tensor.shape, tensor.dtype))

    def __repr__(self) -> str:
        return f"OneBit(bucket_size={self.compressor.bucket_size})"


class EFSign(_DeferredEF):
    """EF-signSGD: :class:`ScaledSign` of p = g + e, with e <- p - q(p). Not summable.

    ``bucket_size``: elements that share one scale (None: the whole tensor, the paper's q, exactly
    1 bit per element plus one float). The default, 64, costs half a bit per element more: with one
    scale per tensor, EF-sign trained 1.0-1.1 points below uncompressed on digits under
    LargeBatchRecipe's decay (10 seeds); with 64 it is at most 0.7 below under momentum SGD,
    Nesterov, Adam, AdamW and the recipe there, and 1.5-3.5 above under Adam on a 1.6M-parameter
    MLP (12 seeds, with the shared first moment; docs/guide/compression.md has the tables).
    Under momentum SGD with a lr halved within the first :data:`EFSIGN_SHORT_RUN` steps it warns:
    1.5-1.9 below on that MLP over a cosine decay of 300 steps, where ``OneBit()`` is within a point.
    On the native path a step reads g and e and writes p once: the residual's ``- q(p)`` is
    deferred to the next step's pass (see :class:`DeferredResiduals`). ``warmup_steps``,
    ``compress_momentum``, ``single_stage_up_to``: as :class:`ErrorFeedback`'s."""

    def __init__(self, bucket_size: int | None = 64, warmup_steps: int = WARMUP_STEPS, compress_momentum: bool = True,
                 single_stage_up_to: int = SINGLE_STAGE_UP_TO) -> None:
        super().__init__(ScaledSign(int_param(bucket_size, "EFSign", "bucket_size", 1, none=True)), warmup_steps,
                         compress_momentum, single_stage_up_to)
        self.residuals = DeferredResiduals()
        self.feedback.first_moment = True

    def wide(self) -> bool:
        """Whether a scale covers more than :data:`EFSIGN_MEASURED_UP_TO` elements: measured short
        of uncompressed on digits under a decaying lr (and under Adam with ``compress_momentum=False``)."""
        size = self.compressor.bucket_size
        return size is None or size > EFSIGN_MEASURED_UP_TO

    def decay_advice(self) -> str | None:
        if not self.wide():
            return self._short_run_advice()
        return ("on digits under LargeBatchRecipe's warm-up and cosine decay, one scale per tensor trained 1.0-1.1 "
                "points below uncompressed (10 seeds), and 1024 elements a scale 1.0 below, where it is within a "
                "point at a constant lr. Use EFSign(bucket_size=64) (the default; 0.5-0.6 below) with a decaying lr.")

    def _short_run_advice(self) -> str | None:
        """Under momentum SGD with the shared velocity, for a lr halved within the first
        :data:`EFSIGN_SHORT_RUN` steps told: measured short of uncompressed on a 1.6M-parameter MLP."""
        fb = self.feedback
        if fb.beta2 or not fb.momentum or fb.told > EFSIGN_SHORT_RUN:
            return None
        return (f"the lr came to half its peak {fb.told} steps into the run. On a 1.6M-parameter MLP under "
                "LargeBatchRecipe (SGD, momentum 0.9, 6 seeds) EFSign() trained 1.5-1.9 points below uncompressed "
                "over 300 steps with the cosine decay (the lr halved at step 181) and 0.5-1.0 below with the step "
                "decay (at step 101); over 375 steps (at step 226) 0.8 below, over 1000 within 0.1, and on digits "
                "over 150 steps within 0.6. For a decay of a few hundred steps use OneBit() (2 bits an entry; 0.7 "
                "below there with the cosine decay, 0.2-0.3 with the step decay), QSGD() or PowerSGD().")

    def _encode(self, tensor: torch.Tensor, key: Key, world: int) -> Payload:
        check_float(tensor, "EFSign")
        bucket = self.compressor._bucket(tensor.numel())

        def kernel(g, e, pending, p):
            scales, bits = native.scaled_sign_encode(g, e, pending, p_out=p, divide=world, bucket=bucket)
            return scales, bits, torch.stack([scales, -scales], 1).reshape(-1)
        scale, bits = self.residuals.encode(tensor, key, bucket, kernel)
        return Payload([scale, bits], EFMeta(Meta(tensor.shape, torch.float32), tensor.shape, tensor.dtype))

    def __repr__(self) -> str:
        size = self.compressor.bucket_size
        return "EFSign()" if size == 64 else f"EFSign(bucket_size={size})"
