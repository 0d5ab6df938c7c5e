"""The driver's MLflow writer and the rank-side helpers on their own, against a real local store."""
from __future__ import annotations

from types import SimpleNamespace

import mlflow
import pytest
from mlflow import MlflowClient

from spark_dl.tracking.mlflow_writer import MlflowWriter, TrackingWarning
from spark_dl.tracking.params import flatten
from spark_dl.tracking.rank import _CommSampler


def test_large_batches_are_split_and_long_params_truncated(tracking_uri):
    w = MlflowWriter(tracking_uri, None, "0")
    params = {f"p{i}": i for i in range(250)}
    params["long"] = "x" * 10_000
    w.log_params(params)
    w.log_metrics([("m", float(i), 1_000 + i, i) for i in range(2500)])
    assert w.close("FINISHED")
    run = MlflowClient().get_run(w.run_id)
    assert run.info.status == "FINISHED"
    assert len(run.data.params) == 251 and run.data.params["p249"] == "249"
    assert run.data.params["long"] == "x" * 6000
    assert [m.step for m in MlflowClient().get_metric_history(w.run_id, "m")] == list(range(2500))


def test_a_rejected_param_costs_only_itself(tracking_uri):
    with mlflow.start_run() as run:
        mlflow.log_param("lr", "0.5")
        w = MlflowWriter(tracking_uri, run.info.run_id)
        w.log_params({"lr": 0.1, "batch": 64})  # lr conflicts with the user's value: MLflow refuses it
        w.log_metrics([("loss", 1.0, 1_000, 0)])
        with pytest.warns(TrackingWarning, match="MLflow rejected a write"):  # said once, not raised
            assert not w.close("FINISHED")
        assert w.dropped == 1
    data = MlflowClient().get_run(run.info.run_id).data
    assert data.params == {"lr": "0.5", "batch": "64"} and data.metrics == {"loss": 1.0}


def test_nested_params_are_flattened():
    assert flatten({"opt": {"name": "sgd", "betas": {"b1": 0.9}}, "lr": 1}) == {
        "opt.name": "sgd", "opt.betas.b1": 0.9, "lr": 1,
    }


def test_compression_stats_become_per_step_metrics():
    stats = SimpleNamespace(bytes_sent=0, calls=0, seconds=0.0, bytes_dense=0)
    sampler = _CommSampler(SimpleNamespace(stats=stats))
    out: dict[str, float] = {}
    sampler.sample(0, out)
    assert out == {}  # a first reading has nothing to compare with
    stats.bytes_sent, stats.calls, stats.seconds, stats.bytes_dense = 1000, 4, 0.02, 32000
    sampler.sample(2, out)
    assert out == {
        "comm/bytes_sent_per_step": 500.0, "comm/allreduce_s_per_step": 0.01,
        "comm/allreduce_calls_per_step": 2.0, "comm/compression_ratio": 32.0,
    }
