"""Ray Train's ``TorchTrainer`` on :class:`spark_dl.TorchDistributor`: ``fit()`` runs
``train_loop_per_worker`` on every rank (:class:`~spark_dl.ray_train.loop.TrainLoop`), the driver's
:class:`~spark_dl.ray_train.keeper.CheckpointKeeper` keeps the reported checkpoints in
``storage_path/name``, and ``TorchTrainer.restore`` goes on with a run from its latest one."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import time
import uuid
from typing import Any, Callable, Mapping

from spark_dl import JobFailed, LaunchRefused, TorchDistributor, Tracking
from spark_dl.compat.ray_train.checkpoint import Checkpoint, Result
from spark_dl.compat.ray_train.config import (
    CheckpointConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    check_torch_config,
    local_path,
    run_config_refusal,
)
from spark_dl.compat.ray_train.keeper import CheckpointKeeper
from spark_dl.compat.ray_train.loop import TrainLoop
from spark_dl.compat.ray_train.record import checkpoint_indices, latest_kept, read_record
from spark_dl.compat.ray_train.resume import Resume, ResumeServer
from spark_dl.compat.ray_train.storage import Storage, checkpoint_folder, storage_mode
from spark_dl.data import DataFrameShards, shards
from spark_dl.errors import as_int


class TorchTrainer:
    """Ray Train's ``TorchTrainer``: ``train_loop_per_worker(train_loop_config)`` on
    ``scaling_config.num_workers`` ranks.

    spark-dl's additions (keyword-only): ``local_mode=True`` runs the workers as processes on the
    driver (no Spark), and ``datasets`` takes Spark DataFrames or
    ``spark_dl.data.shards(df, ...)``.
    """

    def __init__(self, train_loop_per_worker: Callable, *, train_loop_config: dict | None = None,
                 scaling_config: ScalingConfig | None = None, run_config: RunConfig | None = None,
                 datasets: Mapping[str, Any] | None = None, resume_from_checkpoint: Checkpoint | None = None,
                 torch_config: Any = None, metadata: dict | None = None, local_mode: bool = False) -> None:
        if not callable(train_loop_per_worker):
            raise LaunchRefused(f"train_loop_per_worker must be a function, got {type(train_loop_per_worker).__name__}")
        required = _required_parameters(train_loop_per_worker)
        if required > 1:
            raise LaunchRefused(f"train_loop_per_worker takes 0 or 1 arguments (the train_loop_config dict), "
                                f"but {getattr(train_loop_per_worker, '__name__', 'it')} requires {required}")
        if train_loop_config is not None and not isinstance(train_loop_config, Mapping):
            raise LaunchRefused(f"train_loop_config must be a dict, got {type(train_loop_config).__name__}")
        self.torch_config = check_torch_config(torch_config, (scaling_config or ScalingConfig()).use_gpu)
        if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, Checkpoint):
            raise LaunchRefused("resume_from_checkpoint must be a Checkpoint: Checkpoint.from_directory(path)")
        self.metadata = _json_metadata(metadata)
        self._workers = _worker_range((scaling_config or ScalingConfig()).num_workers)
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config) if train_loop_config is not None else None
        self.scaling = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.resume_from_checkpoint = resume_from_checkpoint
        self.datasets = self._datasets(datasets)
        self.local_mode = local_mode
        if self.datasets and local_mode:
            raise LaunchRefused(f"datasets={sorted(self.datasets)} are Spark DataFrames, read by the barrier stage's "
                                "tasks: drop local_mode=True (local processes have no Spark tasks to read them), or "
                                "pass a DataLoader's data through train_loop_config instead")
        refusal = run_config_refusal(self.run_config)
        if refusal is not None:
            raise LaunchRefused(refusal)
        self.max_failures = self._max_failures()
        keeping = self.run_config.checkpoint_config or CheckpointConfig()
        if keeping.num_to_keep is not None and (isinstance(keeping.num_to_keep, bool)
                                                or not isinstance(keeping.num_to_keep, int) or keeping.num_to_keep < 1):
            raise LaunchRefused(f"CheckpointConfig(num_to_keep={keeping.num_to_keep!r}): "
                                "give an int >= 1, or None to keep all")
        if keeping.checkpoint_score_order not in ("max", "min"):
            raise LaunchRefused(f"CheckpointConfig(checkpoint_score_order={keeping.checkpoint_score_order!r}): "
                                "'max' or 'min'")
        self._gpu = self._use_gpu()
        self._restored = False  # set by restore(): the Result goes on from the run's earlier fits
        self.name = self.run_config.name or time.strftime("TorchTrainer_%Y-%m-%d_%H-%M-%S")
        # absolute: the workers (other processes, other working directories) write into it too
        self.path = os.path.abspath(os.path.join(local_path(self.run_config.storage_path), self.name))
        storage_mode()  # SPARK_DL_RAY_STORAGE checked now, not at fit()
        self._distributor()  # every option checked now, not at fit()

    def _datasets(self, datasets: Mapping[str, Any] | None) -> dict[str, DataFrameShards]:
        if datasets is None:
            return {}
        if not isinstance(datasets, Mapping):
            raise LaunchRefused(f"datasets must be a dict of Spark DataFrames, e.g. {{'train': df, 'val': df2}}, "
                                f"got {type(datasets).__name__}")
        out = {}
        for name, value in datasets.items():
            if name == "train_loop_config" or not isinstance(name, str) or not name.isidentifier():
                raise LaunchRefused(f"datasets: name the DataFrame with an identifier other than "
                                    f"'train_loop_config', e.g. 'train'; got {name!r}")
            if isinstance(value, DataFrameShards):
                out[name] = value
            elif hasattr(value, "schema") and hasattr(value, "mapInArrow"):
                out[name] = shards(value)
            else:
                raise LaunchRefused(f"datasets[{name!r}] is a {type(value).__name__}; spark-dl shards Spark "
                                    "DataFrames (ray.data Datasets: convert with ds.to_spark(spark) "
                                    "or load with Spark)")
        return out

    def _max_failures(self) -> int:
        failures = (self.run_config.failure_config or FailureConfig()).max_failures
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
            raise LaunchRefused(f"FailureConfig(max_failures={failures!r}): give a number of restarts >= 0 "
                                "(unlimited restarts, -1, are not supported)")
        return failures

    def _use_gpu(self) -> bool:
        resources = dict(self.scaling.resources_per_worker or {})
        unknown = sorted(set(resources) - {"CPU", "GPU"})
        if unknown:
            raise LaunchRefused(f"resources_per_worker: {unknown} are Ray resources; Spark schedules CPUs "
                                "(spark.task.cpus) and GPUs (spark.task.resource.gpu.amount) only")
        gpus = resources.get("GPU", 1 if self.scaling.use_gpu else 0)
        if gpus not in (0, 1) or (gpus and not self.scaling.use_gpu):
            raise LaunchRefused(f"resources_per_worker={{'GPU': {gpus}}} with use_gpu={self.scaling.use_gpu}: "
                                "each worker has one GPU with use_gpu=True and none without")
        return bool(self.scaling.use_gpu)

    def _distributor(self) -> TorchDistributor:
        low, high = self._workers
        interval = self.scaling.elastic_resize_monitor_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise LaunchRefused(f"ScalingConfig(elastic_resize_monitor_interval_s={interval!r}): give the seconds "
                                "between looks for free task slots, a number > 0")
        distributor = TorchDistributor(high, local_mode=self.local_mode, use_gpu=self._gpu,
                                       max_restarts=self.max_failures, tracking=Tracking(run_name=self.name))
        if low < high and not self.local_mode:  # local processes always start max_workers
            distributor._options["min_np"] = low
            distributor._options["grow_interval"] = interval
            distributor._runner(high)  # checked now, not at fit()
        return distributor

    def fit(self) -> Result:
        """Train; returns a :class:`Result`, or raises the failing rank's error
        (:class:`spark_dl.RankFailed`, a ``RuntimeError``) when the restarts run out; the reported
        checkpoints are in ``path`` either way (the error's note names the latest)."""
        resume = (Resume.of(self.resume_from_checkpoint.path, storage_mode())
                  if self.resume_from_checkpoint is not None else None)
        config = {"train_loop_config": self.train_loop_config} if self.train_loop_config is not None else {}
        earlier = read_record(self.path)
        if self._restored:  # the same run goes on: its id, reports and kept checkpoints
            trial_id = (earlier or {}).get("trial_id") or uuid.uuid4().hex[:8]
        else:
            trial_id = uuid.uuid4().hex[:8]
            self._say_new_run(earlier)
        keeper = CheckpointKeeper(self.path, self.run_config.checkpoint_config or CheckpointConfig(),
                                   earlier if self._restored else None, trial_id)
        distributor = self._distributor()
        distributor._observers.append(keeper)
        server = ResumeServer(resume) if resume is not None else None
        if server is not None:  # the workers that cannot read it in place fetch it from here
            distributor._observers.append(server)
        self._save_for_restore()
        keeper.record([])  # the folder's record is this run's from now on (Result.from_path, restore())
        storage = Storage.prepare(self.path, keeper.offset)
        # checkpoint_dir_name must not take a name the folder holds: an earlier fit's checkpoint may be a live Result's
        taken = frozenset(os.listdir(self.path))
        loop = TrainLoop(self.train_loop_per_worker, self.name, resume, storage, self.metadata, self.path, trial_id,
                         taken, self.torch_config)
        try:
            out = distributor.run(loop, **config, **self.datasets)  # the config's values become MLflow params
        except JobFailed as e:
            if keeper.latest is not None:
                note = (f"the latest reported checkpoint is kept in {keeper.latest.path}: continue with "
                        f"TorchTrainer.restore({self.path!r}).fit()")
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(note)
                sys.stderr.write(f"[spark-dl] {note}\n")
            raise
        finally:
            if storage is not None:
                storage.clean()  # the probe, and what a failed report left staged
            if server is not None:
                server.on_finish(None)  # its packed copy, should the run stop before its observers are told
        keeper.record(out["reports"])
        reports = keeper.history + out["reports"]  # a restored run's earlier fits' too
        return Result(reports[-1] if reports else None, keeper.latest, self.path, reports,
                      best_checkpoints=list(keeper.kept))

    def _say_new_run(self, earlier: dict | None) -> None:
        """A fit (not restored) into a folder that holds a run starts a new one there, as each Ray
        ``fit()`` is a new trial: said on stderr, with what happens to the earlier run's files."""
        indices = checkpoint_indices(self.path)
        kept = [folder for folder, _ in (earlier or {}).get("kept", [])]
        if earlier is None and not indices:
            return
        count = len(set(kept) | {os.path.basename(checkpoint_folder(self.path, i)) for i in indices})
        sys.stderr.write(f"[spark-dl] {self.path} already holds a run ({count} checkpoint folder"
                         f"{'' if count == 1 else 's'}): this fit starts a new run there (as each Ray fit() is a new "
                         "trial), numbering its checkpoints after them; it never removes or overwrites them, nor "
                         "counts them toward num_to_keep, and the folder's record (Result.from_path, restore()) "
                         f"follows the new run. To go on with the earlier run, use TorchTrainer.restore({self.path!r})"
                         "; for a folder of its own, give RunConfig(name=...) a new name\n")

    # -- restore: Ray's way to continue an experiment that failed or was interrupted -------------
    _STATE = "spark_dl_trainer.pkl"

    def _save_for_restore(self) -> None:
        """What :meth:`restore` needs, in ``path``: the loop, its config and the run's settings
        (not the datasets, which are passed again, as in Ray)."""
        import cloudpickle

        os.makedirs(self.path, exist_ok=True)
        state = {"train_loop_per_worker": self.train_loop_per_worker, "train_loop_config": self.train_loop_config,
                 "metadata": self.metadata, "torch_config": self.torch_config,
                 "scaling_config": self.scaling, "run_config": self.run_config, "local_mode": self.local_mode}
        try:
            blob = cloudpickle.dumps(state)
        except Exception:  # noqa: BLE001 - the run itself says what cannot be sent; restore is then unavailable
            return
        with open(os.path.join(self.path, self._STATE), "wb") as f:
            f.write(blob)

    @classmethod
    def can_restore(cls, path: str | os.PathLike) -> bool:
        """Whether ``path`` holds a ``TorchTrainer`` run that :meth:`restore` can continue."""
        return os.path.isfile(os.path.join(os.fspath(path), cls._STATE))

    @classmethod
    def restore(cls, path: str | os.PathLike, train_loop_per_worker: Callable | None = None,
                train_loop_config: dict | None = None, datasets: Mapping[str, Any] | None = None,
                scaling_config: ScalingConfig | None = None) -> "TorchTrainer":
        """The trainer of the run in ``path`` (``Result.path``), resuming from its latest kept
        checkpoint; arguments given replace the saved ones (datasets must be passed again)."""
        import cloudpickle

        path = os.path.normpath(os.fspath(path))  # "runs/linear/" names the folder "linear" too
        if not cls.can_restore(path):
            raise LaunchRefused(f"{path} holds no TorchTrainer run to restore (no {cls._STATE}): pass a Result.path")
        with open(os.path.join(path, cls._STATE), "rb") as f:
            state = cloudpickle.load(f)
        latest = latest_kept(path)
        # the same folder: later checkpoints join the earlier ones
        saved = state["run_config"]  # a run saved before a field was added lacks it: its default
        run_config = RunConfig(**{f.name: getattr(saved, f.name, f.default) for f in dataclasses.fields(RunConfig)
                                  if f.name not in ("name", "storage_path")},
                               name=os.path.basename(path), storage_path=os.path.dirname(path))
        if train_loop_config is None:
            train_loop_config = state["train_loop_config"]
        trainer = cls(train_loop_per_worker or state["train_loop_per_worker"], train_loop_config=train_loop_config,
                      scaling_config=scaling_config or state["scaling_config"], run_config=run_config,
                      datasets=datasets, resume_from_checkpoint=Checkpoint(latest) if latest is not None else None,
                      local_mode=state["local_mode"], metadata=state.get("metadata"),
                      torch_config=state.get("torch_config"))
        trainer._restored = True
        return trainer


def _worker_range(workers: Any) -> tuple[int, int]:
    """``num_workers`` as (fewest, most): an int, or Ray's elastic ``(min_workers, max_workers)``."""
    def whole(n: Any) -> bool:
        return as_int(n) is not None and n >= 1

    if whole(workers):
        return as_int(workers), as_int(workers)
    if isinstance(workers, tuple) and len(workers) == 2 and all(whole(n) for n in workers) and workers[0] <= workers[1]:
        return as_int(workers[0]), as_int(workers[1])
    hint = (" (to train on the driver, as Ray's num_workers=0 does, pass num_workers=1 with "
            "TorchTrainer(local_mode=True))" if workers == 0 and not isinstance(workers, bool) else "")
    raise LaunchRefused(f"ScalingConfig(num_workers={workers!r}): give an int >= 1, the number of ranks, or "
                        f"(min_workers, max_workers) with 1 <= min_workers <= max_workers (elastic){hint}")


def _json_metadata(metadata: Any) -> dict:
    """``TorchTrainer(metadata=...)`` checked: a dict that JSON keeps as it is (Ray's rule)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise LaunchRefused(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as e:
        raise LaunchRefused(f"metadata must be JSON-serialisable (numbers, strings, lists, dicts): {e}") from None


def _required_parameters(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
