"""Native C kernels vs the torch-op path vs a plain memory copy, on one float32 gradient.

    python benchmarks/kernels.py [--numel 25000000] [--repeats 5]

Each row times one compressor operation both ways in this process (``SPARK_DL_NATIVE=0``
switches a call to the torch path), best of ``--repeats``. GB/s counts the fp32 input bytes
(the payload for decoders is counted as the fp32 bytes it expands to), so every row compares
with ``copy`` = ``dst.copy_(src)`` of the same bytes into an existing tensor. Native runs with
2 threads and with 1; torch with ``torch.get_num_threads()``.

"kernel ms" calls ``spark_dl._native`` directly with every output allocated once: a compressor
returns fresh tensors each call, and first-touching a fresh 50-100 MB output costs more than
the cheap kernels themselves (page faults; both paths pay them). "vs copy" uses the kernel time.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import spark_dl.compression as C
from spark_dl.compression import native


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
    """(name, operation) pairs; each operation uses whichever path the switch selects."""
    onebit, efsign, tk = C.OneBit(1024), C.EFSign(), C.TopK(0.01)
    sm = C.SignMeans(1024)
    qsgd = C.QSGD(levels=7, bucket_size=512, seed=0)
    fp16, bf16 = C.FP16(), C.BF16()
    p_sign, p_q = sm.compress(g), qsgd.compress(g)
    p16, pbf = fp16.compress(g), bf16.compress(g)
    return [
        ("1-bit+EF encode", lambda: onebit.compress(g, key="g")),
        ("1-bit decode", lambda: sm.decompress(p_sign)),
        ("EF-sign encode", lambda: efsign.compress(g, key="g")),
        ("fp16 encode", lambda: fp16.compress(g)),
        ("fp16 decode", lambda: fp16.decompress(p16)),
        ("bf16 encode", lambda: bf16.compress(g)),
        ("bf16 decode", lambda: bf16.decompress(pbf)),
        ("QSGD-4bit encode", lambda: qsgd.compress(g)),
        ("QSGD-4bit decode", lambda: qsgd.decompress(p_q)),
        ("top-k 1% encode", lambda: tk.compress(g)),
    ]


def kernels(g: torch.Tensor):
    """(name, call) of the raw kernels writing into preallocated outputs, as in ``cases``."""
    from spark_dl import _native as E

    n = g.numel()
    e = torch.zeros(n)
    out = torch.empty(n)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
    means = torch.empty(2 * -(-n // 1024))
    half = torch.empty(n, dtype=torch.float16)
    norms = torch.empty(-(-n // 512))
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    k = -(-n // 100)
    idx, val = torch.empty(k, dtype=torch.int64), torch.empty(k)
    E.onebit_encode(g.data_ptr(), 0, 0, n, 1024, means.data_ptr(), bits.data_ptr())
    E.qsgd_encode(g.data_ptr(), n, 512, 7, 4, 0, norms.data_ptr(), packed.data_ptr())
    E.convert(g.data_ptr(), half.data_ptr(), n, 1.0, False, True)
    p = g.data_ptr()
    return {
        "1-bit+EF encode": lambda: E.onebit_encode(p, e.data_ptr(), e.data_ptr(), n, 1024, means.data_ptr(),
                                                   bits.data_ptr()),
        "1-bit decode": lambda: E.onebit_decode(means.data_ptr(), bits.data_ptr(), n, 1024, out.data_ptr(), False),
        "EF-sign encode": lambda: E.scaled_sign_encode(p, e.data_ptr(), e.data_ptr(), n, bits.data_ptr()),
        "fp16 encode": lambda: E.convert(p, half.data_ptr(), n, 1.0, False, True),
        "fp16 decode": lambda: E.convert(half.data_ptr(), out.data_ptr(), n, 1.0, False, False),
        "bf16 encode": lambda: E.convert(p, half.data_ptr(), n, 1.0, True, True),
        "bf16 decode": lambda: E.convert(half.data_ptr(), out.data_ptr(), n, 1.0, True, False),
        "QSGD-4bit encode": lambda: E.qsgd_encode(p, n, 512, 7, 4, 1, norms.data_ptr(), packed.data_ptr()),
        "QSGD-4bit decode": lambda: E.qsgd_decode(norms.data_ptr(), packed.data_ptr(), n, 512, 7, 4,
                                                  out.data_ptr(), False),
        "top-k 1% encode": lambda: E.topk(p, n, k, idx.data_ptr(), val.data_ptr()),
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
    t_copy = best(lambda: dst.copy_(g), args.repeats)
    print(f"{args.numel / 1e6:.0f}M float32 ({gb * 1e3:.0f} MB), native paths: {native.features()}, "
          f"torch threads: {torch.get_num_threads()}")
    print(f"copy_: {t_copy * 1e3:.1f} ms, {gb / t_copy:.1f} GB/s\n")
    raw, _buffers = kernels(g)  # _buffers: the outputs the raw calls write into stay alive
    print(f"{'operation':<18}{'torch ms':>9}{'native ms':>10}{'1 thread':>9}{'vs torch':>9}"
          f"{'kernel ms':>10}{'GB/s':>6}{'vs copy':>8}")
    for name, op in cases(g):
        t_torch = best(torch_path(op), args.repeats)
        native.set_threads(1)
        t_one = best(op, args.repeats)
        native.set_threads(2)
        t_nat = best(op, args.repeats)
        t_k = best(raw[name], args.repeats)
        print(f"{name:<18}{t_torch * 1e3:>9.1f}{t_nat * 1e3:>10.1f}{t_one * 1e3:>9.1f}{t_torch / t_nat:>8.1f}x"
              f"{t_k * 1e3:>10.1f}{gb / t_k:>6.1f}{t_copy / t_k:>8.0%}")


if __name__ == "__main__":
    main()
