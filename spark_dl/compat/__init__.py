"""Other launchers' APIs on spark-dl's core: PySpark's ``TorchDistributor``, Horovod's torch API,
``horovod.spark`` (with Parquet staging), the Spark ML estimator, Ray Train. Importable under their
short names too (``spark_dl.horovod``, ``spark_dl.ray_train``, ...: :mod:`spark_dl.import_paths`)."""
