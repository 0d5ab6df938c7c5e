"""The user's process: :class:`~spark_dl.driver.runner.HorovodRunner` -> the controller (attempts,
restarts, grows) -> a launch backend (local processes, a Spark barrier stage, Spark Connect); the job
monitor, cluster checks, serialization, the checkpoint store and shard planning."""
