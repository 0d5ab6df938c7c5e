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


class TopK(Compressor):
    """Keeps the k = ceil(ratio * n) entries of largest |g_i|, zeroes the rest.

    Biased (contractive: ||g - q(g)||^2 <= (1 - k/n)||g||^2): wrap in
    :class:`~spark_dl.compression.ErrorFeedback` for training. Wire: k float32 values + k int32
    indices (64 bits per kept element). Not summable: ranks keep different indices.
    """

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = real_param(ratio, "TopK", "ratio", 0.0, 1.0, open_low=True)

    def _params(self) -> dict:
        return {"ratio": self.ratio}

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        check_float(tensor, "TopK")
        n = tensor.numel()
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        if native.enabled(tensor):
            # Radix selection in C: the same set as torch.topk when no |g_i| ties at the cut.
            idx, values = native.topk(tensor, _k(n, self.ratio))
            return Payload([values, idx.to(index_dtype)], Meta(tensor.shape, tensor.dtype))
        x = flat32(tensor)
        idx = torch.topk(x.abs(), _k(n, self.ratio), sorted=False).indices
        return Payload([x[idx], idx.to(index_dtype)], Meta(tensor.shape, tensor.dtype))

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
