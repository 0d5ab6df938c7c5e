"""LARS (You et al. 2017): the trust ratio on known layers, exclusions, and its effect on the update."""
from __future__ import annotations

import pytest
import torch

from spark_dl.train import LARS, lars_trust_ratio


def test_trust_ratio_of_a_known_layer():
    w = torch.full((2, 2), 3.0)  # ||w|| = 6
    g = torch.full((2, 2), 0.5)  # ||g|| = 1
    # c * ||w|| / (||g|| + beta * ||w||) = 0.001 * 6 / (1 + 0.1 * 6)
    assert lars_trust_ratio(w, g, 0.001, weight_decay=0.1).item() == pytest.approx(0.00375, rel=1e-6)
    assert lars_trust_ratio(w, g, 0.02).item() == pytest.approx(0.12, rel=1e-6)


def test_trust_ratio_is_one_when_a_norm_is_zero():
    assert lars_trust_ratio(torch.zeros(3, 3), torch.ones(3, 3)).item() == 1.0
    assert lars_trust_ratio(torch.ones(3, 3), torch.zeros(3, 3)).item() == 1.0


def model_with_known_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    lin, bn = model[0], model[1]
    with torch.no_grad():
        lin.weight.fill_(3.0)
        lin.bias.fill_(1.0)
    lin.weight.grad = torch.full((2, 2), 0.5)
    lin.bias.grad = torch.tensor([0.2, -0.4])
    bn.weight.grad = torch.tensor([0.1, 0.3])
    bn.bias.grad = torch.tensor([-0.5, 0.5])
    return model


def test_lars_step_scales_weights_and_leaves_bias_and_norm_params_to_plain_sgd():
    model = model_with_known_values()
    lin, bn = model[0], model[1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    lr, wd = 2.0, 0.1
    opt = LARS(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd, trust_coefficient=0.001)
    opt.step()

    ratio = 0.00375
    want_w = before["0.weight"] - lr * ratio * (grads["0.weight"] + wd * before["0.weight"])
    torch.testing.assert_close(lin.weight.detach(), want_w)
    # ndim <= 1: no trust ratio and no weight decay
    torch.testing.assert_close(lin.bias.detach(), before["0.bias"] - lr * grads["0.bias"])
    torch.testing.assert_close(bn.weight.detach(), before["1.weight"] - lr * grads["1.weight"])
    torch.testing.assert_close(bn.bias.detach(), before["1.bias"] - lr * grads["1.bias"])

    # second step: u <- m u + lambda (g + beta w), with lambda recomputed at the new weights
    w1 = lin.weight.detach().clone()
    u1 = opt.state[lin.weight]["momentum_buffer"].clone()
    lin.weight.grad = torch.full((2, 2), 0.25)
    ratio2 = 0.001 * w1.norm() / (lin.weight.grad.norm() + wd * w1.norm())
    opt.step()
    torch.testing.assert_close(lin.weight.detach(), w1 - lr * (0.9 * u1 + ratio2 * (lin.weight.grad + wd * w1)))


def test_exclusion_can_be_turned_off_per_group():
    model = model_with_known_values()
    lin = model[0]
    b0, gb = lin.bias.detach().clone(), lin.bias.grad.clone()
    opt = LARS([{"params": [lin.weight]}, {"params": [lin.bias], "exclude_bias_and_norm": False}],
               lr=1.0, momentum=0.0, trust_coefficient=0.01)
    opt.step()
    ratio = 0.01 * b0.norm() / gb.norm()
    torch.testing.assert_close(lin.bias.detach(), b0 - ratio * gb)


def test_update_size_does_not_depend_on_gradient_size():
    # LARS's point: ||delta w_l|| = lr * c * ||w_l|| whatever the gradient's scale (no decay).
    def first_update(scale):
        torch.manual_seed(1)
        layer = torch.nn.Linear(8, 8, bias=False)
        w0 = layer.weight.detach().clone()
        layer.weight.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(2)) * scale
        LARS(layer.parameters(), lr=0.5, momentum=0.9, trust_coefficient=0.02).step()
        return layer.weight.detach() - w0, w0

    small, w0 = first_update(1e-4)
    large, _ = first_update(1e4)
    torch.testing.assert_close(small, large, rtol=1e-4, atol=1e-9)
    assert small.norm().item() == pytest.approx(0.5 * 0.02 * w0.norm().item(), rel=1e-5)


def test_refuses_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARS(p, lr=0.1, trust_coefficient=0.0)
    with pytest.raises(ValueError, match="momentum"):
        LARS(p, lr=0.1, momentum=1.0)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"lr": None}, TypeError, "lr must be a number >= 0, got None"),
    ({"lr": float("nan")}, ValueError, "lr must be a finite number >= 0, got nan"),
    ({"lr": 0.1, "weight_decay": "1e-4"}, TypeError, "weight_decay must be a number >= 0"),
    ({"lr": 0.1, "momentum": float("nan")}, ValueError, r"momentum must be a finite number in \[0, 1\)"),
])
def test_hyperparameters_of_the_wrong_kind_are_named(kwargs, error, match):
    from spark_dl.train import VFormSGD

    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    for optimizer in (LARS, VFormSGD):
        with pytest.raises(error, match=match):
            optimizer(p, **kwargs)


@pytest.mark.parametrize("optimizer, group, error, match", [
    ("LARS", {"lr": -1.0}, ValueError, r"param group 1: lr must be a finite number >= 0, got -1.0"),
    ("VFormSGD", {"lr": -1.0}, ValueError, r"param group 1: lr must be a finite number >= 0, got -1.0"),
    ("LARS", {"momentum": 2.0}, ValueError, r"param group 1: momentum must be a finite number in \[0, 1\), got 2.0"),
    ("VFormSGD", {"weight_decay": "1e-4"}, TypeError, "param group 1: weight_decay must be a number >= 0"),
    ("LARS", {"trust_coefficient": 0.0}, ValueError, "param group 1: trust_coefficient must be a finite number > 0"),
    ("LARS", {"exclude_bias_and_norm": "no"}, TypeError, "param group 1: exclude_bias_and_norm must be True or False"),
    ("VFormSGD", {"momentum_correction": None}, TypeError, "param group 1: momentum_correction must be True or False"),
])
def test_param_group_hyperparameters_are_checked_like_the_constructors(optimizer, group, error, match):
    import spark_dl.train

    optimizer = getattr(spark_dl.train, optimizer)
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(error, match=match):
        optimizer([{"params": [a]}, {"params": [b], **group}], lr=0.1)
    # and through add_param_group, as when unfreezing layers; the refused group is not added
    opt = optimizer([a], lr=0.1)
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": [b], **group})
    assert len(opt.param_groups) == 1


def test_flags_must_be_bools():
    from spark_dl.train import VFormSGD

    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(TypeError, match="exclude_bias_and_norm must be True or False, got 'no'"):
        LARS(p, lr=0.1, exclude_bias_and_norm="no")  # a non-empty str would count as True
    with pytest.raises(TypeError, match="momentum_correction must be True or False, got None"):
        VFormSGD(p, lr=0.1, momentum_correction=None)  # None would silently drop the correction


def test_a_sparse_gradient_is_refused_with_the_reason():
    emb = torch.nn.Embedding(4, 2, sparse=True)
    opt = LARS(emb.parameters(), lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match=r"LARS got a sparse gradient \(a parameter of shape \(4, 2\).*sparse=False"):
        opt.step()
