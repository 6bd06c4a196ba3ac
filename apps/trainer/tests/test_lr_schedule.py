import math

import pytest
import torch

from tessera.trainer.lr_schedule import build_lr_scheduler, lr_factor


def factors(total, **kw):
    kw = {"warmup_steps": 2, "decay_ratio": None, "decay_type": "linear", "min_lr_factor": 0.0} | kw
    return [lr_factor(s, total_steps=total, **kw) for s in range(1, total + 1)]


def test_warmup_then_linear_decay_to_zero():
    assert factors(6) == pytest.approx([1 / 3, 2 / 3, 0.75, 0.5, 0.25, 0.0])


def test_wsd_keeps_a_plateau_before_decay():
    # 2 warmup, 8 after; decay_ratio 0.25 -> 2 decay steps at the end, 6 stable ones
    f = factors(10, decay_ratio=0.25, min_lr_factor=0.1)
    assert f[2:8] == [1.0] * 6
    assert f[8:] == pytest.approx([0.1 + 0.9 * 0.5, 0.1])


@pytest.mark.parametrize("decay_type, midpoint", [("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("linear", 0.5)])
def test_decay_shapes(decay_type, midpoint):
    f = factors(6, warmup_steps=0, decay_type=decay_type)
    # 6 decay steps: step 3 is halfway
    assert f[2] == pytest.approx(midpoint)
    assert f[-1] == pytest.approx(0.0)


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
