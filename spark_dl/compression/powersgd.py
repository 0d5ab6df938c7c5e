"""PowerSGD (Vogels et al., 2019): rank-r gradient approximation by one power iteration.

Per tensor, viewed as an n x m matrix M (``shape[0] x rest``; a 1-D tensor is laid out as a
near-square matrix, zero-padded), with error feedback e and a warm-started Q (m x r)::

    M  <- G + e
    P  <- allreduce_sum(M Q)           # n x r
    P^ <- orthonormal basis of P       # reduced QR
    Qw <- M^T P^                       # this rank's m x r factor
    Q  <- allreduce_sum(Qw)
    out = P^ Q^T / W                   # the average of the W projections P^ P^T M_w
    e  <- M - P^ Qw^T                  # what the projection dropped on this rank

Both rounds are plain all-reduces of r(n + m) floats instead of n m. Before ``start_iter``
compressed steps (counted per tensor) and for tensors where rank r saves less than
``min_compression_rate``, the tensor is all-reduced uncompressed and e stays empty, as in
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import native
from .base import Compressor, Key, Meta, Payload, check_float, flat32, restore
from .memory import Residuals, key_matches
from .rng import generator

AllReduce = Callable[[torch.Tensor], None]


@dataclass
class _PMeta(Meta):
    rows: int
    cols: int
    compressed: bool


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    n = math.prod(shape)
    if len(shape) >= 2 and shape[0] > 1 and n // shape[0] > 1:
        return shape[0], n // shape[0]
    rows = max(1, math.isqrt(max(n - 1, 0)) + 1) if n else 1
    return rows, max(1, -(-n // rows))


def _no_op(t: torch.Tensor) -> None:
    return None


class PowerSGD(Compressor):
    """See the module docstring. ``rank`` r, ``start_iter`` uncompressed steps per tensor first,
    ``warm_start`` reuses last step's Q (else a fresh random Q each step), error feedback always.
    ``compress``/``decompress`` run the same round for a single process (W = 1).
    Not summable as one payload: :func:`~spark_dl.compression.allreduce` runs its two rounds.
    """

    summable = False

    def __init__(self, rank: int = 4, start_iter: int = 10, warm_start: bool = True,
                 min_compression_rate: float = 2.0, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank = rank
        self.start_iter = start_iter
        self.warm_start = warm_start
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self.residuals = Residuals()
        self.qs: dict[Key, torch.Tensor] = {}
        self.steps: dict[Key, int] = {}

    def _params(self) -> dict:
        return {"rank": self.rank, "start_iter": self.start_iter, "warm_start": self.warm_start}

    @property
    def stateful(self) -> bool:
        return True

    def _plan(self, tensor: torch.Tensor, key: Key) -> _PMeta:
        rows, cols = _matrix_shape(tensor.shape)
        r = min(self.rank, rows, cols)
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        worth = rows * cols >= self.min_compression_rate * r * (rows + cols)
        return _PMeta(tensor.shape, tensor.dtype, rows, cols, worth and step >= self.start_iter)

    def _q(self, key: Key, meta: _PMeta, device: torch.device) -> torch.Tensor:
        r = min(self.rank, meta.rows, meta.cols)
        q = self.qs.get(key)
        if not self.warm_start or q is None or q.shape != (meta.cols, r) or q.device != device:
            # Every rank draws the same Q: M Q can then be summed across ranks.
            g = generator(device, "powersgd", self.seed, key, self.steps[key])
            q = torch.randn(meta.cols, r, generator=g, device=device)
        return q

    def round(self, tensor: torch.Tensor, key: Key, all_reduce: AllReduce = _no_op,
              world: int = 1, scale: float = 1.0) -> tuple[torch.Tensor, Payload]:
        """One PowerSGD step for ``scale * tensor``; ``all_reduce`` sums a tensor in place across
        ranks. Returns the average over ranks of the approximations and this rank's payload.
        """
        check_float(tensor, "PowerSGD")
        meta = self._plan(tensor, key)
        if not meta.compressed:
            wire = flat32(tensor).mul(scale) if scale != 1.0 else flat32(tensor).clone()
            all_reduce(wire)
            return restore(wire / world, meta), Payload([wire], meta)
        # M = e + scale * g, in the residual's own memory when it has one: one pass, no copy
        m = self.residuals.add_scaled(tensor, key, scale)
        n = meta.rows * meta.cols
        if m.numel() != n:
            m = torch.cat([m.reshape(-1), m.new_zeros(n - m.numel())])
        m = m.view(meta.rows, meta.cols)
        # Skinny products as (r x big) @ (big x big): BLAS streams the row-major M once, about
        # 3x (M Q) and 4.5x (M^T P) faster on one CPU core than the tall forms.
        p = (self._q(key, meta, m.device).t() @ m.t()).t().contiguous()
        all_reduce(p)
        p = torch.linalg.qr(p, mode="reduced").Q.contiguous()
        q_local = (p.t() @ m).t().contiguous()
        q = q_local.clone()
        all_reduce(q)
        # e = M - P^ Qw^T, in place: no second n x m temporary.
        self.residuals.store(key, m.addmm_(p, q_local.t(), alpha=-1).view(-1)[:meta.numel].view(meta.shape))
        self.qs[key] = q
        # The 1/W of the average rides on the small factor: no pass over the n x m output.
        q_avg = q / world if world != 1 else q
        if native.enabled(p, q_avg):  # one streaming write; torch's GEMM at k = r is far slower
            approx = native.lowrank_product(p, q_avg, meta.numel)
        else:
            approx = (p @ q_avg.t()).view(-1)[:meta.numel]
        return restore(approx, meta), Payload([p, q_local], meta)

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        return self.round(tensor, key)[1]

    def decompress(self, payload: Payload) -> torch.Tensor:
        meta: _PMeta = payload.meta
        if not meta.compressed:
            return restore(payload.tensors[0], meta)
        p, q = payload.tensors
        return restore((p @ q.t()).view(-1)[:meta.numel], meta)

    def bits_per_element(self, shape: tuple[int, ...] = (1024, 1024)) -> float:
        """32 r (n + m) / (n m) for an n x m matrix (default 1024 x 1024)."""
        rows, cols = _matrix_shape(torch.Size(shape))
        r = min(self.rank, rows, cols)
        return 32.0 * r * (rows + cols) / (rows * cols)

    def reset(self, key: Key = None) -> None:
        self.residuals.reset(key)
        for d in (self.qs, self.steps):
            for k in [k for k in d if key is None or key_matches(k, key)]:
                del d[k]
