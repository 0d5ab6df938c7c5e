"""``hvd.join()`` on three real ranks (Gloo) with uneven data: ranks out of data take part in the
others' DistributedOptimizer steps with zero gradients, every rank ends with the same model (the
one a single process computes from the same batches) and optimizer state, and join returns the
last rank to join."""
from __future__ import annotations

import pytest
import torch

BATCHES = [4, 6, 8]  # rank r has BATCHES[r] batches
LR, MOMENTUM = 0.05, 0.9


def data(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + r)
    x = torch.randn(BATCHES[r] * 8, 4, generator=gen)
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(len(x), generator=gen)


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def join_main(batches, lr, momentum, data, fresh_model):
    import spark_dl.horovod as hvd
    import torch
    import torch.nn.functional as F

    hvd.init()
    r = hvd.rank()
    out = {}
    x, y = data(r)

    def params(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    # one optimizer, uneven batches
    model = fresh_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters())
    for b in range(batches[r]):
        opt.zero_grad()
        F.mse_loss(model(x[b * 8:(b + 1) * 8]).squeeze(1), y[b * 8:(b + 1) * 8]).backward()
        opt.step()
    out["last"] = hvd.join()
    out["params"] = params(model)
    out["after_join_allreduce"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()  # all joined: usable again

    # three optimizers stepped in turn (one with a per-step LR schedule, one with clipping, one
    # Adasum), all with uneven batches
    a, b_model, c = fresh_model(), fresh_model(), fresh_model()
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=lr, momentum=momentum))
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.8)
    opt_b = hvd.DistributedOptimizer(torch.optim.Adam(b_model.parameters(), lr=0.01))
    opt_c = hvd.DistributedOptimizer(torch.optim.SGD(c.parameters(), lr=lr), op=hvd.Adasum)
    for b in range(batches[r] - 2):
        for model_, opt_ in ((a, opt_a), (b_model, opt_b), (c, opt_c)):
            opt_.zero_grad()
            F.mse_loss(model_(x[b * 8:(b + 1) * 8]).squeeze(1), y[b * 8:(b + 1) * 8]).backward()
            if opt_ is opt_b:
                opt_b.synchronize()
                torch.nn.utils.clip_grad_norm_(b_model.parameters(), 0.5)
                with opt_b.skip_synchronize():
                    opt_b.step()
            else:
                opt_.step()
        sched.step()
    out["last_three_optimizers"] = hvd.join()
    out["three_models"] = [params(m) for m in (a, b_model, c)]
    out["lr_a"] = opt_a.param_groups[0]["lr"]
    out["adam_state"] = torch.cat([opt_b.state[p]["exp_avg"].reshape(-1) for p in b_model.parameters()])

    # sparse gradients (an embedding): rank r steps r times, so rank 0 joins before the first
    # step and follows the ranks' agreement on which parameters are sparse too
    emb = torch.nn.Embedding(4, 2, sparse=True)
    torch.nn.init.constant_(emb.weight, 1.0)
    opt_e = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0))
    for _ in range(r):
        opt_e.zero_grad()
        emb(torch.tensor([r])).sum().backward()
        opt_e.step()
    out["last_sparse"] = hvd.join()
    out["embedding"] = emb.weight.detach().clone()

    # while a rank is joined, an all-reduce counts it as zeros (as in Horovod); any other collective
    # is a clear error, not a hang
    if r == 0:
        out["last_misuse"] = hvd.join()
    else:
        opt_a.zero_grad()
        F.mse_loss(a(x[:8]).squeeze(1), y[:8]).backward()
        opt_a.step()  # learns that rank 0 has joined
        out["metric_while_joined"] = hvd.allreduce(torch.tensor([3.0])).item()
        try:
            hvd.allgather(torch.tensor([1.0]))
        except RuntimeError as e:
            out["misuse_error"] = str(e)
        out["last_misuse"] = hvd.join()
    # no optimizer step at all: join is a barrier, every rank "joined last"
    out["last_barrier"] = hvd.join()
    return out


@pytest.fixture(scope="module")
def ranks():
    from spark_dl import HorovodRunner

    return HorovodRunner(np=-3).run_all(join_main, batches=BATCHES, lr=LR, momentum=MOMENTUM, data=data,
                                        fresh_model=fresh_model)


def reference_params() -> torch.Tensor:
    """One process: at step t, every rank with a t-th batch contributes its gradient, the others
    zeros, divided by the world size."""
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sets = [data(r) for r in range(3)]
    for t in range(max(BATCHES)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r, (x, y) in enumerate(sets):
            if t < BATCHES[r]:
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x[t * 8:(t + 1) * 8]).squeeze(1), y[t * 8:(t + 1) * 8]).backward()
                total = [s + p.grad for s, p in zip(total, model.parameters())]
        for p, s in zip(model.parameters(), total):
            p.grad = s / 3
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_join_returns_the_last_rank(ranks):
    assert [o["last"] for o in ranks] == [2, 2, 2]
    assert [o["last_three_optimizers"] for o in ranks] == [2, 2, 2]
    assert [o["after_join_allreduce"] for o in ranks] == [3.0, 3.0, 3.0]


def test_every_rank_ends_with_the_single_process_model(ranks):
    want = reference_params()
    for o in ranks:
        assert torch.equal(o["params"], ranks[0]["params"])
        assert torch.allclose(o["params"], want, atol=1e-6)


def test_several_optimizers_schedules_and_clipping_end_equal_on_every_rank(ranks):
    for o in ranks:
        for got, rank0 in zip(o["three_models"], ranks[0]["three_models"]):
            assert torch.equal(got, rank0)
        # the last joiner's optimizer state and hyper-parameters too (rank 2 stepped the schedule 6 times)
        assert o["lr_a"] == pytest.approx(LR * 0.8 ** 6)
        assert torch.equal(o["adam_state"], ranks[2]["adam_state"])
    # the models did train (the joined ranks did not just keep their own)
    assert not torch.equal(ranks[0]["three_models"][0],
                           torch.cat([p.detach().reshape(-1) for p in fresh_model().parameters()]))


def test_other_collectives_while_a_rank_is_joined_are_refused(ranks):
    for o in ranks[1:]:
        assert o["metric_while_joined"] == 2.0  # (3 + 3 + 0) / 3: the joined rank sent zeros
        assert o["misuse_error"].startswith("allgather: a rank has called hvd.join() and takes part in all-reduces")
    # ranks 1 and 2 joined at the same step: the highest of them is reported
    assert [o["last_misuse"] for o in ranks] == [2, 2, 2]
    assert [o["last_barrier"] for o in ranks] == [2, 2, 2]


def switched_off_main():
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    w = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0))
    (w * (hvd.rank() + 1)).sum().backward()
    opt.step()  # steps work without the agreement
    try:
        hvd.join()
    except RuntimeError as e:
        return w.tolist(), str(e)


def test_switched_off_steps_still_work_and_join_says_why_it_cannot():
    from spark_dl import HorovodRunner

    for w, error in HorovodRunner(np=-2, env={"SPARK_DL_HVD_JOIN": "0"}).run_all(switched_off_main):
        assert w == [-1.5, -1.5]
        assert "SPARK_DL_HVD_JOIN turned off" in error and "unset SPARK_DL_HVD_JOIN" in error


def missing_optimizer_main():
    import spark_dl.horovod as hvd
    import torch

    hvd.init()
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if hvd.rank() == 0:
        # A program whose ranks built different optimizers cannot get here (building one is
        # collective), and parameter hooks keep an optimizer alive; forgetting it in the registry
        # is how this rank comes to lack the optimizer the other one steps.
        from spark_dl.horovod import joining

        joining._job.optimizers.clear()
        return hvd.join()
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return hvd.join()


def test_a_joined_rank_without_the_stepped_optimizer_fails_clearly():
    from spark_dl import HorovodRunner
    from spark_dl.errors import RankFailed

    with pytest.raises(RankFailed) as failed:
        HorovodRunner(np=-2, run_timeout=60).run(missing_optimizer_main)
    assert "DistributedOptimizer #0, which this rank does not have" in str(failed.value)


def test_sparse_gradients_are_followed_from_the_first_step(ranks):
    # step 0: ranks 1 and 2 each send row r (gradient 1), step 1: rank 2 alone; averages over 3 ranks
    want = torch.tensor([[1.0, 1.0], [2 / 3, 2 / 3], [1 / 3, 1 / 3], [1.0, 1.0]])
    for o in ranks:
        assert o["last_sparse"] == 2
        torch.testing.assert_close(o["embedding"], want)


# -- process sets: each set's optimizers are followed within the set ------------------------------

SET_BATCHES = [2, 5, 4, 3]  # rank r has SET_BATCHES[r] batches; sets {0, 2} and {1, 3}


def set_data(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(20 + r)
    x = torch.randn(max(SET_BATCHES) * 8, 4, generator=gen)
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0])


def set_join_main(batches, lr, momentum, set_data, fresh_model):
    import spark_dl.horovod as hvd
    import torch
    import torch.nn.functional as F

    even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[even, odd])
    r = hvd.rank()
    mine = even if r % 2 == 0 else odd
    x, y = set_data(r)

    def params(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def step(model, opt, b):
        opt.zero_grad()
        F.mse_loss(model(x[b * 8:(b + 1) * 8]).squeeze(1), y[b * 8:(b + 1) * 8]).backward()
        opt.step()

    # a whole-job optimizer and one on the rank's set, stepped in turn, uneven batches
    shared, own = fresh_model(), fresh_model()
    opt_shared = hvd.DistributedOptimizer(torch.optim.SGD(shared.parameters(), lr=lr),
                                          named_parameters=shared.named_parameters())
    opt_own = hvd.DistributedOptimizer(torch.optim.SGD(own.parameters(), lr=lr, momentum=momentum),
                                       process_set=mine)
    for b in range(batches[r]):
        step(shared, opt_shared, b)
        step(own, opt_own, b)
    out = {"last": hvd.join(), "shared": params(shared), "own": params(own),
           "momentum": torch.cat([opt_own.state[p]["momentum_buffer"].reshape(-1) for p in own.parameters()])}

    # set optimizers only: rank 0 joins first; rank 2 learns it from its set's step, and a
    # collective on the set is then refused (on the job it is not known, and not refused)
    again = fresh_model()
    opt_again = hvd.DistributedOptimizer(torch.optim.SGD(again.parameters(), lr=lr), process_set=mine)
    for b in range({0: 0, 1: 2, 2: 2, 3: 1}[r]):
        step(again, opt_again, b)
    if r == 2:
        try:
            hvd.allreduce(torch.tensor([1.0]), process_set=even)
        except RuntimeError as e:
            out["set_misuse"] = str(e)
    out["last_sets_only"] = hvd.join()
    out["again"] = params(again)
    out["after"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=mine).item()
    return out


@pytest.fixture(scope="module")
def set_ranks():
    from spark_dl import HorovodRunner

    return HorovodRunner(np=-4).run_all(set_join_main, batches=SET_BATCHES, lr=LR, momentum=MOMENTUM,
                                        set_data=set_data, fresh_model=fresh_model)


def set_reference(members: list[int], batches: list[int], momentum: float) -> torch.Tensor:
    """One process: at step t the members with a t-th batch contribute its gradient, the others
    zeros, divided by the number of members."""
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for t in range(max(batches[r] for r in members)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in members:
            if t < batches[r]:
                x, y = set_data(r)
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x[t * 8:(t + 1) * 8]).squeeze(1), y[t * 8:(t + 1) * 8]).backward()
                total = [s + p.grad for s, p in zip(total, model.parameters())]
        for p, s in zip(model.parameters(), total):
            p.grad = s / len(members)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_optimizers_on_process_sets_are_followed_within_each_set(set_ranks):
    """Rank 0 runs out after 2 batches, rank 2 after 4: rank 0 follows its set's optimizer (with
    zeros) while following the job's; both sets end with their members equal to the model one
    process computes, and with the last joiner's momentum."""
    assert [o["last"] for o in set_ranks] == [1, 1, 1, 1]  # 5 job steps
    shared = set_reference([0, 1, 2, 3], SET_BATCHES, 0.0)
    for o in set_ranks:
        torch.testing.assert_close(o["shared"], shared)
    for members in ([0, 2], [1, 3]):
        want = set_reference(members, SET_BATCHES, MOMENTUM)
        a, b = (set_ranks[r] for r in members)
        assert torch.equal(a["own"], b["own"]) and torch.equal(a["momentum"], b["momentum"])
        torch.testing.assert_close(a["own"], want)


def test_a_set_collective_while_a_member_is_joined_is_refused(set_ranks):
    assert "hvd.join()" in set_ranks[2]["set_misuse"]
    assert [o["last_sets_only"] for o in set_ranks] == [3, 3, 3, 3]  # no job steps: every rank ties
    for members, batches in (([0, 2], [0, 0, 2, 0]), ([1, 3], [0, 2, 0, 1])):
        want = set_reference(members, batches, 0.0)
        for r in members:
            torch.testing.assert_close(set_ranks[r]["again"], want)
    assert [o["after"] for o in set_ranks] == [2.0, 4.0, 2.0, 4.0], "every set usable again after join()"
