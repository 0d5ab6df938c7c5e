"""``compression="auto"``: per tensor (a DDP bucket, a fusion bucket), the compressor that makes the
step fastest on this link among those known to converge with the optimizer in use, and a
guard that falls back to a safer one when compressed training goes wrong.

A candidate is timed by the **step** it is used in: a step starts when a tensor already reduced
in the one under way is reduced again, and ends when the next starts. That is what the choice
changes: the reduction itself, and what it costs the rest of the step (an encoding competing with
backward for the cores, an uncompressed bucket that stays on the wire while backward goes on, as
DDP's own all-reduce does, where a compressed one would hold backward up). Timing the reduction
alone picked fp16 on loopback, whose whole step was slower than fp32's.

For each tensor name, on every rank alike:

1. **warm-up**: the first ``warmup_steps`` reductions go uncompressed (early gradients are large
   and change fast; PowerSGD's ``start_iter`` and 1-bit Adam warm up the same way). Each step after
   the first (which pays one-time costs: allocations, connections) is timed as NoneCompressor's.
2. **probe**, in rounds: each eligible candidate reduces the tensor once a round, until each has
   ``probe_calls`` timed steps. Every tensor probes the same candidates in the same order, so
   in a step all of them use the same candidate. After each round the ranks agree on each
   candidate's time so far (one all-reduce of a few numbers: the lowest over the ranks of their
   fastest step; noise only adds time), and a candidate ``ELIMINATE`` times slower than the
   fastest is not probed again (NoneCompressor: ``ELIMINATE_NONE`` times, so that on a slow link
   the uncompressed reduction is not repeated, and elsewhere one noisy sample does not drop the
   safe choice). A candidate that loses information is dropped once its timed steps were not
   ``lossy_margin / 2`` faster than an exact candidate's (it could not win at step 3; each of its
   steps costs accuracy: on loopback it takes two). Either drop needs ``DROP_SAMPLES`` timed
   steps (NoneCompressor's, one): one step of the user's loop can be slower for its own reasons.
   A stateful candidate keeps its state from one probe call to its next (error feedback sends the
   next time what it dropped, PowerSGD's factors start warm), and every candidate but the pick
   starts afresh at the decision.
3. **decision**, from the agreed times, the same on every rank: candidates are ordered safest
   first (``NoneCompressor`` always first), and a less safe one replaces the pick so far only when
   its steps are at least ``margin`` faster; ``lossy_margin`` when it loses information (anything
   but a 16-bit cast) and the pick so far does not, because such a compressor needs more steps to
   the same accuracy: PowerSGD at rank 4 took a median of 27% more steps to the target than fp32 in
   ``benchmarks/auto_compression.py`` (5% to 47% over 3 seeds), at rank 8 (the candidate) 0% to 27%
   in ``benchmarks/time_to_accuracy.py``, FP16 none more. Where compression saves nothing: none.
4. **watch**: every ``check_every`` reductions the ranks agree (again one small all-reduce) on the
   chosen compressor's recent step time, its error-feedback residual relative to what was
   compressed, whether the result was finite, and the loss told to :meth:`Auto.observe_loss` (the
   worst rank's). A residual past ``guard_ratio`` that grew three checks running, a non-finite
   result or loss two checks running (once is a step a GradScaler skips), or a loss that doubled
   and still rises falls back, for good, to the fastest safer candidate. A pick whose time moved
   by more than ``drift`` two checks running (the link got slower or faster), and every bucket
   every ``recheck_every`` reductions, is probed again.

Through the DDP hook (``in_flight``), a pick that can stay on the wire (a summable compressor on a
CPU bucket: none, FP16) is started and left there, as DDP's own all-reduce is, in the probe as once
picked, so that the probe times what will run.

Eligible: the candidates :func:`spark_dl.compression.advice.advice` has nothing against for the
optimizer told to :meth:`Compressor.observe_optimizer` (``DistributedOptimizer`` and
``make_ddp_hook(..., optimizer=opt)`` tell it); told none, those safe under heavy-ball momentum SGD
that need no optimizer (not OneBit and the other error-feedback ones that compress the velocity of
the optimizer's momentum). Under Adam-style optimizers, not OneBit either: it measures their second
moment on uncompressed reductions first, which the probes would time as its own.
The decisions are in ``spark_dl.compression.stats.choices`` (and MLflow's ``comm/auto/...``); rank 0
prints the table once every tensor has its first decision, and says each later switch on the driver.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from spark_dl.compression import collectives
from spark_dl.compression.advice import advice
from spark_dl.compression.base import Compressor, Key, Payload, real_param
from spark_dl.compression.base import int_param as _int
from spark_dl.compression.fp import FP16, Cast, NoneCompressor
from spark_dl.compression.powersgd import PowerSGD
from spark_dl.compression.sign import OneBit
from spark_dl.compression.stats import RISING, label, norm, residual_norm, stats
from spark_dl.compression.training import ADAPTIVE_WARMUP, all_finite, second_moment_decay
from spark_dl.rank.works import hold

WARMUP, PROBE, CHOSEN = "warm-up", "probe", "chosen"
# A candidate this many times slower than the fastest after a probe round is not probed again; the
# uncompressed reduction only when ELIMINATE_NONE times slower (the safe choice is not dropped on one
# noisy sample): on a slow link it is not repeated (100 Mbit/s: 40x PowerSGD's time, measured).
ELIMINATE = 3.0
ELIMINATE_NONE = 10.0
# A candidate is dropped on this many timed steps, their fastest, not on one: a training loop's
# periodic step (an evaluation, a log, a checkpoint) that falls on a candidate's only timed step made
# FP16 read 4.5x slower than uncompressed on 10 Gbit/s (its steps were as fast). NoneCompressor is
# dropped on one, at ELIMINATE_NONE: far above what such a step adds.
DROP_SAMPLES = 2


def default_candidates() -> list[Compressor]:
    """Safest first: no compression, fp16 (2x, exact up to rounding), PowerSGD (rank 8, low-rank with
    error feedback), OneBit (1-bit with error feedback; eligible under heavy-ball or Nesterov SGD)."""
    return [NoneCompressor(), FP16(), PowerSGD(), OneBit(warmup_steps=0)]


def _assume_momentum() -> torch.optim.Optimizer:
    # told no optimizer: judge the candidates as for heavy-ball momentum SGD, the strictest case
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)


@dataclass
class _Bucket:
    """One tensor name's state (see the module docstring)."""

    elements: int
    calls: int = 0
    phase: str = WARMUP
    queue: list[int] = field(default_factory=list)  # the candidates still to reduce in this probe round
    samples: dict[int, list[float]] = field(default_factory=dict)  # steps timed, per candidate
    sent: dict[int, int] = field(default_factory=dict)  # bytes one call of each candidate sent
    times: dict[int, float] = field(default_factory=dict)  # agreed seconds per step
    timing: int | None = None  # the candidate of this step's call, when the step is timed for it
    tried: set[int] = field(default_factory=set)  # candidates that have paid their first call's costs
    rounds: int = 0  # probe rounds so far (each starts with the next candidate in turn)
    chosen: int = 0
    since: int = 0  # reductions since the decision
    window: list[float] = field(default_factory=list)  # the chosen one's sampled times since the last check
    baseline: float | None = None  # its agreed time at the first check after the decision
    drifted: int = 0  # checks running whose time was outside baseline's band
    hinted: bool = False  # NoneCompressor's samples are the warm-up's (first probe round only)
    bad: int = 0  # checks running that saw a non-finite result or loss
    measured: float | None = None
    excluded: dict[int, str] = field(default_factory=dict)  # by the guard, for good
    ratios: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # told since the last check
    loss_means: list[float] = field(default_factory=list)  # one per check since the decision
    reason: str = ""
    decided: bool = False  # a first decision was made (a later one that differs is a switch)


class Auto(Compressor):
    """Picks per tensor the fastest safe compressor on the measured link; see the module docstring.

    ``candidates``: compressors to choose from, safest first (default :func:`default_candidates`);
    ``NoneCompressor()`` is put first when missing, as the fallback of last resort. Their own
    warm-ups (``warmup_steps``, PowerSGD's ``start_iter``) are set to 0: this warm-up replaces them.
    ``margin``, ``lossy_margin``: how much faster a less safe candidate's steps must be (step 3).
    ``min_elements``: smaller tensors go uncompressed, unmeasured (latency dominates them).
    ``sample_every``: in the chosen phase, every how many reductions one is timed (on CUDA a timed
    call synchronizes the device).

        hook_state, hook = make_ddp_hook("auto", optimizer=opt)
        opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.auto)
    """

    chooses = True

    def __init__(self, candidates: Sequence[Compressor] | None = None, *, warmup_steps: int = 5,
                 probe_calls: int = 4, margin: float = 0.05, lossy_margin: float = 0.25, check_every: int = 50,
                 sample_every: int = 5, recheck_every: int = 2000, drift: float = 0.5, guard_ratio: float = 100.0,
                 min_elements: int = 4096) -> None:
        cands = default_candidates() if candidates is None else list(candidates)
        for c in cands:
            if not isinstance(c, Compressor) or isinstance(c, Auto):
                raise TypeError(f"Auto candidates must be compressor instances (not Auto), got {c!r}")
        if not any(type(c) is NoneCompressor for c in cands):
            cands.insert(0, NoneCompressor())
        for c in cands:  # Auto warms up once for all of them; a probe must time the real encoding
            if c.feedback is not None:
                c.feedback.warmup_steps = 0
            if isinstance(c, PowerSGD):
                c.start_iter = 0
        self.candidates = cands
        self.warmup_steps = _int(warmup_steps, "Auto", "warmup_steps", 0)
        self.probe_calls = _int(probe_calls, "Auto", "probe_calls", 1)
        self.margin = real_param(margin, "Auto", "margin", 0.0, 1.0)
        self.lossy_margin = real_param(lossy_margin, "Auto", "lossy_margin", 0.0, 1.0)
        self.check_every = _int(check_every, "Auto", "check_every", 1)
        self.sample_every = _int(sample_every, "Auto", "sample_every", 1)
        self.recheck_every = _int(recheck_every, "Auto", "recheck_every", 1)
        self.drift = real_param(drift, "Auto", "drift", 0.0, open_low=True)
        self.guard_ratio = real_param(guard_ratio, "Auto", "guard_ratio", 0.0, open_low=True)
        self.min_elements = _int(min_elements, "Auto", "min_elements", 0)
        self.buckets: dict[Key, _Bucket] = {}
        self.unsafe = self._judge(None)
        self.switches = 0
        self._none = NoneCompressor()
        self._printed = False
        self._step: set[Key] = set()  # the tensors reduced in the step under way
        self._step_start: float | None = None

    # -- the Compressor surface ------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        return True

    def bits_per_element(self) -> float:
        """Bits per element of the chosen compressors, weighted by their tensors' sizes (32 before any choice)."""
        decided = [(b.elements, self.candidates[b.chosen].bits_per_element()) for b in self.buckets.values()
                   if b.phase == CHOSEN]
        total = sum(n for n, _ in decided)
        return sum(n * bits for n, bits in decided) / total if total else 32.0

    def compress(self, tensor: torch.Tensor, key: Key = None) -> Payload:
        raise TypeError("Auto picks a compressor per reduction: reduce through spark_dl.compression.allreduce(t, auto, "
                        "name=...), DistributedOptimizer or make_ddp_hook, not compress()/decompress()")

    decompress = compress  # type: ignore[assignment]

    def observe(self, *, lr: float | None = None, momentum: float = 0.0, beta2: float = 0.0,
                beta1: float = 0.0) -> None:
        for c in self.candidates:
            c.observe(lr=lr, momentum=momentum, beta2=beta2, beta1=beta1)

    def observe_optimizer(self, optimizer: Any) -> None:
        """Tell every candidate the optimizer's lr and momentum, and keep as eligible only the
        candidates known to converge with this optimizer."""
        for c in self.candidates:
            c.observe_optimizer(optimizer)
        self.unsafe = self._judge(optimizer)

    def observe_loss(self, loss: Any) -> None:
        """This step's training loss (a number or a 1-element tensor), for the guard: a loss that
        is not finite, or that doubled and keeps rising, makes every tensor fall back."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        for b in self.buckets.values():
            b.losses.append(value)

    def reset(self, key: Key = None) -> None:
        for c in self.candidates:
            c.reset(key)
        if key is None:
            self.buckets.clear()
        else:
            self.buckets.pop(key, None)

    def _params(self) -> dict[str, Any]:
        return {"candidates": [label(c) for c in self.candidates]}

    def _judge(self, optimizer: Any) -> dict[int, str]:
        """Why each unsafe candidate is (by index); ``optimizer`` None: told none."""
        unsafe, judged = {}, optimizer if optimizer is not None else _assume_momentum()
        adaptive = second_moment_decay(optimizer) > 0
        for i, c in enumerate(self.candidates):
            why = advice(c, judged)
            if why is None and optimizer is None and c.feedback is not None and c.feedback.compress_momentum:
                why = (f"{label(c)} compresses the shared velocity under momentum SGD, which it needs the optimizer "
                       "for: pass make_ddp_hook(..., optimizer=opt) or reduce through DistributedOptimizer")
            if why is None and adaptive and c.feedback is not None and c.feedback.precondition:
                why = (f"{label(c)} measures Adam's second moment on its first {ADAPTIVE_WARMUP} reductions, "
                       "uncompressed, which a probe would time as its own")
            if why is not None:
                unsafe[i] = why
        return unsafe

    # -- the reduction ---------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, *, op: str, name: Key, group: Any, layout: Any,
                  out: torch.Tensor | None, in_flight: bool = False) -> torch.Tensor | torch.futures.Future:
        """:func:`spark_dl.compression.allreduce` through the compressor picked for ``name``. With
        ``in_flight`` and ``out`` (the DDP hook's bucket), a future of ``out`` when that compressor
        can stay on the wire (:func:`~spark_dl.compression.collectives.start_summable`)."""
        if not tensor.is_floating_point() or tensor.numel() < self.min_elements:
            return collectives.reduce_into(tensor, self._none, op=op, name=name, group=group, layout=layout,
                                           out=out, in_flight=in_flight)
        b = self.buckets.get(name)
        if b is None or b.elements != tensor.numel():
            b = self.buckets[name] = _Bucket(tensor.numel())
        b.calls += 1
        if b.phase == CHOSEN and str(name) not in stats.choices:  # restored from a checkpoint: shown again
            self._publish(name, b)
        self._clock(name, tensor)
        index = self._next(b, name, tensor, group)
        c = self.candidates[index]
        # the warm-up's reductions after its first are uncompressed ones: NoneCompressor's samples;
        # a candidate's first call pays one-time costs (allocations, a first kernel): not timed
        timed = (b.phase == PROBE and index in b.tried) or (b.phase == WARMUP and b.calls > 1) or (
            b.phase == CHOSEN and b.since % self.sample_every == 0)
        b.tried.add(index)
        b.timing = index if timed else None
        checking = b.phase == CHOSEN and (b.since + 1) % self.check_every == 0
        # read before the reduction: with out=tensor (the DDP hook's bucket) the result overwrites it
        grad = norm(tensor) if checking else 0.0
        sent = stats.bytes_sent
        # the check reads the result: that call is reduced before it returns
        result = collectives.reduce_into(tensor, c, op=op, name=name, group=group, layout=layout, out=out,
                                         in_flight=in_flight and not checking)
        b.sent[index] = stats.bytes_sent - sent
        if b.phase == CHOSEN:
            b.since += 1
            if checking:
                world = dist.get_world_size(group) if dist.is_initialized() and op == "average" else 1
                self._check(b, name, grad, world, tensor, result, group)
        return result

    def _clock(self, name: Key, tensor: torch.Tensor) -> None:
        """Steps: one begins when a tensor already reduced in this one comes again (the first tensor
        of the next). Its time goes to every tensor of the step that was timed, for its candidate."""
        if name not in self._step:
            self._step.add(name)
            if self._step_start is None:
                self._step_start = time.perf_counter()
            return
        timed = [b for key in self._step if (b := self.buckets.get(key)) is not None and b.timing is not None]
        if timed:
            _sync(tensor)  # (on CUDA: the step's kernels are part of its time)
        now = time.perf_counter()
        for b in timed:
            (b.window if b.phase == CHOSEN else b.samples.setdefault(b.timing, [])).append(now - self._step_start)
            b.timing = None
        self._step, self._step_start = {name}, now

    def __getstate__(self) -> dict:
        # the step under way is this process's: a restored one starts its own
        return {**self.__dict__, "_step": set(), "_step_start": None}

    def _next(self, b: _Bucket, name: Key, tensor: torch.Tensor, group: Any) -> int:
        """The candidate that reduces this call (and moves the bucket through its phases). A probe
        round ends at the call after its last: that call's step is timed when the next begins."""
        if b.phase == WARMUP:
            if b.calls <= self.warmup_steps:
                return 0
            self._start_probe(b)
        if b.phase == PROBE and not b.queue:
            self._end_round(b, name, tensor, group)
        if b.phase == PROBE:
            return b.queue.pop(0)
        return b.chosen

    def _eligible(self, b: _Bucket) -> list[int]:
        return [i for i in range(len(self.candidates)) if i not in self.unsafe and i not in b.excluded]

    def _start_probe(self, b: _Bucket) -> None:
        """Probe rounds: each round reduces once with every candidate still in the running."""
        # The warm-up's uncompressed times stand in for NoneCompressor's in the first round, only to
        # drop it there when it is far slower; taken early, they are not compared with the others'.
        b.hinted = b.phase == WARMUP and bool(b.samples.get(0))
        if not b.hinted:
            b.samples, b.sent = {}, {}
        b.phase, b.window, b.timing, b.rounds = PROBE, [], None, 0
        b.queue = [i for i in self._eligible(b) if not (b.hinted and i == 0)]

    def _end_round(self, b: _Bucket, name: Key, tensor: torch.Tensor, group: Any) -> None:
        """Agree on each candidate's time so far; drop those ``ELIMINATE`` times slower than the
        fastest (on a slow link, no more uncompressed probes); decide once none needs samples."""
        n = len(self.candidates)
        local = [min(b.samples[i]) if b.samples.get(i) else math.inf for i in range(n)]
        agreed = _agree(local, tensor, group, lowest=n)
        b.times = {i: t for i, t in enumerate(agreed) if math.isfinite(t)}
        fastest = min(b.times.values(), default=math.inf)

        # the exact candidates' best, not the warm-up's hint (taken early: not compared with the others')
        exact = min((t for i, t in b.times.items() if not _lossy(self.candidates[i]) and not (b.hinted and i == 0)),
                    default=math.inf)

        def running(i: int) -> bool:  # not timed yet (its first call was not): still in
            if i not in b.times or (i != 0 and len(b.samples.get(i, ())) < DROP_SAMPLES):
                return True
            if _lossy(self.candidates[i]) and b.times[i] > exact * (1.0 - self.lossy_margin / 2):
                return False  # it could not clear lossy_margin, and its steps cost accuracy
            return b.times[i] <= (ELIMINATE_NONE if i == 0 else ELIMINATE) * fastest
        if b.hinted and len(b.times) > 1:  # (a candidate's first step is not timed: once another has a time)
            if running(0):
                b.samples[0] = []  # close enough to matter: measured afresh, alongside the others
            b.hinted = False
        b.queue = [i for i in self._eligible(b) if len(b.samples.get(i, ())) < self.probe_calls and running(i)
                   and not (b.hinted and i == 0)]
        # each round starts with the next candidate in turn, so that no one candidate's steps always
        # carry this agreement's all-reduce (every tensor turns alike: they stay in step)
        b.rounds += 1
        turn = b.rounds % len(b.queue) if b.queue else 0
        b.queue = b.queue[turn:] + b.queue[:turn]
        if not b.queue:
            self._choose(b, name, self._pick(b, self._eligible(b)), b.reason or "fastest measured")

    def _pick(self, b: _Bucket, among: list[int]) -> int:
        """Safest first; a later candidate wins only when ``margin`` faster than the pick so far
        (``lossy_margin`` for the first that loses information)."""
        best = None
        for i in among:
            if i not in b.times:
                continue
            lossy = _lossy(self.candidates[i]) and (best is None or not _lossy(self.candidates[best]))
            if best is None or b.times[i] < b.times[best] * (1.0 - (self.lossy_margin if lossy else self.margin)):
                best = i
        return 0 if best is None else best

    def _choose(self, b: _Bucket, name: Key, index: int, reason: str) -> None:
        before = b.chosen if b.decided else None
        for i, c in enumerate(self.candidates):  # the probe's state of those not picked: gone
            if i != index:
                c.reset(name)
        b.phase, b.chosen, b.since, b.reason, b.decided = CHOSEN, index, 0, reason, True
        b.window, b.ratios, b.loss_means, b.losses, b.baseline, b.measured = [], [], [], [], None, None
        b.drifted = b.bad = 0
        b.timing = None
        self._publish(name, b)
        if before is not None and before != index:
            self.switches += 1
            stats.note_switch()
            _say(f"compression auto: '{name}' switched from {label(self.candidates[before])} to "
                 f"{label(self.candidates[index])}: {reason}")
        elif not self._printed and all(x.phase == CHOSEN for x in self.buckets.values()):
            self._printed = True
            mine = {str(k) for k in self.buckets}  # (stats.choices also holds other Auto instances' picks)
            _show(format_choices({k: row for k, row in stats.choices.items() if k in mine}))

    def _check(self, b: _Bucket, name: Key, grad: float, world: int, tensor: torch.Tensor, result: torch.Tensor,
               group: Any) -> None:
        """``grad``: the norm of this rank's gradient before the reduction; the residual is compared
        with this rank's share of what it compressed (over ``world`` when averaging), as
        :func:`spark_dl.compression.stats.watch` does."""
        c = self.candidates[b.chosen]
        residuals = getattr(c, "residuals", None)
        velocity = c.feedback.reduced.get(name) if c.feedback is not None else None
        # under momentum the residual is in the shared velocity's units: compare it with that
        share = (norm(velocity) if velocity is not None else grad) / world
        ratio = residual_norm(residuals, name) / share if residuals is not None and share > 0 else 0.0
        bad = 0.0 if all_finite(result) and math.isfinite(ratio) else 1.0
        loss = statistics.fmean(b.losses) if b.losses else -math.inf
        if b.losses and not math.isfinite(loss):
            bad, loss = 1.0, -math.inf
        recent = statistics.median(b.window) if b.window else math.inf
        recent, ratio, bad, loss = _agree([recent, ratio if math.isfinite(ratio) else 0.0, bad, loss], tensor, group,
                                          lowest=1)
        b.window, b.losses = [], []
        b.measured = recent if math.isfinite(recent) else b.measured
        b.ratios = (b.ratios + [ratio])[-RISING - 1:]
        if math.isfinite(loss):
            b.loss_means.append(loss)
        b.bad = b.bad + 1 if bad else 0
        why = None
        if b.bad >= 2:  # once is a step a GradScaler skips; two checks running, training has diverged
            why = "a non-finite gradient or loss, two checks running"
        elif ratio > self.guard_ratio and len(b.ratios) > RISING and all(x < y for x, y in zip(b.ratios, b.ratios[1:])):
            why = f"its error-feedback residual grew to {ratio:.0f}x the gradient"
        elif (len(b.loss_means) > RISING and b.loss_means[-1] > 2 * min(b.loss_means)
              and all(x < y for x, y in zip(b.loss_means[-RISING - 1:], b.loss_means[-RISING:]))):
            why = f"the loss rose from {min(b.loss_means):.4g} to {b.loss_means[-1]:.4g}"
        if why is not None and b.chosen != 0:
            b.excluded[b.chosen] = why
            safer = [i for i in self._eligible(b) if i < b.chosen]
            c.reset(name)
            self._choose(b, name, self._pick(b, safer), f"guard: {why}")
            return
        moved = b.measured is not None and b.baseline is not None and not (
            b.baseline / (1 + self.drift) <= b.measured <= b.baseline * (1 + self.drift))
        b.drifted = b.drifted + 1 if moved else 0
        if b.measured is not None and b.baseline is None:
            b.baseline = b.measured
        elif b.drifted >= 2:  # two checks running: one slow window is noise, not a new link
            b.reason = (f"re-measured: steps with {label(c)} took {b.measured * 1e3:.1f} ms, "
                        f"{b.baseline * 1e3:.1f} before")
            c.reset(name)
            self._start_probe(b)
        elif b.since >= self.recheck_every:
            b.reason = f"re-measured after {b.since} reductions"
            c.reset(name)
            self._start_probe(b)
        self._publish(name, b)

    def _publish(self, name: Key, b: _Bucket) -> None:
        c = self.candidates[b.chosen]
        stats.set_choice(str(name), {
            "elements": b.elements, "compressor": label(c), "index": b.chosen,
            "predicted_s": b.times.get(b.chosen), "measured_s": b.measured, "bytes": b.sent.get(b.chosen),
            "times": {label(self.candidates[i]): t for i, t in sorted(b.times.items())},
            "reason": b.reason, "excluded": {label(self.candidates[i]): why for i, why in b.excluded.items()},
        })


def _lossy(c: Compressor) -> bool:
    """Loses information (needs more steps to an accuracy): all but sending the tensor or a 16-bit cast of it."""
    return not isinstance(c, (NoneCompressor, Cast))


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:  # the end of a timed step waits for the device, or it times only the launches
        torch.cuda.synchronize(tensor.device)


def _agree(values: list[float], like: torch.Tensor, group: Any, lowest: int = 0) -> list[float]:
    """``values`` agreed over the ranks of ``group`` (the same list on every rank, one small
    all-reduce): the minimum of the first ``lowest`` (times: the rank that reached a collective last
    waited for no one, so its time is the reduction's own, without the others' skew), the maximum
    of the rest (the guard's alarms: one rank's is enough)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    device = like.device if like.is_cuda and dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([-v for v in values[:lowest]] + list(values[lowest:]), dtype=torch.float64, device=device)
    hold(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)).wait()
    out = [float(v) for v in t.cpu()]
    return [-v for v in out[:lowest]] + out[lowest:]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _say(text: str) -> None:
    """A line on the driver whatever its log verbosity (rank 0 only: every rank decides the same)."""
    if _rank0():
        from spark_dl.rank.context import log_to_driver  # the rank's public API; prints where there is no driver

        log_to_driver(text)


def _show(text: str) -> None:
    """Rank 0's stdout: on the driver with ``driver_log_verbosity="all"``."""
    if _rank0():
        print(text, flush=True)


def format_choices(choices: dict[str, dict]) -> str:
    """The decision table: one line per tensor with its size, the chosen compressor, the step time
    probed (predicted) and measured with it, the bytes it sends per call, and every candidate's step time."""
    lines = ["compression auto: per tensor, the compressor picked on this link",
             f"  {'tensor':<40} {'elements':>10} {'chosen':<16} {'predicted':>10} {'measured':>10} {'bytes':>11}  "
             "candidates (ms per step)"]
    for name, row in choices.items():
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.2f} ms"
        cands = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in row["times"].items())
        lines.append(f"  {name[:40]:<40} {row['elements']:>10} {row['compressor']:<16} {ms(row['predicted_s']):>10} "
                     f"{ms(row['measured_s']):>10} {row['bytes'] if row['bytes'] is not None else '-':>11}  {cands}")
    return "\n".join(lines)
