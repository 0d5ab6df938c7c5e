"""LARS: layer-wise adaptive rate scaling (You, Gitman and Ginsburg 2017)."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from spark_dl.train.checks import CheckedGroups, flag, momentum_sgd, number


def lars_trust_ratio(weight: torch.Tensor, grad: torch.Tensor, trust_coefficient: float = 0.001,
                     weight_decay: float = 0.0, eps: float = 0.0) -> torch.Tensor:
    """You et al.'s local lr ``lambda_l = c * ||w_l|| / (||g_l|| + beta * ||w_l|| + eps)``.

    ``c`` is the trust coefficient and ``beta`` the weight decay. It is 1 where ``||w_l||`` or
    ``||g_l||`` is 0 (a freshly zeroed layer, or no gradient), where the ratio says nothing.
    Returned as a 0-d tensor on ``weight``'s device, so no host synchronisation is needed.
    """
    w_norm = torch.linalg.vector_norm(weight)
    g_norm = torch.linalg.vector_norm(grad)
    ratio = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
    return torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))


class LARS(CheckedGroups, torch.optim.Optimizer):
    """SGD with momentum whose per-layer step is scaled by the LARS trust ratio.

    For each parameter tensor ``w_l`` with gradient ``g_l`` (already averaged across ranks when
    wrapped by ``DistributedOptimizer``, so every rank computes the same ratio)::

        lambda_l = trust_coefficient * ||w_l|| / (||g_l|| + weight_decay * ||w_l|| + eps)
        u_l     <- momentum * u_l + lambda_l * (g_l + weight_decay * w_l)
        w_l     <- w_l - lr * u_l

    This is You et al.'s update in the u-form of :mod:`spark_dl.train.momentum`, so a scheduler
    may change ``lr`` without momentum correction. With ``exclude_bias_and_norm`` (default),
    parameters with ``ndim <= 1`` (biases, BatchNorm/LayerNorm weights and biases) take a plain
    momentum-SGD step, with neither trust ratio nor weight decay; set it per param group to
    choose other tensors.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-9, exclude_bias_and_norm: bool = True) -> None:
        defaults = _checked(dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                 trust_coefficient=trust_coefficient, eps=eps,
                                 exclude_bias_and_norm=exclude_bias_and_norm))
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
            m, wd = group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"LARS got a sparse gradient (a parameter of shape {tuple(p.shape)}, e.g. nn.Embedding("
                        "sparse=True)): its trust ratio scales each layer by its whole gradient's norm, so it needs "
                        "dense gradients; build the embedding with sparse=False, or give it an optimizer of its own")
                if group["exclude_bias_and_norm"] and p.ndim <= 1:
                    d = p.grad
                else:
                    ratio = lars_trust_ratio(p, p.grad, group["trust_coefficient"], wd, group["eps"])
                    d = p.grad.add(p, alpha=wd).mul_(ratio)
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = d.clone()
                else:
                    buf.mul_(m).add_(d)
                p.sub_(buf, alpha=float(group["lr"]))
        return loss


def _checked(group: dict[str, Any], where: str = "") -> dict[str, Any]:
    """LARS's hyperparameters in ``group``, checked; ``where`` names the param group, if any."""
    return dict(
        **momentum_sgd(group, where),
        trust_coefficient=number(group["trust_coefficient"], f"{where}trust_coefficient", low=0, low_open=True),
        eps=number(group["eps"], f"{where}eps", low=0),
        exclude_bias_and_norm=flag(group["exclude_bias_and_norm"], f"{where}exclude_bias_and_norm"),
    )
