"""The ranks' half of tracking: ``log_metrics``/``log_params``/``log_model`` (buffered, sent to the
driver), MLflow's fluent API routed to the driver, and Lightning's logger."""
