"""The classes behind :mod:`spark_dl.ray_train.lightning` and :mod:`spark_dl.ray_train.pytorch_lightning`,
built on one Lightning package each (Lightning refuses a strategy or callback of the other one)."""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from types import ModuleType
from typing import Any, Callable

import torch

from spark_dl import get_device
from spark_dl.compat.ray_train.checkpoint import Checkpoint
from spark_dl.compat.ray_train.session import get_context, report
from spark_dl.rank.context import scratch_dir


def build(pl: ModuleType, module: str) -> tuple[type, type, type, Callable]:
    """``(RayLightningEnvironment, RayDDPStrategy, RayTrainReportCallback, prepare_trainer)`` on
    Lightning package ``pl``, named as attributes of ``module`` (so they pickle by reference)."""
    environments = importlib.import_module(f"{pl.__name__}.plugins.environments")
    strategies = importlib.import_module(f"{pl.__name__}.strategies")
    TorchElasticEnvironment = environments.TorchElasticEnvironment

    class RayLightningEnvironment(TorchElasticEnvironment):
        """The worker's rank, world and node from the variables the launcher sets (torchrun's). The
        launcher made the world, so the Trainer's ``devices``/``num_nodes`` need not multiply to it
        (``devices="auto"`` is one device per worker, as under Ray)."""

        def validate_settings(self, num_devices: int, num_nodes: int) -> None:
            pass

    class RayDDPStrategy(strategies.DDPStrategy):
        """DDP over the run's ranks, on each worker's own device (its GPU, or the CPU)."""

        @property
        def root_device(self) -> torch.device:
            return get_device()

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

    class RayTrainReportCallback(pl.Callback):
        """After every training epoch: ``report`` the trainer's logged metrics (plus ``epoch`` and
        ``step``) with a checkpoint holding ``checkpoint.ckpt`` (``trainer.save_checkpoint``)."""

        CHECKPOINT_NAME = "checkpoint.ckpt"

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            metrics = {k: v for k, v in trainer.callback_metrics.items()}
            metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
            directory = tempfile.mkdtemp(prefix="lightning-checkpoint-", dir=scratch_dir())
            try:
                trainer.save_checkpoint(os.path.join(directory, self.CHECKPOINT_NAME))  # rank 0 writes; all wait
                report(metrics, checkpoint=Checkpoint.from_directory(directory))
            finally:
                shutil.rmtree(directory, ignore_errors=True)

    def prepare_trainer(trainer: Any) -> Any:
        """Check that the trainer runs on the run's ranks (``RayDDPStrategy``, or a strategy whose
        cluster environment reads torchrun's variables); returns it."""
        if not isinstance(trainer, pl.Trainer):
            other = type(trainer).__module__.split(".")[0]
            hint = (f": it is {other}'s; import these helpers from spark_dl.ray_train."
                    f"{'pytorch_lightning' if other == 'pytorch_lightning' else 'lightning'} instead"
                    if other in ("lightning", "pytorch_lightning") else "")
            raise TypeError(f"prepare_trainer takes a {pl.__name__}.Trainer, got {type(trainer).__name__}{hint}")
        world = get_context().get_world_size()  # raises outside a TorchTrainer worker
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if world > 1 and (trainer.world_size != world or not isinstance(environment, TorchElasticEnvironment)):
            raise RuntimeError(
                f"the Trainer would train alone on each of the run's {world} workers "
                f"({type(trainer.strategy).__name__}, world size {trainer.world_size}): pass "
                "strategy=RayDDPStrategy() and plugins=[RayLightningEnvironment()]"
            )
        return trainer

    for item in (RayLightningEnvironment, RayDDPStrategy, RayTrainReportCallback, prepare_trainer):
        item.__module__ = module
        item.__qualname__ = item.__name__
    return RayLightningEnvironment, RayDDPStrategy, RayTrainReportCallback, prepare_trainer
