"""The learning-rate schedule (`xray/backends/lr_schedule.py`) every training backend steps: the
warm-up as before, then constant, or cosine / linear decay to `min_lr` that matches Hugging Face's
schedulers step for step after the warm-up; the horizon a run gives it (`OptimConfig.for_run`,
`rl_optimizer_steps`, the supervised jobs' steps) and the errors that say the fix. A decaying
schedule restored from a checkpoint is checked on the engines in `test_snapshot_reshard.py`."""
import dataclasses
import math

import pytest
import torch

from xray.backends.lr_schedule import ScheduleError, lr_factor
from xray.backends.optim import build_optimizer, build_scheduler, follow_configured_lr
from xray.config.optim import OptimConfig, OptimConfigError

pytestmark = pytest.mark.unit

LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 5, 25


def _hf_factors(kind: str, min_lr: float) -> list[float]:
    """Hugging Face's multipliers, steps 0..DECAY+2, for the same warm-up and horizon."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup, get_linear_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    if kind == "cosine":
        sched = get_cosine_with_min_lr_schedule_with_warmup(opt, WARMUP, DECAY, min_lr=min_lr)
    else:
        sched = get_linear_schedule_with_warmup(opt, WARMUP, DECAY)
    return [sched.lr_lambdas[0](step) for step in range(DECAY + 3)]


@pytest.mark.parametrize("kind,min_lr", [("cosine", MIN_LR), ("cosine", 0.0), ("linear", 0.0)])
def test_the_decay_matches_hugging_face_after_the_warm_up(kind, min_lr):
    cfg = OptimConfig(lr=LR, warmup_steps=WARMUP, lr_schedule=kind, min_lr=min_lr, decay_steps=DECAY)
    ours = [lr_factor(step, cfg) for step in range(DECAY + 3)]
    hf = _hf_factors(kind, min_lr)
    assert ours[WARMUP:DECAY + 1] == pytest.approx(hf[WARMUP:DECAY + 1], rel=1e-12, abs=1e-15)
    assert ours[:WARMUP] == pytest.approx([(k + 1) / WARMUP for k in range(WARMUP)], rel=1e-12)  # our warm-up
    assert ours[WARMUP] == 1.0 and ours[WARMUP - 1] == 1.0
    assert ours[DECAY:] == pytest.approx([min_lr / LR] * 3, rel=1e-12, abs=1e-15)  # then it stays at min_lr
    middle = (WARMUP + DECAY) // 2  # half-way: cosine and linear both at the mean of lr and min_lr
    assert LR * ours[middle] == pytest.approx((LR + min_lr) / 2, rel=1e-12)


def test_constant_is_the_old_warm_up_and_the_torch_scheduler_steps_the_function():
    cfg = OptimConfig(lr=LR, warmup_steps=4)
    assert [lr_factor(k, cfg) for k in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert lr_factor(0, OptimConfig(lr=LR)) == 1.0
    cfg = OptimConfig(lr=LR, warmup_steps=2, lr_schedule="cosine", min_lr=MIN_LR, decay_steps=6)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    cosine = [MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(5)]
    assert seen == pytest.approx([LR / 2, LR, *cosine, MIN_LR], rel=1e-12)
    assert sched.state_dict()["lr_lambdas"] == [None]  # a plain function: no lambda state in checkpoints
    scaled = dataclasses.replace(cfg, lr=2 * LR)  # an elastic run's new peak, restored at step 4 of 8
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], scaled)
    again = build_scheduler(opt, scaled)
    again.load_state_dict({**sched.state_dict(), "last_epoch": 4})
    follow_configured_lr(again, 2 * LR)
    assert opt.param_groups[0]["lr"] == pytest.approx(MIN_LR + (2 * LR - MIN_LR) * 0.5, rel=1e-12)  # to min_lr


def test_the_horizon_comes_from_the_run_or_the_error_says_how():
    cosine = OptimConfig(lr=LR, warmup_steps=WARMUP, lr_schedule="cosine")
    with pytest.raises(ScheduleError, match="decay_steps=N"):
        build_scheduler(build_optimizer([torch.nn.Parameter(torch.zeros(1))], cosine), cosine)
    assert cosine.for_run(40).decay_steps == 40
    assert OptimConfig(lr_schedule="linear", decay_steps=9).for_run(40).decay_steps == 9  # a set horizon stays
    assert OptimConfig().for_run(40).decay_steps is None  # constant needs none
    with pytest.raises(OptimConfigError, match="lower warmup_steps, train longer, or set optim.decay_steps"):
        cosine.for_run(WARMUP)
    with pytest.raises(OptimConfigError, match="does not exceed optim.warmup_steps=5"):
        OptimConfig(warmup_steps=5, lr_schedule="cosine", decay_steps=5)
    with pytest.raises(OptimConfigError, match="min_lr=0.01 is above the peak lr 0.001"):
        OptimConfig(lr=LR, lr_schedule="cosine", min_lr=0.01)
    with pytest.raises(OptimConfigError, match="choose one of constant, cosine, linear"):
        OptimConfig(lr_schedule="step")


def test_a_run_gives_its_trained_roles_their_optimizer_steps_and_activation_checkpointing():
    from tests.unit.test_config import DEFAULT
    from xray.config import load_config
    from xray.run.models import rl_optimizer_steps, role_init_kwargs

    cfg = load_config(DEFAULT, [("trainer.steps", 7), ("ppo.rollout_batch_size", 16), ("rollout.n_samples", 2),
                                ("ppo.mini_batch_size", 8), ("ppo.ppo_epochs", 3),
                                ("actor.optim.lr_schedule", "cosine"), ("critic.optim.lr_schedule", "linear"),
                                ("critic.optim.decay_steps", 11), ("actor.activation_checkpointing", True)])
    assert rl_optimizer_steps(cfg) == 7 * 3 * (16 * 2 // 8) == 84
    actor, critic = role_init_kwargs(cfg, "actor", "megatron", "m"), role_init_kwargs(cfg, "critic", "deepspeed", "m")
    assert actor["optim"].decay_steps == 84 and critic["optim"].decay_steps == 11
    assert actor["activation_checkpointing"] is True and "activation_checkpointing" not in critic
    assert "activation_checkpointing" not in role_init_kwargs(cfg, "reference", "megatron", "m")
    assert cfg.actor.optim.decay_steps is None  # the run's config stays as written


def test_a_supervised_job_decays_over_its_own_steps_at_its_own_lr():
    from algorithms.sft import job_optim

    actor = OptimConfig(lr=1e-5, weight_decay=0.1, lr_schedule="cosine", min_lr=1e-6)
    sft = job_optim(actor, 1e-3, 200, 10)  # sft.lr, sft.steps, sft.warmup_steps
    assert (sft.lr, sft.warmup_steps, sft.decay_steps, sft.min_lr, sft.weight_decay) == (1e-3, 10, 200, 1e-6, 0.1)
    last = 1e-6 + (1e-3 - 1e-6) * 0.5 * (1 + math.cos(math.pi * 189 / 190))  # step 199 of 200, 10 warm-up
    assert lr_factor(199, sft) * sft.lr == pytest.approx(last, rel=1e-12)
    assert job_optim(OptimConfig(), 1e-3, 200, 10).decay_steps is None  # constant: as before
