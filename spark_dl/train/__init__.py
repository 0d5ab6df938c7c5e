"""The large-minibatch recipe: lr scaling, gradual warmup, momentum correction, LARS.

Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017) and You et al.,
"Large Batch Training of Convolutional Networks" (2017). Weight decay belongs in the optimizer
(``weight_decay=``), applied after gradients are averaged across ranks, not as an L2 term in the
loss; gradient accumulation is ``spark_dl.horovod.DistributedOptimizer(backward_passes_per_step=)``.
"""
from spark_dl.train.lars import LARS, lars_trust_ratio
from spark_dl.train.momentum import VFormSGD
from spark_dl.train.recipe import LargeBatchRecipe
from spark_dl.train.scaling import scale_lr
from spark_dl.train.schedule import LRSchedule, WarmupScheduler, lr_at

__all__ = [
    "scale_lr",
    "lr_at",
    "LRSchedule",
    "WarmupScheduler",
    "VFormSGD",
    "LARS",
    "lars_trust_ratio",
    "LargeBatchRecipe",
]
