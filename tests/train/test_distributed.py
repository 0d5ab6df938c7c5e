"""The recipe on two real ranks (Gloo) through HorovodRunner: same lr sequence and weights everywhere."""
from __future__ import annotations

import pytest

from spark_dl import HorovodRunner
from spark_dl.train import LargeBatchRecipe

RECIPE = dict(base_lr=0.0125, base_batch=32, per_rank_batch=32, steps_per_epoch=4, warmup_epochs=1,
              milestones=(3,), rule="linear")
STEPS = 16


def train_with_recipe(recipe_args, steps):
    import hashlib

    import spark_dl.horovod as hvd
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl.train import LARS, LargeBatchRecipe

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    recipe = LargeBatchRecipe(world_size=size, **recipe_args)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    x = torch.randn(steps, recipe.per_rank_batch, 4, generator=g)
    coef = torch.tensor([1.0, -2.0, 0.5, 3.0])
    y = x @ coef + 0.1
    x_eval = torch.randn(256, 4, generator=torch.Generator().manual_seed(7))
    y_eval = x_eval @ coef + 0.1

    def make_model():
        torch.manual_seed(rank)  # different on purpose: the broadcast must fix it
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def digest(model):
        h = hashlib.sha1()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
        return h.hexdigest()

    def eval_loss(model):
        with torch.no_grad():
            return F.mse_loss(model(x_eval).squeeze(1), y_eval).item()

    def fit(model, opt, sched):
        lrs, before = [], eval_loss(model)
        for t in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.zero_grad()
            F.mse_loss(model(x[t]).squeeze(1), y[t]).backward()
            opt.step()
            sched.step()
        return lrs, (before, eval_loss(model))

    # Horovod style: LARS wrapped by DistributedOptimizer, scheduled by the recipe. A tiny net at
    # lr 0.025 needs a far larger trust coefficient than ResNet-50's 0.001 to move in 16 steps.
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        LARS(model.parameters(), lr=recipe.peak_lr, momentum=0.9, weight_decay=1e-4, trust_coefficient=1.0),
        named_parameters=model.named_parameters())
    hvd_lrs, hvd_eval = fit(model, opt, recipe.scheduler(opt))
    hvd_digest = digest(model)

    # torch style: DDP and plain momentum SGD.
    ddp = DDP(make_model())  # DDP broadcasts rank 0's parameters
    sgd = torch.optim.SGD(ddp.parameters(), lr=recipe.peak_lr, momentum=0.9, weight_decay=1e-4)
    ddp_lrs, ddp_eval = fit(ddp, sgd, recipe.scheduler(sgd))

    # Weight decay through a real all-reduce with op=Sum: an L2 term in each rank's loss arrives
    # size-fold; the optimizer's weight_decay, applied after the reduction, once.
    w = torch.ones(3, requires_grad=True)
    (0.5 * 0.1 * w @ w).backward()
    dist.all_reduce(w.grad)
    return dict(rank=rank, hvd_lrs=hvd_lrs, ddp_lrs=ddp_lrs, hvd_digest=hvd_digest, ddp_digest=digest(ddp.module),
                hvd_eval=hvd_eval, ddp_eval=ddp_eval, l2_grad=w.grad.tolist())


def test_every_rank_sees_the_recipe_lr_sequence_and_ends_with_the_same_weights():
    ranks = HorovodRunner(np=-2).run_all(train_with_recipe, recipe_args=RECIPE, steps=STEPS)
    recipe = LargeBatchRecipe(world_size=2, **RECIPE)
    want = [recipe.lr_at(t) for t in range(STEPS)]
    assert recipe.peak_lr == pytest.approx(0.025)
    assert want[:5] == pytest.approx([0.0125, 0.015625, 0.01875, 0.021875, 0.025])
    assert want[12:] == pytest.approx([0.0025] * 4)

    for r in ranks:
        assert r["hvd_lrs"] == pytest.approx(want, rel=1e-12)
        assert r["ddp_lrs"] == pytest.approx(want, rel=1e-12)
        assert r["l2_grad"] == pytest.approx([2 * 0.1] * 3)  # 2 ranks x lambda * w
        for key in ("hvd_eval", "ddp_eval"):  # held-out loss before and after training
            before, after = r[key]
            assert after < 0.5 * before, (key, r[key])
    assert ranks[0]["hvd_digest"] == ranks[1]["hvd_digest"]
    assert ranks[0]["ddp_digest"] == ranks[1]["ddp_digest"]
