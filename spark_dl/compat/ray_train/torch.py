"""``ray.train.torch`` under its own name: ``from spark_dl.ray_train.torch import TorchTrainer,
prepare_model`` where Ray's code has ``from ray.train.torch import ...``."""
from __future__ import annotations

from spark_dl import get_device, prepare_data_loader, prepare_model
from spark_dl.compat.ray_train.config import TorchConfig
from spark_dl.compat.ray_train.trainer import TorchTrainer
from spark_dl.rank.prepare import enable_reproducibility, get_devices

__all__ = ["TorchConfig", "TorchTrainer", "enable_reproducibility", "get_device", "get_devices", "prepare_data_loader",
           "prepare_model"]
