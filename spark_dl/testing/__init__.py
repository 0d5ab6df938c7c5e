"""Tools for rehearsing real deployments on one machine: :mod:`spark_dl.testing.cluster`, a Spark
standalone cluster whose workers are separate hosts (network namespaces, shaped links)."""
