"""The digits CNN trained with spark_dl.compression's compressors passed as ``compression=``,
through a real Spark barrier stage (np=2)."""
from __future__ import annotations

from digits import train_digits

from spark_dl import HorovodRunner


def compressed_runs():
    from spark_dl.compression import QSGD, OneBit, PowerSGD

    runs = {}
    for label, compressor in [("none", None), ("qsgd", QSGD()), ("powersgd", PowerSGD()), ("onebit", OneBit())]:
        runs[label] = train_digits(compression=compressor, epochs=20, base_lr=0.1)
    return runs


def test_compressed_training_matches_uncompressed_accuracy(spark):
    ranks = HorovodRunner(np=2).run_all(compressed_runs)
    for label in ("none", "qsgd", "powersgd", "onebit"):
        assert ranks[0][label]["params_sha1"] == ranks[1][label]["params_sha1"], label
    base = ranks[0]["none"]["accuracy"]
    assert base > 0.95
    for label in ("qsgd", "powersgd", "onebit"):  # 1-bit with its built-in error feedback
        assert abs(ranks[0][label]["accuracy"] - base) <= 0.01, (label, ranks[0][label]["accuracy"], base)
