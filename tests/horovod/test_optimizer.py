"""``hvd.DistributedOptimizer`` on two real ranks: the maths of every option, checked numerically.

Each rank computes its expected values itself from the shared data (a reference model trained on
the concatenated global batch), so one launch checks everything.
"""
from __future__ import annotations

import pytest
import torch
from spark_dl.horovod.fusion import fusion_threshold, plan_buckets, plan_groups

from spark_dl import HorovodRunner


def optimizer_main():
    import copy
    import os
    import time
    import warnings

    import spark_dl.horovod as hvd
    import torch
    import torch.nn.functional as F

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    X, Y = torch.randn(16, 3), torch.randn(16, 1)  # identical on both ranks
    out = {}

    def fresh():
        m = torch.nn.Linear(3, 1)
        with torch.no_grad():
            m.weight.copy_(torch.tensor([[0.1, -0.2, 0.3]]))
            m.bias.fill_(0.05)
        return m

    def params(m):
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    # backward_passes_per_step=2 on 2 ranks x 2 micro-batches of 2 == one step on the 8-row batch.
    model, ref = fresh(), fresh()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(2):
        rows = X[8 * s + 4 * r: 8 * s + 4 * r + 4], Y[8 * s + 4 * r: 8 * s + 4 * r + 4]
        for micro in range(2):
            x, y = rows[0][2 * micro: 2 * micro + 2], rows[1][2 * micro: 2 * micro + 2]
            (F.mse_loss(model(x), y) / 2).backward()  # Horovod's convention: scale the loss by 1/k
            if s == 0 and micro == 0:
                out["grad_after_first_pass"] = model.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        F.mse_loss(ref(X[8 * s: 8 * s + 8]), Y[8 * s: 8 * s + 8]).backward()
        ref_opt.step()
    out["accumulation_matches_big_batch"] = torch.allclose(params(model), params(ref), atol=1e-6)
    out["accumulation_params"] = params(model)

    # synchronize(); clip; step() under skip_synchronize() == clipping the global gradient.
    model, ref = fresh(), fresh()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(model(X[4 * r: 4 * r + 4]), Y[4 * r: 4 * r + 4]).backward()
    opt.synchronize()
    out["norm_before_clip"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    out["skip_synchronize_warnings"] = len(caught)
    F.mse_loss(ref(X[:8]), Y[:8]).backward()
    out["ref_norm"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
    ref_opt.step()
    out["clip_matches"] = torch.allclose(params(model), params(ref), atol=1e-6)
    opt.zero_grad()
    F.mse_loss(model(X[:2]), Y[:2]).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # without skip_synchronize(): Horovod warns, so do we
    out["step_after_synchronize_warns"] = any("skip_synchronize" in str(w.message) for w in caught)

    # op and gradient_predivide_factor: rank r's gradient is r + 1 everywhere.
    for label, kwargs in [("average", {}), ("sum", {"op": hvd.Sum}),
                          ("predivide4", {"gradient_predivide_factor": 4.0}), ("adasum", {"op": hvd.Adasum})]:
        w = torch.nn.Parameter(torch.zeros(3))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), **kwargs)
        (w * (r + 1)).sum().backward()
        opt.step()
        out[f"op_{label}"] = w.detach().tolist()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), op=hvd.Sum, gradient_predivide_factor=2.0)
    except ValueError as e:
        out["predivide_with_sum"] = str(e)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), op=hvd.Adasum, compression=hvd.Compression.fp16)
    except ValueError as e:
        out["adasum_compressed"] = str(e)

    # Parameters without gradients on one rank, and backward order that differs between ranks,
    # with one bucket per tensor, tiny buckets, the default single bucket, and Horovod's explicit
    # groups (a number of them, or lists of parameters).
    for threshold in ("0", "64", None, "groups=2", "groups=lists"):
        if threshold is None or threshold.startswith("groups"):
            os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        else:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = threshold
        torch.manual_seed(1)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(3, 2),
                                     "c": torch.nn.Linear(3, 5)})

        def loss_of(m, rank, x):
            if rank == 0:
                return m["a"](x).sum() + m["b"](x).pow(2).sum()  # "c" unused on rank 0
            return m["c"](x).sum() + m["b"](x).pow(2).sum() + m["a"](x).sum()

        reference = copy.deepcopy(model)
        expected = [torch.zeros_like(p) for p in reference.parameters()]
        for k in range(2):
            grads = torch.autograd.grad(loss_of(reference, k, X[4 * k: 4 * k + 4]), list(reference.parameters()),
                                        allow_unused=True)
            for e, g in zip(expected, grads):
                if g is not None:
                    e.add_(g / 2)
        # lr=0 keeps the weights, so both steps must produce the same expected gradients.
        groups = {"groups=2": 2, "groups=lists": [[model["a"].weight, model["c"].bias], [model["b"].weight]]}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), groups=groups.get(threshold))
        out[f"buckets_{threshold}"] = len(opt._hvd_buckets)
        ok = []
        for _ in range(2):  # twice: the second step must start from a clean state
            opt.zero_grad()
            loss_of(model, r, X[4 * r: 4 * r + 4]).backward()
            opt.synchronize()
            ok += [torch.allclose(p.grad, e, atol=1e-5) for p, e in zip(model.parameters(), expected)]
            with opt.skip_synchronize():
                opt.step()
        out[f"unused_ok_{threshold}"] = all(ok)
    os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)

    # Overlap: the last layer's bucket is reduced while backward is still inside an earlier layer.
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    torch.manual_seed(2)
    first, last = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
    expected = sum(torch.autograd.grad(last(first(X[4 * k: 4 * k + 4])).sum(), last.weight)[0] for k in range(2)) / 2
    seen_during_backward = {}

    class WaitForLastLayer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if torch.allclose(last.weight.grad, expected, atol=1e-5):
                    seen_during_backward["reduced"] = True
                    break
                time.sleep(0.005)
            return grad

    opt = hvd.DistributedOptimizer(torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1))
    hvd.barrier()
    last(WaitForLastLayer.apply(first(X[4 * r: 4 * r + 4]))).sum().backward()
    opt.step()
    out["reduced_during_backward"] = seen_during_backward.get("reduced", False)
    os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)

    # A subclass of the wrapped optimizer: isinstance, LR schedulers, state_dict round trip.
    model = fresh()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    out["isinstance_sgd"] = isinstance(opt, torch.optim.SGD)
    out["class_name"] = type(opt).__name__
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(X[4 * r: 4 * r + 4]), Y[4 * r: 4 * r + 4]).backward()
        opt.step()
        sched.step()
    out["lr_after_two_epochs"] = opt.param_groups[0]["lr"]
    opt.load_state_dict(opt.state_dict())
    out["momentum_kept"] = "momentum_buffer" in opt.state[model.weight]

    # Misuse is reported, as in Horovod.
    F.mse_loss(model(X[:4]), Y[:4]).backward()
    try:
        opt.zero_grad()
    except AssertionError as e:
        out["zero_grad_mid_step"] = str(e)
    opt.step()
    opt.zero_grad()
    F.mse_loss(model(X[:4]), Y[:4]).backward()
    try:
        F.mse_loss(model(X[:4]), Y[:4]).backward()
    except AssertionError as e:
        out["too_many_passes"] = str(e)
    opt.step()
    out["final_params"] = params(model)

    # Sparse gradients (nn.Embedding(sparse=True)): made dense with sparse_as_dense=True.
    rows = torch.tensor([r, 2 + r])  # rank 0 looks up rows 0 and 2, rank 1 rows 1 and 3
    emb = torch.nn.Embedding(6, 2, sparse=True)
    torch.nn.init.constant_(emb.weight, 1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), sparse_as_dense=True)
    emb(rows).sum().backward()
    opt.step()
    out["sparse_as_dense"] = emb.weight.detach().clone()
    # Without sparse_as_dense they are reduced as sparse. In the first step rank 1 looks nothing up
    # (no gradient at all): the ranks agree that the weight is reduced as sparse anyway.
    emb = torch.nn.Embedding(6, 2, sparse=True)
    torch.nn.init.constant_(emb.weight, 1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   named_parameters=[("emb.weight", emb.weight)])
    steps = []
    for step in range(2):
        opt.zero_grad()
        if r == 0 or step == 1:
            emb(rows).sum().backward()
        opt.step()
        steps.append((emb.weight.detach().clone(), emb.weight.grad.is_sparse))
    out["sparse_steps"] = steps
    # SparseAdam takes sparse gradients only: the reduced gradient must still be one
    emb = torch.nn.Embedding(6, 2, sparse=True)
    torch.nn.init.constant_(emb.weight, 1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1))
    emb(rows).sum().backward()
    opt.step()
    out["sparse_adam"] = emb.weight.detach().clone()

    # Rebuilding the optimizer over the same parameters (a new trial, a new lr, Adasum after SGD):
    # the newest one reduces their gradients, the older ones are retired.
    w = torch.nn.Parameter(torch.zeros(2))
    steps, built = [], []
    for kwargs in ({}, {"op": hvd.Sum}, {"op": hvd.Adasum}, {}):
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), **kwargs)
        built.append(opt)
        before = w.detach().clone()
        for _ in range(2):
            opt.zero_grad()
            (w * (r + 1)).sum().backward()
            opt.step()
        steps.append((w.detach() - before).tolist())
    out["rebuilt_steps"] = steps
    for label, call in (("step", built[0].step), ("synchronize", built[1].synchronize), ("adasum", built[2].step)):
        try:
            call()
        except RuntimeError as e:
            out[f"retired_{label}"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(optimizer_main)


def test_backward_passes_per_step_equals_one_step_on_the_concatenated_batch(ranks):
    for o in ranks:
        assert o["accumulation_matches_big_batch"] is True
    assert torch.equal(ranks[0]["accumulation_params"], ranks[1]["accumulation_params"])
    # Nothing is reduced before the k-th backward: after the first pass each rank has its own grad.
    assert not torch.allclose(ranks[0]["grad_after_first_pass"], ranks[1]["grad_after_first_pass"])


def test_synchronize_then_clip_under_skip_synchronize(ranks):
    for o in ranks:
        assert o["clip_matches"] is True
        assert o["skip_synchronize_warnings"] == 0
        assert o["norm_before_clip"] == pytest.approx(o["ref_norm"], rel=1e-5)
        assert o["norm_before_clip"] > 0.05  # so clipping did something
        assert o["step_after_synchronize_warns"] is True


def test_sum_average_and_gradient_predivide_factor(ranks):
    for o in ranks:
        assert o["op_average"] == [-1.5, -1.5, -1.5]  # lr 1, mean of gradients 1 and 2
        assert o["op_sum"] == [-3.0, -3.0, -3.0]
        assert o["op_predivide4"] == [-1.5, -1.5, -1.5]  # same average, split as /4 then *4/size
        assert o["predivide_with_sum"] == "gradient_predivide_factor not supported with op != Average"
        # Adasum of parallel updates (-1 and -2 everywhere) is their average
        assert o["op_adasum"] == [-1.5, -1.5, -1.5]
        assert "Compression.none" in o["adasum_compressed"]


def test_parameters_without_gradients_and_any_bucket_size(ranks):
    for o in ranks:
        assert o["unused_ok_0"] is True
        assert o["unused_ok_64"] is True
        assert o["unused_ok_None"] is True
        assert o["unused_ok_groups=2"] is True and o["buckets_groups=2"] == 2
        # two listed groups, and the 3 parameters in none of them one bucket each
        assert o["unused_ok_groups=lists"] is True and o["buckets_groups=lists"] == 5


def test_reduction_overlaps_backward(ranks):
    for o in ranks:
        assert o["reduced_during_backward"] is True


def test_is_a_subclass_of_the_wrapped_optimizer(ranks):
    for o in ranks:
        assert o["isinstance_sgd"] is True and o["class_name"] == "SGD"
        assert o["lr_after_two_epochs"] == pytest.approx(0.025)
        assert o["momentum_kept"] is True


def test_misuse_is_reported_and_ranks_stay_in_lockstep(ranks):
    for o in ranks:
        assert "zero_grad()" in o["zero_grad_mid_step"]
        assert "backward_passes_per_step" in o["too_many_passes"]
    assert torch.equal(ranks[0]["final_params"], ranks[1]["final_params"])


def test_sparse_gradients_as_dense_or_as_sparse(ranks):
    # each looked-up row got gradient 1 on one rank and 0 on the other: an average of 0.5
    want = torch.ones(6, 2)
    want[:4] -= 0.5
    for o in ranks:
        assert torch.equal(o["sparse_as_dense"], want)
        (after_first, first_sparse), (after_second, second_sparse) = o["sparse_steps"]
        # step 1: rows 0 and 2 from rank 0 only, averaged over 2 ranks; step 2: rows 0-3 from one rank each
        assert after_first.tolist() == [[0.5] * 2, [1.0] * 2, [0.5] * 2, [1.0] * 2, [1.0] * 2, [1.0] * 2]
        assert after_second.tolist() == [[0.0] * 2, [0.5] * 2, [0.0] * 2, [0.5] * 2, [1.0] * 2, [1.0] * 2]
        assert first_sparse and second_sparse
        # Adam's first step moves every row with a gradient by about lr, the others not at all
        torch.testing.assert_close(o["sparse_adam"], torch.tensor([[0.9] * 2] * 4 + [[1.0] * 2] * 2))
    assert torch.equal(ranks[0]["sparse_adam"], ranks[1]["sparse_adam"])


def test_explicit_groups_as_horovod_defines_them():
    import warnings

    a, b, c, d = (torch.zeros(3) for _ in range(4))
    h = torch.zeros(3, dtype=torch.float16)
    assert plan_groups([a, b, c, d], 2) == [[d, c], [b, a]]
    assert plan_groups([a, b, c], 2) == [[c, b], [a]]
    assert plan_groups([a, b], 5) == [[b], [a]]  # no more groups than parameters
    assert plan_groups([a, b, c, d], [[a, c]]) == [[d], [c, a], [b]]  # unlisted ones alone, last first
    assert plan_groups([a, h, b], [[a, h, b]]) == [[b], [h], [a]]  # split where the dtype changes
    for bad, message in [(0, ">= 1"), ([[a, a]], "two of the groups"), ([[torch.zeros(1)]], "not a parameter"),
                         ([a], "list of lists"), ("2", "number of groups")]:
        with pytest.raises(ValueError, match=message):
            plan_groups([a, b], bad)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning, match="groups="):
            _num_groups_warns()


def _num_groups_warns():
    import spark_dl.horovod as hvd

    hvd.init()
    try:
        w = torch.nn.Parameter(torch.zeros(2))
        hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), num_groups=1)
    finally:
        hvd.shutdown()


def test_buckets_follow_reverse_registration_order_within_the_threshold():
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(10)  # 40 bytes each
    d = torch.zeros(10, dtype=torch.float64)
    assert plan_buckets([a, b, c], threshold=80) == [[c, b], [a]]
    assert plan_buckets([a, b, c], threshold=0) == [[c], [b], [a]]
    assert plan_buckets([a, d, b], threshold=1 << 20) == [[b], [d], [a]]  # one dtype per bucket
    assert plan_buckets([a], threshold=8) == [[a]]  # larger than the threshold: alone


@pytest.mark.parametrize("value", ["64MB", "-1", "1.5"])
def test_a_bad_fusion_threshold_is_named(monkeypatch, value):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", value)
    with pytest.raises(ValueError, match=rf"HOROVOD_FUSION_THRESHOLD='{value}' is not an integer >= 0 bytes.*"
                                         r"default, 67108864 bytes"):
        fusion_threshold()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    assert fusion_threshold() == 1024


def test_rebuilding_the_optimizer_retires_the_old_one(ranks):
    for o in ranks:
        # two steps each: Average of gradients 1 and 2, Sum, Adasum of parallel updates (= mean), Average
        assert o["rebuilt_steps"] == [[-3.0, -3.0], [-6.0, -6.0], [-3.0, -3.0], [-3.0, -3.0]]
        for label in ("step", "synchronize", "adasum"):
            assert "was replaced" in o[f"retired_{label}"] and "newest" in o[f"retired_{label}"]
