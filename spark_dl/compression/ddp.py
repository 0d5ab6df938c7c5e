"""A DDP communication hook that all-reduces each gradient bucket through a compressor.

    state, hook = make_ddp_hook(QSGD())
    ddp_model.register_comm_hook(state, hook)

Contract: the hook returns a ``torch.futures.Future`` holding the bucket's averaged
(``op="average"``) or summed gradients, identical on every rank. By default the hook starts a
summable compressor's CPU bucket (none, FP16, BF16, random-k without error feedback) and returns
while it is on the wire, as DDP's own all-reduce and torch's hooks do, and reduces any other bucket
before it returns. With ``overlap=True`` (on the default process group) the bucket is
reduced on a background thread while backward goes on producing the next buckets;
that thread reduces the buckets in the order DDP hands them over (bucket index order on every
rank), on a process group of its own, created at the first bucket, so that DDP's own collectives
on the default group (the unused-parameter map, buffer broadcasts) can never interleave with
them. A summable compressor's CPU buckets stay on the wire together there (their all-reduces are
started, and decoded as they land: :func:`~spark_dl.compression.collectives.start_summable`).
A bucket that fails fails every later one on that rank too (the ranks are out of lockstep).
With an explicit ``process_group`` (a new group would have to be created by every rank of the
job, not only the group's) there is no thread: buckets are reduced (or started) inside the hook.
Per-bucket compressor state (error feedback, PowerSGD's Q, step counters) is keyed by the bucket's
index and layout (its size and its parameters' shapes), ``"ddp.bucket<i>.<hash of the layout>"`` (PowerSGD factors
each gradient of the bucket as its own matrix, as torch's ``powerSGD_hook`` does). When DDP
rebuilds its buckets after the first iteration, the new buckets start from fresh state and the
state of the layout they replace is reset once all its parameters have moved, on every rank
alike; the state remembers how that layout's parameters are reduced now. The state pickles
without its process group (restored as the default group), so it can be checkpointed with the
model: a fresh DDP restored from it starts with its initial buckets again, whose gradients are
then reduced through the rebuilt buckets' state they were reduced through before the checkpoint
(the same collectives in the same order: training resumes as if uninterrupted), and the rebuilt
buckets find their state again by their layout.
"""
import atexit
import contextlib
import hashlib
import queue
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from spark_dl.compression.advice import warn_if_known_worse
from spark_dl.compression.base import Compressor, as_compressor
from spark_dl.compression.collectives import OPS, allreduce, reduce_into
from spark_dl.compression.fp import NoneCompressor
from spark_dl.compression.stats import CompressionWarning
from spark_dl.rank.works import callback


@dataclass
class DDPHookState:
    """What the hook keeps between steps: the compressor (with its memories), each bucket index's
    latest layout, how many layouts' state was reset, and ``routes``: for a layout DDP replaced,
    the buckets its parameters went to (state key, index, the parameters' positions in it).
    ``owners`` and ``members`` track this process's parameters (by address) and are not pickled."""

    compressor: Compressor
    op: str = "average"
    process_group: Any = None
    layouts: dict[int, tuple] = field(default_factory=dict)
    resets: int = 0
    routes: dict[str, list[tuple[str, int, tuple[int, ...]]]] = field(default_factory=dict)
    owners: dict[int, str] = field(default_factory=dict, repr=False)  # parameter -> its layout's key
    members: dict[str, tuple[int, list[int], bool]] = field(default_factory=dict, repr=False)
    overlap: bool = False
    worker: Any = field(default=None, repr=False)  # the _Worker reducing buckets, once started
    optimizer: Any = field(default=None, repr=False)  # told to the compressor before each step's first bucket

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["process_group"] = None  # a process group is a live connection, not data
        state["optimizer"] = None  # checkpointed on its own; pass it again to make_ddp_hook
        state["owners"], state["members"] = {}, {}  # addresses of this process's parameters
        state["worker"] = None  # a thread and its process group: started again by the first bucket
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"routes": {}, "owners": {}, "members": {}, "overlap": False, **state,
                              "worker": None, "optimizer": None})


class _Worker:
    """One daemon thread reducing buckets in submission order on its own process group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="spark-dl-ddp-hook", daemon=True)
        self._thread.start()
        _LIVE.add(self)  # released by close(), never by the thread itself (see _LIVE)

    def submit(self, work: Callable[[Any], torch.Tensor], device: torch.device) -> torch.futures.Future:
        """Queue ``work(group)``; call it on the thread (and CUDA stream) that produced the bucket."""
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((work, fut, ready, device))
        return fut

    def stop(self) -> None:
        """End the thread once what is queued is done (the hook state it served is gone)."""
        self._queue.put(None)

    def close(self, timeout: float = 30.0) -> None:
        """End the thread, wait for it, then let go of the worker and its process group here."""
        self.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            _LIVE.discard(self)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._reduce(*item)
            del item  # the work holds its hook state: waiting for the next must not keep it alive

    def _reduce(self, work: Callable[[Any], torch.Tensor], fut: torch.futures.Future, ready: Any,
                device: torch.device) -> None:
        if self.error is not None:
            fut.set_exception(RuntimeError(f"an earlier gradient bucket failed: {self.error!r}"))
            return
        try:
            on_gpu = device.type == "cuda"
            with torch.no_grad(), (torch.cuda.device(device) if on_gpu else contextlib.nullcontext()):
                if on_gpu:
                    torch.cuda.current_stream().wait_event(ready)
                out = work(self.group)
                if on_gpu:  # DDP reads the result on its own stream once the future is done
                    torch.cuda.current_stream().synchronize()
        except BaseException as e:  # raised in backward by DDP's wait on the future
            self.error = e
            fut.set_exception(e)
            return
        if isinstance(out, torch._C.Future):  # still on the wire (then() makes a plain C future)
            out.add_done_callback(callback(lambda done: self._complete(fut, done)))
        else:
            fut.set_result(out)

    def _complete(self, fut: torch.futures.Future, done: torch.futures.Future) -> None:
        try:
            fut.set_result(done.value())
        except BaseException as e:
            self.error = e
            fut.set_exception(e)


# Every worker whose thread may still run. A process group's destructor releases the GIL; run on
# a daemon thread that the interpreter's finalization has begun to stop (the torchrun idiom:
# destroy_process_group() at the end of main(), so the worker holds the last reference to its
# group), taking the GIL back exits the thread mid-destructor and aborts the process ("terminate
# called without an active exception"). So the thread never holds the last reference: this set
# does, and lets go in close(), on another thread, once the thread has ended.
_LIVE: set[_Worker] = set()


def _reap() -> None:
    """Let go of the workers whose threads have ended (their hook states were collected)."""
    for worker in list(_LIVE):
        if not worker.alive():
            worker.close()


@atexit.register
def _close_workers() -> None:
    # atexit runs on the main thread while the interpreter still works: every thread ends and its
    # process group is freed here, not during finalization
    for worker in list(_LIVE):
        worker.close()


def _worker(state: DDPHookState) -> _Worker | None:
    """The state's worker, started (with its process group) at the first bucket; None where
    buckets are reduced in the hook."""
    if state.worker is None and state.overlap and state.process_group is None \
            and dist.is_initialized() and dist.get_world_size() > 1:
        # every rank gets here at its first bucket, so the group is created on all of them alike
        _reap()
        state.worker = _Worker(dist.new_group(backend=dist.get_backend()))
        weakref.finalize(state, state.worker.stop)  # a DDP model per trial must not pile up threads
    return state.worker


def _layout(bucket: dist.GradBucket) -> tuple:
    return (bucket.buffer().numel(), tuple(tuple(p.shape) for p in bucket.parameters()))


def _shapes(bucket: dist.GradBucket) -> list[tuple[int, ...]] | None:
    """The gradients' shapes when they tile the buffer in order (layer-wise PowerSGD needs them),
    else None: the bucket is then treated as one flat tensor."""
    buffer, at = bucket.buffer(), 0
    base = buffer.data_ptr()
    shapes = []
    for g in bucket.gradients():
        if g.data_ptr() != base + at * buffer.element_size():
            return None
        shapes.append(tuple(g.shape))
        at += g.numel()
    return shapes if at == buffer.numel() else None


def _key(index: int, layout: tuple) -> str:
    """The state key of bucket ``index`` with ``layout``: the same in every process and run."""
    return f"ddp.bucket{index}.{hashlib.sha1(repr(layout).encode()).hexdigest()[:12]}"


def _route(state: DDPHookState, old: str) -> list[tuple[str, int, tuple[int, ...]]] | None:
    """How the parameters of layout ``old``, all of which have moved, are reduced now: each
    bucket that took them, in bucket order, with their positions in ``old``; None when one of
    those buckets also holds other parameters or does not tile its buffer."""
    where = {p: i for i, p in enumerate(state.members[old][1])}
    route = []
    for key in sorted({state.owners[p] for p in where}, key=lambda k: state.members[k][0]):
        index, params, tiles = state.members[key]
        if not tiles or any(p not in where for p in params):
            return None
        route.append((key, index, tuple(where[p] for p in params)))
    return route


def _track(state: DDPHookState, index: int, params: list[int], key: str, tiles: bool) -> None:
    """Record that bucket ``index``'s parameters (addresses) are reduced under ``key``; a layout
    whose parameters have all moved to other buckets (DDP rebuilt them) has its state reset and
    its route kept."""
    state.members[key] = (index, params, tiles)
    before = {state.owners.get(p) for p in params} - {None, key}
    for p in params:
        state.owners[p] = key
    for old in before:
        if all(state.owners.get(p) != old for p in state.members[old][1]):
            route = _route(state, old)
            if route is not None:
                state.routes[old] = route
            state.compressor.reset(old)
            state.resets += 1
            del state.members[old]


def _reduce_routed(state: DDPHookState, grads: list[torch.Tensor], params: list[int],
                   route: list[tuple[str, int, tuple[int, ...]]], group: Any) -> None:
    """Reduce the bucket's gradients as the buckets of ``route`` do, each with its own state: a
    restored DDP's initial bucket goes through the state its gradients used before the checkpoint."""
    for key, index, positions in route:
        flat = torch.cat([grads[i].reshape(-1) for i in positions])
        allreduce(flat, state.compressor, op=state.op, name=key, group=group,
                  layout=[tuple(grads[i].shape) for i in positions], out=flat)
        at = 0
        for i in positions:  # the gradients are views of the bucket's buffer
            grads[i].copy_(flat[at:at + grads[i].numel()].view_as(grads[i]))
            at += grads[i].numel()
        state.members[key] = (index, [params[i] for i in positions], True)
        for i in positions:
            state.owners[params[i]] = key


def _reduce(state: DDPHookState, index: int, layout: tuple, shapes: list | None, buffer: torch.Tensor,
            grads: list[torch.Tensor], params: list[int], group: Any) -> torch.Tensor | torch.futures.Future:
    """The bucket reduced into ``buffer``, or a future of it where a summable compressor's
    all-reduce can stay on the wire while the next bucket starts."""
    key = _key(index, layout)
    route = state.routes.get(key)
    if route is not None and shapes is not None:
        _reduce_routed(state, grads, params, route, group)
        return buffer
    _track(state, index, params, key, shapes is not None)
    state.layouts[index] = layout
    # The result goes straight into the bucket (read in full before it is written): no result
    # tensor, and DDP has nothing to copy back.
    return reduce_into(buffer, state.compressor, op=state.op, name=key, group=group, layout=shapes, out=buffer,
                       in_flight=True)


# DDP checks these annotations at runtime, so they are real objects here, not strings.
def compressed_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce ``bucket.buffer()`` through ``state.compressor`` (see the module docstring)."""
    buffer = bucket.buffer()
    # what the reduction needs, read here: the GradBucket is DDP's to reuse once this returns
    args = (bucket.index(), _layout(bucket), _shapes(bucket), buffer, list(bucket.gradients()),
            [p.data_ptr() for p in bucket.parameters()])
    if args[0] == 0 and state.optimizer is not None:  # the step's first bucket: its lr and momentum
        state.compressor.observe_optimizer(state.optimizer)
    worker = _worker(state)
    if worker is not None:
        return worker.submit(lambda group: _reduce(state, *args, group), buffer.device)
    out = _reduce(state, *args, state.process_group)
    if isinstance(out, torch._C.Future):  # on the wire: DDP waits for it at the end of backward
        return out
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


def make_ddp_hook(compressor: Compressor | None = None, *, op: str = "average",
                  process_group: Any = None, overlap: bool = False,
                  optimizer: Any = None) -> tuple[DDPHookState, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``. ``compressor``:
    an instance, or a compressor class that takes no arguments (instantiated once, here).
    ``overlap``: reduce buckets on a background thread while backward runs (default process
    group only; see the module docstring). ``optimizer``: the optimizer that steps the model;
    before each step's first bucket its lr and momentum are told to the compressor
    (:meth:`Compressor.observe_optimizer`), so error feedback rescales its residuals when the lr
    moves and compresses the shared velocity under momentum SGD. A compressor that compresses the
    velocity (OneBit, EFSign, ErrorFeedback) warns without ``optimizer``: without it 1-bit SGD
    under momentum diverges."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    c = NoneCompressor() if compressor is None else as_compressor(compressor, "make_ddp_hook")
    if optimizer is None and c.feedback is not None and c.feedback.compress_momentum:
        warnings.warn(
            f"make_ddp_hook({c!r}) without optimizer=: the hook cannot see the lr or the momentum, so its error "
            "feedback neither compresses the shared velocity under momentum SGD (which 1-bit and sign compression need "
            "to converge) nor rescales its residuals when the lr changes. Pass make_ddp_hook(c, optimizer=opt), "
            "or call c.observe_optimizer(opt) before each backward.", CompressionWarning, stacklevel=2)
    if optimizer is not None:
        warn_if_known_worse(c, optimizer)
    state = DDPHookState(c, op, process_group, overlap=overlap, optimizer=optimizer)
    return state, compressed_hook


ddp_hook = make_ddp_hook
