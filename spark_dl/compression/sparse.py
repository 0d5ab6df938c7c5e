"""Sparsification: top-k (largest magnitudes) and random-k (indices shared by all ranks)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spark_dl.compression import native
from spark_dl.compression.base import (
    Compressor,
    Key,
    Meta,
    Payload,
    check_float,
    flat32,
    int_param,
    real_param,
    restore,
)
from spark_dl.compression.memory import key_matches
from spark_dl.compression.rng import generator


def _k(n: int, ratio: float) -> int:
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


def _subtract_kept(p: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """p - (values scattered at idx) in p's memory, touching only those k entries (duplicated
    indices carry equal values); None where p is not a plain float32 tensor to do that in."""
    if p.dtype != torch.float32 or values.dtype != torch.float32 or not p.is_contiguous():
        return None
    flat, i = p.view(-1), idx.long()
    flat.index_put_((i,), flat[i] - values)
    return p


# TopK's sparsity warm-up (Lin et al., Deep Gradient Compression, 2018): the fraction of entries
# kept starts at START_RATIO and shrinks geometrically to ``ratio`` over RAMP_STEPS compressions of
# each tensor. Digits, 150 steps, 10 seeds, both paths, against uncompressed: without it top-k at 1%
# was 0.7-1.6 points below under momentum SGD, Nesterov and the recipe and 3.0-3.3 under Adam and
# AdamW; over 30 steps -0.1 to -1.1 and 2.2-2.5 (Adam); over 60 steps +0.6 to -0.8 and 1.1-1.4;
# over 100 steps +0.7 to -0.9 and 1.5-1.6 (Adam).
RAMP_STEPS = 60
START_RATIO = 0.25
# Top-k under momentum SGD and a decaying lr is measured short of uncompressed up to this ratio (decay_advice).
DECAY_MEASURED_UP_TO = 0.1
# TopK()'s ratio: RATIO, and ADAPTIVE_RATIO under Adam-style optimizers. Adam divides each entry by
# its own scale, so after that division most entries weigh alike and each waits about 1 / ratio
# steps for its turn, where under SGD the small ones that wait move little anyway. Digits, 150
# steps, 10 seeds, Adam and AdamW, both paths, against uncompressed at lr 0.002 x 2 and at Adam's
# best lr there, 0.016 x 2: ratio 0.01 -1.1..-1.4 and -6.1..-8.4, 0.03 -0.8..-1.3 and -3.7..-4.1,
# 0.1 -0.3..-0.5 and -0.3..-0.8, 0.25 -0.1..-0.2 and -0.0..-0.2.
RATIO = 0.01
ADAPTIVE_RATIO = 0.1


class TopK(Compressor):
    """Keeps the k = ceil(ratio * n) entries of largest |g_i|, zeroes the rest.

    Biased (contractive: ||g - q(g)||^2 <= (1 - k/n)||g||^2): wrap in
    :class:`~spark_dl.compression.ErrorFeedback` for training. Wire: k float32 values + k int32
    indices (64 bits per kept element). Not summable: ranks keep different indices.

    ``ratio``: None (the default) keeps 1% of the entries, and 10% under an Adam-style optimizer
    (told by :meth:`observe`, as ``DistributedOptimizer`` and ``make_ddp_hook(c, optimizer=opt)``
    do), where 1% trains a worse model on short runs (docs/guide/compression.md); a number is
    kept whatever the optimizer.
    ``ramp_steps``: the first compressions of each tensor keep more, from ``start_ratio`` of the
    entries down to ``ratio`` geometrically (Deep Gradient Compression's sparsity warm-up): with
    error feedback an entry waits about 1 / ratio steps for its turn, which early training, where
    the gradient changes fastest, pays most for. 60 (the default) keeps 7.5x the entries of
    ``ratio=0.01`` on average over those steps; 0 keeps ``ratio`` from the start.
    """

    # class defaults: pickles from before the ramp keep ``ratio`` from the start
    ramp_steps: int = 0
    start_ratio: float = START_RATIO
    adaptive: bool = False  # told an Adam-style optimizer

    def __init__(self, ratio: float | None = None, ramp_steps: int = RAMP_STEPS,
                 start_ratio: float = START_RATIO) -> None:
        self.requested = None if ratio is None else real_param(ratio, "TopK", "ratio", 0.0, 1.0, open_low=True)
        self.ramp_steps = int_param(ramp_steps, "TopK", "ramp_steps", 0)
        self.start_ratio = real_param(start_ratio, "TopK", "start_ratio", 0.0, 1.0, open_low=True)
        self.compressions: dict[Key, int] = {}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        if "ratio" in state:  # pickled when the ratio was always given: keep it whatever the optimizer
            state["requested"] = state.pop("ratio")
        self.__dict__.update(state)

    @property
    def ratio(self) -> float:
        """The fraction of entries kept once the sparsity warm-up is over, under the optimizer last observed."""
        return self.ratio_for(self.adaptive)

    def ratio_for(self, adaptive: bool) -> float:
        """``ratio`` under an Adam-style optimizer (``adaptive``) or another one."""
        if self.requested is not None:
            return self.requested
        return ADAPTIVE_RATIO if adaptive else RATIO

    def observe(self, *, lr: float | None = None, momentum: float = 0.0, beta2: float = 0.0,
                beta1: float = 0.0) -> None:
        """Note whether the optimizer is Adam-style (``beta2`` > 0): ``TopK()``'s ratio follows it."""
        self.adaptive = bool(beta2 and beta2 > 0)

    def decay_advice(self) -> str | None:
        if self.adaptive or self.ratio > DECAY_MEASURED_UP_TO:  # measured there only
            return None
        return (f"top-k keeping {self.ratio:g} of the entries a step: on a 1.6M-parameter MLP under LargeBatchRecipe "
                "(SGD, momentum 0.9, 300 steps), with error feedback, it trained 7.1-7.7 points below uncompressed at "
                "ratio 0.01 under the recipe's default step decay (3-6 seeds) and 2.4-3.0 below under a cosine decay "
                "(also over 600 steps; 1.0 below over 1000), and 0.5 and 1.5 below at ratio 0.1, where it is within a "
                "point at a constant lr there and under either decay on digits (150 steps). For a decay of a few "
                "hundred steps use QSGD() (4 bits an entry) or PowerSGD(), within 0.6 under both decays there.")

    def _params(self) -> dict:
        params = {} if self.requested is None else {"ratio": self.requested}
        if self.ramp_steps != RAMP_STEPS or self.start_ratio != START_RATIO:
            params.update(ramp_steps=self.ramp_steps, start_ratio=self.start_ratio)
        return params

    def ratio_at(self, step: int) -> float:
        """The fraction of entries kept at a tensor's ``step``-th compression (from 0)."""
        if step >= self.ramp_steps or self.start_ratio <= self.ratio:
            return self.ratio
        return self.ratio * (self.start_ratio / self.ratio) ** (1.0 - step / self.ramp_steps)

    def _ratio(self, key: Key) -> float:
        """This compression's ratio; counts it for ``key`` while the ramp lasts (every rank
        compresses the same keys in the same order, so their k agree)."""
        if not self.ramp_steps:
            return self.ratio
        seen = self.__dict__.setdefault("compressions", {})
        step = seen.get(key, 0)
        if step < self.ramp_steps:
            seen[key] = step + 1
        return self.ratio_at(step)

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "TopK")
        n = tensor.numel()
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        k = _k(n, self._ratio(key))
        if native.enabled(tensor):
            # Radix selection in C: the same set as torch.topk when no |g_i| ties at the cut.
            idx, values = native.topk(tensor, k)
            return Payload([values, idx.to(index_dtype)], Meta(tensor.shape, tensor.dtype))
        x = flat32(tensor)
        idx = torch.topk(x.abs(), k, sorted=False).indices
        return Payload([x[idx], idx.to(index_dtype)], Meta(tensor.shape, tensor.dtype))

    def reset(self, key: Key = None) -> None:
        seen = self.__dict__.get("compressions", {})
        for k in [k for k in seen if key is None or key_matches(k, key)]:
            del seen[k]

    def decompress(self, payload: Payload) -> torch.Tensor:
        values, idx = payload.tensors
        meta = payload.meta
        out = values.new_zeros(meta.numel).index_put_((idx.long(),), values)
        return restore(out, meta)

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        """Scatter the k values into ``out`` (zeroed first unless ``accumulate``): the collectives'
        decode-accumulate touches k entries instead of adding a dense decompression (an entry
        -0 stays -0 where adding the dense zero would give +0; top-k indices are unique)."""
        values, idx = payload.tensors
        if out.dtype != torch.float32 or values.dtype != torch.float32:
            super().decompress_into(payload, out, accumulate)
            return
        if not accumulate:
            out.zero_()
        out.index_put_((idx.long(),), values, accumulate=accumulate)

    def subtract_decompressed(self, p: torch.Tensor, payload: Payload) -> torch.Tensor:
        values, idx = payload.tensors
        out = _subtract_kept(p, idx, values)
        return super().subtract_decompressed(p, payload) if out is None else out

    def bits_per_element(self) -> float:
        return 64.0 * self.ratio


@dataclass
class _RandMeta(Meta):
    indices: torch.Tensor


def _distinct(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """k distinct indices in [0, n), a uniform k-subset drawn from ``g`` (so every rank with the same
    generator state draws the same). A dense draw is a permutation's prefix; a sparse one keeps the
    first k distinct values of uniform draws, which is uniform too and costs O(k log k), not O(n)."""
    device = g.device
    if k * 4 >= n:
        return torch.randperm(n, generator=g, device=device)[:k]
    draws = torch.empty(0, dtype=torch.long, device=device)
    short = k
    while short > 0:  # k / n < 1/4: the first pass almost always draws enough
        more = torch.randint(0, n, (short + short * k // n + 16,), generator=g, device=device)
        draws = torch.cat([draws, more])
        distinct, inverse = torch.unique(draws, return_inverse=True)
        short = k - distinct.numel()
    order = torch.arange(draws.numel(), device=device)
    first = torch.full_like(distinct, draws.numel()).scatter_reduce_(0, inverse, order, "amin")
    return distinct[torch.argsort(first)[:k]]


class RandomK(Compressor):
    """Keeps k = ceil(ratio * n) entries at indices drawn from (seed, key, step): the same on
    every rank as long as ranks compress the same tensors in the same order, so only the values
    travel and the payload is summable. With ``scale=True`` the values are multiplied by n/k,
    making q unbiased (E[q(g)] = g); by default it is unscaled and meant for error feedback.
    The k indices are distinct (a uniform k-subset: each entry is kept with probability k/n, and
    ``ratio=1`` sends every entry). Wire: k float32 values (32 * ratio bits per element).
    """

    summable = True

    def __init__(self, ratio: float = 0.01, seed: int = 0, scale: bool = False) -> None:
        self.ratio = real_param(ratio, "RandomK", "ratio", 0.0, 1.0, open_low=True)
        self.seed = int_param(seed, "RandomK", "seed")
        if not isinstance(scale, bool):
            raise ValueError(f"RandomK scale must be True or False, got {scale!r}")
        self.scale = scale
        self.steps: dict[Key, int] = {}

    def _params(self) -> dict:
        return {"ratio": self.ratio, "seed": self.seed, "scale": self.scale}

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "RandomK")
        x = flat32(tensor)
        n = x.numel()
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        k = _k(n, self.ratio)
        idx = _distinct(n, k, generator(x.device, "randomk", self.seed, key, step))
        values = x[idx]
        if self.scale and k:
            values.mul_(n / k)
        return Payload([values], _RandMeta(tensor.shape, tensor.dtype, idx))

    def decompress(self, payload: Payload) -> torch.Tensor:
        meta: _RandMeta = payload.meta
        values = payload.tensors[0]
        out = values.new_zeros(meta.numel).index_put_((meta.indices,), values)
        return restore(out, meta)

    def decompress_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> None:
        values = payload.tensors[0]
        if accumulate or out.dtype != torch.float32 or values.dtype != torch.float32:
            # adding: a duplicated index must count once, as in decompress
            super().decompress_into(payload, out, accumulate)
            return
        out.zero_()
        out.index_put_((payload.meta.indices,), values)

    def subtract_decompressed(self, p: torch.Tensor, payload: Payload) -> torch.Tensor:
        out = _subtract_kept(p, payload.meta.indices, payload.tensors[0])
        return super().subtract_decompressed(p, payload) if out is None else out

    def bits_per_element(self) -> float:
        return 32.0 * self.ratio

    @property
    def stateful(self) -> bool:
        return True  # the step counters: a fresh instance per call would draw the same indices each time

    def reset(self, key: Key = None) -> None:
        # Step counters are shared state across ranks: every rank resets them together.
        from spark_dl.compression.memory import key_matches

        if key is None:
            self.steps.clear()
        else:
            for k in [k for k in self.steps if key_matches(k, key)]:
                del self.steps[k]
