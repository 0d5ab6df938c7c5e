"""Train on a Spark DataFrame, the rank's half: what ``main`` receives in place of the DataFrame.

Driver: ``HorovodRunner(np=2).run(main, data=spark_dl.data.shards(df, ...))``. The DataFrame is
repartitioned to one partition per barrier task; each task streams its partition's Arrow batches
to a local Arrow file (no shared storage) and its rank gets a :class:`Shards` object in place of
the DataFrame.

Rank: ``for batch in data.batches(batch_size, epoch)`` yields ``{column: torch.Tensor}``. Every
epoch is ONE global shuffle of all rows with a seed every rank shares, then cut into equal
shards (Goyal et al.: per-worker shuffles sample differently from the large-batch SGD they
stand for). Every rank computes every rank's order, so the rows a rank needs are fetched from
the ranks that hold them with one exchange per batch (byte counts, then rows), in a background
thread one batch ahead; a rank holds its own file (memory-mapped) plus a batch or two.
Shards are equal on every rank (``"drop"`` the remainder or ``"pad"`` by wrapping around):
uneven inputs would hang collectives at the end of an epoch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from spark_dl import protocol
from spark_dl.errors import as_int


@dataclass
class Shards:
    """What ``main`` receives in place of the DataFrame: this rank's view of the sharded rows."""

    columns: list[str]
    kinds: dict[str, str]
    shuffle: bool = True
    seed: int = 0
    remainder: str = "drop"
    key: str = "data"  # the keyword it was passed as: its file in the task's shard directory
    _state: dict = field(default_factory=dict, repr=False, compare=False)

    # -- the world's rows ----------------------------------------------------------------------
    def _open(self) -> dict:
        if self._state:
            return self._state
        import pyarrow as pa
        import torch
        import torch.distributed as dist

        directory = os.environ.get(protocol.SHARD_ENV)
        if directory is None:
            raise RuntimeError("no shard for this rank: pass spark_dl.data.shards(df) to HorovodRunner(np>0).run")
        path = os.path.join(directory, f"{self.key}.arrow")
        if not dist.is_initialized():
            raise RuntimeError("call spark_dl.init() (or dist.init_process_group) before reading the data")
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        group = dist.new_group(backend="gloo")  # row exchange stays on CPU whatever the model uses
        counts = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        counts[dist.get_rank()] = table.num_rows
        dist.all_reduce(counts, group=group)
        chunks = table.to_batches()
        starts = [0]  # each chunk's first row
        for c in chunks:
            starts.append(starts[-1] + c.num_rows)
        self._state.update(table=table, chunks=chunks, starts=starts, group=group, counts=counts.tolist(),
                           rank=dist.get_rank(), world=dist.get_world_size())
        return self._state

    @property
    def total_rows(self) -> int:
        """Rows in the whole DataFrame."""
        return sum(self._open()["counts"])

    def __len__(self) -> int:
        """Rows this rank reads per epoch: the same on every rank."""
        s = self._open()
        n, w = sum(s["counts"]), s["world"]
        return -(-n // w) if self.remainder == "pad" else n // w

    def _orders(self, epoch: int):
        """Every rank's global row indices for ``epoch``, one row of a ``[world, len(self)]``
        tensor: one shared shuffle, cut into equal slices. Each rank computes all of them, so
        no rank has to be told which rows another wants."""
        import torch

        s = self._open()
        n, w, per = sum(s["counts"]), s["world"], len(self)
        if self.shuffle:
            # mod 2**63: a seed such as time.time_ns() would overflow the generator's 64 bits
            seed = (self.seed * 1_000_003 + epoch) % (1 << 63)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        else:
            # "drop" leaves out n mod w rows: each epoch starts that many rows later, so the rows left
            # out move on and every row is read within a few epochs, in a fixed order
            perm = torch.roll(torch.arange(n), -(epoch * (n - per * w)) % max(n, 1))
        if per * w > n:  # pad: wrap around to the start of the same permutation
            perm = torch.cat([perm, perm[: per * w - n]])
        return perm[: per * w].reshape(w, per)

    # -- batches -------------------------------------------------------------------------------
    def batches(self, batch_size: int, epoch: int = 0, drop_last: bool = False,
                padding: str | None = None, prefetch: bool = True) -> Iterator[dict]:
        """This rank's rows for ``epoch`` as ``{column: tensor}`` batches. Every rank must
        iterate the same number of batches (it does: shards are equal), since each batch is
        fetched with a collective. ``padding="is_pad"`` adds a bool tensor under that key, true
        for the rows ``remainder="pad"`` repeats (wrapped around): leave them out of a mean over
        the rows, and each row counts once. ``prefetch``: the next batch is fetched in a
        background thread while the caller works on this one (alone among this object's
        iterators: with two open at once, both fetch in turn)."""
        import torch

        if as_int(batch_size) is None or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if as_int(epoch) is None:
            raise ValueError(f"epoch must be an int (it picks the epoch's shuffle), got {epoch!r}")
        if padding is not None and (not isinstance(padding, str) or padding in self.columns):
            raise ValueError(f"padding must name a key other than the columns {self.columns}, got {padding!r}")
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
        batch_size, epoch = as_int(batch_size), as_int(epoch)
        orders = self._orders(epoch)
        s = self._state
        per = orders.shape[1]
        stop = per - per % batch_size if drop_last else per
        starts = range(0, stop, batch_size)
        # position in the epoch's (wrapped) order: from n on, a row read a second time
        first = s["rank"] * per
        n = self.total_rows

        def fetch(start: int) -> dict:
            batch = self._fetch(orders[:, start:start + batch_size])
            if padding is not None:
                rows = min(batch_size, stop - start)
                batch[padding] = torch.arange(first + start, first + start + rows) >= n
            return batch

        s["open"] = s.get("open", 0) + 1
        ahead = None  # the next batch, fetched in the background
        try:
            for i, start in enumerate(starts):
                if ahead is not None:
                    batch, ahead = ahead.result(), None
                else:
                    self._settle()
                    batch = fetch(start)
                # the same decision on every rank (the same program order), so the fetches every
                # rank issues on the group stay in one order
                if prefetch and s["open"] == 1 and i + 1 < len(starts):
                    ahead = self._ahead(fetch, starts[i + 1])
                yield batch
        finally:
            s["open"] -= 1
            if ahead is not None:  # every rank fetches it: let it finish, so the group's next call is the next one
                self._settle()

    def _ahead(self, fetch: Any, start: int):
        """Run ``fetch(start)`` on this object's fetch thread; it is the group's next collective."""
        from concurrent.futures import ThreadPoolExecutor

        s = self._state
        if "pool" not in s:
            s["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spark-dl-shards")
        s["inflight"] = s["pool"].submit(fetch, start)
        return s["inflight"]

    def _settle(self) -> None:
        """Wait for a fetch in flight on the group (a closed iterator's): the next must follow it.
        Its error, if any, belongs to the iterator that asked for it."""
        inflight = self._state.pop("inflight", None)
        if inflight is not None:
            inflight.exception()

    def _fetch(self, wanted) -> dict:
        """Exchange rows so this rank gets ``wanted[rank]`` (global indices), in that order;
        ``wanted[d]`` is what rank ``d`` gets from the same call."""
        import pyarrow as pa
        import torch
        import torch.distributed as dist

        s = self._open()
        w, rank, counts = s["world"], s["rank"], s["counts"]
        offsets = [sum(counts[:i]) for i in range(w)]
        lo, hi = offsets[rank], offsets[rank] + counts[rank]
        payloads = []
        for d in range(w):
            want = wanted[d]
            local = want[(want >= lo) & (want < hi)] - lo
            payloads.append(_ipc_bytes(_take(s["table"].schema, s["chunks"], s["starts"], local.numpy())))
        send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8) if any(payloads) \
            else torch.zeros(0, dtype=torch.uint8)
        in_splits = [len(p) for p in payloads]
        out_splits_t = torch.empty(w, dtype=torch.int64)
        dist.all_to_all_single(out_splits_t, torch.tensor(in_splits, dtype=torch.int64), group=s["group"])
        out_splits = out_splits_t.tolist()
        recv = torch.empty(sum(out_splits), dtype=torch.uint8)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=s["group"])

        pieces, pos = [], 0
        raw = recv.numpy().tobytes()
        for src, size in enumerate(out_splits):
            pieces.append((src, pa.ipc.open_stream(raw[pos:pos + size]).read_all()))
            pos += size
        # rows arrived grouped by source rank, each group in `wanted` order: restore that order
        want = wanted[rank]
        src_of = torch.bucketize(want, torch.tensor(offsets[1:], dtype=torch.int64), right=True)
        table = pa.concat_tables([t for _, t in pieces]).combine_chunks()  # a batch: one take, below
        position = torch.empty(len(want), dtype=torch.int64)
        start = 0
        for src, t in pieces:
            idx = (src_of == src).nonzero().flatten()
            position[idx] = torch.arange(start, start + t.num_rows)
            start += t.num_rows
        table = table.take(_indices(position.numpy()))
        return {c: column_tensor(table.column(c), self.kinds[c], c) for c in self.columns}


def _take(schema, chunks: list, starts: list[int], rows):
    """``rows`` (a numpy array of row numbers) of the table held as record batches ``chunks``
    (the first rows of which are ``starts``), in that order. pyarrow's ``take`` on a table of
    several chunks concatenates them all first, a copy of the whole shard per batch (40x slower
    than this for 5 chunks of 10,000 rows); here each chunk that holds some of the rows gives them
    with a take of its own."""
    import numpy as np
    import pyarrow as pa

    if len(chunks) == 1:
        return pa.Table.from_batches([chunks[0].take(_indices(rows))])
    which = np.searchsorted(starts, rows, side="right") - 1
    order = np.argsort(which, kind="stable")  # the rows grouped by chunk, each group in the given order
    parts = [chunks[c].take(_indices(rows[which == c] - starts[c])) for c in np.unique(which)]
    grouped = pa.Table.from_batches(parts, schema=schema).combine_chunks()
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return grouped.take(_indices(back))


def _indices(rows):
    """Row numbers (a numpy array) as an Arrow int64 array, without ``pa.array``: that imports
    pandas the first time it is called (to check for a Series), 0.4 s of a rank's first batch."""
    import numpy as np
    import pyarrow as pa

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])


def _ipc_bytes(table) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def column_tensor(column, kind: str, name: str, before: str = "training"):
    """A column's tensor; nulls are refused, naming the column and the fix to apply ``before``."""
    import numpy as np
    import torch

    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    drop = f"df.na.drop(subset=[{name!r}])"
    if kind == "scalar":
        if column.null_count:
            raise ValueError(f"column {name!r} has nulls; fill or drop them before {before} ({drop}, or "
                             f"df.na.fill(0, subset=[{name!r}]))")
        return torch.from_numpy(_numpy(column))
    if column.null_count:
        raise ValueError(f"array column {name!r} has null rows; fill or drop them before {before} ({drop})")
    if column.flatten().null_count:
        raise ValueError(f"array column {name!r} has null elements inside its arrays; fill them (e.g. "
                         f"F.transform({name!r}, lambda v: F.coalesce(v, F.lit(0)))) "
                         f"or drop those rows before {before}")
    lengths = np.diff(_numpy(column.offsets))
    if len(lengths) and (lengths != lengths[0]).any():
        raise ValueError(f"array column {name!r} has rows of different lengths; pad them to one length")
    values = _numpy(column.flatten())
    return torch.from_numpy(values.reshape(len(column), -1))


def _numpy(array):
    """An Arrow array without nulls as a writable numpy array (as torch wants). Fixed-width numbers
    are read off their data buffer: ``to_numpy`` imports pandas first, 0.3 s of a rank's first batch."""
    import numpy as np
    import pyarrow as pa

    t = array.type
    if array.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_floating(t)):
        kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
        dtype = np.dtype(f"{kind}{t.bit_width // 8}")  # Arrow buffers are in native byte order
        return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                             offset=array.offset * dtype.itemsize).copy()
    return np.array(array.to_numpy(zero_copy_only=False))
