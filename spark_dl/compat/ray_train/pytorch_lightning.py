""":mod:`spark_dl.ray_train.lightning`'s helpers built on the ``pytorch_lightning`` package, for
code written with ``import pytorch_lightning as pl`` where ``lightning`` is installed too (Lightning
refuses a strategy or callback of the other package)."""
from __future__ import annotations

import importlib

from spark_dl.compat.ray_train.lightning_helpers import build

try:
    _pl = importlib.import_module("pytorch_lightning")
except ImportError:
    raise ImportError("spark_dl.ray_train.pytorch_lightning needs the pytorch_lightning package: "
                      "pip install pytorch-lightning (or use spark_dl.ray_train.lightning with "
                      "import lightning as L)") from None

RayLightningEnvironment, RayDDPStrategy, RayTrainReportCallback, prepare_trainer = build(_pl, __name__)

__all__ = ["RayDDPStrategy", "RayLightningEnvironment", "RayTrainReportCallback", "prepare_trainer"]
