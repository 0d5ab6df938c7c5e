"""MLflow tracking and live progress for :class:`spark_dl.HorovodRunner` runs.

Ranks call :func:`log_metrics`, :func:`log_params`, :func:`log_model` (or MLflow's fluent API,
which is routed); everything travels over the job's channel to the driver, the only MLflow client,
which writes one run per ``run()`` call in batches from a background thread.
"""
from spark_dl.errors import TrackingWarning
from spark_dl.tracking.driver.observer import Tracking, TrackingObserver, make_observer
from spark_dl.tracking.rank.api import log_artifact_bytes, log_metric, log_metrics, log_model, log_params, set_tags

__all__ = [
    "Tracking",
    "TrackingObserver",
    "TrackingWarning",
    "make_observer",
    "log_metrics",
    "log_metric",
    "log_params",
    "log_model",
    "set_tags",
    "log_artifact_bytes",
]
