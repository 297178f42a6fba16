"""A DeepSpeed JSON config as ms-swift's users write it (`role.deepspeed_config`,
xray/config/deepspeed_json.py): its meaning lands in the role's keys, "auto" takes xray's values, and
what xray cannot honour is an error that says the fix."""
import json

import pytest

from algorithms.specs import command_spec, default_config
from tests.unit.test_deepspeed_elastic_rule import SEED_BLOCK
from xray.config import ConfigError, load_config
from xray.config.plan import plan_run

pytestmark = pytest.mark.unit

SWIFT_ZERO1 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": False,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    "elasticity": SEED_BLOCK,
}
"""ms-swift's default `zero1.json` with the seed's elasticity block (docs/source_en/BestPractices/Elastic.md)."""
GROUPS = {"nproc_per_node": 3,
          "train_group": {"device": "CPU", "ranks": [0, 1], "workers": ["actor", "critic", "reference"]},
          "rollout_group": {"device": "CPU", "ranks": [2], "workers": ["rollout"]}}


def cfg_with(tmp_path, ds: dict, extra=()):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return load_config(default_config("ppo"), [("actor.deepspeed_config", str(path)),
                                               ("critic.deepspeed_config", str(path)), *extra])


def test_swifts_zero1_with_the_seeds_block_becomes_the_roles_settings(tmp_path):
    cfg = cfg_with(tmp_path, SWIFT_ZERO1)
    default = load_config(default_config("ppo"))
    assert cfg.actor.zero_stage == 1 and cfg.critic.zero_stage == 1 and cfg.reference.zero_stage == 3
    assert cfg.actor.optim.grad_clip == default.actor.optim.grad_clip  # "auto": xray's
    assert cfg.actor.micro_batch_size == default.actor.micro_batch_size
    e = cfg.actor.elasticity
    assert (e.max_train_batch_size, e.micro_batch_sizes, e.max_gpus, e.min_time, e.version) == (8, (4, 2), 4, 20, 0.1)
    elastic = cfg_with(tmp_path, SWIFT_ZERO1, [("device_groups", GROUPS), ("actor.dp", 2), ("critic.dp", 2),
                                               ("reference.dp", 2)])
    text = plan_run(elastic, "deepspeed-dsinfer", command_spec("ppo")).describe()
    assert "1: 1 x 4 x 2 = 8" in text and "2: 2 x 4 x 1 = 8" in text, text  # DeepSpeed's one batch of 8


def test_values_of_its_own_land_or_are_refused_with_the_fix(tmp_path):
    own = dict(SWIFT_ZERO1, gradient_clipping=0.5, train_micro_batch_size_per_gpu=2, elasticity={})
    own["zero_optimization"] = dict(SWIFT_ZERO1["zero_optimization"], stage=2)
    cfg = cfg_with(tmp_path, {k: v for k, v in own.items() if k != "elasticity"})
    assert (cfg.actor.zero_stage, cfg.actor.optim.grad_clip, cfg.actor.micro_batch_size) == (2, 0.5, 2)
    cases = [
        (dict(SWIFT_ZERO1, zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}),
         r"offload_optimizer.device='cpu'.*set it to \"none\""),
        (dict(SWIFT_ZERO1, fp16={"enabled": True}), r"fp16.enabled=True; xray trains in fp32 or bf16"),
        (dict(SWIFT_ZERO1, bf16={"enabled": True}), r"bf16.enabled=True but model.dtype is float32"),
        (dict(SWIFT_ZERO1, amp={"enabled": True}), r"keys xray does not read: \['amp'\]"),
        (dict(SWIFT_ZERO1, optimizer={"type": "AdamW", "params": {"lr": 1e-5}}), r"optimizer with values of its own"),
        ({"train_batch_size": 64}, r"train_batch_size=64; xray derives it"),
        ({"zero_optimization": {"stage": 0}}, r"stage=0; the deepspeed backend runs ZeRO 1, 2 or 3"),
    ]
    for ds, message in cases:
        with pytest.raises(ConfigError, match=message):
            cfg_with(tmp_path, ds)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(default_config("ppo"), [("actor.deepspeed_config", str(tmp_path / "missing.json"))])
    # "auto" everywhere with bf16: follows model.dtype
    assert cfg_with(tmp_path, dict(SWIFT_ZERO1, bf16={"enabled": True}),
                    [("model.dtype", "bfloat16")]).actor.zero_stage == 1
