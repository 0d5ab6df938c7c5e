"""Momentum correction (Goyal et al. 2017, §3): the velocity form of momentum SGD.

Momentum SGD has two textbook forms. The *u-form* (Goyal's eq. 9), which ``torch.optim.SGD``
implements (``dampening=0``, no Nesterov)::

    u_{t+1} = m u_t + g_t,          w_{t+1} = w_t - eta_{t+1} u_{t+1}

and the *v-form* (eq. 10, used by Caffe and others), from substituting ``v_t = eta_t u_t``::

    v_{t+1} = m v_t + eta_{t+1} g_t,  w_{t+1} = w_t - v_{t+1}

They agree while ``eta`` is constant. When it changes, the substitution gives
``eta_{t+1} u_{t+1} = m (eta_{t+1} / eta_t) v_t + eta_{t+1} g_t``: the v-form must multiply ``v_t``
by ``eta_{t+1} / eta_t`` ("momentum correction") or it keeps stepping with the old lr's velocity,
which matters most with the large lr jumps of the linear scaling rule and step decay.

``torch.optim.SGD`` needs no correction, since its buffer is ``u``: pair it with any scheduler.
:class:`VFormSGD` is the v-form with the correction, for code and checkpoints that carry ``v``.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from spark_dl.train.checks import CheckedGroups, flag, momentum_sgd


class VFormSGD(CheckedGroups, torch.optim.Optimizer):
    """Momentum SGD in velocity form, with Goyal et al.'s momentum correction.

    With ``d_t = g_t + weight_decay * w_t`` (decay added to the already averaged gradient)::

        v_{t+1} = m * (eta_{t+1} / eta_t) * v_t + eta_{t+1} * d_t
        w_{t+1} = w_t - v_{t+1}

    ``eta_t`` is the lr of the previous step of this parameter and ``eta_{t+1}`` the group's lr now,
    so any scheduler may change ``group["lr"]``. ``momentum_correction=False`` drops the ratio
    (the uncorrected v-form). After a step at lr 0 the velocity is 0 and restarts from ``eta d``:
    the v-form cannot hold a velocity through a zero lr.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 momentum_correction: bool = True) -> None:
        defaults = _checked(dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                 momentum_correction=momentum_correction))
        super().__init__(params, defaults)

    @staticmethod
    def _check_group(group: dict[str, Any], where: str = "") -> dict[str, Any]:
        return _checked(group, where)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            m, wd = group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                state = self.state[p]
                v = state.get("velocity")
                if v is None:
                    v = state["velocity"] = d.mul(lr)
                else:
                    prev = state["lr"]
                    ratio = (lr / prev if prev > 0 else 0.0) if group["momentum_correction"] else 1.0
                    v.mul_(m * ratio).add_(d, alpha=lr)
                state["lr"] = lr
                p.sub_(v)
        return loss


def _checked(group: dict[str, Any], where: str = "") -> dict[str, Any]:
    """VFormSGD's hyperparameters in ``group``, checked; ``where`` names the param group, if any."""
    return dict(
        **momentum_sgd(group, where),
        momentum_correction=flag(group["momentum_correction"], f"{where}momentum_correction"),
    )
