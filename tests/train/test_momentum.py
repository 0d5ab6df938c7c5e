"""Momentum correction (Goyal et al. §3): u-form vs v-form under learning-rate changes."""
from __future__ import annotations

import pytest
import torch

from spark_dl.train import LRSchedule, VFormSGD, WarmupScheduler

M = 0.9
# Warm up 0.1 -> 0.8 over 4 steps, then divide by 10 twice: every kind of lr change.
SCHEDULE = LRSchedule(peak_lr=0.8, warmup_steps=4, warmup_start_lr=0.1, decay="step", milestones=(8, 12))
STEPS = 16


def quadratic():
    """f(w) = 1/2 w'Aw - b'w: a gradient that depends on w, so trajectories feel every lr change."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 5, generator=g, dtype=torch.float64)
    a = q @ q.T / 5 + torch.eye(5, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64)
    w0 = torch.randn(5, generator=g, dtype=torch.float64)
    return a, b, w0


def run(make_optimizer, with_scheduler=True):
    """Weights after each step, plus each step's momentum state, for an optimizer on the quadratic."""
    a, b, w0 = quadratic()
    w = torch.nn.Parameter(w0.clone())
    opt = make_optimizer([w])
    sched = WarmupScheduler(opt, SCHEDULE) if with_scheduler else None
    ws, states = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        (0.5 * w @ a @ w - b @ w).backward()
        opt.step()
        if sched is not None:
            sched.step()
        ws.append(w.detach().clone())
        states.append({k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v)})
    return ws, states


def u_form_by_hand():
    """Goyal's eq. (9) written out: u <- m u + g(w); w <- w - eta_{t+1} u."""
    a, b, w = quadratic()
    u = torch.zeros_like(w)
    ws = []
    for t in range(STEPS):
        u = M * u + (a @ w - b)
        w = w - SCHEDULE(t) * u
        ws.append(w)
    return ws


def test_torch_sgd_is_the_u_form_so_needs_no_correction():
    sgd, _ = run(lambda p: torch.optim.SGD(p, lr=SCHEDULE.peak_lr, momentum=M))
    for got, want in zip(sgd, u_form_by_hand()):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_corrected_v_form_matches_u_form_and_uncorrected_does_not():
    sgd, sgd_state = run(lambda p: torch.optim.SGD(p, lr=SCHEDULE.peak_lr, momentum=M))
    corrected, v_state = run(lambda p: VFormSGD(p, lr=SCHEDULE.peak_lr, momentum=M))
    uncorrected, _ = run(lambda p: VFormSGD(p, lr=SCHEDULE.peak_lr, momentum=M, momentum_correction=False))

    for t in range(STEPS):
        torch.testing.assert_close(corrected[t], sgd[t], rtol=1e-12, atol=1e-12)
        # the substitution v_t = eta_t u_t holds at every step
        torch.testing.assert_close(v_state[t]["velocity"], SCHEDULE(t) * sgd_state[t]["momentum_buffer"],
                                   rtol=1e-12, atol=1e-12)

    # Step 0 has no velocity yet, so both v-forms agree with the u-form; from the first lr
    # change on, the uncorrected one moves with a velocity scaled for the old lr.
    torch.testing.assert_close(uncorrected[0], sgd[0], rtol=1e-12, atol=1e-12)
    gaps = [float((uncorrected[t] - sgd[t]).norm()) for t in range(STEPS)]
    assert gaps[1] > 1e-3 and max(gaps) > 1e-1, gaps


def test_forms_agree_while_the_lr_is_constant():
    sgd, _ = run(lambda p: torch.optim.SGD(p, lr=0.3, momentum=M), with_scheduler=False)
    uncorrected, _ = run(lambda p: VFormSGD(p, lr=0.3, momentum=M, momentum_correction=False), with_scheduler=False)
    for got, want in zip(uncorrected, sgd):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_one_corrected_step_by_hand():
    # eta 0.1 -> 0.01 (a step decay, the seed's example): v' = m * (0.01 / 0.1) * v + 0.01 * g
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = VFormSGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.tensor([2.0], dtype=torch.float64)
    opt.step()  # v = 0.1 * 2 = 0.2, w = 0.8
    opt.param_groups[0]["lr"] = 0.01
    w.grad = torch.tensor([3.0], dtype=torch.float64)
    opt.step()
    v = 0.9 * (0.01 / 0.1) * 0.2 + 0.01 * 3.0
    assert opt.state[w]["velocity"].item() == pytest.approx(v, rel=1e-15)
    assert w.item() == pytest.approx(0.8 - v, rel=1e-15)


def test_weight_decay_is_added_to_the_gradient_in_both_forms():
    sgd, _ = run(lambda p: torch.optim.SGD(p, lr=SCHEDULE.peak_lr, momentum=M, weight_decay=0.05))
    vform, _ = run(lambda p: VFormSGD(p, lr=SCHEDULE.peak_lr, momentum=M, weight_decay=0.05))
    for got, want in zip(vform, sgd):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_v_form_restarts_its_velocity_after_a_zero_lr():
    # Warmup from 0: v = 0 * g at step 0 carries nothing, so step 1 starts afresh (no 0/0).
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = VFormSGD([w], lr=0.0, momentum=0.9)
    w.grad = torch.tensor([2.0], dtype=torch.float64)
    opt.step()
    opt.param_groups[0]["lr"] = 0.1
    w.grad = torch.tensor([3.0], dtype=torch.float64)
    opt.step()
    assert opt.state[w]["velocity"].item() == pytest.approx(0.3, rel=1e-15)
    assert w.item() == pytest.approx(0.7, rel=1e-15)
