"""A Spark Connect client that runs spark-dl against a real Spark Connect server.

A Connect session switches pyspark in its process to Connect mode, so each check runs here, in a
process of its own: ``python connect_client.py MODE sc://HOST:PORT``. Prints ``RESULT <json>``.
"""
import json
import os
import sys
import threading
import time

import cloudpickle
import procs
from pyspark.sql import SparkSession

from spark_dl import HorovodRunner, JobFailed, LaunchRefused, TorchDistributor

cloudpickle.register_pickle_by_value(procs)  # the ranks cannot import this directory's modules


def world(tag, *, y=0):
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"hello from rank {dist.get_rank()}", flush=True)
    return {"tag": tag, "y": y, "sum": t.item(), "rank": os.environ["RANK"], "pid": os.getpid(),
            "task_pid": int(os.environ["SPARK_DL_TASK_PID"]), "host": socket.gethostname()}


def fail_on_rank_1(pid_dir):
    procs.record_self_and_child(pid_dir)
    if os.environ["RANK"] == "1":
        raise ValueError("loss is NaN on rank 1")
    time.sleep(120)


def fail_first_attempt():
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        raise RuntimeError("executor lost (pretend)")
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def errors(fn, *args, **kwargs) -> dict:
    t = time.monotonic()
    try:
        fn(*args, **kwargs)
    except (LaunchRefused, JobFailed) as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t,
                "rank": getattr(e, "rank", None)}
    return {"type": None, "seconds": time.monotonic() - t}


def run_mode(spark) -> dict:
    out = {"ranks": HorovodRunner(np=2, driver_log_verbosity="all").run_all(world, "a", y=4)}
    pid_dir = os.environ["PID_DIR"]
    out["failure"] = errors(HorovodRunner(np=2).run, fail_on_rank_1, pid_dir=pid_dir)
    out["left_alive"] = procs.wait_all_dead(procs.recorded_pids(pid_dir), timeout=20)
    out["after_failure"] = HorovodRunner(np=2).run(world, "b")["sum"]
    out["restarted"] = HorovodRunner(np=2, max_restarts=1).run(fail_first_attempt)
    out["too_many"] = errors(HorovodRunner(np=3).run, world, "c")

    def hang():
        time.sleep(120)

    out["run_timeout"] = errors(HorovodRunner(np=2, run_timeout=3).run, hang)
    with open("train.py", "w") as f:  # a script that writes what torchrun would have given it
        f.write("import os, sys\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
                "print('script rank', dist.get_rank(), 'of', dist.get_world_size(), sys.argv[1:], flush=True)\n"
                "sys.exit(int(sys.argv[2]) if dist.get_rank() == 1 else 0)\n")
    HorovodRunner(np=2, driver_log_verbosity="all").run_script("train.py", "--code", "0")
    out["script_failure"] = errors(HorovodRunner(np=2).run_script, "train.py", "--code", "3")
    return out


def data_mode(spark) -> dict:
    import torch
    from spark_dl.estimator import TorchEstimator
    from spark_dl.horovod import spark as hvd_spark

    from spark_dl.data import shards

    def rows(data):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return sorted(float(x) for b in data.batches(2) for x in b["x"])

    df = spark.createDataFrame([(float(i), 3.0 * i - 2.0) for i in range(40)], "x double, y double")
    out = {"shards": HorovodRunner(np=2).run_all(rows, data=shards(df.filter("x < 10"), remainder="pad"))}

    def rank_and_size(a):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return [dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], a]

    out["distributor"] = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(rank_and_size, 5)
    out["distributor_gpu"] = errors(TorchDistributor, num_processes=2, local_mode=False, use_gpu=True)

    def hvd_rank():
        import spark_dl.horovod as hvd

        hvd.init()
        return hvd.rank()

    out["horovod_spark"] = hvd_spark.run(hvd_rank)  # num_proc from the local cluster's declared slots

    from spark_dl.ray_train import RunConfig, ScalingConfig, TorchTrainer

    def ray_loop(config):
        import spark_dl.ray_train as train

        rows = [float(v) for b in train.get_dataset_shard("train").iter_torch_batches(batch_size=4) for v in b["x"]]
        train.report({"rows": len(rows), "world": train.get_context().get_world_size(), "lr": config["lr"]})

    out["ray"] = TorchTrainer(ray_loop, train_loop_config={"lr": 0.1}, scaling_config=ScalingConfig(num_workers=2),
                              datasets={"train": df}, run_config=RunConfig(storage_path="ray_results")).fit().metrics

    class Line(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)

        def forward(self, x):
            return self.lin(x.unsqueeze(1)).squeeze(1)

    torch.manual_seed(0)
    est = TorchEstimator(model=Line(), optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
                         loss=torch.nn.functional.mse_loss, feature_cols="x", label_cols="y",
                         epochs=60, batch_size=8, num_proc=2, validation=0.25)  # a second DataFrame in the run
    scaled = df.selectExpr("x / 40 as x", "y / 40 as y")
    model = est.fit(scaled)
    predicted = model.transform(scaled).orderBy("x").collect()
    out["estimator"] = {"weight": model.model.lin.weight.item(), "bias": model.model.lin.bias.item(),
                        "max_error": max(abs(r["prediction"] - r["y"]) for r in predicted), "rows": len(predicted),
                        "val_history": model.val_history}
    out["saved"] = _save_and_load(est, model, scaled)
    out["staged"] = _staged(est, scaled)
    return out


def _save_and_load(est, model, df) -> dict:
    """Spark ML's save, overwrite() (whose JVM delete a Connect client has not) and load."""
    import tempfile

    from spark_dl.estimator import TorchEstimator, TorchModel

    where = tempfile.mkdtemp(dir=os.getcwd())
    model.save(f"{where}/model")
    first = errors_any(model.save, f"{where}/model")  # there already: Spark's error, not a silent overwrite
    est.save(f"{where}/est")
    est.setEpochs(7)
    est.write().overwrite().save(f"{where}/est")
    model.write().overwrite().save(f"{where}/model")
    loaded = TorchModel.load(f"{where}/model")
    again = {r["x"]: r["prediction"] for r in loaded.transform(df).collect()}
    mine = {r["x"]: r["prediction"] for r in model.transform(df).collect()}
    return {"exists_error": first, "predictions_equal": again == mine,
            "history_equal": loaded.history == model.history,
            "estimator_epochs": TorchEstimator.load(f"{where}/est").getEpochs()}


def errors_any(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - Spark Connect's own error classes
        return f"{type(e).__name__}: {e}"
    return None


def _staged(est, df) -> dict:
    """Horovod's Parquet staging through Connect: the server's executors write and read the files."""
    import tempfile

    import torch
    from spark_dl.horovod import staging
    from spark_dl.horovod.store import Store

    store = Store.create(tempfile.mkdtemp(dir=os.getcwd()))
    with staging.prepare_data(2, store, df, label_columns="y", feature_columns="x", validation=0.25) as idx:
        props = staging.get_dataset_properties(idx)
        torch.manual_seed(0)
        fitted = est.copy({est.epochs: 60, est.store: store}).fit_on_parquet(dataset_idx=idx)
    staging.clear_training_cache(remove_data=True)
    return {"rows": [props["train_rows"], props["val_rows"]], "weight": fitted.model.lin.weight.item(),
            "val_history": fitted.val_history, "left": sorted(os.listdir(store.prefix_path))}


def timeout_mode(spark) -> dict:
    def sleeper():
        time.sleep(20)

    holder = threading.Thread(target=HorovodRunner(np=2).run, args=(sleeper,))  # holds both task slots
    holder.start()
    time.sleep(8)
    out = {"timed_out": errors(HorovodRunner(np=2, start_timeout=4).run, world, "d")}
    holder.join()
    out["after"] = HorovodRunner(np=2).run(world, "e")["sum"]
    spark.stop()
    out["stopped"] = errors(HorovodRunner(np=2).run, world, "f")
    return out


def relay_mode(spark) -> dict:
    """SPARK_DL_CHANNEL=relay: barrier task 0 stands in for this client, as for one off the cluster."""
    import hashlib

    import mlflow

    from spark_dl import load_checkpoint, log_metrics, save_checkpoint
    from spark_dl.data import shards

    os.environ["SPARK_DL_CHANNEL"] = "relay"

    def logged(tag, y):
        for step in range(3):
            log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        return world(tag, y=y)

    os.environ["SPARK_DL_TRACKING"] = "1"  # the suite turns it off; MLflow's default store, in this directory
    runner = HorovodRunner(np=2, driver_log_verbosity="all")
    out = {"ranks": runner.run_all(logged, "r", y=2)}
    history = mlflow.MlflowClient().get_metric_history(runner.last_run.mlflow_run_id, "loss")
    out["loss"] = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
    os.environ["SPARK_DL_TRACKING"] = "0"

    pid_dir = os.environ["PID_DIR"]
    out["failure"] = errors(HorovodRunner(np=2).run, fail_on_rank_1, pid_dir=pid_dir)
    out["left_alive"] = procs.wait_all_dead(procs.recorded_pids(pid_dir), timeout=20)

    def checkpointed():
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 1:
            return load_checkpoint()
        import torch.distributed as dist

        dist.init_process_group("gloo")
        save_checkpoint({"step": 7}, step=7)
        dist.barrier()  # rank 0's checkpoint is stored before rank 1 fails
        if os.environ["RANK"] == "1":
            raise RuntimeError("executor lost (pretend)")
        time.sleep(120)

    out["resumed"] = HorovodRunner(np=2, max_restarts=1).run(checkpointed)

    def big():
        blob = os.urandom(3 << 20)  # larger than one result row of the relay's report
        return {"blob": blob, "sha": hashlib.sha256(blob).hexdigest()}

    got = HorovodRunner(np=2).run(big)
    out["big"] = hashlib.sha256(got["blob"]).hexdigest() == got["sha"]

    def hang():
        print(f"rank {os.environ['RANK']} waits for a peer", flush=True)
        time.sleep(120)

    out["run_timeout"] = errors(HorovodRunner(np=2, run_timeout=3).run, hang)

    def rows(data):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return sorted(float(x) for b in data.batches(2) for x in b["x"])

    df = spark.createDataFrame([(float(i),) for i in range(10)], "x double")
    out["shards"] = HorovodRunner(np=2).run_all(rows, data=shards(df))

    from spark_dl.ray_train import Checkpoint, RunConfig, ScalingConfig, TorchTrainer

    def sharded():
        import tempfile

        import spark_dl.ray_train as train

        rank = train.get_context().get_world_rank()
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"shard-{rank}"), "w") as f:
                f.write(str(rank))
            train.report({"rank": rank}, checkpoint=Checkpoint.from_directory(d))

    def read_resumed():
        import spark_dl.ray_train as train

        checkpoint = train.get_checkpoint()
        with checkpoint.as_directory() as d:
            files = {f: open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))}
        train.report({"files": files, "path": checkpoint.path})  # every worker reads it; rank 0's is returned

    for storage in ("shared", "driver"):  # written by the workers / sent through task 0 to this client
        os.environ["SPARK_DL_RAY_STORAGE"] = storage
        result = TorchTrainer(sharded, scaling_config=ScalingConfig(num_workers=2),
                              run_config=RunConfig(storage_path="ray_results", name=storage)).fit()
        path = result.checkpoint.path
        out[f"ray_{storage}"] = {f: open(os.path.join(path, f)).read() for f in sorted(os.listdir(path))}
        # resumed from it: read in place where the workers see it, else fetched from task 0's relay
        resumed = TorchTrainer(read_resumed, scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(storage_path="ray_results", name=f"{storage}-resumed"),
                               resume_from_checkpoint=result.checkpoint).fit()
        out[f"ray_{storage}_resumed"] = resumed.metrics | {"in_place": resumed.metrics["path"] == path}
    del os.environ["SPARK_DL_RAY_STORAGE"]

    def sleeper():
        time.sleep(12)

    holder = threading.Thread(target=HorovodRunner(np=2).run, args=(sleeper,))  # holds both task slots
    holder.start()
    time.sleep(6)
    out["timed_out"] = errors(HorovodRunner(np=2, start_timeout=4).run, world, "t")
    holder.join()
    return out


def lost_mode(spark) -> dict:
    """A relayed run whose barrier task 0 (the job's control server) loses its executor JVM."""
    from spark_dl import load_checkpoint, save_checkpoint

    os.environ["SPARK_DL_CHANNEL"] = "relay"

    def kill_task_0s_executor(pid_dir):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "1":  # the relaunch: what did the lost attempt leave?
            return {"restart_count": 1, "checkpoint": load_checkpoint()}
        procs.record_self_and_child(pid_dir)
        save_checkpoint({"step": 5}, step=5)  # held by task 0 until the attempt ends
        dist.barrier()
        if os.environ["RANK"] == "0":
            pid = os.getpid()
            while pid > 1:  # up the process tree to the executor's JVM
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"CoarseGrainedExecutorBackend" in f.read():
                        os.kill(pid, 9)
                        time.sleep(120)
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            raise RuntimeError("no executor JVM above rank 0")
        time.sleep(120)

    dirs = [os.path.join(os.environ["PID_DIR"], f"attempt-{i}") for i in range(2)]
    for d in dirs:
        os.makedirs(d)
    out = {"lost": errors(HorovodRunner(np=2).run, kill_task_0s_executor, pid_dir=dirs[0])}
    out["left_alive"] = procs.wait_all_dead(procs.recorded_pids(dirs[0]), timeout=20)
    out["relaunched"] = HorovodRunner(np=2, max_restarts=1).run(kill_task_0s_executor, pid_dir=dirs[1])
    out["left_alive_relaunched"] = procs.wait_all_dead(procs.recorded_pids(dirs[1]), timeout=20)
    return out


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    session = SparkSession.builder.remote(url).getOrCreate()
    result = {"run": run_mode, "data": data_mode, "timeout": timeout_mode, "relay": relay_mode,
              "lost": lost_mode}[mode](session)
    print("RESULT " + json.dumps(result), flush=True)
