"""Weight decay is not scaled with the loss (Goyal et al. §3, remark 1).

k workers each hold n examples. The reference is one worker taking the whole kn batch with
l(x, w) = lambda/2 ||w||^2 + eps(x, w), whose summed-loss gradient is sum_x grad eps + lambda w.
Gradients here are combined by summing over workers, as an all-reduce with op=Sum does.
"""
from __future__ import annotations

import torch

K, N, LAMBDA, LR = 4, 8, 0.05, 0.1


def setup():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, dtype=torch.float64, generator=g)
    x = torch.randn(K, N, 3, dtype=torch.float64, generator=g)
    y = torch.randn(K, N, dtype=torch.float64, generator=g)
    return w, x, y


def data_loss(w, x, y):
    return ((x @ w - y) ** 2).sum()


def grad_of(loss_fn, w):
    w = w.clone().requires_grad_(True)
    loss_fn(w).backward()
    return w.grad


def test_l2_in_a_summed_loss_is_k_fold_while_optimizer_weight_decay_is_exact():
    w, x, y = setup()
    reference = grad_of(lambda v: data_loss(v, x.reshape(-1, 3), y.reshape(-1)) + LAMBDA / 2 * v @ v, w)
    data_sum = sum(grad_of(lambda v: data_loss(v, x[j], y[j]), w) for j in range(K))

    # Wrong: each worker puts the L2 term in its loss; the all-reduce sums it k times.
    l2_in_loss = sum(grad_of(lambda v: data_loss(v, x[j], y[j]) + LAMBDA / 2 * v @ v, w) for j in range(K))
    torch.testing.assert_close(l2_in_loss - data_sum, K * LAMBDA * w)
    assert (l2_in_loss - reference).norm() > 0.1

    # Right: reduce the data gradient, then the optimizer adds lambda * w once.
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([p], lr=LR, weight_decay=LAMBDA)
    p.grad = data_sum
    opt.step()
    torch.testing.assert_close(p.detach(), w - LR * reference)


def test_averaging_does_not_scale_it_but_rescaling_the_loss_does():
    w, x, y = setup()
    mean_reference = grad_of(lambda v: data_loss(v, x.reshape(-1, 3), y.reshape(-1)) / (K * N) + LAMBDA / 2 * v @ v, w)
    # With per-worker mean losses and an averaging all-reduce, an L2 term comes out once...
    averaged = sum(grad_of(lambda v: data_loss(v, x[j], y[j]) / N + LAMBDA / 2 * v @ v, w) for j in range(K)) / K
    torch.testing.assert_close(averaged, mean_reference)
    # ...but any loss scaling (e.g. a summed rather than averaged loss, or a static loss scale
    # of s standing in for an lr change) scales the L2 term with it: scaling the loss is not
    # scaling the lr.
    s = 8.0
    scaled = grad_of(lambda v: s * (data_loss(v, x[0], y[0]) / N + LAMBDA / 2 * v @ v), w)
    unscaled_data = grad_of(lambda v: data_loss(v, x[0], y[0]) / N, w)
    torch.testing.assert_close(scaled - s * unscaled_data, s * LAMBDA * w)
