"""The digits CNN trained with spark_dl.compression's compressors passed as ``compression=``,
through a real Spark barrier stage (np=2)."""
from __future__ import annotations

from digits import train_digits

from spark_dl import HorovodRunner

SEEDS = (42, 7)


def compressed_runs():
    from spark_dl.compression import QSGD, OneBit, PowerSGD

    runs = {}
    for seed in SEEDS:  # two initialisations: one run's accuracy moves by a few of 360 test digits
        for label, make in [("none", lambda: None), ("qsgd", lambda: QSGD(seed=seed)), ("powersgd", PowerSGD),
                            ("onebit", OneBit)]:
            runs[label, seed] = train_digits(compression=make(), epochs=20, base_lr=0.1, seed=seed)
    return runs


def test_compressed_training_matches_uncompressed_accuracy(spark):
    ranks = HorovodRunner(np=2).run_all(compressed_runs)
    labels = ("none", "qsgd", "powersgd", "onebit")
    for key in ranks[0]:
        assert ranks[0][key]["params_sha1"] == ranks[1][key]["params_sha1"], key
    mean = {label: sum(ranks[0][label, s]["accuracy"] for s in SEEDS) / len(SEEDS) for label in labels}
    assert mean["none"] > 0.95
    # PowerSGD (rank 8) factored each weight on its own, through the optimizer's fusion bucket: conv2
    # (32 x 144) and fc1 (64 x 128); conv1 (16 x 9), fc2 (10 x 64: its factors, 8 x 74, would not save
    # 2x) and the biases went uncompressed.
    assert ranks[0]["powersgd", SEEDS[0]]["q_shapes"] == [(128, 8), (144, 8)]
    for label in ("qsgd", "powersgd", "onebit"):  # 1-bit with its built-in error feedback
        assert abs(mean[label] - mean["none"]) <= 0.01, (label, mean)
