"""The driver's half of tracking: the observer that turns rank messages into one MLflow run, the
batching writer, logged models, the store check and the progress bar."""
