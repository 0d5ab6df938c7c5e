"""A rank process: its entry point, the context a training function sees, Ray Train's helpers,
checkpoints and shard reading. Imports no pyspark and nothing of the driver or the task."""
from spark_dl.rank.context import scratch_dir

__all__ = ["scratch_dir"]
