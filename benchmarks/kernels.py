"""Native C kernels vs the torch-op path vs a plain memory copy, on one float32 gradient.

    python benchmarks/kernels.py [--numel 25000000] [--repeats 5]

Each row times one compressor operation both ways in this process (``SPARK_DL_NATIVE=0``
switches a call to the torch path), best of ``--repeats``. Encoders are compressor calls (fp16
and bf16 with the 1/W scale that ``allreduce`` applies before the sum); decoders are timed as
the collectives run them, ``decompress_into(payload, acc, accumulate=True)`` (torch path: a new
tensor, then ``add_``), and as plain ``decompress`` into a new tensor ("(new)" rows). GB/s
counts the fp32 bytes read (decoders: the fp32 bytes they produce), so every row compares with
``copy`` = ``dst.copy_(src)`` of the same bytes into an existing tensor, timed (best of
``--repeats``, like the kernel) right next to that row, since bandwidth drifts on a shared machine. Native runs with
torch's thread count and with 1; torch with ``torch.get_num_threads()``.

"kernel ms" calls ``spark_dl._native`` directly with every output allocated once. "vs copy" uses
the kernel time. Where a row misses the goal, the script checks whether any code could meet it
here: 5x the torch path leaves torch ms / 5 for the first-touch page faults of the memory the row
returns (measured: filling a fresh tensor minus filling an existing one) and for the bytes the row
must read and write at the least; if that traffic would need a faster rate than the fastest memory
pass measured in the run (``copy_``, ``sum``, an in-place ``mul_``, and every kernel here), the row
says the goal is out of reach. Like the launcher's ranks, this process sets ``THP_MEM_ALLOC_ENABLE=1`` (huge
pages for big tensors), so fresh outputs cost both paths far fewer page faults.
"""
from __future__ import annotations

import argparse
import os
import time

# As in the launcher's rank processes: huge pages for big CPU tensors, so fresh outputs do not
# cost both paths 25,000 page faults per 100 MB. Read by torch at its first big allocation.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

import spark_dl.compression as C  # noqa: E402
from spark_dl.compression import native  # noqa: E402


def best(fn, repeats: int) -> float:
    fn()  # warm: allocator, residual memory, page faults
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def torch_path(fn):
    def run():
        os.environ["SPARK_DL_NATIVE"] = "0"
        try:
            return fn()
        finally:
            del os.environ["SPARK_DL_NATIVE"]
    return run


def cases(g: torch.Tensor):
    """(name, operation, bytes moved, fresh bytes) rows; each operation uses whichever path the
    switch selects.

    Encoders are the compressor calls. Decoders are timed as the collectives use them:
    ``decompress_into(payload, acc, accumulate=True)`` adds one rank's payload into the
    reduction buffer (torch path: decompress to a new tensor, then ``add_``); the "(new)" rows
    decompress into a fresh tensor, as a user's ``decompress`` call does.
    """
    onebit, efsign, tk = C.OneBit(1024), C.EFSign(), C.TopK(0.01, ramp_steps=0)  # top-k's steady state
    sm, ss = C.SignMeans(1024), C.ScaledSign(64)  # EFSign()'s scale per 64 elements
    qsgd = C.QSGD(levels=7, bucket_size=512, seed=0)
    fp16, bf16 = C.FP16(), C.BF16()
    p_sign, p_ss, p_q = sm.compress(g), ss.compress(g), qsgd.compress(g)
    p16, pbf = fp16.compress(g), bf16.compress(g)
    acc = torch.zeros_like(g)
    # Per row also: the bytes per element it must read plus write at the least, and the bytes per
    # element of fresh memory it returns (first-touch page faults).
    return [
        ("1-bit+EF encode", lambda: onebit.compress(g, key="g"), 12.125, 0.125),
        ("EF-sign encode", lambda: efsign.compress(g, key="g"), 12.1875, 0.1875),
        # as an averaging all-reduce calls them: g / W inside the encoder's pass
        ("1-bit+EF enc /W", lambda: onebit.compress_averaged(g, 2, key="g"), 12.125, 0.125),
        ("EF-sign enc /W", lambda: efsign.compress_averaged(g, 2, key="g"), 12.1875, 0.1875),
        ("fp16 encode /W", lambda: fp16.compress_scaled(g, 0.5), 6, 2),
        ("bf16 encode /W", lambda: bf16.compress_scaled(g, 0.5), 6, 2),
        ("QSGD-4bit encode", lambda: qsgd.compress(g), 4.5, 0.5),
        ("top-k 1% encode", lambda: tk.compress(g), 4, 0.12),
        ("1-bit decode+acc", lambda: sm.decompress_into(p_sign, acc, True), 8.125, 0),
        ("EF-sign dec+acc", lambda: ss.decompress_into(p_ss, acc, True), 8.1875, 0),
        ("fp16 decode+acc", lambda: fp16.decompress_into(p16, acc, True), 10, 0),
        ("bf16 decode+acc", lambda: bf16.decompress_into(pbf, acc, True), 10, 0),
        ("QSGD decode+acc", lambda: qsgd.decompress_into(p_q, acc, True), 8.5, 0),
        ("1-bit decode (new)", lambda: sm.decompress(p_sign), 4.125, 4),
        ("fp16 decode (new)", lambda: fp16.decompress(p16), 6, 4),
        ("QSGD decode (new)", lambda: qsgd.decompress(p_q), 4.5, 4),
    ]


def kernels(g: torch.Tensor):
    """(name, call) of the raw kernels writing into preallocated outputs, as in ``cases``."""
    from spark_dl import _native as E

    n = g.numel()
    e = torch.zeros(n)
    out = torch.empty(n)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
    means = torch.empty(2 * -(-n // 1024))
    scales, pend = torch.empty(-(-n // 64)), torch.full((2 * -(-n // 64),), 0.5)
    pend[1::2] = -0.5
    half = torch.empty(n, dtype=torch.float16)
    norms = torch.empty(-(-n // 512))
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    k = -(-n // 100)
    idx, val = torch.empty(k, dtype=torch.int64), torch.empty(k)
    E.onebit_encode(g.data_ptr(), 0, 0, 0, False, n, 1024, means.data_ptr(), bits.data_ptr(), 1.0)
    E.qsgd_encode(g.data_ptr(), n, 512, 7, 4, 0, norms.data_ptr(), packed.data_ptr(), True)
    E.convert(g.data_ptr(), half.data_ptr(), n, 1.0, False, True)
    p = g.data_ptr()

    def onebit_dec(acc):
        return E.onebit_decode(means.data_ptr(), bits.data_ptr(), n, 1024, out.data_ptr(), acc)

    def qsgd_dec(acc):
        return E.qsgd_decode(norms.data_ptr(), packed.data_ptr(), n, 512, 7, 4, out.data_ptr(), acc)

    return {
        "1-bit+EF encode": lambda: E.onebit_encode(p, e.data_ptr(), 0, e.data_ptr(), False, n, 1024, means.data_ptr(),
                                                   bits.data_ptr(), 1.0),
        "EF-sign encode": lambda: E.scaled_sign_encode(p, e.data_ptr(), pend.data_ptr(), e.data_ptr(), n, 64,
                                                       bits.data_ptr(), scales.data_ptr(), 1.0),
        "1-bit+EF enc /W": lambda: E.onebit_encode(p, e.data_ptr(), 0, e.data_ptr(), False, n, 1024, means.data_ptr(),
                                                   bits.data_ptr(), 2.0),
        "EF-sign enc /W": lambda: E.scaled_sign_encode(p, e.data_ptr(), pend.data_ptr(), e.data_ptr(), n, 64,
                                                       bits.data_ptr(), scales.data_ptr(), 2.0),
        "fp16 encode /W": lambda: E.convert(p, half.data_ptr(), n, 0.5, False, True),
        "bf16 encode /W": lambda: E.convert(p, half.data_ptr(), n, 0.5, True, True),
        # the compressor's default scale, max |v| per bucket
        "QSGD-4bit encode": lambda: E.qsgd_encode(p, n, 512, 7, 4, 1, norms.data_ptr(), packed.data_ptr(), True),
        "top-k 1% encode": lambda: E.topk(p, n, k, idx.data_ptr(), val.data_ptr()),
        "1-bit decode+acc": lambda: onebit_dec(True),
        "EF-sign dec+acc": lambda: E.scaled_sign_decode(scales.data_ptr(), bits.data_ptr(), n, 64, out.data_ptr(),
                                                        True),
        "fp16 decode+acc": lambda: E.convert(half.data_ptr(), out.data_ptr(), n, 1.0, False, False, True),
        "bf16 decode+acc": lambda: E.convert(half.data_ptr(), out.data_ptr(), n, 1.0, True, False, True),
        "QSGD decode+acc": lambda: qsgd_dec(True),
        "1-bit decode (new)": lambda: onebit_dec(False),
        "fp16 decode (new)": lambda: E.convert(half.data_ptr(), out.data_ptr(), n, 1.0, False, False),
        "QSGD decode (new)": lambda: qsgd_dec(False),
    }, (e, out, bits, means, half, norms, packed, idx, val)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not native.available():
        raise SystemExit("spark_dl._native is not built: pip install -e . with a C compiler")
    g = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    gb = g.numel() * 4 / 1e9
    dst = torch.empty_like(g)
    t_copy = best(lambda: dst.copy_(g), 3 * args.repeats)
    print(f"{args.numel / 1e6:.0f}M float32 ({gb * 1e3:.0f} MB), native paths: {native.features()}, "
          f"torch threads: {torch.get_num_threads()}")
    print(f"copy_: {t_copy * 1e3:.1f} ms, {gb / t_copy:.1f} GB/s\n")
    # How fast this machine moves memory, as generously as we can measure it: the best rate of
    # plain torch passes (bytes read + written) and, below, of every kernel.
    acc = torch.zeros_like(g)
    rates = {"copy_": 2 * gb / t_copy,  # gb: the fp32 input's size; copy_ reads and writes it
             "sum": gb / best(lambda: g.sum(), 3 * args.repeats),
             "mul_ in place": 2 * gb / best(lambda: acc.mul_(1.0), 3 * args.repeats)}
    # First-touch cost of fresh memory: filling a new tensor minus filling an existing one.
    t_fill = best(lambda: dst.fill_(1.0), 3 * args.repeats)
    t_fault = max(0.0, best(lambda: torch.empty_like(g).fill_(1.0), 3 * args.repeats) - t_fill)
    print("memory passes (GB/s read + written): " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
          + f"; a fresh {gb * 1e3:.0f} MB output costs {t_fault * 1e3:.1f} ms of page faults\n")
    raw, _buffers = kernels(g)  # _buffers: the outputs the raw calls write into stay alive
    threads = torch.get_num_threads()
    rows = []
    for name, op, moved, fresh in cases(g):
        t_torch = best(torch_path(op), args.repeats)
        native.set_threads(1)
        t_one = best(op, args.repeats)
        native.set_threads(threads)
        t_nat = best(op, args.repeats)
        t_k = best(raw[name], args.repeats)
        # copy bandwidth drifts on a shared machine: compare with a copy timed next to the kernel
        t_copy = best(lambda: dst.copy_(g), args.repeats)
        native.set_threads(None)
        rates[name] = moved / 4 * gb / t_k
        rows.append((name, t_torch, t_one, t_nat, t_k, t_copy, moved, fresh))
    fastest = max(rates.values())
    print(f"{'operation':<19}{'torch ms':>9}{'native ms':>10}{'1 thread':>9}{'vs torch':>9}"
          f"{'kernel ms':>10}{'GB/s':>6}{'vs copy':>8}  goal (>=5x torch, >=40% copy)")
    for name, t_torch, t_one, t_nat, t_k, t_copy, moved, fresh in rows:
        # 5x the torch path leaves t_torch / 5 for the page faults of the output and the memory
        # traffic; the rate that traffic would need, against the fastest pass seen in this run.
        budget = t_torch / 5 - t_fault * fresh / 4
        need = moved / 4 * gb / budget if budget > 0 else float("inf")
        if t_torch / t_nat >= 5 and t_copy / t_k >= 0.4:
            verdict = "met"
        elif need > fastest:
            verdict = f"not met; out of reach: 5x needs {need:.0f} GB/s, the fastest pass here {fastest:.0f}"
        else:
            verdict = "not met"
        print(f"{name:<19}{t_torch * 1e3:>9.1f}{t_nat * 1e3:>10.1f}{t_one * 1e3:>9.1f}{t_torch / t_nat:>8.1f}x"
              f"{t_k * 1e3:>10.1f}{gb / t_k:>6.1f}{t_copy / t_k:>8.0%}  {verdict}")

if __name__ == "__main__":
    main()
