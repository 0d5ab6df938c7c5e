"""``DistributedOptimizer``: gradients averaged across ranks while backward is still running.

Each parameter gets a post-accumulate-grad hook. When every parameter of a fusion bucket has its
gradient (on the ``backward_passes_per_step``-th backward), the bucket is handed to a background
thread that all-reduces it on a process group of its own, so collectives the training loop issues
on the default group cannot interleave with it. ``step()`` (or ``synchronize()``) launches what is
left, zero-filling gradients that no backward produced, and waits.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from spark_dl.compat.horovod import adasum, joining
from spark_dl.compat.horovod.basics import Adasum, Average, ReduceOp, Sum
from spark_dl.compat.horovod.compression import Compression, is_none
from spark_dl.compat.horovod.compression import reduce as reduce_compressed
from spark_dl.compat.horovod.compression import resolve as resolve_compression
from spark_dl.compat.horovod.exchange import sparse_sum
from spark_dl.compat.horovod.functions import broadcast_optimizer_state, broadcast_parameters
from spark_dl.compat.horovod.fusion import BucketReducer, fusion_threshold, plan_buckets, plan_groups
from spark_dl.compat.horovod.ops import fused_inplace
from spark_dl.compat.horovod.process_sets import ProcessSet, global_process_set, optimizer_group_of
from spark_dl.compat.horovod.process_sets import resolve as resolve_set
from spark_dl.compat.horovod.state import check
from spark_dl.compression.advice import warn_if_known_worse
from spark_dl.rank.tensors import comm_device

# id(parameter) -> (the parameter, the DistributedOptimizer whose hooks are on it), both weak
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _claim(params: list[torch.Tensor], opt: Any) -> None:
    """Make ``opt`` the optimizer of ``params``: one built earlier over any of them is retired (its
    hooks removed), so rebuilding an optimizer (a new trial, a new LR) does not leave two
    reducing the same gradients."""
    for p in params:
        entry = _owners.get(id(p))
        old = entry[1]() if entry is not None and entry[0]() is p else None
        if old is not None and old is not opt:
            old._hvd_retire()
        _owners[id(p)] = (weakref.ref(p), weakref.ref(opt))
    for key in [k for k, (pref, _) in _owners.items() if pref() is None]:
        del _owners[key]


_RETIRED = ("this DistributedOptimizer was replaced: a newer one was built over its parameters "
            "(only the newest reduces their gradients); step the newest one")

_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to "
    "step(). Increase backward_passes_per_step to accumulate gradients locally."
)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed in ahead of the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    def _hvd_setup(self, named_parameters: Any, compressor: Any, backward_passes_per_step: int,
                   op: ReduceOp, gradient_predivide_factor: float, sparse_as_dense: bool,
                   ps: ProcessSet, groups: Any = None) -> None:
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._hvd_names = _parameter_names(all_params, named_parameters)
        self._hvd_compressor = compressor
        self._hvd_op = op
        self._hvd_predivide = gradient_predivide_factor
        self._hvd_sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        params = [p for p in all_params if p.requires_grad]
        self._hvd_buckets = plan_buckets(params, fusion_threshold()) if groups is None else plan_groups(params, groups)
        self._hvd_bucket_of = {p: i for i, bucket in enumerate(self._hvd_buckets) for p in bucket}
        # which parameters of each bucket are reduced as sparse: agreed by the ranks at the bucket's
        # first launch (a rank without a gradient there cannot tell on its own)
        self._hvd_kinds: list[list[bool] | None] = (
            [[False] * len(b) for b in self._hvd_buckets] if sparse_as_dense else [None] * len(self._hvd_buckets))
        self._hvd_group = _optimizer_group(ps)
        self._hvd_ps = ps
        self._hvd_join = joining.register(self, ps.process_set_id)
        self._hvd_control = None
        self._hvd_reducer = BucketReducer(self._hvd_reduce)
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self._hvd_lock = threading.Lock()
        self._hvd_reset()
        self._hvd_retired = False
        _claim(params, self)
        self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_on_grad) for p in params]
        # A backward too many must fail before it adds to p.grad, which the reducer thread may be
        # reading: a post-accumulate check alone would leave ranks with diverging gradients.
        self._hvd_hooks += [p.register_hook(partial(self._hvd_guard, p)) for p in params]

    def _hvd_reset(self) -> None:
        self._hvd_passes = {p: 0 for p in self._hvd_bucket_of}
        self._hvd_waiting = [len(bucket) for bucket in self._hvd_buckets]
        self._hvd_next = 0

    def _hvd_on_grad(self, p: torch.Tensor) -> None:
        # Autograd runs one thread per device, so hooks of CPU and GPU parameters can race.
        with self._hvd_lock:
            self._hvd_count_pass(p)

    def _hvd_guard(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        with self._hvd_lock:
            if self._hvd_passes[p] >= self.backward_passes_per_step:
                raise AssertionError(_TOO_MANY_PASSES)

    def _hvd_count_pass(self, p: torch.Tensor) -> None:
        passes = self._hvd_passes[p] + 1
        if passes > self.backward_passes_per_step:
            raise AssertionError(_TOO_MANY_PASSES)
        self._hvd_passes[p] = passes
        if passes == self.backward_passes_per_step:
            i = self._hvd_bucket_of[p]
            self._hvd_waiting[i] -= 1
            # Launch in bucket order only, so every rank issues the same collective sequence.
            while self._hvd_next < len(self._hvd_buckets) and self._hvd_waiting[self._hvd_next] == 0:
                self._hvd_launch(self._hvd_next)

    def _hvd_agree(self, i: int, sparse: list[bool]) -> list[bool]:
        """Once per bucket, on the reducer's group in the reducer's order: a parameter is reduced
        as sparse if its gradient is sparse on any rank."""
        mask = torch.tensor(sparse, dtype=torch.int32, device=comm_device())
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self._hvd_group)
        self._hvd_kinds[i] = [bool(v) for v in mask.tolist()]
        return self._hvd_kinds[i]

    def _hvd_launch(self, i: int) -> None:
        if i == 0:
            self._hvd_control = joining.start_control(self._hvd_join)
            # lr and momentum of this step: error feedback rescales, compresses the velocity
            self._hvd_compressor.observe_optimizer(self)
        self._hvd_next = i + 1
        self._hvd_reducer.submit(i, partial(self._hvd_prepare, i), self._hvd_buckets[i][0].device)

    def _hvd_prepare(self, i: int) -> tuple[list[torch.Tensor], Any]:
        """On the reducer thread: the bucket's dense gradients, and the sparse ones' reduction."""
        bucket = self._hvd_buckets[i]
        kinds = self._hvd_kinds[i]
        if kinds is None:
            kinds = self._hvd_agree(i, [p.grad is not None and p.grad.is_sparse for p in bucket])
        grads, sparse, densified = [], [], []
        for p, is_sparse in zip(bucket, kinds):
            if is_sparse:
                # entries only; a rank with no gradient here sends none
                p.grad = _no_entries(p) if p.grad is None else p.grad if p.grad.is_sparse else p.grad.to_sparse(1)
                sparse.append(p)
                continue
            if p.grad is None:
                # Another rank may have a gradient here (a branch it took): send zeros to match it.
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                densified.append((p, p.grad.sparse_dim()))
                p.grad = p.grad.to_dense()  # as Horovod's sparse_as_dense: reduced like any gradient
            grads.append(p.grad)
        return grads, (partial(self._hvd_after_dense, sparse, densified) if sparse or densified else None)

    def _hvd_after_dense(self, sparse: list[torch.Tensor], densified: list[tuple[torch.Tensor, int]]) -> None:
        if sparse:
            self._hvd_reduce_sparse(sparse)
        for p, sparse_dim in densified:
            # sparse again once reduced, for optimizers that take sparse gradients only (SparseAdam)
            p.grad = p.grad.to_sparse(sparse_dim)

    def _hvd_reduce_sparse(self, params: list[torch.Tensor]) -> None:
        for p in params:
            p.grad = sparse_sum(p.grad, self._hvd_group, average=self._hvd_op == Average)

    def _hvd_reduce(self, i: int, flat: torch.Tensor, shapes: list) -> torch.Tensor:
        name = f"DistributedOptimizer.bucket{i}.{self._hvd_names[self._hvd_buckets[i][0]]}"
        average = self._hvd_op == Average
        if average and self._hvd_predivide != 1.0:
            flat.mul_(1.0 / self._hvd_predivide)
        dev = comm_device()
        work = flat if flat.device == dev else flat.to(dev)  # e.g. CUDA gradients over Gloo
        # the bucket's own flat copy receives the result: no second bucket-sized tensor
        out = reduce_compressed(work, self._hvd_compressor, average=average, name=name,
                                group=self._hvd_group, layout=shapes, out=work)
        out = out if out.device == flat.device else out.to(flat.device)
        if average and self._hvd_predivide != 1.0:
            out.mul_(self._hvd_predivide)
        return out

    def _hvd_follow_step(self) -> None:
        """A joined rank's part in the others' step (see :mod:`.joining`): zeros into every bucket,
        no entries into the sparse reductions, in the reducer's order."""
        with torch.no_grad():
            for i, bucket in enumerate(self._hvd_buckets):
                kinds = self._hvd_kinds[i] or self._hvd_agree(i, [False] * len(bucket))
                dense = [p for p, is_sparse in zip(bucket, kinds) if not is_sparse]
                if dense:
                    flat = torch.zeros(sum(p.numel() for p in dense), dtype=dense[0].dtype, device=dense[0].device)
                    self._hvd_reduce(i, flat, [tuple(p.shape) for p in dense])
                for p, is_sparse in zip(bucket, kinds):
                    if is_sparse:
                        sparse_sum(_no_entries(p), self._hvd_group, average=self._hvd_op == Average)

    def _hvd_take_from(self, root: int) -> None:
        _take_from(self, root, self._hvd_ps)

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's name of this attribute (parameter -> name), which code written for it reads."""
        return self._hvd_names

    # ---- Horovod's public optimizer API ---------------------------------------------------------

    def _hvd_retire(self) -> None:
        for handle in self._hvd_hooks:
            handle.remove()
        self._hvd_reducer.wait()
        self._hvd_retired = True

    def synchronize(self) -> None:
        """Finish reducing every gradient; after it each ``p.grad`` holds the cross-rank result."""
        if self._hvd_retired:
            raise RuntimeError(_RETIRED)
        for i in range(self._hvd_next, len(self._hvd_buckets)):
            self._hvd_launch(i)
        # waited for apart from the reducer: a joined rank needs it before it can follow the buckets
        joining.finish_control(self._hvd_control)
        self._hvd_control = None
        self._hvd_reducer.wait()
        self._hvd_reset()
        self._hvd_synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` skip :meth:`synchronize`; for ``synchronize(); clip; step()``."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): gradients are reduced again. Wrap step() in "
                    "`with optimizer.skip_synchronize():`.",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_reducer.busy() or self._hvd_next or any(self._hvd_passes.values()):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(): the gradients are being reduced."
            )
        super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        self._hvd_reducer.wait()
        self._hvd_reset()
        self._hvd_synchronized = False
        super().load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before gradients are reduced."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        self._hvd_reset()


class _LocalGradients(torch.optim.Optimizer):
    """An optimizer whose gradients are never reduced (Adasum combines updates in ``step()``; a rank
    outside the process set has nothing to reduce): Horovod's gradient API accepted, doing nothing."""

    def synchronize(self) -> None:
        """Nothing to wait for: gradients stay local."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Accepted for code written for the reducing optimizers; ``synchronize()`` does nothing here."""
        yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Gradients accumulate locally until ``step()``; the count is kept for Horovod's API."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes


class _DistributedAdasumOptimizer(_LocalGradients):
    """``op=Adasum``, as Horovod does it: every rank steps its optimizer on its own gradients,
    then the ranks' parameter updates (not gradients) are combined by Adasum and applied from
    where the step started. Optimizer state (momentum, Adam's moments) stays per rank."""

    def _hvd_setup(self, named_parameters: Any, compressor: Any, backward_passes_per_step: int,
                   op: ReduceOp, gradient_predivide_factor: float, sparse_as_dense: bool,
                   ps: ProcessSet, groups: Any = None) -> None:
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._hvd_names = _parameter_names(all_params, named_parameters)
        self._hvd_params = [p for p in all_params if p.requires_grad]
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_group = _optimizer_group(ps)
        self._hvd_ps = ps
        self._hvd_join = joining.register(self, ps.process_set_id)
        self._hvd_retired = False
        _claim(self._hvd_params, self)

    def _hvd_retire(self) -> None:
        self._hvd_retired = True

    def step(self, closure: Any = None) -> Any:
        if self._hvd_retired:
            raise RuntimeError(_RETIRED)
        joining.control(self._hvd_join)
        with torch.no_grad():
            start = [p.detach().clone() for p in self._hvd_params]
        loss = super().step(closure)
        with torch.no_grad():
            self._hvd_combine(start, [p.detach() - s for p, s in zip(self._hvd_params, start)])
        return loss

    def _hvd_adasum(self, _j: int, flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return adasum.allreduce(flat, sizes, self._hvd_group)

    def _hvd_combine(self, start: list[torch.Tensor], deltas: list[torch.Tensor]) -> None:
        fused_inplace(deltas, self._hvd_adasum)
        for p, s, d in zip(self._hvd_params, start, deltas):
            p.copy_(s + d)

    def _hvd_follow_step(self) -> None:
        """A joined rank's part in the others' step: a zero update into the combination."""
        with torch.no_grad():
            fused_inplace([torch.zeros_like(p) for p in self._hvd_params], self._hvd_adasum)

    def _hvd_take_from(self, root: int) -> None:
        _take_from(self, root, self._hvd_ps)


class _NonMemberOptimizer(_LocalGradients):
    """A ``DistributedOptimizer`` on a process set this rank is not in: as in Horovod, it steps on
    this rank's own gradients, with nothing to reduce."""

    def _hvd_setup(self, named_parameters: Any, compressor: Any, backward_passes_per_step: int, *args: Any) -> None:
        _parameter_names([p for group in self.param_groups for p in group["params"]], named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_retired = False


def _no_entries(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``p``'s shape with no entries (rows of an embedding, say)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=p.device),
                                   p.new_empty((0,) + tuple(p.shape[1:])), p.shape)


def _take_from(opt: torch.optim.Optimizer, root: int, ps: ProcessSet) -> None:
    """Overwrite this optimizer's parameters and state with rank ``root``'s (after ``join()``,
    where every member of ``ps`` is, so its group is free)."""
    broadcast_parameters([p for group in opt.param_groups for p in group["params"]], root, process_set=ps)
    broadcast_optimizer_state(opt, root, process_set=ps)


def _optimizer_group(ps: ProcessSet) -> Any:
    # A group of the optimizer's own keeps its background collectives from interleaving with the
    # training loop's. new_group is collective over the whole job, which a process set's
    # optimizer (built on its members only) cannot call: the set made one when it was registered.
    return dist.new_group() if ps is global_process_set else optimizer_group_of(ps)


def _parameter_names(params: list[torch.Tensor], named_parameters: Any) -> dict[torch.Tensor, str]:
    if named_parameters is None:
        return {p: f"allreduce.noname.{j}" for j, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced "
            "by model.named_parameters()."
        )
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    by_param = {p: n for n, p in named}
    unnamed = [p for p in params if p not in by_param]
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but {len(unnamed)} parameter(s) of the optimizer "
            "are not named in it; pass model.named_parameters() for the model the optimizer trains."
        )
    return by_param


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so ``step()`` applies gradients averaged (or summed) over all ranks.

    The result is an instance of a subclass of ``type(optimizer)`` sharing its param groups and
    state, so ``isinstance`` checks and LR schedulers work; use it instead of ``optimizer``.

    Args:
        named_parameters: ``model.named_parameters()``; names appear in errors and key
            compressor state.
        compression: a compressor, e.g. ``Compression.fp16``; applied per fusion bucket.
        backward_passes_per_step: backward passes whose gradients are accumulated (summed,
            as in Horovod) locally before one reduction; call ``step()`` after the last.
        op: ``Average``, ``Sum``, or ``Adasum`` (each rank steps on its own gradients and the
            updates are combined by Adasum; see :class:`_DistributedAdasumOptimizer`).
        gradient_predivide_factor: with ``Average``, divide by this before the sum and multiply
            by ``factor / size`` after it (the result is the same average; it trades overflow
            against underflow in low precision).
        num_groups: deprecated spelling of ``groups=n`` (as in Horovod).
        groups: explicit fusion instead of the size threshold: n (that many buckets of
            consecutive parameters) or a list of parameter lists (one bucket each; parameters
            in none of them are reduced one by one).
        sparse_as_dense: sparse gradients (``nn.Embedding(sparse=True)``) are made dense and
            reduced like the others; without it they are reduced as sparse (their entries
            allgathered and summed where they meet), so ``torch.optim.SparseAdam`` works.
        process_set: reduce over this set's ranks only (created on its members only).

    ``HOROVOD_FUSION_THRESHOLD`` (bytes, default 64 MiB, 0 = one bucket per tensor) sets the
    bucket size.
    """
    check()
    member = not (isinstance(process_set, ProcessSet) and process_set is not global_process_set
                  and process_set.included() is False)
    ps = resolve_set(process_set) if member else process_set
    op = ReduceOp(op)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer supports op=Average, Sum or Adasum, got {op.name}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if num_groups:
        warnings.warn("num_groups is deprecated, use groups=", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if isinstance(groups, int) and not isinstance(groups, bool) and groups == 0:
        groups = None  # Horovod's "no explicit groups"
    if isinstance(optimizer, (_DistributedOptimizer, _LocalGradients)):
        raise ValueError("optimizer is already a DistributedOptimizer")
    compressor = resolve_compression(compression)
    warn_if_known_worse(compressor, optimizer)
    if op == Adasum and not is_none(compressor):
        raise ValueError("op=hvd.Adasum combines full-precision updates: pass compression=hvd.Compression.none")
    base = type(optimizer)
    mixin = _DistributedAdasumOptimizer if op == Adasum else _DistributedOptimizer
    if not member:
        mixin = _NonMemberOptimizer
    cls = type(base.__name__, (mixin, base), {"__module__": __name__})
    wrapped = cls.__new__(cls)
    # Share the wrapped optimizer's param groups, state and hooks; an instance-level `step`
    # (an LR scheduler's patch of the original) must not shadow ours.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._hvd_setup(named_parameters, compressor, backward_passes_per_step, op, gradient_predivide_factor,
                       bool(sparse_as_dense), ps, groups)
    return wrapped
