"""The README's demo trains to a useful accuracy, on Spark and locally."""
from spark_dl import HorovodRunner, demo


def test_demo_training_function_on_spark(spark):
    out = HorovodRunner(np=2).run(demo.train, epochs=3, lr=0.05, batch_size=64)
    assert out["world_size"] == 2
    assert out["test_accuracy"] > 0.9


def test_demo_command_line_in_local_mode(capsys):
    assert demo.main(["--np", "-2", "--epochs", "3"]) == 0
    assert "trained on 2 ranks" in capsys.readouterr().out
