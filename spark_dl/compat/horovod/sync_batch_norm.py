"""``hvd.SyncBatchNorm``: batch normalization over the global batch of all ranks.

In training, each rank normalizes with the mean and variance of every rank's batch together, so a
small per-rank batch normalizes as the whole batch would. Two differentiable all-reduces per call
(per-channel sums and the count, then the sums of squared deviations from the global mean), on
CPU (Gloo) and GPU alike; ``torch.nn.SyncBatchNorm`` runs on accelerators only. Gradients flow
back through the same all-reduces, so they are those of the global batch. In eval mode, or with a
single rank, it is a plain ``BatchNorm``.
"""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from spark_dl.compat.horovod.basics import is_initialized, size
from spark_dl.compat.horovod.ops import sum_unchecked


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (``(N, C, ...)`` input) whose training-mode
    statistics span all ranks. Same arguments as ``torch.nn.BatchNorm2d``. Every rank must call
    it the same number of times, in the same order (its all-reduces are collectives)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an (N, C, ...) input of at least 2 dimensions, "
                             f"got {input.dim()}")
        if input.size(1) != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got {input.size(1)} channels")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and is_initialized() and size() > 1):
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as in torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.tensor([x.numel() // x.size(1)], dtype=x.dtype, device=x.device)
        sums = sum_unchecked(torch.cat([x.sum(dims), count]))
        total = sums[-1]
        if not x.is_cuda and float(total) < 2:  # (on a GPU the check would cost a sync per layer)
            raise ValueError(f"SyncBatchNorm needs more than one value per channel across all ranks, "
                             f"got {int(total)} (input shape {tuple(input.shape)} on this rank)")
        mean = sums[:-1] / total
        centered = x - mean.view(shape)
        var = sum_unchecked((centered * centered).sum(dims)) / total  # biased, as normalization uses
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                unbiased = var.detach() * (total / (total - 1).clamp_min(1))
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return out.to(input.dtype)

