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

Both rounds are plain all-reduces of r(n + m) floats instead of n m. A bucket of gradients
(``allreduce(..., layout=shapes)``: the DDP hook and ``DistributedOptimizer`` pass their
buckets' shapes) is factored gradient by gradient, 1-D ones sent uncompressed, with every P in
one all-reduce and every Q in another. On the CPU with the native kernels a round makes two
passes over M: the first adds the gradient, subtracts the last round's P^ Qw^T (e is kept as M
and its factors: :class:`FactoredResiduals`) and projects; the second computes Qw; the output
is one streaming write. The torch path (GPUs, or no C compiler) batches the tensors that share
a matrix shape (ResNet-50's 54 weights come in 21 shapes): one (k, n, m) M per shape, whose
slices are the residuals, with batched products and one in-place residual update while Q is on
the wire; on a GPU the orthonormal bases of the summed P are computed on the host (one copy each
way), where LAPACK beats the GPU's chain of small QR kernels for these thin matrices.
Before ``start_iter``
compressed steps (counted per tensor) and for tensors where rank r saves less than
``min_compression_rate``, or no bytes at all (r(n + m) >= n m: a (1, N) or (N, 1) weight), the
tensor is all-reduced uncompressed, exactly, and e stays empty, as in
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``; float64 tensors sent uncompressed
stay float64 on the wire. A round whose P or Q comes out non-finite (an inf or NaN gradient on
some rank) returns a non-finite result and drops that tensor's e and warm-start Q.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from spark_dl.compression import native
from spark_dl.compression.base import Compressor, Key, Meta, Payload, check_float, int_param, real_param, restore
from spark_dl.compression.memory import PendingResiduals, key_matches
from spark_dl.compression.rng import generator
from spark_dl.compression.training import TrainingFeedback

AllReduce = Callable[[torch.Tensor], None]
# begins an in-place sum across ranks and returns the function that waits for it to finish
StartAllReduce = Callable[[torch.Tensor], Callable[[], None]]


@dataclass
class _PMeta(Meta):
    rows: int
    cols: int
    compressed: bool


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """torch's view, ``shape[0] x rest``, for a tensor of two or more dimensions (a (1, N) or
    (N, 1) weight stays 1 x N or N x 1, which no factorization shrinks: it goes uncompressed);
    a 1-D tensor as a near-square matrix, zero-padded."""
    n = math.prod(shape)
    if len(shape) >= 2:
        return shape[0], n // shape[0] if shape[0] else math.prod(shape[1:])
    rows = max(1, math.isqrt(max(n - 1, 0)) + 1) if n else 1
    return rows, max(1, -(-n // rows))


@functools.lru_cache(maxsize=64)
def _positions(numels: tuple[int, ...], which: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The positions, in a bucket packing tensors of ``numels`` in order, of the elements of the
    tensors ``which`` (ascending), in order: one index for a gather and a scatter."""
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    return torch.cat([torch.arange(starts[i], starts[i + 1]) for i in which]).to(device)


def _bases_on_host(p_all: torch.Tensor, dims: list[tuple[int, int, int]],
                   names: list[tuple[int, int]]) -> dict[tuple[int, int], torch.Tensor]:
    """The orthonormal bases of a bucket's P on a CUDA device, computed on the host: ``p_all`` holds
    each group's k factors P^T (r x n each) side by side, ``dims`` each group's (k, n, r).
    A GPU's batched QR of these thin matrices is a chain of small launches (ResNet-50's 21
    groups: 4.9 ms on an H200, against 1.2 ms with LAPACK and both copies), and with Gloo P
    has just crossed host memory anyway. Returns (k, n, r) bases on ``p_all``'s device."""
    host = torch.empty(p_all.shape, dtype=p_all.dtype, pin_memory=True)
    host.copy_(p_all, non_blocking=True)
    torch.cuda.current_stream(p_all.device).synchronize()
    out = torch.empty_like(host, pin_memory=True)
    at, views = 0, []
    for k, n, r in dims:
        size = k * n * r
        q = out[at:at + size].view(k, n, r)
        q.copy_(torch.linalg.qr(host[at:at + size].view(k, r, n).transpose(1, 2), mode="reduced").Q)
        views.append((at, size, (k, n, r)))
        at += size
    on_device = out.to(p_all.device, non_blocking=True)
    return {name: on_device[a:a + size].view(shape) for name, (a, size, shape) in zip(names, views)}


def _no_op(t: torch.Tensor) -> None:
    return None


def _done() -> None:
    return None


def _finite(*tensors: torch.Tensor) -> bool:
    return bool(functools.reduce(torch.logical_and, [torch.isfinite(t).all() for t in tensors]))


def _started(all_reduce: AllReduce) -> StartAllReduce:
    def start(t: torch.Tensor) -> Callable[[], None]:
        all_reduce(t)
        return _done
    return start


class FactoredResiduals(PendingResiduals):
    """PowerSGD's residuals. With the native kernels a residual ``e = M - P^ Qw^T`` is kept as M
    and its two factors, and the next round's first pass subtracts the product while it adds
    the gradient and projects (:func:`native.powersgd_project`): a pass over M fewer per round.
    Reading :attr:`memory` (or pickling) applies the pending products first, so the residuals
    seen from outside are always ``e``."""

    def _settle(self, e: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor]) -> None:
        native.lowrank_subtract(e.view(-1), *pending)

    def project(self, g: torch.Tensor, key: Key, scale: float, q: torch.Tensor, rows: int, cols: int,
                pt: torch.Tensor) -> torch.Tensor:
        """``M = e + scale * g`` (in e's memory when it fits) and ``pt = (M Q)^T``, one pass;
        returns M, flat. A residual of another shape is dropped (as :class:`Residuals` does). The
        caller must store a residual for ``key`` afterwards."""
        e = self._memory.pop(key, None)
        pending = self.pending.pop(key, None)
        if (e is not None and e.shape == g.shape and e.device == g.device and e.dtype == torch.float32
                and e.is_contiguous()):
            m, mode = e.view(-1), (2 if pending is not None else 1)
        else:  # no residual yet, or it no longer fits (the tensor changed): e = 0
            m, mode = torch.empty(g.numel(), dtype=torch.float32, device=g.device), 0
        native.powersgd_project(g.reshape(-1), m, q, rows, cols, pt, scale, mode, pending)
        return m

    def store_factored(self, key: Key, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """The residual ``m - p @ q.T``, its product left pending (``p`` rows x r, ``q`` cols x r)."""
        self._memory[key] = m
        self.pending[key] = (p, q)

    def drop(self, key: Key) -> None:
        """Forget ``key``'s residual, pending product included (after a non-finite round: the next
        round starts from e = 0); exactly that key, where :meth:`reset` also takes its sub-keys."""
        self._memory.pop(key, None)
        self.pending.pop(key, None)


class PowerSGD(Compressor):
    """See the module docstring. ``rank`` r, ``start_iter`` uncompressed steps per tensor first,
    ``warm_start`` reuses last step's Q (else a fresh random Q each step), error feedback always.
    ``compress``/``decompress`` run the same round for a single process (W = 1).
    Not summable as one payload: :func:`~spark_dl.compression.allreduce` runs its two rounds.

    The defaults, rank 8 and no warm-up, are measured (``benchmarks/convergence.py``,
    ``benchmarks/time_to_accuracy.py``): at most 0.1 points below uncompressed training on digits
    under SGD with momentum, Nesterov, Adam, AdamW and the large-batch recipe (10 seeds), where rank
    4 after 10 uncompressed steps was up to 0.4 below, and to a target accuracy rank 4 needed
    up to 47% more steps than fp32, rank 8 up to 27%. The uncompressed steps of a warm-up cost most
    on the slow links compression is for (10 fp32 steps: 36 s of an 83 s run at 100 Mbit/s).
    """

    summable = False

    def __init__(self, rank: int = 8, start_iter: int = 0, warm_start: bool = True,
                 min_compression_rate: float = 2.0, seed: int = 0) -> None:
        self.rank = int_param(rank, "PowerSGD", "rank", 1)
        self.start_iter = int_param(start_iter, "PowerSGD", "start_iter", 0)
        if not isinstance(warm_start, bool):
            raise ValueError(f"PowerSGD warm_start must be True or False, got {warm_start!r}")
        self.warm_start = warm_start
        self.min_compression_rate = real_param(min_compression_rate, "PowerSGD", "min_compression_rate", 0.0)
        self.seed = int_param(seed, "PowerSGD", "seed")
        self.residuals = FactoredResiduals()
        self.qs: dict[Key, torch.Tensor] = {}
        self.steps: dict[Key, int] = {}
        # its residuals follow the lr (spark_dl.compression.training); start_iter is its warm-up, and
        # the gradient, neither the velocity nor Adam's preconditioned one, is factored (within a
        # point of fp32 as is under momentum SGD and Adam)
        self.feedback = TrainingFeedback(0, compress_momentum=False, precondition=False)

    def _params(self) -> dict:
        return {"rank": self.rank, "start_iter": self.start_iter, "warm_start": self.warm_start}

    @property
    def stateful(self) -> bool:
        return True

    def _plan(self, tensor: torch.Tensor, key: Key, vectors: bool = True) -> _PMeta:
        rows, cols = _matrix_shape(tensor.shape)
        r = min(self.rank, rows, cols)
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        # as torch's _should_compress: the factors must be smaller than the tensor, whatever the rate
        worth = ((vectors or tensor.dim() > 1) and r * (rows + cols) < rows * cols
                 and rows * cols >= self.min_compression_rate * r * (rows + cols))
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
        out, payloads = self._round([tensor], [key], _started(all_reduce), world, scale)
        return restore(out, Meta(tensor.shape, tensor.dtype)), payloads[0]

    def round_layers(self, flat: torch.Tensor, shapes: Sequence[Sequence[int]] | None, key: Key,
                     start: StartAllReduce, world: int = 1, scale: float = 1.0,
                     into: torch.Tensor | None = None) -> torch.Tensor:
        """One step for a bucket: ``flat`` packs tensors of ``shapes`` (flattened, in order); each
        is factored as its own matrix (state keyed ``(key, i)``) and 1-D ones (biases, norms) go
        uncompressed, as torch's ``powerSGD_hook`` does per gradient. ``shapes=None``: ``flat``
        is one tensor, keyed ``key``. All P (with the tensors sent uncompressed) go in one
        all-reduce and all Q in a second, whatever the number of tensors. ``start(t)`` begins an
        in-place sum of ``t`` across ranks and returns a function that waits for it. Returns the
        average, flat float32 (float64 for a float64 ``flat``, whose uncompressed tensors then
        travel in float64), written into ``into`` when given (a contiguous float32 tensor of
        ``flat``'s numel; ``flat`` itself is allowed: it is read before anything is written).
        """
        check_float(flat, "PowerSGD")
        if into is not None and (into.numel() != flat.numel() or into.dtype != torch.float32
                                 or not into.is_contiguous() or into.device != flat.device):
            raise ValueError(f"into must be a contiguous float32 tensor of {flat.numel()} elements on "
                             f"{flat.device}, got {into.dtype} {tuple(into.shape)} on {into.device}")
        if shapes is None:
            return self._round([flat], [key], start, world, scale, into=into)[0]
        parts, at = [], 0
        for shape in shapes:
            n = math.prod(shape)
            parts.append(flat.reshape(-1)[at:at + n].view(tuple(shape)))
            at += n
        if at != flat.numel():
            raise ValueError(
                f"layout of {len(shapes)} tensors holds {at} elements but the bucket has {flat.numel()}: "
                "pass the shapes of exactly the tensors packed in it, in order."
            )
        if not parts:
            return flat.new_empty(0, dtype=torch.float32)
        return self._round(parts, [(key, i) for i in range(len(parts))], start, world, scale, vectors=False,
                           into=into, flat=flat, with_payloads=False)[0]

    def _round(self, parts: list[torch.Tensor], keys: list[Key], start: StartAllReduce, world: int,
               scale: float, vectors: bool = True, into: torch.Tensor | None = None,
               flat: torch.Tensor | None = None,
               with_payloads: bool = True) -> tuple[torch.Tensor, list[Payload]]:
        """``flat``: the bucket ``parts`` are consecutive views of, in order; its uncompressed
        tensors then move with one gather and one scatter instead of two calls each."""
        metas = [self._plan(t, k, vectors) for t, k in zip(parts, keys)]
        device = parts[0].device
        comp = [i for i, m in enumerate(metas) if m.compressed]
        ranks = {i: min(self.rank, metas[i].rows, metas[i].cols) for i in comp}
        # The compressed tensors by matrix shape, in order of first appearance: a group's P (and
        # Q) lie side by side on the wire, so its QR, and on the torch path its products and
        # residual update, are one batched call each, however many layers share the shape.
        groups: dict[tuple[int, int], list[int]] = {}
        for i in comp:
            groups.setdefault((metas[i].rows, metas[i].cols), []).append(i)
        # Round 1 carries the uncompressed tensors (scaled) first, then every P, stored r x n: the
        # layout (Q^T M^T) in which BLAS streams the row-major M once (3x faster than M Q).
        # float64 ones travel in float64 instead, in a buffer of their own (torch's hook sends
        # them in the bucket's dtype), and the result is then float64.
        wide = parts[0].dtype == torch.float64 and into is None
        raw_at, p_at, q_at, n1, n2 = {}, {}, {}, 0, 0
        for i, m in enumerate(metas):
            if not m.compressed:
                raw_at[i] = n1
                n1 += m.numel
        n_raw = n1
        if wide:
            n1 = 0
        for idx in groups.values():
            for i in idx:
                p_at[i], q_at[i] = n1, n2
                n1 += ranks[i] * metas[i].rows
                n2 += ranks[i] * metas[i].cols
        round1 = torch.empty(n1, dtype=torch.float32, device=device)
        round2 = torch.empty(n2, dtype=torch.float32, device=device)
        raw = torch.empty(n_raw, dtype=torch.float64, device=device) if wide else round1[:n_raw]
        fused = native.enabled(parts[0]) and all(parts[i].dtype == torch.float32 for i in comp)
        gather = None
        if flat is not None and len(raw_at) > 1:  # (a bucket's biases and norms: one call, not one each)
            gather = _positions(tuple(metas[i].numel for i in range(len(metas))),
                                tuple(sorted(raw_at)), device)
            if flat.dtype == raw.dtype:
                torch.index_select(flat.reshape(-1), 0, gather, out=raw)
                if scale != 1.0:
                    raw.mul_(scale)
            else:
                torch.mul(flat.reshape(-1).index_select(0, gather), scale, out=raw)
        elif raw_at:
            for i in raw_at:
                torch.mul(parts[i].reshape(-1).to(raw.dtype), scale, out=raw[raw_at[i]:raw_at[i] + metas[i].numel])

        def group_slice(buf: torch.Tensor, at: dict[int, int], idx: list[int], width: int) -> torch.Tensor:
            r = ranks[idx[0]]
            return buf[at[idx[0]]:at[idx[0]] + len(idx) * r * width].view(len(idx), r, width)

        # M = e + scale * g per tensor, and P. Native: one pass per matrix. Torch: a group's M is
        # one (k, n, m) tensor (the residuals are its slices, so next step adds in place).
        ms: dict[int, torch.Tensor] = {}
        stacks: dict[tuple[int, int], torch.Tensor] = {}
        for (rows, cols), idx in groups.items():
            if fused:
                for i in idx:
                    pt = round1[p_at[i]:p_at[i] + ranks[i] * rows].view(ranks[i], rows)
                    ms[i] = self.residuals.project(parts[i], keys[i], scale, self._q(keys[i], metas[i], device),
                                                   rows, cols, pt)
                continue
            if all(metas[i].numel == rows * cols for i in idx):
                mat = stacks[rows, cols] = self._stacked_m([parts[i] for i in idx], [keys[i] for i in idx],
                                                           rows, cols, scale)
                qt = torch.stack([self._q(keys[i], metas[i], device).t() for i in idx])
                torch.bmm(qt, mat.transpose(1, 2), out=group_slice(round1, p_at, idx, rows))
                for j, i in enumerate(idx):
                    ms[i] = mat[j]
                continue
            for i in idx:  # a 1-D tensor as a zero-padded near-square matrix (round() only)
                m = metas[i]
                mat = self.residuals.add_scaled(parts[i], keys[i], scale)
                mat = torch.cat([mat.reshape(-1), mat.new_zeros(rows * cols - mat.numel())])
                ms[i] = mat = mat.view(rows, cols)
                pt = round1[p_at[i]:p_at[i] + ranks[i] * rows].view(ranks[i], rows)
                torch.mm(self._q(keys[i], m, device).t(), mat.t(), out=pt)
        wait_raw = start(raw) if wide and n_raw else _done
        if n1 or not wide:
            start(round1)()
        wait_raw()
        # Orthonormal bases, one batched QR per group; on a GPU, on the host (see _bases_on_host).
        ps: dict[int, torch.Tensor] = {}
        bases: dict[tuple[int, int], torch.Tensor] = {}
        if device.type == "cuda" and groups:
            first = next(iter(groups.values()))[0]
            bases = _bases_on_host(round1[p_at[first]:n1], [(len(idx), rows, ranks[idx[0]])
                                                            for (rows, _), idx in groups.items()],
                                   list(groups))
        else:
            for (rows, cols), idx in groups.items():
                bases[rows, cols] = torch.linalg.qr(group_slice(round1, p_at, idx, rows).transpose(1, 2),
                                                    mode="reduced").Q.contiguous()
        for shape, idx in groups.items():
            for j, i in enumerate(idx):
                ps[i] = bases[shape][j]
        # this rank's Q, stored r x m (P^T M: M streamed once)
        for (rows, cols), idx in groups.items():
            if (rows, cols) in stacks:
                torch.bmm(bases[rows, cols].transpose(1, 2), stacks[rows, cols],
                          out=group_slice(round2, q_at, idx, cols))
                continue
            for i in idx:
                qt = round2[q_at[i]:q_at[i] + ranks[i] * cols].view(ranks[i], cols)
                if fused:
                    native.powersgd_back(ps[i], ms[i], rows, cols, qt)
                else:
                    torch.mm(ps[i].t(), ms[i], out=qt)
        local = round2.clone()
        wait = start(round2)
        for (rows, cols), idx in groups.items():
            if fused:  # e = M - P^ Qw^T is left to the next round's first pass
                for i in idx:
                    q_local = local[q_at[i]:q_at[i] + ranks[i] * cols].view(ranks[i], cols)
                    self.residuals.store_factored(keys[i], ms[i].view(metas[i].shape), ps[i], q_local.t())
                continue
            # While Q travels: e = M - P^ Qw^T, in place (no second n x m temporary).
            if (rows, cols) in stacks:
                stacks[rows, cols].baddbmm_(bases[rows, cols], group_slice(local, q_at, idx, cols), alpha=-1)
            else:
                for i in idx:
                    ms[i].addmm_(ps[i], local[q_at[i]:q_at[i] + ranks[i] * cols].view(ranks[i], cols), alpha=-1)
            for i in idx:
                self.residuals.store(keys[i], ms[i].view(-1)[:metas[i].numel].view(metas[i].shape))
        wait()
        # An overflowed step (an inf or a NaN in a gradient on any rank) leaves that tensor's summed
        # P and Q non-finite on every rank alike: its output stays non-finite, so AMP's GradScaler
        # sees it and skips the step, but its residual (non-finite too) and warm-start Q are
        # dropped, so the steps after it start clean instead of staying non-finite for good. One
        # check of both rounds (one device sync), one per tensor only when it fails.
        poisoned: set[int] = set()
        if comp and not _finite(round1[0 if wide else n_raw:], round2):
            poisoned = {i for i in comp if not _finite(round1[p_at[i]:p_at[i] + ranks[i] * metas[i].rows],
                                                       round2[q_at[i]:q_at[i] + ranks[i] * metas[i].cols])}
        for i in poisoned:
            self.residuals.drop(keys[i])
        # every read of the parts happened in the first loop: ``into`` may alias them
        total = sum(m.numel for m in metas)
        out = into.view(-1) if into is not None else torch.empty(total, dtype=raw.dtype, device=device)
        if gather is not None:
            out.index_copy_(0, gather, raw / world if world != 1 else raw)
        starts, at = [], 0
        for m in metas:
            starts.append(at)
            at += m.numel
        for i in raw_at:
            if gather is None:
                dest, wire = out[starts[i]:starts[i] + metas[i].numel], raw[raw_at[i]:raw_at[i] + metas[i].numel]
                if world != 1:
                    torch.div(wire, world, out=dest)
                else:
                    dest.copy_(wire)
        for (rows, cols), idx in groups.items():
            q_sum = group_slice(round2, q_at, idx, cols)  # (k, r, m): Q^T of each tensor, summed
            # The 1/W of the average rides on the small factor: no pass over the n x m output.
            q_avg = q_sum / world if world != 1 else q_sum
            for j, i in enumerate(idx):
                m = metas[i]
                if i in poisoned:
                    self.qs.pop(keys[i], None)  # the next step draws a fresh Q, the same on every rank
                else:
                    self.qs[keys[i]] = q_sum[j].t()
                dest = out[starts[i]:starts[i] + m.numel]
                if wide:  # a float64 result: the float32 product, then cast
                    dest.copy_((ps[i] @ q_avg[j]).view(-1)[:m.numel])
                elif native.enabled(ps[i]):  # one streaming write; torch's GEMM at k = r is far slower
                    native.lowrank_product(ps[i], q_avg[j].t(), m.numel, out=dest)
                elif m.numel == rows * cols:
                    torch.mm(ps[i], q_avg[j], out=dest.view(rows, cols))
                else:
                    dest.copy_((ps[i] @ q_avg[j]).view(-1)[:m.numel])
        payloads = []
        if with_payloads:
            for i, m in enumerate(metas):
                if i in raw_at:
                    payloads.append(Payload([raw[raw_at[i]:raw_at[i] + m.numel]], m))
                else:
                    r = ranks[i]
                    qw = local[q_at[i]:q_at[i] + r * m.cols].view(r, m.cols).t().contiguous()
                    payloads.append(Payload([ps[i].contiguous(), qw], m))
        return out, payloads

    def _stacked_m(self, parts: list[torch.Tensor], keys: list[Key], rows: int, cols: int,
                   scale: float) -> torch.Tensor:
        """``M = e + scale * g`` for a group of same-shape tensors as one (k, rows, cols) float32
        tensor; the group's residuals are its slices when they were stored from such a tensor,
        and then M is formed in that memory."""
        memory = self.residuals.memory
        es = [memory.get(key) for key in keys]
        g = torch.stack([t.reshape(rows, cols) for t in parts])
        base = es[0]._base if es[0] is not None else None
        step = rows * cols * 4
        if (base is not None and base.shape == (len(parts), rows, cols) and base.dtype == torch.float32
                and base.device == g.device
                and all(e is not None and e._base is base and e.shape == t.shape
                        and e.data_ptr() == base.data_ptr() + j * step for j, (e, t) in enumerate(zip(es, parts)))):
            mat = base.add_(g, alpha=scale)
        else:
            mat = g.to(torch.float32).mul(scale) if scale != 1.0 or g.dtype != torch.float32 else g
            for j, (e, t) in enumerate(zip(es, parts)):
                if e is not None and e.shape == t.shape and e.device == t.device:
                    mat[j].add_(e.reshape(rows, cols))
        for key in keys:
            memory.pop(key, None)
        return mat

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
        self.feedback.reset(key)
        for d in (self.qs, self.steps):
            for k in [k for k in d if key is None or key_matches(k, key)]:
                del d[k]
