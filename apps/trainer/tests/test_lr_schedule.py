import math

import pytest
import torch

from tessera.trainer.lr_schedule import LockstepSchedulers, build_lr_scheduler, lr_factor


def factors(total, **kw):
    kw = {"warmup_steps": 2, "decay_ratio": None, "decay_type": "linear", "min_lr_factor": 0.0} | kw
    return [lr_factor(s, total_steps=total, **kw) for s in range(1, total + 1)]


def test_warmup_then_linear_decay_towards_zero():
    # torchtitan 0.2's curve: warm-up s / 2; 4 decay steps aimed at a virtual step 7, so step 6
    # keeps a quarter of the lr
    assert factors(6) == pytest.approx([1 / 2, 1.0, 1.0, 0.75, 0.5, 0.25])


def test_decay_ratio_is_a_fraction_of_all_steps():
    # torchtitan's debug config over 100 steps: warm-up 2, decay_ratio 0.8 -> the last 80 steps
    # decay (from step 22 on), not 0.8 of the 98 after warm-up
    f = factors(100, decay_ratio=0.8)
    assert f[1:21] == [1.0] * 20
    assert f[21] == pytest.approx(1 - 1 / 80)
    assert f[99] == pytest.approx(1 / 80)


def test_wsd_keeps_a_plateau_before_decay():
    # 10 steps, 2 warm-up, decay_ratio 0.2 -> 2 decay steps (10 and the virtual 11), 7 stable ones
    f = factors(10, decay_ratio=0.2, min_lr_factor=0.1)
    assert f[2:9] == [1.0] * 7
    assert f[9:] == pytest.approx([0.1 + 0.9 * 0.5])


def test_schedule_shorter_than_training_stays_at_the_floor():
    f = [lr_factor(s, total_steps=4, warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.1)
         for s in range(1, 8)]
    assert f == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1, 0.1])


def test_no_decay_phase_keeps_the_full_lr_past_the_schedule():
    f = [lr_factor(s, total_steps=4, warmup_steps=4, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
         for s in range(1, 8)]
    assert f == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])


def test_warmup_longer_than_the_schedule_is_cut():
    assert factors(3, warmup_steps=5) == pytest.approx([1 / 3, 2 / 3, 1.0])


@pytest.mark.parametrize("decay_type, midpoint", [("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("linear", 0.5)])
def test_decay_shapes(decay_type, midpoint):
    f = factors(6, warmup_steps=0, decay_type=decay_type)
    # 6 decay steps aimed at step 7 (progress (s - 1) / 6): step 4 is halfway
    assert f[0] == 1.0
    assert f[3] == pytest.approx(midpoint)


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = build_lr_scheduler(opt, 6, warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(factors(6))


@pytest.mark.parametrize("new_lr", [1.0, 2.0, 0.0])
def test_a_resumed_schedule_applies_the_lr_it_logs(new_lr):
    """A checkpoint of a run at lr 1 loads into a run at ``new_lr``: from the first resumed step
    the lr applied is the one logged (get_last_lr), this run's, and a changed lr is kept to be said."""
    schedule = dict(warmup_steps=0, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)

    def run(lr):
        params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
        opt = torch.optim.AdamW([{"params": params[:1], "lr": lr}, {"params": params[1:], "lr": lr / 4}], lr=lr)
        return opt, LockstepSchedulers([build_lr_scheduler(opt, 4, **schedule)], lr)

    opt, sched = run(1.0)
    for _ in range(2):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    opt, sched = run(new_lr)
    opt.load_state_dict(saved_opt)  # the checkpoint's lrs, as the trainer loads the optimizer first
    sched.load_state_dict(saved_sched)
    assert sched.replaced == (None if new_lr == 1.0 else 1.0)
    for step in (3, 4):
        factor = lr_factor(step, total_steps=4, **schedule)
        assert sched.get_last_lr() == pytest.approx([new_lr * factor])
        assert [group["lr"] for group in opt.param_groups] == pytest.approx([new_lr * factor, new_lr / 4 * factor])
        opt.step()
        sched.step()
    # the schedule left out of the load (exclude_from_loading): its own position, step 1, rules
    opt, sched = run(new_lr)
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(sched.state_dict())
    factor = lr_factor(1, total_steps=4, **schedule)
    assert [group["lr"] for group in opt.param_groups] == pytest.approx([new_lr * factor, new_lr / 4 * factor])


def test_every_optimizer_resumes_at_the_saved_position():
    """AdamW and Muon (or a pipeline's stages) each have a scheduler, one position saved: a
    resume puts all of them there, and they go on stepping together."""
    schedule = dict(warmup_steps=1, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)

    def run():
        optimizers = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr) for lr in (1.0, 0.5)]
        return optimizers, LockstepSchedulers([build_lr_scheduler(opt, 6, **schedule) for opt in optimizers], 1.0)

    optimizers, sched = run()
    for _ in range(3):
        for opt in optimizers:
            opt.step()
        sched.step()
    saved = [opt.state_dict() for opt in optimizers], sched.state_dict()
    optimizers, sched = run()
    for opt, state in zip(optimizers, saved[0]):
        opt.load_state_dict(state)
    sched.load_state_dict(saved[1])
    for step in (4, 5, 6):
        factor = lr_factor(step, total_steps=6, **schedule)
        assert [opt.param_groups[0]["lr"] for opt in optimizers] == pytest.approx([factor, 0.5 * factor]), step
        for opt in optimizers:
            opt.step()
        sched.step()
