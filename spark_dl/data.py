"""Train on a Spark DataFrame: ``shards(df)`` on the driver, a :class:`Shards` in each rank.

``HorovodRunner(np=2).run(main, data=spark_dl.data.shards(df, ...))``: ``main`` receives
``data`` as a :class:`Shards`, this rank's equal share of the rows, shuffled globally each epoch.
"""
from spark_dl.driver.shards import DataFrameShards, shards
from spark_dl.rank.shards import Shards

__all__ = ["shards", "Shards", "DataFrameShards"]
