"""The DeepSpeed engine's config dict and export bucket plan: pure functions, no processes."""
import pytest
import torch

from xray.backends.base import OptimConfig
from xray.backends.deepspeed.config import DeepSpeedConfigError, ZeroOptions, deepspeed_config
from xray.backends.deepspeed.export import plan_buckets

pytestmark = pytest.mark.backends


def test_config_sizes_buckets_from_hidden_size():
    cfg = deepspeed_config(3, OptimConfig(grad_clip=0.5), dp_size=4, hidden_size=512)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 512**2
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 512**2)
    assert zero["stage3_param_persistence_threshold"] == 0
    assert cfg["gradient_clipping"] == 0.5 and cfg["train_batch_size"] == 4
    assert "optimizer" not in cfg and "scheduler" not in cfg  # xray's AdamW and warm-up are passed as objects
    assert deepspeed_config(2, OptimConfig(), 1, 64, ZeroOptions(reduce_bucket_size=1000))[
        "zero_optimization"]["reduce_bucket_size"] == 1000


def test_reference_runs_stage_0_below_stage_3():
    assert deepspeed_config(1, OptimConfig(), 2, 64, trains=False)["zero_optimization"]["stage"] == 0
    assert deepspeed_config(2, OptimConfig(), 2, 64, trains=False)["zero_optimization"]["stage"] == 0
    assert deepspeed_config(3, OptimConfig(), 2, 64, trains=False)["zero_optimization"]["stage"] == 3


def test_bad_stage_and_dtype():
    with pytest.raises(DeepSpeedConfigError, match="stage 1, 2 or 3"):
        deepspeed_config(0, OptimConfig(), 2, 64)
    with pytest.raises(DeepSpeedConfigError, match="float32"):
        ZeroOptions(dtype="float16")


def test_plan_buckets_bounds_bytes():
    units = [(f"p{i}", [torch.nn.Parameter(torch.zeros(n))]) for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    plan = plan_buckets(units, bucket_bytes=30 * 4)
    assert [[name for name, _ in b] for b in plan] == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5"]]
