"""Ray Train's PyTorch Lightning helpers (``ray.train.lightning``) for ``TorchTrainer`` loops.

``from spark_dl.ray_train.lightning import RayDDPStrategy, RayLightningEnvironment,
RayTrainReportCallback, prepare_trainer``: a Lightning ``Trainer`` inside ``train_loop_per_worker``
trains with DDP over the run's ranks, and every epoch's metrics and checkpoint are reported, so a
restarted run resumes with ``trainer.fit(model, ckpt_path=...)`` from ``get_checkpoint()``.

These are built on ``lightning.pytorch`` (``import lightning as L``), or on ``pytorch_lightning``
where only that is installed, as Ray's are. Lightning refuses to mix the two packages' objects, so
code written with ``import pytorch_lightning as pl`` on a machine that has both imports the same
names from :mod:`spark_dl.ray_train.pytorch_lightning`, built on that package.
"""
from __future__ import annotations

from spark_dl.compat.lightning_import import lightning_module
from spark_dl.compat.ray_train.lightning_helpers import build

_USER = "spark_dl.ray_train.lightning"
RayLightningEnvironment, RayDDPStrategy, RayTrainReportCallback, prepare_trainer = build(
    lightning_module(_USER), __name__)

__all__ = ["RayDDPStrategy", "RayLightningEnvironment", "RayTrainReportCallback", "prepare_trainer"]
