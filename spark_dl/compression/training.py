"""What a compressor with error feedback is told about the training it serves, and what it does with it.

Three measures keep a biased compressor (1-bit, EF-sign, top-k or random-k with error feedback)
within reach of uncompressed training with the same optimizer and hyperparameters:

* **warm-up**: the first ``warmup_steps`` reductions of each tensor go uncompressed. Early
  gradients are large and change fast, and a biased compressor's delayed error hurts most there
  (PowerSGD's ``start_iter`` and DeepSpeed's 1-bit Adam warm up the same way).
* **shared momentum** (as DeepSpeed's 1-bit Adam compresses its momentum): under momentum SGD
  every rank compresses ``x_k = g_k + m v_{t-1}``, its gradient plus the momentum of the reduced
  velocity ``v_{t-1}`` that every rank holds alike, so the reduction gives the velocity
  ``v_t = m v_{t-1} + mean_k g_k`` itself, to within the compression error that error feedback
  sends later. It is handed to the optimizer as ``g~_t = v_t - m v_{t-1}``, so the optimizer's
  own buffer ``u <- m u + g~`` equals ``v_t``. The compressed vectors are then nearly the same
  on every rank and dominated by the smooth velocity, whose signs 1-bit compression keeps well.
  On digits (heavy-ball momentum, 1-bit with 64-element buckets, 60 seeds of a 2-rank
  simulation) this is 0.4 points below uncompressed training, where compressing each rank's own
  velocity (Lin et al. 2018's momentum correction) is 1.3 below; EF-sign is 0.1 below here
  and was 5.6 below that way (10 seeds). With exact compression ``g~_t`` is the averaged gradient.
* **preconditioning** under Adam-style optimizers (``betas``), which rescale the gradient per
  entry: every rank compresses ``g_k / d``, where ``d`` is the square root of the mean square of
  the reduced gradient (Adam's second moment of it, held alike by every rank), and the reduction
  is multiplied by ``d`` again. A 1-bit bucket's mean, or EF-sign's one scale, then spans entries
  of like size in Adam's eyes, instead of being set by the few with the largest raw gradients.
  Signs do not carry magnitudes, so the second moment is measured on the first
  ``ADAPTIVE_WARMUP`` reductions (or ``warmup_steps``, if more), which go uncompressed, and then
  held, as DeepSpeed's 1-bit Adam freezes its variance after warm-up. A compressed reduction
  carries its compression error, up to a bucket's scale on an entry whose gradient is near 0;
  taken into the second moment it raised ``d``, which raised the residual in gradient units
  (``d e``) and so the next error. On a 1.6M-parameter MLP under Adam, EF-sign's residual then
  grew to 15,000-20,000 times the divided gradient in some runs; with the second moment held
  (12 seeds) it is 1.2 points below uncompressed with no such run (it was 1.5 below over 6
  seeds, 2.7-6 below on three), 1-bit +0.1, top-k at 1% -0.3; on digits (10 seeds) EF-sign's
  one scale per tensor went from 1.1-1.7 below to 0.9-1.1 below, top-k at 1% from 3.6-3.9
  below to 3.0-3.3 below, and the others stayed within 0.2 of where they were. Held, ``d`` does
  not follow later changes in the relative sizes of a bucket's entries; only those matter, as a
  bucket's scale is measured afresh each step.
* **shared first moment** (the sign compressors, ``first_moment``) under Adam-style optimizers with
  ``beta1 > 0``, once ``d`` is held: the shared momentum above in ``d``'s units, with Adam's
  ``beta1`` for ``m``. Every rank compresses ``g_k / d + beta1 u_{t-1}``; the reduction gives
  ``u_t = beta1 u_{t-1} + mean_k g_k / d``, and the optimizer is handed
  ``(u_t - beta1 u_{t-1}) d``, so Adam's first moment follows ``(1 - beta1) u_t d``: DeepSpeed's
  1-bit Adam compresses that momentum too. Compressing each
  rank's preconditioned gradient instead held up only at a small lr: at Adam's best lr for digits
  (0.016 x 2 ranks, 10 seeds) EF-sign was 2.2-3.2 points below uncompressed and its one scale per
  tensor 9.8-11.6 below, where with the shared first moment they are +0.6 to +0.7 and +0.0 to
  +0.1; on a 1.6M-parameter MLP (12 seeds) EF-sign went from 1.2 below to 3.5 above at lr 0.002
  x 2 and from 0.3 below to 1.5 above at that model's best lr, 0.00025 x 2, 1-bit from +0.1 and
  +0.2 to +3.2 and +1.3. Adam's own second moment takes in the compression error of the gradient
  it is handed, and the gains above uncompressed say its steps differ, not that compression helps
  in general. Top-k at 1% trained worse this way (12.5 below on the 1.6M-parameter model, against
  3.1 below) and keeps compressing its own preconditioned gradient; what it needs under Adam is a
  larger ratio, which ``TopK()`` takes there (:data:`spark_dl.compression.sparse.ADAPTIVE_RATIO`).
* **each rank's own gradient through a decay** (``own_below``, 1-bit's default): under momentum SGD,
  once the lr told has fallen below ``own_below`` of its peak, every rank compresses its own
  gradient and the optimizer keeps the velocity, as ``compress_momentum=False`` does; back to the
  shared velocity if the lr climbs again to that fraction. Measured with 1-bit (6 seeds on a
  1.6M-parameter MLP, 10 on digits, 2 ranks), 0.95 of the peak against none, points against
  uncompressed: the 1.6M-parameter MLP under ``LargeBatchRecipe``'s cosine decay over 300 steps
  -1.3 to -0.7, under its step decay -0.7 to -0.3; digits under the two -0.4/-0.5 to -0.5/-0.6
  and -0.5/-0.6 to -0.6 (``DistributedOptimizer``/DDP hook). EF-sign and top-k lost 6 to 13
  points on digits over the 30 steps after such a switch (EF-sign -0.5/-0.6 to -0.7/-1.2, top-k
  -0.6/-0.8 to -3.9/-2.8) and keep the shared velocity.
* **learning-rate rescaling**: error feedback's residual ``e`` (gradient or velocity units) is
  an update of ``eta e`` not yet applied. When the lr moves from ``eta`` to ``eta'`` (warm-up,
  decay), ``e <- e * eta / eta'`` keeps that update the same (EF-SGD defines the residual on
  ``eta g``).

:class:`TrainingFeedback` holds these per compressor. ``DistributedOptimizer`` and
``make_ddp_hook(c, optimizer=opt)`` call :meth:`TrainingFeedback.observe` with the optimizer's lr,
momentum and ``beta2`` before each step's first bucket; code that calls ``allreduce`` itself calls
``compressor.observe_optimizer(opt)`` (or ``compressor.feedback.observe(lr=..., momentum=...)``)
once per step, before its reductions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from spark_dl.compression import native

Key = Hashable
# Under an Adam-style optimizer, at least this many reductions of each tensor go uncompressed: the
# preconditioner's second moment is measured on them (true magnitudes, which signs do not carry) and
# then held. 1.6M-parameter MLP, Adam, 6 seeds, EF-sign against uncompressed, the second moment held:
# 5 steps -1.1 points, 10 steps -2.4, 20 steps -1.9.
ADAPTIVE_WARMUP = 5


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one pass where it is: a sum is finite only if
    every element is, while ``isfinite(t).all()`` makes several passes over a whole bucket each
    step; the exact test runs only for a sum that overflowed."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def optimizer_settings(optimizer: Any) -> tuple[float | None, float]:
    """``(lr, momentum)`` of ``optimizer``'s first param group. ``momentum`` is that of optimizers
    whose buffer is the velocity ``u <- m u + g`` (``torch.optim.SGD`` without dampening, Nesterov
    included, and ``spark_dl.train.VFormSGD``); 0 for the others (Adam's moments, RMSprop's or
    LARS's momentum over a rescaled gradient), whose updates are not linear in the gradient."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None, 0.0
    group = groups[0]
    lr = group.get("lr")
    velocity = (isinstance(optimizer, torch.optim.SGD) and not group.get("dampening", 0.0)) \
        or "momentum_correction" in group
    momentum = float(group.get("momentum", 0.0) or 0.0) if velocity else 0.0
    return (None if lr is None else float(lr)), momentum


def _beta(optimizer: Any, i: int) -> float:
    groups = getattr(optimizer, "param_groups", None)
    betas = groups[0].get("betas") if groups else None
    try:
        return float(betas[i]) if betas is not None and 0.0 < float(betas[i]) < 1.0 else 0.0
    except (TypeError, IndexError, ValueError):
        return 0.0


def second_moment_decay(optimizer: Any) -> float:
    """``beta2`` of optimizers that divide by a running second moment of the gradient (``betas`` in
    the first param group: Adam, AdamW, NAdam, RAdam, LAMB-like ones); 0 for the others."""
    return _beta(optimizer, 1)


def first_moment_decay(optimizer: Any) -> float:
    """``beta1``, the decay of the running mean of the gradient (Adam's ``m``), of optimizers with
    ``betas`` in their first param group; 0 for the others and for ``beta1 = 0``."""
    return _beta(optimizer, 0)


@dataclass
class TrainingFeedback:
    """Warm-up, shared momentum and lr rescaling for one compressor (see the module doc).

    ``warmup_steps``: uncompressed reductions per tensor name before compression starts.
    ``compress_momentum``: compress the shared velocity when told a momentum > 0.
    ``rescale_lr``: rescale the residuals by ``eta / eta'`` when told a new lr.
    ``precondition``: divide by the reduced gradient's second moment when told an Adam-style
    ``beta2`` (and keep the first ``ADAPTIVE_WARMUP`` reductions uncompressed).
    ``first_moment``: with ``precondition`` and ``compress_momentum``, compress the shared first
    moment when told a ``beta1`` too (1-bit and EF-sign; top-k trained worse that way).
    ``own_below``: under momentum SGD, each rank's own gradient while the lr told is below this
    fraction of the highest lr told so far (``peak_lr``); 0: the shared velocity at every lr.
    ``told``: the steps told an lr so far (how far into its schedule the run is).
    """

    warmup_steps: int = 0
    compress_momentum: bool = True
    rescale_lr: bool = True
    single_stage_up_to: int = 0
    momentum: float = 0.0
    lr: float | None = None
    precondition: bool = True
    beta2: float = 0.0
    first_moment: bool = False
    beta1: float = 0.0
    own_below: float = 0.0
    peak_lr: float = 0.0
    told: int = 0
    steps: dict[Key, int] = field(default_factory=dict)
    reduced: dict[Key, torch.Tensor] = field(default_factory=dict, repr=False)  # v_{t-1} (or u_{t-1}) per name
    second: dict[Key, torch.Tensor] = field(default_factory=dict, repr=False)  # s_{t-1} per name
    seen: dict[Key, int] = field(default_factory=dict, repr=False)  # reductions in s per name
    divisors: dict[Key, torch.Tensor] = field(default_factory=dict, repr=False)  # d of the reduction under way
    held: dict[Key, torch.Tensor] = field(default_factory=dict, repr=False)  # d of the s held per name
    spare: dict[Key, torch.Tensor] = field(default_factory=dict, repr=False)  # v_{t-1}'s memory, for v_{t+1}
    scratch: dict[Key, torch.Tensor] = field(default_factory=dict, repr=False)  # memory of before()'s result, CPU

    def __getstate__(self) -> dict:
        # scratch memory and what s gives again: not worth a checkpoint's bytes
        return {**self.__dict__, "held": {}, "spare": {}, "scratch": {}}

    def __setstate__(self, state: dict) -> None:
        # pickled before a field existed: that field's default
        fresh = TrainingFeedback(precondition=False)
        self.__dict__.update(fresh.__dict__)
        self.__dict__.update(state)
        if "told" not in state:  # the reductions of each tensor so far: as many as the steps told
            self.told = max(self.steps.values(), default=0)

    def observe(self, residuals: Any = None, *, lr: float | None = None, momentum: float = 0.0,
                beta2: float = 0.0, beta1: float = 0.0) -> None:
        """The optimizer's ``lr``, ``momentum`` and (Adam-style) ``beta2`` and ``beta1`` for the step
        about to be reduced. A changed lr (both old and new > 0) rescales every residual in
        ``residuals`` (a residual memory with a ``memory`` dict) by old / new; a changed momentum or
        ``beta1`` restarts the velocity, a changed ``beta2`` the second moment, and so does the lr
        falling below ``own_below`` of its peak or climbing back. Under momentum the betas are not
        used; ``beta1`` is used only with ``beta2``."""
        if lr is not None and lr > 0:
            if self.rescale_lr and residuals is not None and self.lr and lr != self.lr:
                rescale(residuals, self.lr / lr)
            self.lr = float(lr)
            self.peak_lr = max(self.peak_lr, self.lr)
            self.told += 1
        decayed = bool(self.own_below and self.lr and self.lr < self.own_below * self.peak_lr)
        m = float(momentum) if self.compress_momentum and not decayed else 0.0
        if m != self.momentum:
            self.momentum = m
            self.reduced.clear()
        b2 = float(beta2) if self.precondition and not m else 0.0
        if b2 != self.beta2:
            self.beta2 = b2
            self.second.clear()
            self.held.clear()
            self.seen.clear()
        b1 = float(beta1) if b2 and self.first_moment and self.compress_momentum and 0.0 < beta1 < 1.0 else 0.0
        if b1 != self.beta1:
            self.beta1 = b1
            self.reduced.clear()

    def single_stage(self, world: int) -> bool:
        """Whether ``world`` ranks exchange whole compressed tensors (one compression stage, an
        all-gather) rather than compressed chunks reduced and compressed again."""
        return world <= self.single_stage_up_to

    def warming(self, name: Key) -> bool:
        """Count a reduction of ``name``; True while it is one of the first ``warmup_steps``, and
        under an Adam-style optimizer while the second moment holds fewer than ``ADAPTIVE_WARMUP``
        uncompressed reductions (at the start, and again after it was restarted: a new ``beta2``, a
        non-finite gradient)."""
        n = self.steps.get(name, 0)
        self.steps[name] = n + 1
        return n < self.warmup_steps or bool(self.beta2 and self.seen.get(name, 0) < ADAPTIVE_WARMUP)

    def before(self, tensor: torch.Tensor, name: Key, share: float = 1.0) -> torch.Tensor:
        """What is compressed for ``tensor``: under momentum ``tensor + share * m * v_{t-1}`` in
        float32; under an Adam-style optimizer ``tensor / d`` (:meth:`divisor`), plus ``share *
        beta1 * u_{t-1}`` once compressed reductions have given ``u`` (one native pass on the
        CPU); else ``tensor``. Not ``tensor``'s memory; on the CPU memory kept for ``name``, which
        the next reduction of ``name`` writes over (:meth:`_scratch`). ``share``: 1 where the
        reduction averages the ranks' tensors, 1 / W where it sums them, so the reduction is ``v_t``
        (``u_t``) either way."""
        if not self.momentum:
            d = self.divisor(tensor, name) if self.beta2 else None
            if d is None:
                return tensor
            self.divisors[name] = d
            u = self.reduced.get(name) if self.beta1 else None
            if u is not None and (u.shape != tensor.shape or u.device != tensor.device):
                u = None
            x = self._scratch(tensor, name)
            if x is not None and native.feedback_fits(tensor, d, u, x):  # divide and add in one pass
                return native.feedback_before(tensor, d, u, self.beta1 * share, x)
            x = torch.div(tensor, d) if x is None else torch.div(tensor, d, out=x)
            return x if u is None else x.add_(u, alpha=self.beta1 * share)
        v = self.reduced.get(name)
        if v is None or v.shape != tensor.shape or v.device != tensor.device:
            return tensor
        # half-precision gradients are promoted inside the add (exactly): no float32 copy of their own
        t = tensor if tensor.dtype in (torch.float16, torch.bfloat16, torch.float32) else tensor.to(torch.float32)
        x = self._scratch(tensor, name)
        if x is None:
            return torch.add(t, v, alpha=self.momentum * share)
        return torch.add(t, v, alpha=self.momentum * share, out=x)

    def _scratch(self, tensor: torch.Tensor, name: Key) -> torch.Tensor | None:
        """Float32 memory of ``tensor``'s shape for :meth:`before`'s result, kept per name from one
        reduction to the next, on the CPU only: there a new gradient-sized tensor a step costs its
        page faults, more than the pass that fills it (10M elements: 13-14 ms against 6-7 ms),
        where CUDA's caching allocator hands the same block back for free. Nothing keeps what
        :meth:`before` returns past its reduction: the compressors copy what they store."""
        if tensor.device.type != "cpu":
            return None
        x = self.scratch.get(name)
        if x is None or x.shape != tensor.shape:
            x = self.scratch[name] = torch.empty(tensor.shape, dtype=torch.float32)
        return x

    def after(self, result: torch.Tensor, name: Key, compressed: bool = False) -> torch.Tensor:
        """The reduced velocity ``v_t`` as the gradient ``v_t - m v_{t-1}`` (in ``result``'s memory);
        a non-finite ``v_t`` (a step a GradScaler skips) restarts this tensor's velocity. Under an
        Adam-style optimizer ``result * d``, whose square ``s`` takes in (:meth:`divisor`) where the
        reduction was not ``compressed``; with ``beta1``, a compressed one is ``u_t`` and is handed
        on as ``(u_t - beta1 u_{t-1}) d``."""
        if not self.momentum:
            return self._precondition_after(result, name, compressed) if self.beta2 else result
        self._shared(result, name, self.momentum)
        return result

    def divisor(self, tensor: torch.Tensor, name: Key) -> torch.Tensor | None:
        """``d = max(sqrt(s), mean(sqrt(s)))`` for ``tensor``, where ``s`` is the running mean
        square of ``name``'s uncompressed reduced gradients (a mean over the first ``1 / (1 -
        beta2)``, then decaying by ``beta2``: Adam's second moment of the same gradients), held
        while compressed reductions follow (see the module doc). Every rank holds the
        same ``s``, so dividing before the reduction and multiplying after is exact but for the
        compression. The floor keeps entries whose gradients were near 0 from being multiplied
        up to dominate their bucket's statistic. None before ``name``'s first reduction. Kept while
        ``s`` is held, so compressed reductions do not recompute it (three passes and a host sync)."""
        s = self.second.get(name)
        if s is None or s.shape != tensor.shape or s.device != tensor.device:
            return None
        d = self.held.get(name)
        if d is not None:
            return d
        d = s.sqrt()
        floor = float(d.mean())
        if not floor > 0:
            return None
        self.held[name] = d.clamp_(min=floor)
        return d

    def _precondition_after(self, result: torch.Tensor, name: Key, compressed: bool) -> torch.Tensor:
        d = self.divisors.pop(name, None)
        if d is not None and d.shape != result.shape:
            d = None
        if compressed and self.beta1 and d is not None:
            self._shared(result, name, self.beta1, d)  # u_t, in d's units; result: (u_t - beta1 u_{t-1}) d
        else:
            if not compressed:
                # uncompressed, d still moves (warm-up): u starts afresh with the first compressed reduction
                self.reduced.pop(name, None)
            if d is not None:
                result.mul_(d.to(result.dtype))
        if compressed:
            return result  # s stays as measured: this result carries the compression error
        r = result.to(torch.float32)
        self.held.pop(name, None)  # s moves (or restarts): d with it
        if not all_finite(r):
            self.second.pop(name, None)
            self.seen.pop(name, None)
            return result
        s = self.second.get(name)
        n = self.seen.get(name, 0) + 1 if s is not None and s.shape == r.shape else 1
        self.seen[name] = n
        if n == 1:
            self.second[name] = r * r
        else:
            w = max(1.0 - self.beta2, 1.0 / n)
            s.mul_(1.0 - w).addcmul_(r, r, value=w)
        return result

    def _shared(self, result: torch.Tensor, name: Key, decay: float, d: torch.Tensor | None = None) -> None:
        """Keep the reduction ``result`` as ``name``'s shared velocity (``v_t``, or Adam's ``u_t``) and
        turn ``result`` into ``(v_t - decay v_{t-1}) d`` (``d`` None: 1); a non-finite ``v_t`` (a step
        a GradScaler skips) restarts it, and ``result`` is then ``v_t d``. On the CPU one native pass
        does the copy, the finiteness check, the subtraction and the multiply."""
        spare = self.spare.pop(name, None)
        if spare is None or spare.shape != result.shape or spare.device != result.device:
            spare = None  # else v_{t-2}'s memory: no new gradient-sized tensor (page faults on CPU) a step
        prev = self.reduced.get(name)
        if prev is not None and prev.shape != result.shape:
            prev = None
        if native.feedback_fits(result, prev, d, spare):
            v = spare if spare is not None else torch.empty(result.shape, dtype=torch.float32)
            finite = native.feedback_after(result, prev, decay, d, v)
            if not finite:  # undone: nothing is subtracted from the gradient of a step that is skipped
                result.copy_(v)
                if d is not None:
                    result.mul_(d)
        else:
            v = result.to(torch.float32, copy=True) if spare is None else spare.copy_(result)
            finite = all_finite(v)
            if finite and prev is not None:
                result.sub_(prev.to(result.dtype), alpha=decay)
            if d is not None:
                result.mul_(d.to(result.dtype))
        if not finite:
            self.reduced.pop(name, None)
            return
        self.reduced[name] = v
        if prev is not None:
            self.spare[name] = prev  # no longer read: before() reads v_t next

    def reset(self, key: Key = None) -> None:
        """Forget the counters, velocities and second moments of ``key`` (every key when None)."""
        for d in (self.steps, self.reduced, self.second, self.seen, self.divisors, self.held, self.spare,
                  self.scratch):
            for k in [k for k in d if key is None or k == key or (isinstance(k, tuple) and k[:1] == (key,))]:
                del d[k]


def rescale(residuals: Any, ratio: float) -> None:
    """Multiply every residual in ``residuals`` (its ``memory`` dict settles pending parts first) by ``ratio``."""
    for e in residuals.memory.values():
        e.mul_(ratio)
