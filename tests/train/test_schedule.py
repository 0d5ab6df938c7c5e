"""LR scaling rules, gradual warmup and decay, against the numbers in Goyal et al. and the seed lectures."""
from __future__ import annotations

import math

import pytest
import torch

from spark_dl.train import LargeBatchRecipe, LRSchedule, WarmupScheduler, lr_at, scale_lr


# Goyal et al. (Table 2c / Mask R-CNN Table 4): eta = 0.1 * kn / 256, and 2.5e-3 per 2 images.
@pytest.mark.parametrize("kn, lr", [(256, 0.1), (512, 0.2), (1024, 0.4), (2048, 0.8), (4096, 1.6),
                                    (8192, 3.2), (16384, 6.4)])
def test_linear_rule_matches_goyal_resnet50_table(kn, lr):
    assert scale_lr(0.1, 256, kn) == pytest.approx(lr, rel=1e-12)


@pytest.mark.parametrize("kn, lr", [(2, 2.5e-3), (4, 5e-3), (8, 10e-3), (16, 20e-3)])
def test_linear_rule_matches_goyal_mask_rcnn_table(kn, lr):
    assert scale_lr(2.5e-3, 2, kn) == pytest.approx(lr, rel=1e-12)


# Sedona et al. (seed lecture 001): k GPUs x n per GPU, eta = 0.1 * k * n / 256.
@pytest.mark.parametrize("gpus, per_gpu, lr", [(8, 64, 0.2), (128, 64, 3.2), (128, 128, 6.4), (128, 256, 12.8)])
def test_linear_rule_matches_sedona_resnet50_runs(gpus, per_gpu, lr):
    assert scale_lr(0.1, 256, gpus * per_gpu) == pytest.approx(lr, rel=1e-12)


def test_sqrt_rule_is_goyal_alternative_row_and_keeps_update_covariance():
    # Goyal's Table 2a row "8k, 0.10 * sqrt(32)".
    assert scale_lr(0.1, 256, 8192, rule="sqrt") == pytest.approx(0.1 * math.sqrt(32), rel=1e-12)
    # Hoffer et al.: cov(dw) ~ eta^2 / M; sqrt scaling keeps it constant as M grows.
    for m in (256, 1024, 65536):
        assert scale_lr(0.1, 256, m, rule="sqrt") ** 2 / m == pytest.approx(0.1 ** 2 / 256, rel=1e-12)


def test_none_rule_and_refusals():
    assert scale_lr(0.1, 256, 8192, rule="none") == 0.1
    with pytest.raises(ValueError, match="rule must be one of"):
        scale_lr(0.1, 256, 8192, rule="cubic")
    with pytest.raises(ValueError, match="positive"):
        scale_lr(0.1, 0, 8192)


def goyal_recipe(**kw) -> LargeBatchRecipe:
    # ResNet-50 on ImageNet: 256 workers x 32 images, 1.28M images -> ~156 steps per epoch,
    # 5 warmup epochs, /10 at epochs 30, 60, 80, 90 epochs in all.
    args = dict(steps_per_epoch=156, warmup_epochs=5, milestones=(30, 60, 80), epochs=90)
    args.update(kw)
    return LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=256, **args)


def test_a_warmup_shorter_than_a_step_still_warms_up_for_one():
    r = goyal_recipe(steps_per_epoch=10, warmup_epochs=0.01)  # 0.1 steps
    assert r.warmup_steps == 1
    assert r.lr_at(0) == pytest.approx(0.1) and r.lr_at(1) == pytest.approx(3.2)
    assert goyal_recipe(steps_per_epoch=10, warmup_epochs=0).warmup_steps == 0  # none asked for


def test_goyal_warmup_from_eta_to_k_eta_over_five_epochs():
    r = goyal_recipe()
    assert r.global_batch == 8192 and r.peak_lr == pytest.approx(3.2)
    assert r.warmup_steps == 5 * 156
    assert r.lr_at(0) == pytest.approx(0.1)  # starts at the single-worker eta
    assert r.lr_at(390) == pytest.approx((0.1 + 3.2) / 2)  # halfway
    assert r.lr_at(780) == pytest.approx(3.2)  # reaches k * eta after 5 epochs
    # "increment it by a constant amount at each iteration"
    steps = [r.lr_at(t + 1) - r.lr_at(t) for t in range(780)]
    assert steps == pytest.approx([(3.2 - 0.1) / 780] * 780, rel=1e-9)


def test_step_decay_divides_by_ten_at_each_milestone():
    r = goyal_recipe()
    epoch = 156
    assert r.lr_at(30 * epoch - 1) == pytest.approx(3.2)
    assert r.lr_at(30 * epoch) == pytest.approx(0.32)
    assert r.lr_at(60 * epoch - 1) == pytest.approx(0.32)
    assert r.lr_at(60 * epoch) == pytest.approx(0.032)
    assert r.lr_at(80 * epoch) == pytest.approx(0.0032)
    assert r.lr_at(90 * epoch) == pytest.approx(0.0032)


def test_step_decay_without_milestones_takes_goyal_proportions_of_epochs():
    r = goyal_recipe(steps_per_epoch=10, milestones=())  # decay="step" by default, epochs=90
    assert r.decay == "step" and r.milestones == (30, 60, 80) and r.schedule.milestones == (300, 600, 800)
    assert r == goyal_recipe(steps_per_epoch=10)  # the same recipe as Goyal's milestones given
    assert r.lr_at(50) == pytest.approx(3.2)
    assert r.lr_at(299) == pytest.approx(3.2)
    assert r.lr_at(300) == pytest.approx(3.2 * 0.1)
    assert r.lr_at(600) == pytest.approx(3.2 * 0.01)
    assert r.lr_at(800) == pytest.approx(3.2 * 0.001)
    assert r.lr_at(900) == pytest.approx(3.2 * 0.001)
    # 45 epochs: /10 at epochs 15, 30 and 40
    half = goyal_recipe(steps_per_epoch=10, milestones=(), epochs=45)
    assert half.milestones == (15, 30, 40) and half.schedule.milestones == (150, 300, 400)
    assert [half.lr_at(t) for t in (149, 150, 300, 400)] == pytest.approx([3.2, 0.32, 0.032, 0.0032])


def test_derived_milestones_follow_epochs_through_dataclasses_replace_given_ones_stay():
    import dataclasses

    r = goyal_recipe(steps_per_epoch=10, milestones=())
    longer = dataclasses.replace(r, epochs=180)
    assert longer.milestones == (60, 120, 160) and longer.schedule.milestones == (600, 1200, 1600)
    assert dataclasses.replace(r, epochs=45).milestones == (15, 30, 40)  # not "80 comes after the last epoch"
    assert dataclasses.replace(longer, epochs=90) == r
    given = goyal_recipe(steps_per_epoch=10, milestones=(20, 40), epochs=50)
    assert dataclasses.replace(given, epochs=60).milestones == (20, 40)
    assert dataclasses.replace(r, milestones=(10, 20)).milestones == (10, 20)
    with pytest.raises(ValueError, match="falls inside the warmup"):
        dataclasses.replace(r, milestones=(2, 20))
    assert "_milestones_of_epochs" not in repr(r)


def test_step_decay_without_milestones_refuses_proportions_inside_the_warmup():
    # epochs=12: Goyal's proportions put the first milestone at epoch 4, inside a 5-epoch warmup
    with pytest.raises(ValueError, match=(
            r"decay='step' without milestones divides the lr at Goyal et al.'s proportions of epochs=12 "
            r"\(epochs 4, 8, 10.6667\), but the first does not come after the warmup \(5 epochs\): "
            r"pass milestones=\(...\) in epochs after the warmup")):
        goyal_recipe(milestones=(), epochs=12)
    assert goyal_recipe(milestones=(6, 10), epochs=12).schedule.milestones == (6 * 156, 10 * 156)


def test_step_decay_without_milestones_or_epochs_is_refused_with_the_fixes():
    with pytest.raises(ValueError) as refused:
        LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=256, steps_per_epoch=156)
    message = str(refused.value)
    assert message.startswith("decay='step' needs milestones, or epochs to place them")
    for fix in ("milestones=(30, 60, 80) (epochs from the start)", "epochs= to divide the lr at Goyal et al.'s",
                "decay='none' to stay at peak_lr after the warmup", "decay='cosine'"):
        assert fix in message
    # each fix works
    kw = dict(per_rank_batch=32, world_size=256, steps_per_epoch=156)
    assert LargeBatchRecipe(0.1, 256, **kw, milestones=(30, 60, 80)).lr_at(30 * 156) == pytest.approx(0.32)
    assert LargeBatchRecipe(0.1, 256, **kw, epochs=90).lr_at(30 * 156) == pytest.approx(0.32)
    assert LargeBatchRecipe(0.1, 256, **kw, decay="none").lr_at(90 * 156) == pytest.approx(3.2)
    assert LargeBatchRecipe(0.1, 256, **kw, decay="cosine", epochs=90).lr_at(90 * 156) == pytest.approx(0.0)


@pytest.mark.parametrize("call", [
    lambda: LRSchedule(peak_lr=3.2, warmup_steps=10, warmup_start_lr=0.1, decay="step"),
    lambda: LRSchedule(peak_lr=3.2, decay="step", milestones=()),
    lambda: lr_at(100, peak_lr=3.2, decay="step"),
    lambda: lr_at(100, peak_lr=3.2, decay="step", milestones=[]),
])
def test_schedule_refuses_step_decay_without_milestones(call):
    with pytest.raises(ValueError, match=(
            r"decay='step' needs milestones, the absolute optimizer steps at which the lr is multiplied by gamma: "
            r"pass milestones=\(...\) in steps, e.g. milestones=\(3000, 6000\), or decay='none' to stay at peak_lr "
            r"after the warmup")):
        call()
    assert lr_at(100, peak_lr=3.2, decay="none") == 3.2  # what it used to do, asked for


def test_cosine_decay_after_warmup():
    r = goyal_recipe(decay="cosine", milestones=(), final_lr=0.0)
    w, t = 780, 90 * 156
    assert r.lr_at(w) == pytest.approx(3.2)
    assert r.lr_at((w + t) // 2) == pytest.approx(1.6)  # cos(pi/2) = 0: half way down
    q = w + (t - w) // 4
    assert r.lr_at(q) == pytest.approx(3.2 * (1 + math.cos(math.pi / 4)) / 2)
    assert r.lr_at(t) == pytest.approx(0.0, abs=1e-15)
    assert r.lr_at(t + 100) == pytest.approx(0.0, abs=1e-15)
    # with a floor
    assert lr_at(t, peak_lr=3.2, warmup_steps=w, warmup_start_lr=0.1, decay="cosine", total_steps=t,
                 final_lr=0.032) == pytest.approx(0.032)


def test_lr_at_without_warmup_and_validation():
    assert lr_at(0, peak_lr=0.5) == 0.5
    assert lr_at(10, peak_lr=0.5, decay="step", milestones=(5, 10)) == pytest.approx(0.005)
    with pytest.raises(ValueError, match="warmup_start_lr"):
        lr_at(0, peak_lr=3.2, warmup_steps=10)
    with pytest.raises(ValueError, match="inside the warmup"):
        LRSchedule(peak_lr=3.2, warmup_steps=10, warmup_start_lr=0.1, decay="step", milestones=(5,))
    with pytest.raises(ValueError, match="total_steps"):
        LRSchedule(peak_lr=3.2, decay="cosine")
    with pytest.raises(ValueError, match="increasing"):
        LRSchedule(peak_lr=3.2, decay="step", milestones=(20, 10))


def test_recipe_below_base_batch_does_not_ramp_down():
    r = LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=2, steps_per_epoch=10, warmup_epochs=1,
                         decay="none")
    assert r.peak_lr == pytest.approx(0.025)
    assert [r.lr_at(t) for t in (0, 5, 10)] == pytest.approx([0.025] * 3)


def test_recipe_counts_accumulated_passes_in_the_global_batch():
    r = LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=64, backward_passes_per_step=4,
                         steps_per_epoch=156, milestones=(30,))
    assert r.global_batch == 8192 and r.peak_lr == pytest.approx(3.2)


def test_scheduler_follows_lr_at_step_by_step():
    r = LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=32, steps_per_epoch=4, warmup_epochs=2,
                         milestones=(4, 6), epochs=8)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=r.peak_lr, momentum=0.9)
    sched = r.scheduler(opt)
    seen = []
    for _ in range(r.total_steps):
        seen.append(opt.param_groups[0]["lr"])
        w.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert seen == pytest.approx([r.lr_at(t) for t in range(32)], rel=1e-12)
    assert seen[0] == pytest.approx(0.1) and seen[8] == pytest.approx(0.4)
    assert seen[16] == pytest.approx(0.04) and seen[24] == pytest.approx(0.004)


def test_scheduler_keeps_group_ratios_and_refuses_an_unscaled_optimizer():
    s = LRSchedule(peak_lr=1.0, warmup_steps=4, warmup_start_lr=0.0)
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.1}], lr=1.0)
    sched = WarmupScheduler(opt, s)
    for _ in range(2):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.05])

    built_with_base_lr = torch.optim.SGD([a], lr=0.1)
    with pytest.raises(ValueError, match="lr=schedule.peak_lr"):
        WarmupScheduler(built_with_base_lr, LRSchedule(peak_lr=3.2, warmup_steps=5, warmup_start_lr=0.1))


def _trained(r, steps=0, checkpoint=None):
    """A one-weight SGD under ``r``'s scheduler, restored from ``checkpoint`` (optimizer, scheduler
    states) if given, then stepped ``steps`` times; returns it with the lr each step ran at."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=r.peak_lr, momentum=0.9)
    sched = r.scheduler(opt)
    if checkpoint is not None:
        opt.load_state_dict(checkpoint[0])
        sched.load_state_dict(checkpoint[1])
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        w.grad = torch.ones(2)
        opt.step()
        sched.step()
    return opt, sched, seen


def test_recipe_pickles_and_scheduler_resumes_from_a_checkpoint():
    import pickle

    r = LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=32, steps_per_epoch=4, warmup_epochs=2,
                         milestones=(4,))
    assert pickle.loads(pickle.dumps(r)) == r
    opt, sched, _ = _trained(r, steps=6)
    saved = pickle.dumps((opt.state_dict(), sched.state_dict()))
    _, _, seen = _trained(r, steps=14, checkpoint=pickle.loads(saved))
    assert seen == pytest.approx([r.lr_at(t) for t in range(6, 20)], rel=1e-12)


def test_scheduler_checkpoint_loads_with_torch_load_defaults():
    # torch.load defaults to weights_only=True (torch >= 2.6): the state must be plain values.
    import io

    r = LargeBatchRecipe(0.1, 256, per_rank_batch=32, world_size=32, steps_per_epoch=4, warmup_epochs=2,
                         milestones=(4,))
    opt, sched, _ = _trained(r, steps=5)
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    checkpoint = torch.load(buf)
    _, sched2, _ = _trained(r, checkpoint=(checkpoint["optimizer"], checkpoint["scheduler"]))
    assert sched2.schedule == r.schedule and sched2.last_epoch == 5
    _, _, seen = _trained(r, steps=15, checkpoint=(checkpoint["optimizer"], checkpoint["scheduler"]))
    assert seen == pytest.approx([r.lr_at(t) for t in range(5, 20)], rel=1e-12)


def test_scheduler_refuses_a_model_in_place_of_the_optimizer():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer, got Linear; pass the optimizer"):
        WarmupScheduler(model, LRSchedule(peak_lr=0.1))


def test_schedule_takes_whole_float_milestones_and_tensor_steps():
    s = LRSchedule(peak_lr=1.0, warmup_steps=4, warmup_start_lr=0.0, decay="step", milestones=(3000.0,))
    assert s.milestones == (3000,)
    assert s(torch.tensor(2.0)) == s(2) == 0.5  # optimizers keep their step as a 0-d tensor


def test_scheduler_is_followed_by_another_through_sequential_lr():
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.8)
    warmup = WarmupScheduler(opt, LRSchedule(peak_lr=0.8, warmup_steps=4, warmup_start_lr=0.1))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[4])
    seen = []
    for _ in range(9):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.275, 0.45, 0.625, 0.8, 0.4 * (1 + math.cos(math.pi / 4)), 0.4,
                                  0.4 * (1 - math.cos(math.pi / 4)), 0.0], abs=1e-12)


RECIPE_ARGS = dict(base_lr=0.1, base_batch=256, per_rank_batch=32, world_size=8, steps_per_epoch=10)


@pytest.mark.parametrize("change, error, match", [
    ({"world_size": None}, TypeError, "world_size must be an int >= 1, got None"),
    ({"per_rank_batch": 2.5}, TypeError, "per_rank_batch must be an int >= 1, got 2.5"),
    ({"base_lr": float("nan")}, ValueError, "base_lr must be a finite number >= 0, got nan"),
    ({"base_lr": "0.1"}, TypeError, "base_lr must be a number >= 0, got '0.1'"),
    ({"warmup_epochs": float("nan")}, ValueError, "warmup_epochs must be a finite number >= 0"),
    ({"epochs": -5, "decay": "cosine"}, ValueError, "epochs must be a finite number > 0, got -5"),
    ({"milestones": 30}, TypeError, r"milestones must be a tuple of epochs, e.g. \(30, 60, 80\), got 30"),
    ({"milestones": (2,)}, ValueError, r"milestone epoch 2 falls inside the warmup \(5 epochs\)"),
    ({"decay": "cosine"}, ValueError, "decay='cosine' anneals until epochs, which must be > warmup_epochs=5; got "
                                      "epochs=None"),
    ({"milestones": (30, 4680), "epochs": 90}, ValueError,
     r"milestone epoch 4680 comes after the last epoch \(90\): milestones are epochs, not steps"),
])
def test_recipe_arguments_of_the_wrong_kind_are_named(change, error, match):
    with pytest.raises(error, match=match):
        LargeBatchRecipe(**{**RECIPE_ARGS, **change})


def test_recipe_takes_numpy_counts():
    import numpy

    r = LargeBatchRecipe(**{**RECIPE_ARGS, "world_size": numpy.int64(8), "base_lr": numpy.float32(0.1),
                            "epochs": numpy.int64(90)})
    assert type(r.world_size) is int and r.peak_lr == pytest.approx(0.1)
    assert r.milestones == (30, 60, 80) and all(type(m) is float for m in r.milestones)


@pytest.mark.parametrize("call, error, match", [
    (lambda: scale_lr(None, 256, 512), TypeError, "base_lr must be a number >= 0, got None"),
    (lambda: scale_lr(0.1, "256", 512), TypeError, "base_batch must be a number, got '256'"),
    (lambda: LRSchedule(peak_lr=float("inf")), ValueError, "peak_lr must be a finite number >= 0, got inf"),
    (lambda: LRSchedule(peak_lr=1.0, decay="step", milestones=30), TypeError, "milestones must be a tuple of steps"),
    (lambda: LRSchedule(peak_lr=1.0, decay="step", milestones=("a",)), TypeError, "each milestone must be a number"),
    (lambda: LRSchedule(peak_lr=1.0, warmup_steps=10, warmup_start_lr=float("nan")), ValueError,
     "warmup_start_lr must be a finite number >= 0"),
    (lambda: lr_at(float("nan"), peak_lr=1.0), ValueError, "step must be a finite number >= 0, got nan"),
    (lambda: lr_at(None, peak_lr=1.0), TypeError, "step must be a number >= 0, got None"),
    (lambda: LRSchedule(peak_lr=1.0, decay="step", milestones=(2.7,)), ValueError,
     "each milestone must be a whole number of optimizer steps, got 2.7"),
    (lambda: LRSchedule(peak_lr=1.0, decay="step", milestones=(5,), final_lr=0.01), ValueError,
     r"final_lr=0.01 is where decay='cosine' ends; decay='step' does not use it"),
])
def test_schedule_arguments_of_the_wrong_kind_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()
