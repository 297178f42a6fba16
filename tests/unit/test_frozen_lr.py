"""The engines' skipped update: an AdamW step at lr 0 leaves every weight bitwise, and the lr
schedule goes on (`xray.backends.optim.frozen_lr`)."""
import pytest
import torch

from xray.backends.base import OptimConfig
from xray.backends.optim import build_optimizer, build_scheduler, frozen_lr, skips_update

pytestmark = pytest.mark.unit


def test_a_frozen_step_keeps_the_weights_and_the_schedule_moves_on():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4))
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=4)
    opt = build_optimizer([w], cfg)
    sched = build_scheduler(opt, cfg)
    (w ** 2).sum().backward()
    opt.step()  # a real step first: the moments are not zero
    sched.step()
    before, lr = w.detach().clone(), opt.param_groups[0]["lr"]
    opt.zero_grad()
    (w ** 3).sum().backward()
    with frozen_lr(opt, True):
        opt.step()
    assert torch.equal(w.detach(), before) and opt.param_groups[0]["lr"] == lr
    with frozen_lr(opt, True):  # a scheduler stepped inside sets the next lr itself
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(cfg.lr * 3 / 4)
    with frozen_lr(opt, False):
        opt.step()
    assert not torch.equal(w.detach(), before)
    assert skips_update(1.0) and not skips_update(0.75) and not skips_update(None)
