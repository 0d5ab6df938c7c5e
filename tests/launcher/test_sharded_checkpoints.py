"""Sharded checkpoints: ``save_checkpoint(state, sharded=True)`` on every rank, each rank's shard
back from ``load_checkpoint()`` after a restart (FSDP's sharded state, a ZeRO optimizer's
partition), a save that some rank never finished leaving the previous checkpoint in place, and a
checkpoint saved by another number of ranks refused unless the ranks ask for the shards they want."""
from __future__ import annotations

import os
import pickle

import pytest

from spark_dl import HorovodRunner, load_checkpoint, save_checkpoint
from spark_dl.driver.checkpoint_store import CheckpointStore
from spark_dl.driver.monitor import JobMonitor
from spark_dl.task.relay import Relay, replay
from spark_dl.transport import channel


def resumes_own_shard(crash_rank, crash_before_epoch_saved):
    import os

    import torch
    import torch.distributed as dist

    import spark_dl

    spark_dl.init()
    r, ctx = dist.get_rank(), spark_dl.get_context()
    state = spark_dl.load_checkpoint()
    start = 0 if state is None else state["epoch"] + 1
    seen = None if state is None else {"rank": state["rank"], "epoch": state["epoch"], "w": state["w"].tolist()}
    for epoch in range(start, 4):
        if ctx.attempt == 0 and epoch == 2 and r == crash_rank and crash_before_epoch_saved:
            os._exit(5)  # the others may have sent their epoch-2 shards: that save never completes
        assert spark_dl.save_checkpoint({"rank": r, "epoch": epoch, "w": torch.full((2,), 10.0 * r + epoch)},
                                        step=epoch, sharded=True) is True
        dist.barrier()  # every shard of this epoch is stored before anyone fails
        if ctx.attempt == 0 and epoch == 2 and r == crash_rank and not crash_before_epoch_saved:
            os._exit(5)
    everyone = [s["rank"] for s in spark_dl.load_checkpoint(shard="all")]
    return {"attempt": ctx.attempt, "seen": seen, "all": everyone, "third": spark_dl.load_checkpoint(shard=2)["rank"]}


def test_each_rank_resumes_from_its_own_shard(capfd):
    ranks = HorovodRunner(np=-3, max_restarts=1).run_all(resumes_own_shard, crash_rank=1,
                                                         crash_before_epoch_saved=False)
    for r, out in enumerate(ranks):
        assert out["attempt"] == 1
        assert out["seen"] == {"rank": r, "epoch": 2, "w": [10.0 * r + 2] * 2}  # its own shard of the last save
        assert out["all"] == [0, 1, 2] and out["third"] == 2
    assert "a shard for each of 3 ranks" in capfd.readouterr().err  # the driver's restart message


def test_a_save_some_rank_never_finished_leaves_the_previous_checkpoint():
    ranks = HorovodRunner(np=-3, max_restarts=1).run_all(resumes_own_shard, crash_rank=2, crash_before_epoch_saved=True)
    assert [out["seen"]["epoch"] for out in ranks] == [1, 1, 1]  # epoch 2 lacked rank 2's shard
    assert [out["seen"]["rank"] for out in ranks] == [0, 1, 2]


def fsdp_main(crash):
    """FSDP2 (fully_shard) on CPU ranks over Gloo: each rank saves the local shards of its
    parameters and Adam state, and puts them back into the fresh model's DTensors on a restart."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import spark_dl

    spark_dl.init()
    rank, attempt = dist.get_rank(), spark_dl.get_context().attempt
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def to_local(tree):
        if isinstance(tree, DTensor):
            return tree.to_local().clone()
        if isinstance(tree, dict):
            return {k: to_local(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [to_local(v) for v in tree]
        return tree

    def from_local(template, saved):
        if isinstance(template, DTensor):
            return DTensor.from_local(saved, template.device_mesh, template.placements, run_check=False,
                                      shape=template.shape, stride=template.stride())
        if isinstance(template, dict):
            return {k: from_local(template[k], saved[k]) for k in template}
        if isinstance(template, list):
            return [from_local(t, s) for t, s in zip(template, saved)]
        return saved

    start = 0
    shard = spark_dl.load_checkpoint()
    if shard is not None:
        msd, osd = get_state_dict(model, opt)
        set_state_dict(model, opt, model_state_dict=from_local(msd, shard["model"]),
                       optim_state_dict=from_local(osd, shard["optim"]))
        start = shard["step"] + 1
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]
    for step in range(start, 8):
        x, y = data[step]
        loss = (model(x[rank::2]) - y[rank::2]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        spark_dl.save_checkpoint({"model": to_local(msd), "optim": to_local(osd), "step": step}, step=step,
                                 sharded=True)
        dist.barrier()
        if crash and attempt == 0 and step == 4 and rank == 1:
            os._exit(1)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return attempt, {k: v.tolist() for k, v in full.items()}


@pytest.mark.slow  # seconds each: the full suite runs it, the fast tier does not
def test_an_fsdp_model_restarted_from_its_shards_ends_as_an_uninterrupted_run_does(capfd):
    attempt, resumed = HorovodRunner(np=-2, max_restarts=1).run(fsdp_main, crash=True)
    assert attempt == 1 and "returns the one saved at step 4" in capfd.readouterr().err
    assert HorovodRunner(np=-2).run(fsdp_main, crash=False) == (0, resumed)  # bit for bit


def saves(sharded):
    import spark_dl

    spark_dl.init()
    r = spark_dl.get_context().rank
    spark_dl.save_checkpoint({"from": r}, step=7, sharded=sharded)
    return r


def loads(how):
    import spark_dl

    spark_dl.init()
    try:
        return spark_dl.load_checkpoint() if how == "default" else spark_dl.load_checkpoint(shard=how)
    except ValueError as e:
        return f"ValueError: {e}"


def test_a_checkpoint_of_another_number_of_ranks_is_refused_unless_shards_are_asked_for(tmp_path):
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    HorovodRunner(np=-2, checkpoint_dir=str(sharded)).run(saves, sharded=True)
    HorovodRunner(np=-2, checkpoint_dir=str(plain)).run(saves, sharded=False)

    def load(directory, how, np=-3):
        return HorovodRunner(np=np, checkpoint_dir=str(directory)).run_all(loads, how=how)

    refused = load(sharded, "default")
    assert refused == [refused[0]] * 3 and refused[0] == (
        "ValueError: load_checkpoint: the checkpoint was saved by 2 ranks, one shard each, but this run has 3: "
        "load the shard of your choice with load_checkpoint(shard=k), or every shard with "
        "load_checkpoint(shard='all') and split their state for this many ranks, or run on 2 ranks")
    assert load(sharded, "all") == [[{"from": 0}, {"from": 1}]] * 3
    assert load(sharded, 1) == [{"from": 1}] * 3
    assert load(sharded, 5)[0] == "ValueError: load_checkpoint: there is no shard 5: the checkpoint has shards 0 to 1"
    assert load(sharded, "default", np=-2) == [{"from": 0}, {"from": 1}]  # as many ranks: each its own
    # rank 0's own checkpoint: the same state everywhere, its one shard
    assert load(plain, "default") == [{"from": 0}] * 3
    assert load(plain, "all") == [[{"from": 0}]] * 3 and load(plain, 0) == [{"from": 0}] * 3
    assert load(plain, 1)[0] == ("ValueError: load_checkpoint: there is no shard 1: the checkpoint was saved by rank 0 "
                                 "alone (save_checkpoint without sharded=True): its only shard is 0")


@pytest.mark.parametrize("call, message", [
    (lambda: save_checkpoint({}, sharded="yes"), "sharded must be True or False, got 'yes'"),
    (lambda: load_checkpoint(shard=-1), "shard must be None, a rank (an int >= 0) or 'all', got -1"),
    (lambda: load_checkpoint(shard="first"), "got 'first'"),
    (lambda: load_checkpoint(shard=True), "got True"),
])
def test_bad_shard_arguments_are_refused_naming_what_they_take(call, message):
    with pytest.raises(TypeError) as info:
        call()
    assert message in str(info.value)


def test_the_driver_assembles_a_save_from_every_ranks_shard_and_drops_unfinished_ones(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", "job-a")
    try:
        assert store.save_shard(1, 2, b"one", step=4) is False  # rank 1 first: waits for rank 0's
        assert store.info is None and os.listdir(tmp_path / "ckpt") != [".lock"]  # the part waits in a file
        assert store.save_shard(0, 2, b"zero!", step=4) is True
        assert store.info.shards == (5, 3) and store.load() == b"zero!one"
        with pytest.raises(ValueError, match="rank 0 saved a shard of 3 ranks, but the others' of the same save "
                                             "were of 2"):
            store.save_shard(1, 2, b"x", step=5) or store.save_shard(0, 3, b"y", step=5)
        store.attempt = 1  # a restart: the unfinished save's parts are gone
        assert sorted(os.listdir(tmp_path / "ckpt")) == [".lock", "latest.ckpt"]
        assert store.load() == b"zero!one"
    finally:
        store.close()
    reopened = CheckpointStore(tmp_path / "ckpt", "job-b")  # a later run reads the shards' sizes back
    try:
        assert reopened.info.shards == (5, 3) and "a shard for each of 2 ranks" in reopened.describe()
    finally:
        reopened.close()


def test_a_relayed_attempt_serves_shards_and_the_client_keeps_the_sharded_save(tmp_path):
    secret = b"s" * 32
    relay = Relay(secret, "job-sh", world_size=2, num_tasks=1, host="127.0.0.1",
                  checkpoint=(b"AAABB", 3, (3, 2)))
    host, port = relay.address
    task = channel.connect(host, port, secret, relay=True)
    task.send("hello", {"role": "task", "partition": 0, "host": "h0", "pid": 1})
    task.send("layout", [{"rank": r, "host": "h0", "local_rank": r} for r in range(2)])
    ranks = []
    for r in range(2):
        conn = channel.connect(host, port, secret, relay=True)
        conn.send("hello", {"role": "rank", "rank": r, "pid": 2 + r})
        ranks.append(conn)
    for r, conn in enumerate(ranks):
        conn.send("checkpoint/load", {"id": 1, "shard": None, "world": 2})
        assert bytes(conn.recv()[1]["blob"]) == [b"AAA", b"BB"][r]
    for r, conn in enumerate(ranks):
        conn.send("checkpoint/save", {"id": 2, "blob": pickle.PickleBuffer(b"new-%d" % r), "step": 8,
                                      "sharded": True, "world": 2})
        assert "error" not in conn.recv()[1]
        conn.close()
    for r in range(2):
        task.send("exit", {"rank": r, "code": 0, "host": "h0", "aborted": False})
    task.close()
    relay.finish()
    assert relay.monitor.failure is None
    store = CheckpointStore(tmp_path / "client", "job-sh")
    try:
        monitor = JobMonitor(world_size=2, num_tasks=1, verbosity="log_callback_only", on_failure=lambda f: None,
                             checkpoints=store)
        replay(relay.chunks(), monitor)
        assert store.info.shards == (5, 5) and store.info.step == 8 and store.load() == b"new-0new-1"
    finally:
        store.close()
