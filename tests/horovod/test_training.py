"""End to end: a Horovod-style training script converges under HorovodRunner with one changed import."""
from __future__ import annotations

from digits import train_digits

from spark_dl import HorovodRunner


def test_digits_cnn_converges_and_ranks_end_identical():
    ranks = HorovodRunner(np=-2).run_all(train_digits)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["accuracy"] > 0.9, ranks
    assert ranks[0]["accuracy"] == ranks[1]["accuracy"]  # averaged with hvd.allreduce
    assert ranks[0]["params_sha1"] == ranks[1]["params_sha1"]
