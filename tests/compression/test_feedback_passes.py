"""The training feedback's passes over memory (spark_dl/compression/training.py): what is compressed
is written into memory kept per tensor on the CPU, the native one-pass kernels give the torch
path's bits, and no result handed back is overwritten by a later reduction. Real Gloo ranks."""
from __future__ import annotations

import pickle

import pytest
import torch

from spark_dl import HorovodRunner, protocol
from spark_dl.compression.training import TrainingFeedback


def steps(fb: TrainingFeedback, n: int) -> list[torch.Tensor]:
    """What ``fb`` hands on for 7 compressed reductions of one tensor, each with an error of its own;
    the 5th one's sum is not finite (a step a GradScaler skips)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in range(7):
        x = fb.before(torch.randn(n, generator=gen), "w")
        r = x + 0.01 * torch.randn(n, generator=gen) if t != 4 else torch.full((n,), float("inf"))
        out.append(fb.after(r, "w", compressed=True).clone())
    return out


@pytest.mark.parametrize("n", [4, 1_000_003])
@pytest.mark.parametrize("kind", ["momentum", "adam", "adam with the first moment"])
def test_the_kernels_hand_on_the_torch_paths_bits(kind, n, monkeypatch):
    def feedback() -> TrainingFeedback:
        fb = TrainingFeedback(first_moment=kind.endswith("moment"))
        fb.observe(lr=0.1, momentum=0.9 if kind == "momentum" else 0.0, beta2=0.999, beta1=0.9)
        if kind != "momentum":  # d measured on uncompressed reductions, then held
            gen = torch.Generator().manual_seed(1)
            while fb.warming("w"):
                g = torch.randn(n, generator=gen)
                fb.before(g, "w")
                fb.after(g, "w")
        return fb

    native = steps(feedback(), n)
    monkeypatch.setenv(protocol.NATIVE_ENV, "0")
    plain = steps(feedback(), n)
    assert all(torch.equal(a, b) for a, b in zip(native, plain, strict=True))
    assert not torch.isfinite(native[4]).any()  # the skipped step goes on as reduced (times d)


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_what_is_compressed_lives_in_memory_kept_per_tensor_on_the_cpu(kind):
    fb = TrainingFeedback(first_moment=True)
    fb.observe(lr=0.1, momentum=0.9 if kind == "momentum" else 0.0, beta2=0.999, beta1=0.9)
    g = torch.arange(6.0).reshape(2, 3)
    fb.before(g, "w")
    fb.after(g.clone(), "w")  # the first velocity, or the second moment's first reduction
    while fb.warming("w"):
        fb.before(g, "w")
        fb.after(g.clone(), "w")
    first = fb.before(g, "w")
    fb.after(first.clone(), "w", compressed=True)
    second = fb.before(g, "w")
    assert second.data_ptr() == first.data_ptr() == fb.scratch["w"].data_ptr()
    assert second.shape == g.shape and second.dtype == torch.float32
    back = pickle.loads(pickle.dumps(fb))
    assert back.scratch == {} and torch.equal(back.reduced["w"], fb.reduced["w"])
    fb.reset("w")
    assert fb.scratch == {}


def results_main(native_on: bool) -> list[list[float]]:
    """7 averaged reductions of two tensors per compressor, under momentum SGD and under Adam: every
    result as it was handed back, read again after the last reduction."""
    import os

    import torch

    import spark_dl
    import spark_dl.compression as C
    from spark_dl import protocol

    spark_dl.init()
    if not native_on:
        os.environ[protocol.NATIVE_ENV] = "0"
    rank = spark_dl.get_context().rank
    makes = [C.OneBit, C.EFSign, lambda: C.ErrorFeedback(C.TopK()), lambda: C.ErrorFeedback(C.RandomK(0.5))]
    kept, copies = [], []
    for make in makes:
        for opt in ("momentum", "adam"):
            c = make()
            p = torch.zeros(3000, requires_grad=True)
            c.observe_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9) if opt == "momentum"
                                else torch.optim.Adam([p], lr=0.01))
            gen = torch.Generator().manual_seed(rank)
            for step in range(7):
                for name, n in (("a", 3000), ("b", 777)):
                    r = C.allreduce(torch.randn(n, generator=gen), c, name=name)
                    kept.append(r)
                    copies.append(r.clone())
    assert all(torch.equal(r, c) for r, c in zip(kept, copies))  # none overwritten since
    return [r.tolist()[:50] for r in kept]


def test_reductions_on_real_ranks_keep_their_results_and_the_torch_paths_bits():
    native, plain = (HorovodRunner(np=-2).run_all(results_main, native_on=on) for on in (True, False))
    assert native[0] == native[1] == plain[0] == plain[1]
    assert len(native[0]) == 4 * 2 * 7 * 2
