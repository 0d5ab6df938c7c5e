"""Adasum: the combination rule's algebra on one process, then ``op=hvd.Adasum`` on 3 and 4 real
ranks (Gloo; 3 exercises the fold of a world that is not a power of two), against the tree
computed on one process from every rank's input."""
from __future__ import annotations

import pytest
import torch
from spark_dl.horovod.adasum import combine, reference

from spark_dl import HorovodRunner


def test_orthogonal_vectors_add_up_and_equal_ones_count_once():
    a, b = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, -2.0, 5.0])
    assert torch.equal(combine(a, b), a + b)
    assert torch.equal(combine(a, a), a)
    assert torch.equal(combine(a, -a), torch.zeros(3))


def test_parallel_vectors_give_their_average():
    # b = k a: (1 - k/2) a + (1 - 1/2k) k a = (1 + k)/2 a, the mean of a and b
    g = torch.randn(1000, dtype=torch.float64)
    for k in (0.5, 2.0, 7.0):
        assert torch.allclose(combine(g, k * g), (g + k * g) / 2)


def test_matches_the_formula_and_is_symmetric_bit_for_bit():
    torch.manual_seed(0)
    a, b = torch.randn(4097), torch.randn(4097)
    ad, bd = a.double(), b.double()
    dot = ad @ bd
    want = (1 - dot / (2 * ad @ ad)) * ad + (1 - dot / (2 * bd @ bd)) * bd
    assert torch.allclose(combine(a, b).double(), want, atol=1e-6)
    # both partners of an exchange compute the combination; they must agree exactly
    assert torch.equal(combine(a, b), combine(b, a))


def test_zero_vector_takes_coefficient_one():
    b = torch.tensor([1.0, 2.0])
    assert torch.equal(combine(torch.zeros(2), b), b)
    assert torch.equal(combine(torch.zeros(2), torch.zeros(2)), torch.zeros(2))


def test_each_segment_gets_its_own_coefficients():
    a = torch.tensor([1.0, 0.0, 4.0, 4.0])
    b = torch.tensor([0.0, 1.0, 4.0, 4.0])  # segment 1 orthogonal, segment 2 equal
    assert combine(a, b, [2, 2]).tolist() == [1.0, 1.0, 4.0, 4.0]
    assert combine(a, b).tolist() != [1.0, 1.0, 4.0, 4.0]  # one coefficient for the whole vector differs
    with pytest.raises(ValueError, match="add up to 3"):
        combine(a, b, [1, 2])


def test_half_precision_is_combined_in_float32_and_returned_in_its_dtype():
    a, b = torch.tensor([1.0, 0.0], dtype=torch.bfloat16), torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    out = combine(a, b)
    assert out.dtype == torch.bfloat16 and out.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("world", range(1, 8))
def test_tree_of_mutually_orthogonal_or_identical_vectors(world):
    eye = torch.eye(8)
    assert torch.equal(reference([eye[i] * (i + 1) for i in range(world)]), sum(eye[i] * (i + 1) for i in range(world)))
    g = torch.randn(16)
    assert torch.allclose(reference([g] * world), g)


def adasum_main(steps=60):
    import spark_dl.horovod as hvd
    import torch
    from spark_dl.horovod.adasum import reference

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r}
    gen = torch.Generator().manual_seed(100 + r)
    g = torch.randn(1001, generator=gen)
    every = hvd.allgather(g.unsqueeze(0))  # every rank's input, to compute the tree here
    out["allreduce"] = hvd.allreduce(g, op=hvd.Adasum)
    out["reference"] = reference(list(every))
    out["scaled"] = hvd.allreduce(g, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
    inplace = g.clone().view(7, 143)
    out["inplace_is_same_object"] = hvd.allreduce_(inplace, op=hvd.Adasum) is inplace
    out["inplace"] = inplace.view(-1)
    out["async"] = hvd.synchronize(hvd.allreduce_async(g, op=hvd.Adasum))
    out["orthogonal"] = hvd.allreduce(torch.eye(n)[r] * (r + 1), op=hvd.Adasum).tolist()
    same = torch.arange(5.0)
    out["identical"] = hvd.allreduce(same, op=hvd.Adasum).tolist()
    # one fused call, two tensors: each must get its own coefficients
    a, b = hvd.grouped_allreduce([same.clone(), torch.eye(n)[r]], op=hvd.Adasum)
    out["grouped"] = (a.tolist(), b.tolist())
    for label, call in [("int", lambda: hvd.allreduce(torch.tensor([1, 2]), op=hvd.Adasum)),
                        ("fp16", lambda: hvd.allreduce(g, op=hvd.Adasum, compression=hvd.Compression.fp16)),
                        ("reducescatter", lambda: hvd.reducescatter(g, op=hvd.Adasum))]:
        try:
            call()
        except ValueError as e:
            out[f"error_{label}"] = str(e)

    # DistributedOptimizer(op=Adasum): one step is "local SGD step, Adasum of the updates"
    w0 = torch.linspace(-1, 1, 6)
    w = torch.nn.Parameter(w0.clone())
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), op=hvd.Adasum)
    x = torch.randn(6, generator=gen)
    ((w * x).sum() ** 2).backward()
    local_update = -0.1 * w.grad.clone()
    opt.step()
    updates = hvd.allgather(local_update.unsqueeze(0))
    out["opt_step"] = (w.detach() - w0, reference(list(updates)))
    out["is_sgd"] = isinstance(opt, torch.optim.SGD)

    # least squares, each rank with its own rows of one consistent system: Adasum reaches the solution
    true_w = torch.tensor([2.0, -1.0, 0.5])
    X = torch.randn(64, 3, generator=torch.Generator().manual_seed(7)) + r
    Y = X @ true_w
    model = torch.nn.Linear(3, 1, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X).squeeze(1), Y).backward()
        opt.synchronize()  # Horovod-style code keeps working; nothing to wait for
        with opt.skip_synchronize():
            opt.step()
    out["fit"] = model.weight.detach().view(-1)
    return out


@pytest.fixture(scope="module", params=[3, 4], ids=["3-ranks", "4-ranks"])
def ranks(request):
    return HorovodRunner(np=-request.param).run_all(adasum_main)


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
def test_allreduce_is_the_tree_of_every_ranks_input(ranks):
    for o in ranks:
        assert torch.equal(o["allreduce"], o["reference"])
        # every rank ends with exactly the same tensor
        assert torch.equal(o["allreduce"], ranks[0]["allreduce"])
        assert torch.allclose(o["scaled"], 0.5 * o["reference"])
        assert o["inplace_is_same_object"] and torch.equal(o["inplace"], o["reference"])
        assert torch.equal(o["async"], o["reference"])


def test_orthogonal_inputs_sum_and_identical_ones_do_not_grow(ranks):
    n = len(ranks)
    for o in ranks:
        assert o["orthogonal"] == [float(i + 1) for i in range(n)]
        assert o["identical"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert o["grouped"] == ([0.0, 1.0, 2.0, 3.0, 4.0], [1.0] * n)


def test_unsupported_uses_are_clear_errors(ranks):
    for o in ranks:
        assert "floating-point" in o["error_int"] and "hvd.Sum" in o["error_int"]
        assert "Compression.none" in o["error_fp16"]
        assert "Adasum" in o["error_reducescatter"]


def test_optimizer_combines_the_ranks_local_updates(ranks):
    for o in ranks:
        got, want = o["opt_step"]
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.equal(got, ranks[0]["opt_step"][0])
        assert o["is_sgd"] is True


def test_optimizer_converges_and_ranks_agree(ranks):
    for o in ranks:
        assert torch.allclose(o["fit"], torch.tensor([2.0, -1.0, 0.5]), atol=1e-3)
        assert torch.equal(o["fit"], ranks[0]["fit"])
