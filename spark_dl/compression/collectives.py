"""Compressed all-reduce on ``torch.distributed`` (Gloo and NCCL).

* Summable payloads (none, fp16, bf16, shared-seed random-k): one ``all_reduce`` per wire
  tensor, then decompress.
* PowerSGD: its own two all-reduce rounds (P, then Q).
* Everything else: compressed scatter-reduce + all-gather. The flat tensor is split into W
  chunks; rank j owns chunk j. Each rank compresses every chunk (error-feedback memory
  ``(name, "worker", j)``) and an ``all_to_all`` sends chunk j to rank j; rank j decompresses
  and sums the W copies, recompresses the sum (a second memory ``(name, "server")``) and an
  ``all_gather`` gives every rank every reduced chunk. Each rank sends about 2 (W-1)/W of one
  compressed copy of the tensor: O(size), not O(W size). Every rank decompresses the same
  payloads, so the result is identical on all ranks. Chunks of more than ``PIECE_ELEMS``
  elements travel in pieces with asynchronous collectives, so encoding and decoding overlap
  the transfers.

Payloads travel as one uint8 buffer each; the receiver unpacks it with the layout of its own
payload for the same chunk (see :mod:`spark_dl.compression.base`), so no sizes are exchanged.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from spark_dl.compression.base import Compressor, Payload, as_compressor
from spark_dl.compression.fp import Cast, NoneCompressor
from spark_dl.compression.layers import by_layer
from spark_dl.compression.powersgd import PowerSGD
from spark_dl.compression.stats import stats, watch
from spark_dl.errors import as_int
from spark_dl.rank.works import callback, hold

OPS = ("average", "sum")


def to_bytes(payload: Payload) -> torch.Tensor:
    """The payload's wire tensors concatenated as one flat uint8 tensor."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in payload.tensors]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def from_bytes(buf: torch.Tensor, like: Payload) -> Payload:
    """Inverse of :func:`to_bytes`, with the layout and meta of ``like`` (views where aligned)."""
    tensors, offset = [], 0
    for t in like.tensors:
        n = t.numel() * t.element_size()
        piece = buf[offset:offset + n]
        if piece.storage_offset() % t.element_size():
            piece = piece.clone()  # viewing bytes as wider types needs an aligned start
        tensors.append(piece.view(t.dtype).reshape(t.shape))
        offset += n
    return Payload(tensors, like.meta)


def _ring_bytes(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


def _through_host(t: torch.Tensor, group: Any) -> bool:
    """CUDA tensors under Gloo travel through host memory: Gloo cannot move them in every
    collective, and where it can it costs more than a copy each way."""
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _finished() -> None:
    return None


def _start_all_reduce(t: torch.Tensor, group: Any, world: int) -> Callable[[], None]:
    """Begin summing ``t`` in place across ranks; returns the function that waits for the sum."""
    if world == 1:
        return _finished
    stats.add_bytes(_ring_bytes(t.numel() * t.element_size(), world))
    if _through_host(t, group):
        # a copy each way beats Gloo's CUDA path: 0.4 vs 0.7 ms for 80 KB on an H100
        host = t.cpu()
        work = hold(dist.all_reduce(host, group=group, async_op=True))

        def wait() -> None:
            work.wait()
            t.copy_(host)
        return wait
    return hold(dist.all_reduce(t, group=group, async_op=True)).wait


def _all_reduce(t: torch.Tensor, group: Any, world: int) -> None:
    _start_all_reduce(t, group, world)()


def _summable(x: torch.Tensor, c: Compressor, name: Any, group: Any, world: int,
              scale: float = 1.0, into: torch.Tensor | None = None, average: bool = False) -> torch.Tensor:
    if scale != 1.0:
        payload = c.compress_scaled(x, scale, key=name)  # fp16/bf16: the kernel divides as it casts
    elif average:  # x / world, inside error feedback's own pass where there is one
        payload = c.compress_averaged(x, world, key=name)
    else:
        payload = c.compress(x, key=name)
    for t in payload.tensors:
        _all_reduce(t, group, world)
    if into is not None:  # decoded straight into out= (fp16/bf16: one native pass, no result tensor)
        c.decompress_into(payload, into)
        return into
    return c.decompress(payload)


def _all_gather(out: torch.Tensor, piece: torch.Tensor, group: Any) -> Any:
    # torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return hold(gather(out, piece, group=group, async_op=True))


PIECE_ELEMS = 1 << 21  # chunks above this are sent in pieces, pipelined (at most MAX_PIECES)
MAX_PIECES = 8


def _pieces(numel: int) -> int:
    return max(1, min(MAX_PIECES, numel // PIECE_ELEMS))


def _scatter_reduce_allgather(x: torch.Tensor, c: Compressor, name: Any, group: Any,
                              world: int, into: torch.Tensor | None = None, average: bool = False,
                              sizes: list[int] | None = None) -> torch.Tensor:
    """With ``average`` each rank's pieces are compressed as ``piece / world``
    (:meth:`Compressor.compress_averaged`: error feedback divides inside its own pass).
    ``sizes``: the tensors packed in ``x``, for compressors that go layer by layer in each piece."""
    me = dist.get_rank(group) if world > 1 else 0
    chunks = torch.tensor_split(x.reshape(-1), world)  # rank j owns chunk j

    def encode(t: torch.Tensor, key: Any, cc: Compressor) -> Payload:
        return cc.compress_averaged(t, world, key=key) if average else cc.compress(t, key=key)
    if world == 1:
        whole = by_layer(c, sizes)
        own = encode(chunks[0], (name, "worker", 0), whole)
        reduced = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        whole.decompress_into(own, reduced)
        mine = whole.compress(reduced.to(x.dtype), key=(name, "server"))
        return whole.decompress(mine).reshape(x.shape)
    # Large chunks go in K pieces, pipelined: while piece k is on the wire (async collectives
    # run on the backend's threads) piece k+1 is encoded, and piece k is decoded while later
    # pieces travel. Every rank issues the same collectives in the same order.
    wire = torch.device("cpu") if _through_host(x, group) else x.device
    K = _pieces(chunks[0].numel())
    parts = [torch.tensor_split(ch, K) for ch in chunks]  # parts[j][k]
    starts = [[0] * K for _ in range(world)]
    for j in range(world):
        for k in range(1, K):
            starts[j][k] = starts[j][k - 1] + parts[j][k - 1].numel()
    chunk_at = [0] * world
    for j in range(1, world):
        chunk_at[j] = chunk_at[j - 1] + chunks[j - 1].numel()
    # the compressor of each piece: c itself, or c layer by layer where the piece spans tensors
    comp = [[by_layer(c, sizes, chunk_at[j] + starts[j][k], parts[j][k].numel()) for k in range(K)]
            for j in range(world)]

    def key(role: str, *ids: int) -> Any:  # per piece only when there are pieces
        return (name, role, *ids) if K > 1 else (name, role, *ids[:-1])

    scattered = []
    for k in range(K):
        sent = [encode(parts[j][k], key("worker", j, k), comp[j][k]) for j in range(world)]
        buffers = [to_bytes(p) for p in sent]
        lengths = [b.numel() for b in buffers]
        # Pieces of different chunks differ by at most one element, so their payloads by a few
        # bytes: one 8-aligned width for all (aligned views, equal splits) lets the single-tensor
        # all_to_all and all_gather that Gloo and NCCL both provide carry them.
        width = -(-max(lengths) // 8) * 8
        outgoing = torch.zeros(world, width, dtype=torch.uint8, device=wire)
        for j, b in enumerate(buffers):
            outgoing[j, :lengths[j]] = b
        incoming = torch.empty_like(outgoing)
        work = hold(dist.all_to_all_single(incoming, outgoing, group=group, async_op=True))
        stats.add_bytes((world - 1) * width)
        scattered.append((sent, lengths, width, incoming, outgoing, work))

    reduced = torch.empty(chunks[me].numel(), dtype=torch.float32, device=x.device)
    gathering = []
    for k, (sent, lengths, width, incoming, _outgoing, work) in enumerate(scattered):
        work.wait()
        incoming = incoming.to(x.device)
        own = sent[me]
        piece = reduced[starts[me][k]:starts[me][k] + parts[me][k].numel()]
        # Decode-accumulate into one buffer: the native kernels add each payload in one pass.
        for i in range(world):
            p = own if i == me else from_bytes(incoming[i, :lengths[me]], own)
            comp[me][k].decompress_into(p, piece, accumulate=i > 0)
        mine = to_bytes(comp[me][k].compress(piece.to(x.dtype), key=key("server", k)))
        padded = torch.zeros(width, dtype=torch.uint8, device=wire)
        padded[:mine.numel()] = mine
        gathered = torch.empty(world, width, dtype=torch.uint8, device=wire)
        g_work = _all_gather(gathered.view(-1), padded, group)
        stats.add_bytes((world - 1) * width)
        gathering.append((sent, lengths, gathered, padded, g_work))

    # Every read of x happened above (each piece compressed before it was sent), so ``into``
    # may be x itself.
    out = into if into is not None else torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    for k, (sent, lengths, gathered, _padded, g_work) in enumerate(gathering):
        g_work.wait()
        gathered = gathered.to(x.device)
        for j in range(world):
            at = chunk_at[j] + starts[j][k]
            comp[j][k].decompress_into(from_bytes(gathered[j, :lengths[j]], sent[j]),
                                       out[at:at + parts[j][k].numel()])
    return out.to(x.dtype).reshape(x.shape)


def _allgather_sum(x: torch.Tensor, c: Compressor, name: Any, group: Any, world: int,
                   into: torch.Tensor | None = None, average: bool = False) -> torch.Tensor:
    """One compression stage: every rank compresses its whole tensor (error-feedback memory
    ``(name, "worker")``), an ``all_gather`` brings every payload to every rank, and each sums the
    W decompressions in rank order (the same bits everywhere). Each rank sends (W-1) compressed
    copies, against 2(W-1)/W for the scatter-reduce, whose second compression of the reduced chunk
    (with its own error feedback) doubles the delay error feedback puts on the update."""
    flat = x.reshape(-1)
    key = (name, "worker")
    payload = c.compress_averaged(flat, world, key=key) if average else c.compress(flat, key=key)
    mine = to_bytes(payload)
    out = into if into is not None else torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    if world == 1:
        c.decompress_into(payload, out)
        return out.to(x.dtype).reshape(x.shape)
    wire = torch.device("cpu") if _through_host(x, group) else x.device
    gathered = torch.empty(world, mine.numel(), dtype=torch.uint8, device=wire)
    _all_gather(gathered.view(-1), mine.to(wire), group).wait()
    stats.add_bytes((world - 1) * mine.numel())
    gathered = gathered.to(x.device)
    for i in range(world):
        c.decompress_into(from_bytes(gathered[i], payload), out, accumulate=i > 0)
    return out.to(x.dtype).reshape(x.shape)


def _dims(layout: Any) -> list[list[int]] | None:
    """``layout`` as lists of Python ints, or None where it is not a list of sequences of ints."""
    try:
        dims = [None if isinstance(shape, (str, bytes)) else [as_int(d) for d in shape] for shape in layout]
    except TypeError:  # not iterable
        return None
    return None if any(shape is None or None in shape for shape in dims) else dims


def _check_layout(layout: Sequence[Sequence[int]], tensor: torch.Tensor) -> None:
    # as_int: a dimension such as "3" or 2.5 is not silently converted (int() would take both)
    dims = None if isinstance(layout, (str, bytes)) else _dims(layout)
    if dims is None:
        raise TypeError(f"layout must be a list of shapes (sequences of ints), got {layout!r}")
    sizes = [math.prod(shape) for shape in dims]
    if any(d < 0 for shape in dims for d in shape) or sum(sizes) != tensor.numel():
        raise ValueError(
            f"layout describes {sum(sizes)} elements in {len(sizes)} tensors but the tensor has "
            f"{tensor.numel()}: pass the shapes of exactly the tensors packed in it, in order."
        )


def _reduce(tensor: torch.Tensor, c: Compressor, name: Any, group: Any, world: int, layout: Any,
            into: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``allreduce``'s exchange: the path that fits ``c``'s payload."""
    if isinstance(c, PowerSGD):
        # the 1/W scale rides PowerSGD's own pass that adds the residual: no pass of its own
        return c.round_layers(tensor, layout, name, lambda t: _start_all_reduce(t, group, world), scale=scale,
                              into=into)
    if isinstance(c, Cast) and scale != 1.0:
        # divide before the sum (no fp16 overflow) inside the cast: no pass of its own
        return _summable(tensor, c, name, group, world, scale=scale, into=into)
    # the division by the world size happens in the compressors' calls (compress_averaged)
    if c.summable:
        return _summable(tensor, c, name, group, world, into=into, average=scale != 1.0)
    sizes = None if layout is None or c.span is None else [math.prod(shape) for shape in _dims(layout)]
    if c.feedback is not None and c.feedback.single_stage(world):
        return _allgather_sum(tensor, by_layer(c, sizes), name, group, world, into=into, average=scale != 1.0)
    return _scatter_reduce_allgather(tensor, c, name, group, world, into=into, average=scale != 1.0, sizes=sizes)


def allreduce(tensor: torch.Tensor, compression: Compressor | None = None, *,
              op: str = "average", name: Any = None, group: Any = None,
              layout: Sequence[Sequence[int]] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum or average ``tensor`` over ``group`` through ``compression``; synchronous.

    Returns a new tensor of the input's shape and dtype, identical on every rank; the input is
    not modified. ``op="average"`` divides by the world size *before* compressing (no fp16
    overflow; error-feedback memory then holds averaged units). ``name`` keys per-tensor state
    (error feedback, warm starts) and is required for stateful compressors. Bytes sent and time
    go to :data:`spark_dl.compression.stats`. ``layout``: when ``tensor`` is a bucket, the shapes
    of the tensors packed in it (flattened, in order); layer-wise compressors (PowerSGD) then
    factor each as its own matrix, and those whose elements share a statistic (OneBit's means,
    EFSign's scale) never share one between two tensors (:mod:`spark_dl.compression.layers`).
    ``out``: a contiguous tensor of the input's numel, dtype and device (``tensor`` itself is
    allowed) that receives the result and is returned; every compressed path decodes into a
    float32 ``out`` directly, with no result tensor of its own (what the DDP hook does with the
    bucket).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    # an instance only: a class or a name would fail deep inside (or lose its state every call)
    c = NoneCompressor() if compression is None else as_compressor(compression, "allreduce", instances_only=True)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce takes a torch.Tensor, got {type(tensor).__name__}")
    if c.stateful and name is None:
        raise ValueError(
            f"{c!r} keeps state per tensor (error feedback / warm start): pass name=... that is "
            "unique to this tensor and the same on every rank."
        )
    if layout is not None:
        _check_layout(layout, tensor)
    if out is not None and (not isinstance(out, torch.Tensor) or out.numel() != tensor.numel()
                            or out.dtype != tensor.dtype or out.device != tensor.device
                            or not out.is_contiguous()):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous tensor of {tensor.numel()} {tensor.dtype} elements on "
                         f"{tensor.device}, got {got}")
    if c.chooses:  # Auto: the compressor picked for this tensor reduces it, through this function
        return c.allreduce(tensor, op=op, name=name, group=group, layout=layout, out=out)
    # where the float32 paths may write the result directly
    into = out.view(-1) if out is not None and out.dtype == torch.float32 else None
    world = dist.get_world_size(group)
    start = time.perf_counter()
    average = op == "average"
    integer = not (tensor.is_floating_point() or tensor.is_complex())
    scale = 1.0 / world if average and not integer else 1.0
    fb = c.feedback if name is not None and tensor.is_floating_point() and tensor.numel() else None
    if tensor.numel() == 0:
        result = tensor * scale if scale != 1.0 else tensor.clone()
    elif fb is None:
        result = _reduce(tensor, c, name, group, world, layout, into, scale)
    else:  # warm-up, shared momentum (spark_dl.compression.training)
        x = fb.before(tensor, name, share=1.0 if average else 1.0 / world)
        now = NoneCompressor() if fb.warming(name) else c
        result = fb.after(_reduce(x, now, name, group, world, layout, into, scale), name, compressed=now is c)
        if now is c:
            watch(c, name, x, result, world)
    if average and integer:
        result = torch.div(result, world, rounding_mode="trunc")
    result = result.to(tensor.dtype).reshape(tensor.shape)
    if out is not None and result.data_ptr() != out.data_ptr():
        out.copy_(result.view(out.shape))
    stats.add_call(tensor.numel(), _ring_bytes(tensor.numel() * tensor.element_size(), world),
                   time.perf_counter() - start)
    return out if out is not None else result


def reduce_into(tensor: torch.Tensor, compression: Compressor, *, op: str, name: Any, group: Any, layout: Any,
                out: torch.Tensor | None, in_flight: bool) -> torch.Tensor | torch.futures.Future:
    """:func:`allreduce` (into ``out``, if given); with ``in_flight`` and ``out``, a future of ``out``
    instead where the reduction can stay on the wire (:func:`start_summable`; ``Auto`` decides for
    its pick)."""
    if compression.chooses:
        return compression.allreduce(tensor, op=op, name=name, group=group, layout=layout, out=out,
                                     in_flight=in_flight)
    if in_flight and out is not None and summable_in_flight(tensor, compression):
        return start_summable(tensor, compression, op=op, name=name, group=group, out=out)
    return allreduce(tensor, compression, op=op, name=name, group=group, layout=layout, out=out)


def summable_in_flight(tensor: torch.Tensor, compression: Compressor) -> bool:
    """Whether :func:`start_summable` takes this tensor: a contiguous float32 CPU tensor and a
    summable compressor (one all-reduce per payload tensor)."""
    return (compression.summable and compression.feedback is None and not isinstance(compression, PowerSGD)
            and tensor.device.type == "cpu"
            and tensor.dtype == torch.float32 and tensor.is_contiguous())


def start_summable(tensor: torch.Tensor, compression: Compressor, *, op: str, name: Any, group: Any,
                   out: torch.Tensor) -> torch.futures.Future:
    """:func:`allreduce` of ``tensor`` into ``out`` (the same bits) for what
    :func:`summable_in_flight` takes, returned as soon as the payload's all-reduces are under way:
    the future completes with ``out`` once they are done and decoded (on a thread of the process
    group). Several buckets can then be on the wire at once, as DDP's own all-reduces are."""
    world = dist.get_world_size(group)
    start = time.perf_counter()
    scale = 1.0 / world if op == "average" else 1.0
    if type(compression) is NoneCompressor and out.data_ptr() == tensor.data_ptr():
        # the bucket itself goes on the wire, as DDP's own all-reduce sends it: no copy in or out
        if scale != 1.0:
            out.div_(world)  # the bits of tensor / world, as compress_averaged has them
        stats.add_bytes(_ring_bytes(out.numel() * out.element_size(), world))

        def done(f: torch.futures.Future) -> torch.Tensor:
            f.value()  # raises the collective's error, if any
            stats.add_call(tensor.numel(), _ring_bytes(tensor.numel() * tensor.element_size(), world),
                           time.perf_counter() - start)
            return out
        return hold(dist.all_reduce(out, group=group, async_op=True)).get_future().then(callback(done))
    if isinstance(compression, Cast) and scale != 1.0:
        payload = compression.compress_scaled(tensor, scale, key=name)
    elif scale != 1.0:
        payload = compression.compress_averaged(tensor, world, key=name)
    else:
        payload = compression.compress(tensor, key=name)
    futures = []
    for t in payload.tensors:
        stats.add_bytes(_ring_bytes(t.numel() * t.element_size(), world))
        futures.append(hold(dist.all_reduce(t, group=group, async_op=True)).get_future())

    def decode(_: torch.futures.Future) -> torch.Tensor:
        for f in futures:
            f.value()  # raises the collective's error, if any
        compression.decompress_into(payload, out.view(-1))
        stats.add_call(tensor.numel(), _ring_bytes(tensor.numel() * tensor.element_size(), world),
                       time.perf_counter() - start)
        return out
    return torch.futures.collect_all(futures).then(callback(decode))
