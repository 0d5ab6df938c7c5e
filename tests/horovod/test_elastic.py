"""hvd.elastic: Elastic-Horovod-style code (written fresh, as in Horovod's elastic PyTorch examples)
under HorovodRunner(max_restarts=...): a rank lost mid-epoch, the job relaunched, the epoch resumed
from the last commit without reprocessing the committed samples."""
from __future__ import annotations

import json
import os

import pytest

import spark_dl
from spark_dl import HorovodRunner, RankFailed

BATCH = 4
N = 64  # 2 ranks x 8 batches of 4 per epoch


def elastic_train(out_dir, epochs=3, crash=(1, 6), commit_every=2, release=None):
    """Elastic Horovod training; rank 1 dies at ``crash`` (epoch, batch) of attempt 0. With
    ``release`` (a directory), attempt 0's batches are slow and after its third batch rank 0
    creates ``release/release`` (another Spark job's slots free up)."""
    import time

    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.linspace(-1, 1, N).unsqueeze(1), torch.arange(N))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    model = torch.nn.Linear(1, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    attempt = spark_dl.get_context().attempt
    seen, resets = [], []

    @hvd.elastic.run
    def train(state):
        start = {"epoch": state.epoch, "len": len(loader), "commits": state._commits,
                 "committed": sorted(state.train_sampler.processed_indices)}
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, (x, idx) in enumerate(loader):
                opt.zero_grad()
                (model(x) - 2 * x).pow(2).mean().backward()
                opt.step()
                seen.extend([state.epoch, int(i)] for i in idx)
                state.train_sampler.record_batch(batch_idx, BATCH)
                if batch_idx % commit_every == commit_every - 1:
                    state.commit()
                if attempt == 0 and crash and (state.epoch, batch_idx) == tuple(crash) and hvd.rank() == 1:
                    os._exit(1)  # after batch 6's all-reduce, so rank 0's commit of batch 5 is stored
                if attempt == 0 and release:
                    time.sleep(0.2)
                    if batch_idx == 2 and hvd.rank() == 0:
                        open(os.path.join(release, "release"), "w").close()
            state.train_sampler.set_epoch(state.epoch + 1)  # at the end of the epoch, as Horovod says
            state.commit()
        return start

    state = hvd.elastic.TorchState(model=model, optimizer=opt, train_sampler=sampler, epoch=0)
    state.register_reset_callbacks([lambda: resets.append(state.epoch)])
    start = train(state)
    out = {"attempt": attempt, "size": hvd.size(), "start": start, "seen": seen, "resets": resets,
           "params": [p.detach().tolist() for p in model.parameters()], "commits": state._commits}
    with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(out, f)
    return out


def test_an_elastic_horovod_script_resumes_mid_epoch_without_reprocessing_committed_samples(tmp_path):
    outs = HorovodRunner(np=-2, max_restarts=1).run_all(elastic_train, out_dir=str(tmp_path))
    assert [o["attempt"] for o in outs] == [1, 1]
    # resumed in epoch 1 from the commit after batch 5: 6 batches x 4 x 2 ranks = 48 samples done,
    # the other 16 split into 2 batches per rank; the reset callbacks ran once, on the restore
    assert [o["start"]["epoch"] for o in outs] == [1, 1] and [o["start"]["len"] for o in outs] == [2, 2]
    assert [o["resets"] for o in outs] == [[1], [1]]
    epoch1 = sorted(i for o in outs for e, i in o["seen"] if e == 1)
    committed = set(outs[0]["start"]["committed"])  # every rank's progress, gathered at the commit
    assert outs[1]["start"]["committed"] == outs[0]["start"]["committed"] and len(committed) == 48
    assert len(epoch1) == 16 and committed.isdisjoint(epoch1) and committed | set(epoch1) == set(range(N))
    epoch2 = sorted(i for o in outs for e, i in o["seen"] if e == 2)
    assert epoch2 == list(range(N))  # a full epoch after it, every sample once
    assert outs[0]["params"] == outs[1]["params"]
    # commit counter carried over: 4 commits in epoch 0 (+1 at its end), 3 in epoch 1 before the failure
    assert outs[0]["start"]["commits"] == 8 and outs[0]["commits"] == 8 + 1 + 1 + 4 + 1


def test_without_restarts_the_failure_is_raised(tmp_path):
    with pytest.raises(RankFailed):
        HorovodRunner(np=-2).run(elastic_train, out_dir=str(tmp_path))


def test_object_state_syncs_from_rank_0_and_commits_outside_a_run():
    def main():
        import spark_dl.horovod as hvd

        hvd.init()
        state = hvd.elastic.ObjectState(epoch=hvd.rank() * 10, note=f"from {hvd.rank()}")

        @hvd.elastic.run
        def train(s):
            s.epoch += 1
            s.commit()
            s.epoch = 99
            s.restore()  # back to the last commit
            return s.epoch, s.note

        return train(state)

    assert HorovodRunner(np=-2).run_all(main) == [(1, "from 0"), (1, "from 0")]


def test_elastic_run_needs_a_state():
    import spark_dl.horovod as hvd

    with pytest.raises(TypeError, match="first argument must be an hvd.elastic State"):
        hvd.elastic.run(lambda s: s)({"epoch": 0})


def test_sampler_pads_uneven_shares_and_skips_processed_indices():
    import spark_dl.horovod as hvd

    s = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    assert list(s) == list(range(10))  # one rank (no process group): everything, in order
    s.record_batch(0, 4)
    s.reset()
    assert list(s) == [4, 5, 6, 7, 8, 9]
    s.load_state_dict({"epoch": 3, "processed_indices": [0, 1]})
    assert s.epoch == 3 and len(s) == 8
    s.set_epoch(4)
    assert len(s) == 10 and s.state_dict() == {"epoch": 4, "processed_indices": []}


def test_a_user_attribute_named_commits_is_the_users():
    import spark_dl.horovod as hvd

    s = hvd.elastic.ObjectState(commits=5, epoch=1)
    s.commit()  # outside a rank process: saved locally, nothing sent
    s.epoch = 7
    s.restore()
    assert (s.commits, s.epoch) == (5, 1)
