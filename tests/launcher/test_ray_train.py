"""Ray Train's TorchTrainer API (spark_dl.ray_train): reports, checkpoints across a restart and into
the result, resuming from a checkpoint, DataFrame shards through get_dataset_shard, refusals."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

import pytest
import spark_dl.ray_train as train
import torch
from spark_dl.ray_train import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    Result,
    RunConfig,
    ScalingConfig,
    SyncConfig,
    TorchTrainer,
)
from spark_dl.ray_train.torch import TorchConfig

from spark_dl import LaunchRefused, RankFailed


def train_func(config):
    """Ray's idiom: resume from get_checkpoint(), report every epoch, rank 0 with a checkpoint;
    rank 1 dies in epoch 2 of the first attempt."""
    model = train.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"))
        model.module.load_state_dict(state["model"])
        start = state["epoch"] + 1
    ctx = train.get_context()
    g = torch.Generator().manual_seed(ctx.get_world_rank())
    for epoch in range(start, config["epochs"]):
        for _ in range(10):
            x = torch.randn(16, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if (epoch == config.get("crash_at") and ctx.get_world_rank() == 1
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
            os._exit(3)
        with tempfile.TemporaryDirectory() as d:
            saved = None
            if ctx.get_world_rank() == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(d, "model.pt"))
                saved = Checkpoint.from_directory(d)
            train.report({"loss": loss, "epoch": epoch, "started_at": start,
                          "world": [ctx.get_world_size(), ctx.get_local_rank(), ctx.get_node_rank()],
                          "name": ctx.get_experiment_name()}, checkpoint=saved)


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
@pytest.mark.parametrize("storage", ["auto", "driver"])  # written by the workers (storage seen by all) / by the driver
def test_a_restarted_run_resumes_from_its_last_reported_checkpoint(tmp_path, monkeypatch, storage):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)
    trainer = TorchTrainer(
        train_func, train_loop_config={"lr": 0.05, "epochs": 5, "crash_at": 2},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="linear", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=1)),
        local_mode=True)
    result = trainer.fit()
    reports = result.reports
    assert [r["epoch"] for r in reports] == [0, 1, 2, 3, 4]  # the reports kept with the checkpoint, then the rest
    assert [r["started_at"] for r in reports][-1] in (2, 3)  # resumed, not started over
    assert result.metrics == reports[-1] and isinstance(result.metrics["loss"], float)  # tensors reported as numbers
    assert result.metrics["loss"] < reports[0]["loss"] / 10
    assert result.metrics["world"] == [2, 0, 0] and result.metrics["name"] == "linear"
    assert list(result.metrics_dataframe["epoch"]) == [0, 1, 2, 3, 4]
    assert result.path == str(tmp_path / "linear") and result.error is None
    assert result.checkpoint.path.startswith(result.path) and os.listdir(result.checkpoint.path) == ["model.pt"]
    assert torch.load(os.path.join(result.checkpoint.path, "model.pt"))["epoch"] == 4


def writes_beside_its_checkpoints(config):
    """Ray's get_storage() idiom: a worker writes a file of its own into the run's folder with the
    storage's file system, then reports a checkpoint under a name it built the path of."""
    storage = train.get_context().get_storage()
    rank = train.get_context().get_world_rank()
    if storage.shared:
        with storage.storage_filesystem.open_output_stream(f"{storage.experiment_fs_path}/rank{rank}.txt") as f:
            f.write(b"written by rank %d" % rank)
    try:
        train.get_context().get_trial_resources()
        refusal = None
    except NotImplementedError as e:
        refusal = str(e)
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "state"), "w").write("1")
        train.report({"storage": [storage.storage_path, storage.experiment_dir_name, storage.trial_fs_path,
                                  storage.shared, type(storage.storage_filesystem).__name__,
                                  storage.build_checkpoint_path_from_name("first")], "resources": refusal},
                     checkpoint=Checkpoint.from_directory(d) if rank == 0 else None, checkpoint_dir_name="first")


@pytest.mark.parametrize("storage", ["auto", "driver"])
def test_get_storage_names_the_run_folder_and_says_whether_the_workers_share_it(tmp_path, monkeypatch, storage):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)
    result = TorchTrainer(writes_beside_its_checkpoints, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                          run_config=RunConfig(name="art", storage_path=str(tmp_path))).fit()
    shared = storage == "auto"  # one machine: every worker sees storage_path unless told to send through the driver
    assert result.metrics["storage"] == [str(tmp_path), "art", str(tmp_path / "art"), shared, "LocalFileSystem",
                                         str(tmp_path / "art" / "first")]
    assert result.checkpoint.path == str(tmp_path / "art" / "first")
    assert "get_trial_resources() returns a Ray placement group (deprecated in Ray Train V2); spark-dl's workers " \
           "are Spark tasks: their CPUs are spark.task.cpus" in result.metrics["resources"]
    written = sorted(f for f in os.listdir(tmp_path / "art") if f.startswith("rank"))
    assert written == (["rank0.txt", "rank1.txt"] if shared else [])
    if shared:
        assert (tmp_path / "art" / "rank1.txt").read_text() == "written by rank 1"


def waits_for_a_missing_worker():
    """Rank 1 never joins rank 0's all-reduce: TorchConfig's timeout ends it, not a hang."""
    import torch.distributed as dist

    assert dist.get_backend() == "gloo"
    if train.get_context().get_world_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(60)


def test_torch_config_sets_the_backend_and_the_collectives_timeout(tmp_path):
    started = time.monotonic()
    trainer = TorchTrainer(waits_for_a_missing_worker, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                           torch_config=TorchConfig(backend="gloo", init_method="tcp", timeout_s=3),
                           run_config=RunConfig(storage_path=str(tmp_path)))
    with pytest.raises(RankFailed) as failed:
        trainer.fit()
    assert failed.value.rank == 0 and "Timed out" in str(failed.value), str(failed.value)[-2000:]
    assert time.monotonic() - started < 40  # the 3 s timeout, not rank 1's 60 s sleep (nor torch's 30 min)
    assert TorchTrainer.restore(trainer.path).torch_config == TorchConfig(backend="gloo", init_method="tcp",
                                                                         timeout_s=3)


def fails_right_after_a_report(config):
    """Rank 1 fails as soon as the report of epoch 1 returns, in the first attempt."""
    ctx = train.get_context()
    checkpoint = train.get_checkpoint()
    start = 0
    if checkpoint:
        with checkpoint.as_directory() as d:
            start = int(open(os.path.join(d, "epoch")).read()) + 1
    for epoch in range(start, 3):
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "epoch"), "w").write(str(epoch))
            train.report({"epoch": epoch, "started_at": start}, checkpoint=Checkpoint.from_directory(d))
        if epoch == 1 and ctx.get_world_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            raise ValueError("failed after the report")


@pytest.mark.parametrize("storage", ["auto", "driver"])
def test_a_report_returns_only_once_its_checkpoint_is_kept(tmp_path, monkeypatch, storage):
    """Ray's report is a barrier: a worker failing right after it cannot beat rank 0's checkpoint
    to the driver, so the restart resumes from that checkpoint, not the one before."""
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)
    result = TorchTrainer(fails_right_after_a_report, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                          run_config=RunConfig(storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1))
                          ).fit()
    assert [(r["epoch"], r["started_at"]) for r in result.reports] == [(0, 0), (1, 0), (2, 2)]


def test_resume_from_checkpoint_gives_every_worker_its_files(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step.txt").write_text("41")

    def read_it():  # no parameter: Ray calls it with no config
        with train.get_checkpoint().as_directory() as d:
            step = int(open(os.path.join(d, "step.txt")).read())
        train.report({"step": step + 1, "rank": train.get_context().get_world_rank()})

    resumed = TorchTrainer(read_it, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                           resume_from_checkpoint=Checkpoint.from_directory(tmp_path / "ckpt"),
                           run_config=RunConfig(storage_path=str(tmp_path))).fit()
    assert resumed.metrics == {"step": 42, "rank": 0}
    assert resumed.checkpoint is None and resumed.best_checkpoints == []  # none reported in this run
    copy = Checkpoint.from_directory(tmp_path / "ckpt").to_directory(tmp_path / "copy")
    assert copy == str(tmp_path / "copy") and (tmp_path / "copy" / "step.txt").read_text() == "41"


def _resumable(folder):
    (folder / "nested").mkdir(parents=True)
    (folder / "step.txt").write_text("41")
    (folder / "nested" / "weights.bin").write_bytes(os.urandom(300_000))
    return Checkpoint.from_directory(folder)


def read_resumed():
    checkpoint = train.get_checkpoint()
    with checkpoint.as_directory() as d:
        step = int(open(os.path.join(d, "step.txt")).read())
        digest = hashlib.sha256(open(os.path.join(d, "nested", "weights.bin"), "rb").read()).hexdigest()
    assert train.get_checkpoint().path == checkpoint.path  # fetched once, not at every call
    train.report({"step": step, "sha": digest, "path": checkpoint.path,
                  "rank": train.get_context().get_world_rank()})
    return checkpoint.path


@pytest.mark.parametrize("storage", ["auto", "driver"])
def test_resume_from_checkpoint_is_read_in_place_where_seen_else_fetched_from_the_driver(tmp_path, monkeypatch,
                                                                                        storage):
    import cloudpickle
    from spark_dl.ray_train import resume

    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)
    monkeypatch.setattr(resume, "CHUNK_BYTES", 64 << 10)  # the driver serves it in several pieces
    checkpoint = _resumable(tmp_path / "ckpt")
    # the closure carries its path and fingerprint, not its files
    assert len(cloudpickle.dumps(resume.Resume.of(checkpoint.path, storage))) < 1000
    trainer = TorchTrainer(read_resumed, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                           resume_from_checkpoint=checkpoint, run_config=RunConfig(storage_path=str(tmp_path)))
    driver_tmp = tmp_path / "driver-tmp"  # the driver's temporary files, apart from other processes'
    driver_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(driver_tmp))
    result = trainer.fit()
    sha = hashlib.sha256((tmp_path / "ckpt" / "nested" / "weights.bin").read_bytes()).hexdigest()
    assert result.metrics["step"] == 41 and result.metrics["sha"] == sha
    if storage == "auto":  # one machine: the worker sees the driver's folder
        assert result.metrics["path"] == checkpoint.path
    else:  # a copy of its own, removed when the loop ends
        assert result.metrics["path"] != checkpoint.path and not os.path.exists(result.metrics["path"])
    assert not [f for f in os.listdir(driver_tmp) if f.startswith("spark-dl-resume-")]  # the packed copy is removed


def test_a_resumed_folder_that_differs_on_a_worker_is_fetched(tmp_path):
    from spark_dl.ray_train.resume import Resume

    checkpoint = _resumable(tmp_path / "ckpt")
    seen = Resume.of(checkpoint.path, "auto")
    assert seen.readable() and not Resume.of(checkpoint.path, "driver").readable()
    weights = tmp_path / "ckpt" / "nested" / "weights.bin"
    weights.write_bytes(os.urandom(300_001))  # another epoch's weights on this host's own disk
    assert not seen.readable()
    weights.write_bytes(os.urandom(300_000))
    os.utime(weights, (0, 0))
    assert not seen.readable()
    again = Resume.of(checkpoint.path, "auto")
    (tmp_path / "ckpt" / "extra").write_text("x")
    assert not again.readable()
    assert not Resume(str(tmp_path / "nowhere"), again.digest, True).readable()


def test_a_resumed_checkpoint_the_driver_cannot_send_fails_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", "driver")
    checkpoint = _resumable(tmp_path / "ckpt")

    def remove_then_read():
        if train.get_context().get_world_rank() == 0:
            shutil.rmtree(checkpoint.path)
        train.collective.barrier()
        train.get_checkpoint()

    trainer = TorchTrainer(remove_then_read, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                           resume_from_checkpoint=checkpoint, run_config=RunConfig(storage_path=str(tmp_path)))
    with pytest.raises(RankFailed, match=r"could not send resume_from_checkpoint .*ckpt.*No such file"):
        trainer.fit()
    # and a folder gone before fit() is named at once, before anything is launched
    with pytest.raises(LaunchRefused, match=r"resume_from_checkpoint=.*ckpt.* is not a directory"):
        trainer.fit()


def test_spark_dataframes_are_sharded_through_get_dataset_shard(spark, tmp_path):
    df = spark.createDataFrame([(float(i), i % 2) for i in range(24)], "x double, label long")
    held_out = spark.createDataFrame([(100.0 + i,) for i in range(6)], "x double")

    def loop(config):
        import torch.distributed as dist

        shard = train.get_dataset_shard("train")
        epochs = [[float(v) for b in shard.iter_torch_batches(batch_size=config["batch"]) for v in b["x"]]
                  for _ in range(2)]
        val = [float(v) for b in train.get_dataset_shard("val").iter_torch_batches(batch_size=2) for v in b["x"]]
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (epochs, val))
        # Ray's options: dtypes (one, or per column), collate_fn (numpy in), batch_size=None (all rows)
        cast = next(iter(shard.iter_torch_batches(batch_size=4, dtypes=torch.float32)))
        per_column = next(iter(shard.iter_torch_batches(batch_size=4, dtypes={"x": torch.float16})))
        collated = next(iter(shard.iter_torch_batches(
            batch_size=4, collate_fn=lambda b: (type(b["x"]).__name__, torch.as_tensor(b["x"] * 2)))))
        whole = [len(b["x"]) for b in shard.iter_torch_batches(batch_size=None)]
        numpy_batch = next(iter(shard.iter_batches(batch_size=4)))
        pandas_batch = next(iter(shard.iter_batches(batch_size=4, batch_format="pandas")))
        rows = list(shard.iter_rows())
        refused = []
        for bad in ({"collate_fn": dict, "dtypes": torch.float32}, {"local_shuffle_buffer_size": 8},
                    {"batch_size": 0}, {"dtypes": "float32"}, {"prefetch": 2}):
            try:
                next(iter(shard.iter_torch_batches(**bad)))
            except (ValueError, TypeError) as e:
                refused.append(str(e))
        train.report({"seen": seen, "cast": [str(cast["x"].dtype), str(cast["label"].dtype)],
                      "per_column": [str(per_column["x"].dtype), str(per_column["label"].dtype)],
                      "collated": [collated[0], str(collated[1].dtype)], "whole": whole, "refused": refused,
                      "numpy": sorted((k, type(v).__name__, len(v)) for k, v in numpy_batch.items()),
                      "pandas": [type(pandas_batch).__name__, list(pandas_batch.columns), len(pandas_batch)],
                      "rows": [len(rows), sorted(rows[0])]})

    result = TorchTrainer(loop, train_loop_config={"batch": 5}, scaling_config=ScalingConfig(num_workers=2),
                          datasets={"train": df, "val": held_out},
                          run_config=RunConfig(storage_path=str(tmp_path))).fit()
    ((r0_e0, r0_e1), val0), ((r1_e0, r1_e1), val1) = result.metrics["seen"]
    assert sorted(r0_e0 + r1_e0) == sorted(r0_e1 + r1_e1) == [float(i) for i in range(24)]  # each epoch: every row once
    assert len(r0_e0) == len(r1_e0) == 12 and r0_e0 != r0_e1  # equal shares, a new shuffle per epoch
    assert sorted(val0 + val1) == [100.0 + i for i in range(6)]  # the second DataFrame, on its own
    assert result.checkpoint is None
    m = result.metrics
    assert m["cast"] == ["torch.float32", "torch.float32"] and m["per_column"] == ["torch.float16", "torch.int64"]
    assert m["collated"] == ["ndarray", "torch.float64"] and m["whole"] == [12]
    assert m["numpy"] == [("label", "ndarray", 4), ("x", "ndarray", 4)]  # Ray's iter_batches and iter_rows
    assert m["pandas"] == ["DataFrame", ["x", "label"], 4] and m["rows"] == [12, ["label", "x"]]
    refused = m["refused"]
    assert len(refused) == 5 and "cannot be combined" in refused[0] and "shuffles the whole DataFrame" in refused[1]
    assert "batch_size must be an int >= 1 or None" in refused[2] and "dtypes must be a torch.dtype" in refused[3]
    assert "prefetch" in refused[4]


def test_dataframes_in_local_mode_are_refused_at_construction(spark):
    df = spark.createDataFrame([(1.0,)], "x double")
    with pytest.raises(LaunchRefused, match=r"datasets=\['train'\] are Spark DataFrames.*drop local_mode=True"):
        TorchTrainer(lambda: None, datasets={"train": df}, local_mode=True)


def test_elastic_num_workers_start_on_the_free_slots(spark, tmp_path):
    from slots import OtherJob

    def loop():
        train.report({"world": train.get_context().get_world_size()})

    with OtherJob(spark.sparkContext, str(tmp_path)) as other:
        other.start()  # two of local[4]'s four slots are taken
        result = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=(2, 4)),
                              run_config=RunConfig(storage_path=str(tmp_path))).fit()
    assert result.metrics["world"] == 2  # Ray's elastic range: what is free, at least min_workers


def test_elastic_num_workers_grow_at_a_reported_checkpoint_when_slots_free_up(spark, tmp_path):
    from slots import OtherJob

    flags = str(tmp_path)

    def loop():
        import time

        ctx = train.get_context()
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as d:
                start = int(open(os.path.join(d, "epoch")).read()) + 1
        for epoch in range(start, 30):
            if ctx.get_world_rank() == 0 and epoch == 2 and start == 0:
                open(os.path.join(flags, "release"), "w").close()  # the other job's slots free up
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "epoch"), "w") as f:
                    f.write(str(epoch))
                metrics = {"epoch": epoch, "world": ctx.get_world_size(), "start": start}
                train.report(metrics, checkpoint=Checkpoint.from_directory(d) if ctx.get_world_rank() == 0 else None)
            if start == 0:
                time.sleep(0.2)

    with OtherJob(spark.sparkContext, flags) as other:
        other.start()  # two of local[4]'s four slots are taken: the run starts on min_workers
        result = TorchTrainer(loop,
                              scaling_config=ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=0.5),
                              run_config=RunConfig(storage_path=str(tmp_path), name="grow")).fit()
    df = result.metrics_dataframe
    grown_at = int(df[df.world == 4].start.iloc[0])  # the first epoch of the grown attempt
    assert result.metrics == {"epoch": 29, "world": 4, "start": grown_at} and 3 <= grown_at < 30
    # each epoch reported once per attempt that ran it: on 2 workers up to the checkpoint it
    # stopped at (one epoch may run again after it), on 4 from there on
    assert list(df[df.world == 4].epoch) == list(range(grown_at, 30))
    assert list(df[df.world == 2].epoch)[:grown_at] == list(range(grown_at))


def sharded_loop():
    """Each rank saves its own shard (and a file every rank writes, with its rank in it); rank 1
    dies after the second report of the first attempt and, restarted, checks its shard came back.
    The last report carries rank 1's checkpoint only."""
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    resumed = None
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            resumed = sorted(os.listdir(d))
    train.session.REPORT_STALL_S = 0.5  # where report() and get_checkpoint() read it
    if rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        import time

        time.sleep(2)  # rank 1 waits for it in its first report() and says why
    for step in range(3):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"shard-{rank}"), "w") as f:
                f.write(str(step))
            with open(os.path.join(d, "meta"), "w") as f:
                f.write(f"rank {rank}")
            train.report({"step": step, "resumed": resumed}, checkpoint=Checkpoint.from_directory(d))
        if step == 1 and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os._exit(3)
    with tempfile.TemporaryDirectory() as d:
        if rank == 1:
            open(os.path.join(d, "rank-1-only"), "w").close()
        train.report({"step": 3, "resumed": resumed}, checkpoint=Checkpoint.from_directory(d) if rank == 1 else None)


@pytest.mark.parametrize("storage", ["auto", "driver"])
def test_every_workers_checkpoint_files_are_merged_as_in_ray(tmp_path, capfd, monkeypatch, storage):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)
    result = TorchTrainer(sharded_loop, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                          run_config=RunConfig(storage_path=str(tmp_path), name="sharded",
                                               failure_config=FailureConfig(max_failures=1))).fit()
    assert ("[spark-dl] rank 1 has waited 0.5 s in train.report() for the other workers' report"
            in capfd.readouterr().err)
    # the restarted workers got the merged checkpoint of the last report before the failure
    assert result.metrics == {"step": 3, "resumed": ["meta", "shard-0", "shard-1"]}
    kept = sorted(os.listdir(os.path.join(str(tmp_path), "sharded")))
    checkpoints = [k for k in kept if k.startswith("checkpoint_")]
    # a report with any worker's checkpoint registers one (Ray's rule): the last had rank 1's only
    assert os.listdir(result.checkpoint.path) == ["rank-1-only"]
    merged = os.path.join(str(tmp_path), "sharded", checkpoints[-2])
    assert sorted(os.listdir(merged)) == ["meta", "shard-0", "shard-1"]
    assert open(os.path.join(merged, "meta")).read() == "rank 0"  # a file every rank wrote: the lowest rank's
    assert [open(os.path.join(merged, f"shard-{r}")).read() for r in (0, 1)] == ["2", "2"]
    # no probe, none staged
    assert sorted(set(kept) - set(checkpoints)) == ["spark_dl_run.json", "spark_dl_trainer.pkl"]


def blob_sizes(monkeypatch) -> list[int]:
    """The size of every checkpoint message the driver's keeper receives (the real one still runs)."""
    from spark_dl.ray_train.keeper import CheckpointKeeper

    sizes, original = [], CheckpointKeeper.on_checkpoint

    def spy(self, blob, step):
        sizes.append(len(blob))
        return original(self, blob, step)

    monkeypatch.setattr(CheckpointKeeper, "on_checkpoint", spy)
    return sizes


def write_big_shards():
    """Each rank writes a 2 MB shard and a nested file; rank 1's nested file clashes with rank 0's."""
    rank = train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, f"shard-{rank}.bin"), "wb") as f:
            f.write(bytes([rank + 1]) * (2 << 20))
        os.makedirs(os.path.join(d, "meta"))
        for name in ("common", f"rank-{rank}"):
            with open(os.path.join(d, "meta", name), "w") as f:
                f.write(str(rank))
        train.report({"rank": rank}, checkpoint=Checkpoint.from_directory(d))


@pytest.mark.parametrize("storage", ["shared", "driver"])
def test_with_storage_every_worker_sees_only_the_checkpoints_path_reaches_the_driver(tmp_path, monkeypatch, storage):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)
    sizes = blob_sizes(monkeypatch)
    result = TorchTrainer(write_big_shards, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                          run_config=RunConfig(storage_path=str(tmp_path), name="big")).fit()
    path = result.checkpoint.path
    assert path == str(tmp_path / "big" / "checkpoint_000000")
    assert sorted(os.listdir(path)) == ["meta", "shard-0.bin", "shard-1.bin"]
    assert [open(os.path.join(path, f"shard-{r}.bin"), "rb").read() == bytes([r + 1]) * (2 << 20) for r in (0, 1)] \
        == [True, True]
    # nested folders merge file by file; a file both ranks wrote is rank 0's
    assert sorted(os.listdir(os.path.join(path, "meta"))) == ["common", "rank-0", "rank-1"]
    assert open(os.path.join(path, "meta", "common")).read() == "0"
    if storage == "shared":  # the workers wrote the files: the driver got a path
        assert len(sizes) == 1 and sizes[0] < 4096
    else:  # both shards travelled through rank 0 to the driver
        assert len(sizes) == 1 and sizes[0] > 4 << 20


def test_relative_storage_paths_are_the_drivers_on_executors_with_their_own_working_directory(
        spark_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", "shared")  # fails unless both executors see the folder

    def loop():
        rank = train.get_context().get_world_rank()
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"shard-{rank}"), "w") as f:
                f.write(os.getcwd())
            train.report({"rank": rank}, checkpoint=Checkpoint.from_directory(d))

    result = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path="results", name="rel")).fit()
    assert result.checkpoint.path == str(tmp_path / "results" / "rel" / "checkpoint_000000")
    cwds = [open(os.path.join(result.checkpoint.path, f"shard-{r}")).read() for r in (0, 1)]
    assert str(tmp_path) not in cwds  # the executors run elsewhere: "results" alone would have gone astray


def test_shared_storage_that_a_worker_cannot_see_is_named_before_training(tmp_path):
    from spark_dl.ray_train.storage import Storage, agree

    from spark_dl import HorovodRunner

    probe = Storage.prepare(str(tmp_path / "seen"), 0)  # the driver's probe, as fit() writes it

    def check(mode):
        import spark_dl

        spark_dl.init()
        # rank 1 looks for the same probe at a path it does not have (another machine's disk)
        path = probe.path if int(os.environ["RANK"]) == 0 else str(tmp_path / "elsewhere")
        return agree(Storage(path, mode, probe.token, 0), None)

    assert HorovodRunner(np=-2).run(check, mode="auto") is False  # both ranks agree: through the driver
    with pytest.raises(RankFailed, match=r"SPARK_DL_RAY_STORAGE=shared, but rank 1 cannot read /.*/"
                                         r"\.spark_dl_storage_probe-[0-9a-f]{32}, which the driver wrote, or write "
                                         r"beside it: give RunConfig"):
        HorovodRunner(np=-2).run(check, mode="shared")

    def check_writing(mode):
        import spark_dl

        spark_dl.init()
        return agree(Storage(probe.path, mode, probe.token, 0), None)

    assert HorovodRunner(np=-2).run(check_writing, mode="shared") is True  # both read and write there
    os.mkdir(probe.probe + "-rank1")  # rank 1 reads the probe but cannot write its file beside it
    with pytest.raises(RankFailed, match=r"but rank 1 cannot read .*, which the driver wrote, or write beside it"):
        HorovodRunner(np=-2).run(check_writing, mode="shared")


def test_file_uris_and_relative_storage_paths_become_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in (f"file://{tmp_path}/runs", f"file:{tmp_path}/runs", f"file://localhost{tmp_path}/runs", "runs",
                  "./runs/", f"file://{tmp_path}/r%75ns"):  # %75 is "u"
        assert TorchTrainer(lambda: None, local_mode=True, run_config=RunConfig(name="x", storage_path=given)).path \
            == str(tmp_path / "runs" / "x")
    assert TorchTrainer(lambda: None, local_mode=True, run_config=RunConfig(name="x", storage_path="run:1")).path \
        == str(tmp_path / "run:1" / "x")  # a colon without a slash: a folder's name, not a URI


def test_a_fit_cleans_up_only_its_own_probe_and_staging(tmp_path):
    from spark_dl.ray_train.storage import Storage, stage

    first, second = Storage.prepare(str(tmp_path), 0), Storage.prepare(str(tmp_path), 0)  # two fits, one folder
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "f").write_text("x")
    assert stage(str(tmp_path / "mine"), second, 0, rank=0) == 1  # the second fit is mid-report
    first.clean()
    assert not first.seen_here() and second.seen_here()
    assert os.listdir(second.staging(0)) == ["rank_0"]
    second.clean()
    assert sorted(os.listdir(tmp_path)) == ["mine"]
    # a report staged by a driver that died: gone at the next fit once a day old, not before
    for name, age in ((".staging_checkpoint_000003-dead", 25 * 3600), (".staging_checkpoint_000004-busy", 60)):
        (tmp_path / name / "rank_0").mkdir(parents=True)
        os.utime(tmp_path / name, (time.time() - age, time.time() - age))
    third = Storage.prepare(str(tmp_path), 0)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".staging")) == [".staging_checkpoint_000004-busy"]
    third.clean()


def test_a_bad_storage_setting_is_refused_at_construction(monkeypatch):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", "s3")
    with pytest.raises(LaunchRefused, match=r"SPARK_DL_RAY_STORAGE='s3' is not one of \('auto', 'shared', 'driver'\)"):
        TorchTrainer(lambda: None, local_mode=True)


def test_with_shared_storage_every_worker_follows_the_latest_checkpoint_as_older_ones_are_pruned(tmp_path):
    def loop():
        import torch.distributed as dist

        rank, seen = train.get_context().get_world_rank(), []
        for step in range(3):
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "step"), "w") as f:
                    f.write(str(step))
                train.report({}, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
            with train.get_checkpoint().as_directory() as d:  # rank 1: as soon as rank 0 has published it
                seen.append(open(os.path.join(d, "step")).read())
        views = [None, None]
        dist.all_gather_object(views, seen)
        train.report({"views": views})

    result = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                          run_config=RunConfig(storage_path=str(tmp_path), name="follow",
                                               checkpoint_config=CheckpointConfig(num_to_keep=1))).fit()
    assert result.metrics["views"] == [["0", "1", "2"]] * 2
    assert sorted(os.listdir(tmp_path / "follow")) == ["checkpoint_000002", "spark_dl_run.json", "spark_dl_trainer.pkl"]


def test_checkpoint_metadata_travels_with_the_files(tmp_path):
    def loop():
        with tempfile.TemporaryDirectory() as d:
            checkpoint = Checkpoint.from_directory(d)
            assert checkpoint.get_metadata() == {}
            checkpoint.set_metadata({"epoch": 3, "note": "x"})
            checkpoint.update_metadata({"note": "best", "val_loss": 0.5})
            train.report({}, checkpoint=checkpoint)
        train.report({"resumed": train.get_checkpoint().get_metadata()})

    result = TorchTrainer(loop, local_mode=True, run_config=RunConfig(storage_path=str(tmp_path))).fit()
    assert (result.metrics["resumed"] == result.checkpoint.get_metadata()
            == {"epoch": 3, "note": "best", "val_loss": 0.5})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        result.checkpoint.set_metadata({"model": torch.nn.Linear(1, 1)})
    with pytest.raises(TypeError, match="must be a dict, got list"):
        result.checkpoint.update_metadata([("a", 1)])
    assert result.checkpoint.get_metadata()["epoch"] == 3  # a refused update changes nothing


@pytest.mark.parametrize("storage", ["auto", "driver"])
def test_trainer_metadata_reaches_the_workers_and_every_reported_checkpoint(tmp_path, monkeypatch, storage):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)

    def loop():
        with tempfile.TemporaryDirectory() as d:
            checkpoint = Checkpoint.from_directory(d)
            if train.get_context().get_world_rank() == 0:
                checkpoint.set_metadata({"team": "worker's"})  # what a worker sets wins
            train.report({"metadata": train.get_context().get_metadata()}, checkpoint=checkpoint)

    trainer = TorchTrainer(loop, local_mode=True, scaling_config=ScalingConfig(num_workers=2),
                           metadata={"team": "trainer's", "version": 2},
                           run_config=RunConfig(storage_path=str(tmp_path)))
    result = trainer.fit()
    assert result.metrics["metadata"] == {"team": "trainer's", "version": 2}
    assert result.checkpoint.get_metadata() == {"team": "worker's", "version": 2}
    assert TorchTrainer.restore(result.path).metadata == {"team": "trainer's", "version": 2}


def test_ray_train_torch_names_run_rays_imports(tmp_path):
    def loop():
        from spark_dl.ray_train.torch import enable_reproducibility, get_device, get_devices, prepare_model

        enable_reproducibility(seed=7)
        draw = torch.rand(1).item()
        model = prepare_model(torch.nn.Linear(2, 1))
        train.report({"draw": draw, "devices": [str(d) for d in get_devices()],
                      "device": str(get_device()), "deterministic": torch.are_deterministic_algorithms_enabled(),
                      "ddp": type(model).__name__})

    from spark_dl.ray_train.torch import TorchTrainer as RayNamed

    assert RayNamed is TorchTrainer and train.torch.prepare_model is train.prepare_model
    result = RayNamed(loop, local_mode=True, run_config=RunConfig(storage_path=str(tmp_path))).fit()
    torch.manual_seed(7)
    assert result.metrics == {"draw": torch.rand(1).item(), "devices": ["cpu"], "device": "cpu", "deterministic": True,
                              "ddp": "Linear"}


def test_a_worker_reporting_more_often_than_the_others_fails_with_rays_rule(tmp_path):
    def loop():
        train.report({"step": 0})
        if train.get_context().get_world_rank() == 1:
            train.report({"step": 1})  # rank 0 has ended: nobody meets this report

    with pytest.raises(RankFailed, match=r"train.report\(\) on rank 1 could not meet the other workers' report: every "
                                         r"worker must call train.report\(\) as many times \(Ray's rule\)") as e:
        TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                     run_config=RunConfig(storage_path=str(tmp_path))).fit()
    assert e.value.rank == 1


def test_collective_barrier_and_broadcast_from_rank_zero(tmp_path):
    flag = str(tmp_path / "written")

    def loop():
        import time

        rank = train.get_context().get_world_rank()
        if rank == 0:
            time.sleep(1)
            open(flag, "w").close()
        train.collective.barrier()  # rank 1 goes on only once rank 0 has written the file
        seen = os.path.exists(flag)
        chosen = train.collective.broadcast_from_rank_zero({"seed": 100 + rank, "path": flag})
        if rank == 1 and not (seen and chosen == {"seed": 100, "path": flag}):  # only rank 0's report is returned
            raise AssertionError(f"rank 1 saw seen={seen}, chosen={chosen}")
        train.report({"seen": seen, "chosen": chosen})

    trainer = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                           run_config=RunConfig(storage_path=str(tmp_path)))
    assert trainer.fit().metrics == {"seen": True, "chosen": {"seed": 100, "path": flag}}


def test_get_checkpoint_follows_the_latest_report(tmp_path):
    def loop():
        seen = [train.get_checkpoint()]
        for step in (1, 2):
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "step"), "w") as f:
                    f.write(str(step))
                train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
            with train.get_checkpoint().as_directory() as d:
                seen.append(open(os.path.join(d, "step")).read())
        train.report({"seen": seen})

    result = TorchTrainer(loop, local_mode=True, run_config=RunConfig(storage_path=str(tmp_path))).fit()
    assert result.metrics["seen"] == [None, "1", "2"]
    assert open(os.path.join(result.checkpoint.path, "step")).read() == "2"


def test_numpy_worker_counts_are_taken(tmp_path):
    import numpy

    def loop():
        train.report({"world": train.get_context().get_world_size()})

    for workers in (numpy.int64(2), (numpy.int32(2), numpy.int64(2))):
        result = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=workers), local_mode=True,
                              run_config=RunConfig(storage_path=str(tmp_path))).fit()
        assert result.metrics["world"] == 2


def test_a_failure_without_restarts_raises_the_ranks_error(tmp_path):
    def loop():
        if train.get_context().get_world_rank() == 1:
            raise ValueError("diverged")

    with pytest.raises(RankFailed, match="diverged") as e:
        TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                     run_config=RunConfig(storage_path=str(tmp_path))).fit()
    assert e.value.rank == 1 and isinstance(e.value, RuntimeError)
    assert isinstance(e.value, train.TrainingFailedError)  # what Ray's code catches


class MLflowLoggerCallback:  # Ray Tune's callbacks, as far as the refusal sees them: by their class names
    pass


class PrintingCallback:
    pass


@pytest.mark.parametrize("kwargs, message", [
    ({"run_config": RunConfig(failure_config=FailureConfig(max_failures=-1))}, "unlimited restarts"),
    ({"scaling_config": ScalingConfig(num_workers=2, resources_per_worker={"TPU": 1})}, "Ray resources"),
    ({"scaling_config": ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2})}, "one GPU"),
    ({"scaling_config": ScalingConfig(num_workers=0)}, r"num_workers=0\): give an int >= 1.*num_workers=1 with "
     r"TorchTrainer\(local_mode=True\)"),
    ({"metadata": {"model": object()}}, "metadata must be JSON-serialisable"),
    ({"metadata": [("a", 1)]}, "metadata must be a dict, got list"),
    ({"scaling_config": ScalingConfig(num_workers=(3, 2))}, r"\(min_workers, max_workers\) with 1 <= min_workers"),
    ({"scaling_config": ScalingConfig(num_workers=(0, 2))}, r"num_workers=\(0, 2\)\): give an int >= 1"),
    ({"scaling_config": ScalingConfig(num_workers=[1, 2])}, r"num_workers=\[1, 2\]\)"),
    ({"scaling_config": ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=0)},
     r"elastic_resize_monitor_interval_s=0\): give the seconds between looks for free task slots"),
    ({"datasets": {"train": [1, 2, 3]}}, "spark-dl shards Spark DataFrames"),
    ({"datasets": [("train", None)]}, "datasets must be a dict"),
    ({"torch_config": object()}, r"torch_config must be a TorchConfig \(spark_dl.ray_train.torch.TorchConfig\), got "
     r"object"),
    ({"torch_config": TorchConfig(backend="mpi")}, r"TorchConfig\(backend='mpi'\): the backend is 'nccl', 'gloo'"),
    ({"torch_config": TorchConfig(backend="nccl")}, r"TorchConfig\(backend='nccl'\) needs a GPU per worker: pass "
     r"ScalingConfig\(use_gpu=True\)"),
    ({"torch_config": TorchConfig(init_method="file")}, r"TorchConfig\(init_method='file'\): 'env' or 'tcp'"),
    ({"torch_config": TorchConfig(timeout_s=0)}, r"TorchConfig\(timeout_s=0\) must be a number of seconds > 0"),
    ({"train_loop_config": [0.1]}, "train_loop_config must be a dict"),
    ({"resume_from_checkpoint": "/tmp/ckpt"}, "Checkpoint.from_directory"),
    ({"run_config": RunConfig(checkpoint_config=CheckpointConfig(num_to_keep=0))}, "num_to_keep=0"),
    ({"run_config": RunConfig(checkpoint_config=CheckpointConfig(checkpoint_score_order="best"))}, "'max' or 'min'"),
    ({"run_config": RunConfig(storage_path="s3://bucket/runs")}, r"storage_path='s3://bucket/runs'\): spark-dl writes "
     r"checkpoints to a file system path, not to a s3: URI; pass the folder where the storage is mounted"),
    ({"run_config": RunConfig(storage_path="dbfs:/runs")}, r"\(Databricks mounts it at /dbfs/runs\)"),
    ({"run_config": RunConfig(storage_path="dbfs:/Volumes/c/s/v")}, r"\(Databricks mounts it at /Volumes/c/s/v\)"),
    ({"run_config": RunConfig(storage_path="file://nas/runs")}, r"names a path on this machine \(file:///path\), not "
     r"on host 'nas'"),
    # Ray's RunConfig fields that would change what the run does: refused with the spark-dl way
    ({"run_config": RunConfig(stop={"training_iteration": 10})}, r"RunConfig\(stop=\{'training_iteration': 10\}\): "
     r"stop criteria are not supported; end the loop yourself .*broadcast_from_rank_zero"),
    ({"run_config": RunConfig(callbacks=[MLflowLoggerCallback()])}, r"callbacks=\['MLflowLoggerCallback'\]\): MLflow "
     r"tracking is built in .*drop the MLflow callback"),
    ({"run_config": RunConfig(callbacks=[PrintingCallback()])}, r"callbacks=\['PrintingCallback'\]\): Ray Tune/Train "
     r"callbacks are not run; reports reach MLflow"),
    ({"run_config": RunConfig(progress_reporter=object())}, r"progress_reporter=\.\.\.\): no progress tables"),
    ({"run_config": RunConfig(log_to_file=True)}, r"log_to_file=True\): every rank's stdout/stderr .*logs/rank<r>.txt"),
    ({"run_config": RunConfig(local_dir="/tmp/ray")}, r"local_dir='/tmp/ray'\): Ray's deprecated name; pass "
     r"storage_path"),
    ({"run_config": RunConfig(worker_runtime_env={"env_vars": {"A": "1"}})}, r"worker_runtime_env=\.\.\.\): the "
     r"workers are Spark tasks.*spark.executorEnv"),
    ({"run_config": RunConfig(sync_config=SyncConfig(sync_artifacts=True))}, r"sync_artifacts=True\)\): nothing is "
     r"synced.*get_trial_dir\(\)"),
    ({"run_config": RunConfig(storage_filesystem="s3fs")}, r"storage_filesystem=str\): spark-dl writes checkpoints to "
     r"a file system path; drop storage_filesystem"),
])
def test_bad_trainers_are_refused_at_construction(kwargs, message):
    with pytest.raises(LaunchRefused, match=message):
        TorchTrainer(lambda config: None, local_mode=True, **kwargs)


def test_bad_loops_and_calls_are_refused():
    with pytest.raises(LaunchRefused, match="takes 0 or 1 arguments"):
        TorchTrainer(lambda a, b: None, local_mode=True)
    with pytest.raises(LaunchRefused, match="must be a function"):
        TorchTrainer("train.py", local_mode=True)
    with pytest.raises(ValueError, match="not a directory"):
        Checkpoint.from_directory("/nonexistent/spark-dl")
    for call in (lambda: train.report({"loss": 1.0}), train.get_context, train.get_checkpoint):
        with pytest.raises(RuntimeError, match="not inside a TorchTrainer worker"):
            call()


def test_misuse_inside_a_worker_names_the_fix(tmp_path):
    def loop():
        errors = []
        for call in (lambda: train.report({"loss": 1.0}, checkpoint="/tmp/x"),
                     lambda: train.get_dataset_shard("validation"),
                     lambda: train.report([("loss", 1.0)])):
            try:
                call()
            except (TypeError, KeyError) as e:
                errors.append(str(e))
        with tempfile.TemporaryDirectory() as d:
            train.report({}, checkpoint=Checkpoint.from_directory(d))  # written into the storage, seen by all
        import shutil

        shutil.rmtree(train.get_checkpoint().path)  # the storage went away under the run
        train.session.REPORT_STALL_S = 0.5  # where report() and get_checkpoint() read it
        try:
            train.get_checkpoint()
        except RuntimeError as e:
            errors.append(str(e))
        train.report({"errors": errors})

    errors = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1), local_mode=True,
                          run_config=RunConfig(storage_path=str(tmp_path))).fit().metrics["errors"]
    assert "Checkpoint.from_directory" in errors[0]
    assert "no dataset named 'validation'" in errors[1]
    assert "metrics must be a dict" in errors[2]
    assert "checkpoint_000000, is not readable on rank 0 after 0.5 s: storage_path must stay mounted on every " \
           "executor, and its checkpoints be left to the run" in errors[3]


def lightning_net(pl, crash: bool = False):
    """A LightningModule class fitting y = sum(x), on Lightning package ``pl`` (``lightning`` or
    ``pytorch_lightning``); ``crash``: rank 1 dies in epoch 2 of the first attempt."""

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            if (crash and self.current_epoch == 2 and self.global_rank == 1
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                os._exit(3)
            loss = (self.layer(x) - y).pow(2).mean()
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Net


def lightning_trainer(pl, helpers, epochs: int):
    """Ray Train's Lightning idiom: a Trainer on ``helpers``' strategy, environment and report callback."""
    return pl.Trainer(max_epochs=epochs, devices="auto", accelerator="cpu", strategy=helpers.RayDDPStrategy(),
                      plugins=[helpers.RayLightningEnvironment()], callbacks=[helpers.RayTrainReportCallback()],
                      enable_checkpointing=False, enable_progress_bar=False, logger=False, enable_model_summary=False)


def lightning_loop(config):
    """Ray Train's Lightning idiom; rank 1 dies in epoch 2 of the first attempt."""
    import lightning as L
    from spark_dl.ray_train import lightning as helpers
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(256, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    trainer = helpers.prepare_trainer(lightning_trainer(L, helpers, config["epochs"]))
    net = lightning_net(L, crash=True)()
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(net, data)
    else:
        with checkpoint.as_directory() as d:
            trainer.fit(net, data, ckpt_path=os.path.join(d, helpers.RayTrainReportCallback.CHECKPOINT_NAME))
    train.report({"batches": trainer.num_training_batches, "world": trainer.world_size,
                  "environment": type(trainer.strategy.cluster_environment).__name__})


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
def test_lightning_with_rays_callback_resumes_after_a_restart(tmp_path):
    result = TorchTrainer(lightning_loop, train_loop_config={"epochs": 5}, local_mode=True,
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1))
                          ).fit()
    *epochs, last = result.reports
    assert [r["epoch"] for r in epochs] == [0, 1, 2, 3, 4]  # epoch 2 redone from epoch 1's checkpoint
    assert last == {"batches": 8, "world": 2, "environment": "RayLightningEnvironment"}  # each rank half the data
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] / 5
    state = torch.load(os.path.join(result.checkpoint.path, "checkpoint.ckpt"), weights_only=False)
    assert state["epoch"] == 4 and "layer.weight" in state["state_dict"]


def pytorch_lightning_loop(config):
    """The same idiom written with ``import pytorch_lightning as pl`` where ``lightning`` is installed too."""
    import pytorch_lightning as pl
    from spark_dl.ray_train import lightning as for_lightning
    from spark_dl.ray_train import pytorch_lightning as helpers
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(128, 4)
    trainer = lightning_trainer(pl, helpers, config["epochs"])
    try:
        for_lightning.prepare_trainer(trainer)  # the other package's helpers: named, not Lightning's own error
    except TypeError as e:
        mixed = str(e)
    trainer = helpers.prepare_trainer(trainer)
    trainer.fit(lightning_net(pl)(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16))
    train.report({"mixed": mixed, "world": trainer.world_size})


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
def test_pytorch_lightning_code_uses_helpers_built_on_its_own_package(tmp_path):
    result = TorchTrainer(pytorch_lightning_loop, train_loop_config={"epochs": 2}, local_mode=True,
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=str(tmp_path))).fit()
    *epochs, last = result.reports
    assert [r["epoch"] for r in epochs] == [0, 1] and last["world"] == 2
    assert os.listdir(result.checkpoint.path) == ["checkpoint.ckpt"]
    assert ("prepare_trainer takes a lightning.pytorch.Trainer, got Trainer: it is pytorch_lightning's; import these "
            "helpers from spark_dl.ray_train.pytorch_lightning instead") in last["mixed"]


def test_prepare_trainer_refuses_a_trainer_that_would_train_alone_on_each_worker(tmp_path):
    def loop():
        import lightning as L
        from spark_dl.ray_train.lightning import prepare_trainer

        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        try:
            prepare_trainer(trainer)
        except RuntimeError as e:
            train.report({"error": str(e)})

    result = TorchTrainer(loop, local_mode=True, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=str(tmp_path))).fit()
    assert "would train alone on each of the run's 2 workers (SingleDeviceStrategy" in result.metrics["error"]
    assert "strategy=RayDDPStrategy()" in result.metrics["error"]


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
def test_a_run_that_fails_for_good_keeps_its_latest_checkpoint_to_resume_from(tmp_path):
    config = {"lr": 0.05, "epochs": 4, "crash_at": 2}
    run = RunConfig(name="failing", storage_path=str(tmp_path))
    with pytest.raises(RankFailed) as e:  # no restarts: rank 1 dies in epoch 2
        TorchTrainer(train_func, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                     run_config=run, local_mode=True).fit()
    folder = tmp_path / "failing"
    kept = sorted(d for d in os.listdir(folder) if d.startswith("checkpoint_"))
    assert kept[:2] == ["checkpoint_000000", "checkpoint_000001"]  # written as they were reported
    path = str(folder / kept[-1])
    note = "\n".join(getattr(e.value, "__notes__", []))
    assert (f"the latest reported checkpoint is kept in {path}" in note
            and f"TorchTrainer.restore({str(folder)!r})" in note)
    epoch = torch.load(os.path.join(path, "model.pt"))["epoch"]
    assert epoch in (1, 2)  # epoch 2's report may or may not have beaten rank 1's death

    assert TorchTrainer.can_restore(folder) and not TorchTrainer.can_restore(tmp_path)
    restored = TorchTrainer.restore(f"{folder}/", train_loop_config={**config, "crash_at": None})  # Ray's way back
    assert restored.path == str(folder)
    resumed = restored.fit()
    # the Result goes on from the failed fit's reports and checkpoints, as Ray's restored run does
    assert [r["epoch"] for r in resumed.reports] == [0, 1, 2, 3]
    assert {r["started_at"] for r in resumed.reports[epoch + 1:]} == {epoch + 1}
    after = sorted(d for d in os.listdir(folder) if d.startswith("checkpoint_"))
    assert after[:len(kept)] == kept and len(after) == len(kept) + 3 - epoch  # numbering goes on
    assert resumed.checkpoint.path == str(folder / after[-1])
    assert [os.path.basename(c.path) for c, _ in resumed.best_checkpoints] == after
    assert torch.load(os.path.join(resumed.checkpoint.path, "model.pt"))["epoch"] == 3
    # restoring the finished run: nothing left to train, and its Result is still the run's
    again = TorchTrainer.restore(folder).fit()
    assert again.checkpoint.path == resumed.checkpoint.path and again.metrics["epoch"] == 3
    assert [r["epoch"] for r in again.reports] == [0, 1, 2, 3]
    with pytest.raises(LaunchRefused, match="no TorchTrainer run to restore"):
        TorchTrainer.restore(tmp_path)


def report_scored_checkpoints(config):
    for i, score in enumerate(config["scores"]):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "i"), "w") as f:
                f.write(str(i))
            train.report({"score": score, "i": i}, checkpoint=Checkpoint.from_directory(d))


@pytest.mark.parametrize("keeping, kept", [
    (CheckpointConfig(), [0, 1, 2, 3, 4]),  # Ray's default: every reported checkpoint
    (CheckpointConfig(num_to_keep=2), [3, 4]),  # the latest
    (CheckpointConfig(num_to_keep=3, checkpoint_score_attribute="score"), [0, 2, 4]),  # best two, and the latest
    (CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score", checkpoint_score_order="min"), [1, 4]),
])
def test_checkpoints_are_kept_in_storage_as_checkpoint_config_says(tmp_path, keeping, kept):
    result = TorchTrainer(report_scored_checkpoints, train_loop_config={"scores": [3, 1, 5, 2, 0]}, local_mode=True,
                          run_config=RunConfig(name="scored", storage_path=str(tmp_path),
                                               checkpoint_config=keeping)).fit()
    on_disk = sorted(d for d in os.listdir(tmp_path / "scored") if d.startswith("checkpoint_"))
    assert on_disk == [f"checkpoint_{i:06d}" for i in kept]
    assert [m["i"] for _, m in result.best_checkpoints] == kept
    assert all(open(os.path.join(c.path, "i")).read() == str(m["i"]) for c, m in result.best_checkpoints)
    assert result.checkpoint.path.endswith("checkpoint_000004")


def report_nested_scores(config):
    for i, score in enumerate(config["scores"]):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "i"), "w") as f:
                f.write(str(i))
            metrics = {"i": i} if score is None else {"i": i, "val": {"loss": torch.tensor(score)}}
            train.report(metrics, checkpoint=Checkpoint.from_directory(d))


@pytest.mark.parametrize("order, kept", [("min", [2, 4]), ("max", [1, 4])])
def test_a_nested_score_ranks_checkpoints_and_reports_without_a_number_rank_last(tmp_path, capfd, order, kept):
    """Ray's "val/loss" reaches into {"val": {"loss": ...}}; a NaN or a missing score never
    outranks a real one, whichever the order (before, NaN kept a checkpoint for good)."""
    keeping = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val/loss", checkpoint_score_order=order)
    result = TorchTrainer(report_nested_scores, train_loop_config={"scores": [float("nan"), 1.0, 0.5, None, 3.0]},
                          local_mode=True, run_config=RunConfig(name="nested", storage_path=str(tmp_path),
                                                                checkpoint_config=keeping)).fit()
    assert [m["i"] for _, m in result.best_checkpoints] == kept
    on_disk = sorted(d for d in os.listdir(tmp_path / "nested") if d.startswith("checkpoint_"))
    assert on_disk == [f"checkpoint_{i:06d}" for i in kept]
    assert result.metrics == {"i": 4, "val": {"loss": 3.0}} and isinstance(result.metrics["val"]["loss"], float)
    best = {"min": 2, "max": 4}[order]  # Ray's Result.get_best_checkpoint, over the kept ones
    assert open(os.path.join(result.get_best_checkpoint("val/loss", order).path, "i")).read() == str(best)
    assert result.get_best_checkpoint("accuracy", "max") is None
    with pytest.raises(ValueError, match="'min' or 'max'"):
        result.get_best_checkpoint("val/loss", "lowest")
    err = capfd.readouterr().err
    assert err.count("checkpoint_score_attribute='val/loss'") == 1 and "report 0 has no number there" in err


def test_a_restored_run_keeps_num_to_keep_across_its_fits(tmp_path):
    keeping = CheckpointConfig(num_to_keep=1)
    first = TorchTrainer(report_scored_checkpoints, train_loop_config={"scores": [3, 1]}, local_mode=True,
                         run_config=RunConfig(name="kept", storage_path=str(tmp_path), checkpoint_config=keeping)).fit()
    assert [os.path.basename(c.path) for c, _ in first.best_checkpoints] == ["checkpoint_000001"]
    second = TorchTrainer.restore(first.path, train_loop_config={"scores": [2]}).fit()
    on_disk = sorted(d for d in os.listdir(first.path) if d.startswith("checkpoint_"))
    assert on_disk == ["checkpoint_000002"]  # the first fit's kept one counted, so pruned
    assert [r["score"] for r in second.reports] == [3, 1, 2]


def test_rays_harmless_run_config_fields_are_accepted_and_kept_by_restore(tmp_path):
    from pyarrow.fs import LocalFileSystem

    run = RunConfig(name="harmless", storage_path=str(tmp_path), verbose=1, sync_config=SyncConfig(), callbacks=[],
                    storage_filesystem=LocalFileSystem(), log_to_file=False, worker_runtime_env={})
    result = TorchTrainer(lambda: train.report({"ok": 1}), local_mode=True, run_config=run).fit()
    assert result.metrics == {"ok": 1}
    restored = TorchTrainer.restore(result.path)
    assert restored.run_config.sync_config == SyncConfig() and restored.run_config.verbose == 1


def report_named_checkpoints(config):
    """Epochs named epoch_<n> (one left to the automatic checkpoint_<n>), resumed from get_checkpoint();
    rank 1 fails right after epoch 1's report in the first attempt when config says so."""
    ctx = train.get_context()
    start = 0
    checkpoint = train.get_checkpoint()  # the kept folder, or (through the driver) a copy of it
    if checkpoint:
        with checkpoint.as_directory() as d:
            start = int(open(os.path.join(d, "epoch")).read()) + 1
    for epoch in range(start, config["epochs"]):
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "epoch"), "w").write(str(epoch))
            name = None if epoch == config.get("unnamed") else f"epoch_{epoch}"
            train.report({"epoch": epoch, "started_at": start},
                         checkpoint=Checkpoint.from_directory(d) if ctx.get_world_rank() == 0 else None,
                         checkpoint_dir_name=name)
        if (epoch == config.get("crash_after") and ctx.get_world_rank() == 1
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
            raise ValueError("failed after the report")


@pytest.mark.parametrize("storage", ["auto", "driver"])
def test_checkpoint_dir_name_names_the_kept_folder_through_pruning_restarts_and_restore(tmp_path, monkeypatch, storage):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)
    run = RunConfig(name="named", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1),
                    checkpoint_config=CheckpointConfig(num_to_keep=2))
    result = TorchTrainer(report_named_checkpoints, train_loop_config={"epochs": 4, "unnamed": 3, "crash_after": 1},
                          scaling_config=ScalingConfig(num_workers=2), local_mode=True, run_config=run).fit()
    folder = tmp_path / "named"
    # the restart resumed from the named folder of the report before the failure
    assert [(r["epoch"], r["started_at"]) for r in result.reports] == [(0, 0), (1, 0), (2, 2), (3, 2)]
    assert sorted(d for d in os.listdir(folder) if not d.startswith("spark_dl_")) == ["checkpoint_000003", "epoch_2"]
    assert [os.path.basename(c.path) for c, _ in result.best_checkpoints] == ["epoch_2", "checkpoint_000003"]
    assert result.checkpoint.path == str(folder / "checkpoint_000003")
    # restore() follows the record, not the highest checkpoint_<n>: here the latest is named
    more = TorchTrainer.restore(folder, train_loop_config={"epochs": 6, "unnamed": 4})
    assert more.resume_from_checkpoint.path == str(folder / "checkpoint_000003")
    more = more.fit()
    assert [(r["epoch"], r["started_at"]) for r in more.reports[4:]] == [(4, 4), (5, 4)]
    assert sorted(d for d in os.listdir(folder) if not d.startswith("spark_dl_")) == ["checkpoint_000004", "epoch_5"]
    assert open(folder / "epoch_5" / "epoch").read() == "5"
    again = TorchTrainer.restore(folder)
    assert again.resume_from_checkpoint.path == str(folder / "epoch_5")  # named, and numbered lower than the other


def test_bad_checkpoint_dir_names_are_refused_with_the_reason(tmp_path):
    def loop():
        errors = []
        with tempfile.TemporaryDirectory() as d:
            checkpoint = Checkpoint.from_directory(d)
            train.report({}, checkpoint=checkpoint, checkpoint_dir_name="best")
            for bad in ("a/b", "..", "", ".hidden", "checkpoint_000007", 7, "best", "first"):
                try:
                    train.report({}, checkpoint=checkpoint, checkpoint_dir_name=bad)
                except (TypeError, ValueError) as e:
                    errors.append(str(e))
        train.report({"errors": errors})

    first = TorchTrainer(lambda: train.report({}, checkpoint=Checkpoint.from_directory(tempfile.mkdtemp()),
                                              checkpoint_dir_name="first"),
                         local_mode=True, run_config=RunConfig(name="bad", storage_path=str(tmp_path))).fit()
    assert first.checkpoint.path == str(tmp_path / "bad" / "first")
    errors = TorchTrainer(loop, local_mode=True, run_config=RunConfig(name="bad", storage_path=str(tmp_path))
                          ).fit().metrics["errors"]
    assert len(errors) == 8
    assert all("give a plain folder name (no '/', not '.' or '..'" in e for e in errors[:3])
    assert "names starting with '.' are the run's staging and probe files" in errors[3]
    assert "checkpoint_<number> names are the automatic ones" in errors[4]
    assert "give the checkpoint folder's name as a str" in errors[5]
    assert "report 0 of this fit already put a checkpoint under that name" in errors[6]
    assert f"{tmp_path / 'bad'} already holds 'first' (an earlier fit's checkpoint" in errors[7]
    assert os.listdir(first.checkpoint.path) == []  # the earlier fit's checkpoint is untouched


@pytest.mark.parametrize("storage", ["auto", "driver"])
def test_workers_passing_different_checkpoint_dir_names_fail_the_run(tmp_path, monkeypatch, storage):
    monkeypatch.setenv("SPARK_DL_RAY_STORAGE", storage)

    def loop():
        rank = train.get_context().get_world_rank()
        with tempfile.TemporaryDirectory() as d:
            # a rank with neither a checkpoint nor a name takes no part in the name
            train.report({}, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None,
                         checkpoint_dir_name="same" if rank == 0 else None)
            train.report({}, checkpoint=Checkpoint.from_directory(d), checkpoint_dir_name=f"rank_{rank}")

    with pytest.raises(RankFailed, match=r"the workers passing a checkpoint or a name \(ranks \[0, 1\]\) passed "
                                         r"different names \(rank [01]: 'rank_[01]'\).*pass the same name on every "
                                         r"worker"):
        TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2), local_mode=True,
                     run_config=RunConfig(name="differ", storage_path=str(tmp_path))).fit()
    assert sorted(d for d in os.listdir(tmp_path / "differ") if not d.startswith("spark_dl_")) == ["same"]


def test_result_from_path_is_the_runs_result_and_other_folders_are_refused(tmp_path):
    from pyarrow.fs import LocalFileSystem, SubTreeFileSystem

    keeping = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score")
    run = RunConfig(name="done", storage_path=str(tmp_path), checkpoint_config=keeping)
    result = TorchTrainer(report_scored_checkpoints, train_loop_config={"scores": [3, 1, 5, 2]}, local_mode=True,
                          run_config=run).fit()
    for given in (result.path, f"{result.path}/", f"file://{result.path}"):
        loaded = Result.from_path(given)
        assert loaded.path == result.path and loaded.metrics == result.metrics == {"score": 2, "i": 3}
        assert loaded.checkpoint.path == result.checkpoint.path and loaded.error is None
        assert [(c.path, m) for c, m in loaded.best_checkpoints] == [(c.path, m) for c, m in result.best_checkpoints]
        assert loaded.reports == result.reports and list(loaded.metrics_dataframe["score"]) == [3, 1, 5, 2]
        assert loaded.get_best_checkpoint("score", "max").path.endswith("checkpoint_000002")
    assert isinstance(loaded.filesystem, LocalFileSystem)
    assert Result.from_path(result.path, storage_filesystem=LocalFileSystem()).metrics == result.metrics
    with pytest.raises(ValueError, match=rf"Result.from_path\('{tmp_path}'\): not a run folder \(no readable "
                                         r"spark_dl_run.json\); expected a TorchTrainer run's folder, "
                                         r"storage_path/name \(Result.path\)"):
        Result.from_path(tmp_path)
    with pytest.raises(ValueError, match=r"nowhere'\): no such folder; expected a TorchTrainer run's folder"):
        Result.from_path(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"storage_filesystem=SubTreeFileSystem\): spark-dl's runs are on file system"):
        Result.from_path(result.path, storage_filesystem=SubTreeFileSystem(str(tmp_path), LocalFileSystem()))


def report_context(config):
    import torch.distributed as dist

    ctx = train.get_context()
    seen = [None] * ctx.get_world_size()
    dist.all_gather_object(seen, (ctx.get_trial_dir(), ctx.get_trial_id(), ctx.get_trial_name()))
    with tempfile.TemporaryDirectory() as d:
        train.report({"seen": seen}, checkpoint=Checkpoint.from_directory(d) if config.get("checkpoint") else None)


def test_a_second_fit_with_the_same_name_is_a_new_run_that_leaves_the_first_alone(tmp_path, capfd):
    keeping = CheckpointConfig(num_to_keep=1)
    run = RunConfig(name="twice", storage_path=str(tmp_path), checkpoint_config=keeping)
    first = TorchTrainer(report_scored_checkpoints, train_loop_config={"scores": [3, 1]}, local_mode=True,
                         run_config=run).fit()
    assert "already holds a run" not in capfd.readouterr().err
    second = TorchTrainer(report_scored_checkpoints, train_loop_config={"scores": [7, 8]}, local_mode=True,
                          run_config=run).fit()
    folder = tmp_path / "twice"
    err = capfd.readouterr().err
    assert f"[spark-dl] {folder} already holds a run (1 checkpoint folder): this fit starts a new run there" in err
    assert "it never removes or overwrites them, nor counts them toward num_to_keep" in err
    assert f"use TorchTrainer.restore({str(folder)!r})" in err
    # as each Ray fit() is a new trial: the first run's checkpoint stays, for its Result, uncounted
    assert first.checkpoint.path == str(folder / "checkpoint_000001") and open(
        os.path.join(first.checkpoint.path, "i")).read() == "1"
    assert second.checkpoint.path == str(folder / "checkpoint_000003")
    assert [r["score"] for r in second.reports] == [7, 8] and len(second.best_checkpoints) == 1
    assert sorted(d for d in os.listdir(folder) if d.startswith("checkpoint_")) == ["checkpoint_000001",
                                                                                 "checkpoint_000003"]
    # the folder's record, Result.from_path and restore() follow the new run
    assert Result.from_path(folder).reports == second.reports
    third = TorchTrainer.restore(folder, train_loop_config={"scores": [9]}).fit()
    assert [r["score"] for r in third.reports] == [7, 8, 9]
    assert sorted(d for d in os.listdir(folder) if d.startswith("checkpoint_")) == ["checkpoint_000001",
                                                                                 "checkpoint_000004"]


def test_the_context_names_the_runs_folder_and_its_id(tmp_path, capfd):
    run = RunConfig(name="ctx", storage_path=str(tmp_path))
    result = TorchTrainer(report_context, train_loop_config={"checkpoint": True}, local_mode=True,
                          scaling_config=ScalingConfig(num_workers=2), run_config=run).fit()
    (folder, trial_id, name), other = result.metrics["seen"]
    assert other == (folder, trial_id, name) or list(other) == [folder, trial_id, name]  # every worker alike
    assert folder == result.path and name == "ctx" and len(trial_id) == 8
    restored = TorchTrainer.restore(result.path).fit()  # the same run: the same id
    assert [tuple(s) for s in restored.metrics["seen"]] == [(folder, trial_id, "ctx")] * 2
    fresh = TorchTrainer(report_context, local_mode=True, run_config=run).fit()  # a new run: a new id
    assert fresh.metrics["seen"][0][1] != trial_id


def test_the_context_names_the_runs_folder_and_its_id_on_spark(spark, tmp_path):
    result = TorchTrainer(report_context, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="ctx", storage_path=str(tmp_path))).fit()
    seen = [tuple(s) for s in result.metrics["seen"]]
    assert seen[0] == seen[1] and seen[0][0] == result.path == str(tmp_path / "ctx") and len(seen[0][1]) == 8
