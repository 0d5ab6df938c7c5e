"""``hvd.SyncBatchNorm`` on two real ranks (Gloo, CPU) against ``torch.nn.BatchNorm2d`` on the
concatenated batch: outputs, input and parameter gradients, running statistics."""
from __future__ import annotations

import pytest
import torch

from spark_dl import HorovodRunner

SPLIT = 5  # rank 0 holds the first 5 samples, rank 1 the other 3: uneven on purpose


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 4, 4, generator=gen) * 2 + 1
    upstream = torch.randn(8, 3, 4, 4, generator=gen)  # d loss / d output
    return x, upstream


def init(bn):
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    return bn


def sbn_main():
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    r = hvd.rank()
    x, upstream = data()
    rows = slice(0, SPLIT) if r == 0 else slice(SPLIT, 8)
    bn = init(hvd.SyncBatchNorm(3, momentum=0.1))
    out = {}
    for step in range(2):  # two steps: the running statistics move twice
        xin = x[rows].clone().requires_grad_()
        bn.zero_grad()
        y = bn(xin)
        (y * upstream[rows]).sum().backward()
    out.update(y=y.detach(), xgrad=xin.grad, wgrad=bn.weight.grad.clone(), bgrad=bn.bias.grad.clone(),
               running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone(),
               batches=int(bn.num_batches_tracked))
    bn.eval()
    out["eval"] = bn(x[rows]).detach()
    bn.train()
    errors = []
    for bad in (torch.randn(4, 2, 3), torch.randn(3)):  # both ranks alike: no collective is issued
        try:
            bn(bad)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(sbn_main)


def reference():
    x, upstream = data()
    bn = init(torch.nn.BatchNorm2d(3, momentum=0.1))
    for _ in range(2):
        xin = x.clone().requires_grad_()
        bn.zero_grad()
        y = bn(xin)
        (y * upstream).sum().backward()
    bn.eval()
    return bn, y.detach(), xin.grad, bn(x).detach()


def test_outputs_and_input_gradients_are_those_of_the_whole_batch(ranks):
    _, y, xgrad, _ = reference()
    for r, rows in ((0, slice(0, SPLIT)), (1, slice(SPLIT, 8))):
        assert torch.allclose(ranks[r]["y"], y[rows], atol=1e-5)
        assert torch.allclose(ranks[r]["xgrad"], xgrad[rows], atol=1e-5)


def test_parameter_gradients_sum_to_the_whole_batch_and_running_stats_match(ranks):
    bn, _, _, evaluated = reference()
    assert torch.allclose(ranks[0]["wgrad"] + ranks[1]["wgrad"], bn.weight.grad, atol=1e-4)
    assert torch.allclose(ranks[0]["bgrad"] + ranks[1]["bgrad"], bn.bias.grad, atol=1e-4)
    for o in ranks:
        assert torch.allclose(o["running_mean"], bn.running_mean, atol=1e-6)
        assert torch.allclose(o["running_var"], bn.running_var, atol=1e-5)  # unbiased, as torch keeps it
        assert o["batches"] == 2
    assert torch.allclose(ranks[0]["eval"], evaluated[:SPLIT], atol=1e-5)
    assert torch.allclose(ranks[1]["eval"], evaluated[SPLIT:], atol=1e-5)


def test_bad_inputs_are_clear_errors(ranks):
    errors = ranks[0]["errors"]
    assert "SyncBatchNorm(3) got 2 channels" in errors[0]
    assert "at least 2 dimensions" in errors[1]
