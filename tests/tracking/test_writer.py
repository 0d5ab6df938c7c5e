"""The driver's MLflow writer and the rank-side helpers on their own, against a real local store."""
from __future__ import annotations

import time
import warnings
from types import SimpleNamespace

import mlflow
import pytest
from mlflow import MlflowClient

from spark_dl.tracking.driver.mlflow_writer import MlflowWriter, TrackingWarning
from spark_dl.tracking.params import flatten, is_secret_name, redact
from spark_dl.tracking.rank.buffer import CommSampler as _CommSampler


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
    mark = "...[cut from 10000 chars]"  # cut to MLflow's limit, visibly
    assert run.data.params["long"] == "x" * (6000 - len(mark)) + mark
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


def test_credentials_are_known_by_their_names_not_by_words_inside_them():
    secret = ["hf_token", "HF_TOKEN", "db_password", "apiKey", "api_key", "aws_secret_access_key", "sas_token",
              "--hf-token", "auth_header", "credentials", "storage_account_key", "Authorization"]
    plain = ["max_tokens", "tokenizer", "sort_key", "key", "author", "lr", "num_tokens", "keyword"]
    assert [n for n in secret if not is_secret_name(n)] == [] and [n for n in plain if is_secret_name(n)] == []


def test_redact_hides_credentials_by_name_in_argv_and_in_url_passwords():
    out = redact({"hf_token": "hf_abc", "cfg.api_key": "k1", "max_tokens": 512, "token": None,
                  "db": "postgresql://bob:s3cr@t@db:5432/x", "urls": ["https://u:p@h/a", "https://h/a:b@c"],
                  "argv": ["--lr", "0.1", "--hf-token", "abc", "--api-key=xyz", "--token", "--verbose",
                           "--db", "mysql://u:pw@h/x"]})
    assert out == {"hf_token": "***", "cfg.api_key": "***", "max_tokens": 512, "token": None,
                   "db": "postgresql://bob:***@db:5432/x", "urls": ["https://u:***@h/a", "https://h/a:b@c"],
                   "argv": ["--lr", "0.1", "--hf-token", "***", "--api-key=***", "--token", "--verbose",
                            "--db", "mysql://u:***@h/x"]}


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


def test_errors_a_retry_cannot_fix_are_told_from_server_trouble():
    from mlflow.exceptions import MlflowException
    from mlflow.protos import databricks_pb2 as codes

    from spark_dl.tracking.driver.mlflow_writer import _permanent

    def permanent(code):
        return _permanent(MlflowException("x", error_code=getattr(codes, code)))

    for code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "ENDPOINT_NOT_FOUND", "UNAUTHENTICATED",
                 "PERMISSION_DENIED", "BAD_REQUEST", "INVALID_STATE", "MAX_BLOCK_SIZE_EXCEEDED"):
        assert permanent(code), code
    for code in ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED",
                 "RESOURCE_CONFLICT", "IO_ERROR"):
        assert not permanent(code), code
    assert not _permanent(ConnectionRefusedError()) and _permanent(ValueError("a model that does not unpickle"))


@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_a_run_mlflow_refuses_to_create_is_given_up_at_once(store, request):
    uri = request.getfixturevalue("tracking_uri" if store == "sqlite" else "server_uri")
    w = _one_metric_then_close(uri, "987654321", 30.0, within_s=10,  # not retried until grace_s
                               match=r"refused to create the run in experiment 987654321 .*not tracked \(training "
                                     r"is not affected\)\. Fix: check the tracking URI, and point MLFLOW_EXPERIMENT_ID")
    assert w.run_id is None and w.dropped >= 1


def _one_metric_then_close(uri, experiment_id, grace_s, within_s, match):
    """A writer given one metric, closed: it must fail to write it, say ``match``, and return within ``within_s``."""
    w = MlflowWriter(uri, None, experiment_id, grace_s=grace_s)
    w.log_metrics([("loss", 1.0, 1_000, 0)])
    t0 = time.monotonic()
    with pytest.warns(TrackingWarning, match=match):
        assert not w.close("FINISHED")
    assert time.monotonic() - t0 < within_s
    return w


def test_a_write_that_keeps_failing_never_holds_back_the_runs_end(tracking_uri, tmp_path, capfd):
    """An artifact location that cannot be written (under a file): the artifacts are skipped at the
    end, the metrics, tags and the run's FINISHED status are written."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    exp = MlflowClient().create_experiment("bad-artifacts", artifact_location=str(blocker / "artifacts"))
    w = MlflowWriter(tracking_uri, None, exp, grace_s=2.0)
    w.log_metrics([("loss", 1.0, 1_000, 0)])
    w.log_artifact_bytes("a.txt", b"a")
    w.log_artifact_bytes("b.txt", b"b")
    w.set_tags({"after": "yes"})
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not w.close("FINISHED")
    elapsed = time.monotonic() - t0
    run = MlflowClient().get_run(w.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"loss": 1.0} and run.data.tags["after"] == "yes"
    assert w.dropped == 2 and elapsed < 8, (w.dropped, elapsed)
    said = " ".join(str(c.message) for c in caught if issubclass(c.category, TrackingWarning)) + capfd.readouterr().err
    assert "skipped artifact 'a.txt' so that the rest of the run could be written" in said
    assert "NotADirectoryError" in said


def test_a_new_sqlite_store_is_created_and_written_however_short_grace_s(tmp_path):
    """The first write to a new SQLite store creates it (MLflow's schema migrations: seconds on a busy
    machine); a writer closed before that is done waits for it instead of dropping the run."""
    uri = f"sqlite:///{tmp_path / 'new.db'}"
    w = MlflowWriter(uri, None, "0", grace_s=0.0)
    w.log_metrics([("loss", 1.0, 1_000, 0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackingWarning)
        assert w.close("FINISHED")
    run = MlflowClient(uri).get_run(w.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"loss": 1.0}


def test_a_server_that_takes_connections_and_never_answers_costs_grace_s_not_a_minute():
    import socket

    with socket.socket() as s:  # listens (the kernel completes connections) but never reads or answers
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        _one_metric_then_close(f"http://127.0.0.1:{s.getsockname()[1]}", "0", 2.0, within_s=6,
                               match=r"could not be completed: it did not answer within 2 s\. Training was not "
                                     r"affected; about \d+ pending MLflow writes were dropped")
