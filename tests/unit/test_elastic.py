"""Elastic batches (xray.config.elasticity: DeepSpeed's rule) and their DeepSpeed keys
(xray.backends.elastic), checked against hand-computed batches (and against DeepSpeed's own function
in tests/unit/test_deepspeed_elastic_rule.py)."""
from dataclasses import replace

import pytest

from xray.backends.elastic import apply_elasticity
from xray.config.elasticity import ElasticBatch, ElasticityConfig, ElasticityError, elastic_batch

pytestmark = pytest.mark.unit

CFG = ElasticityConfig(max_train_batch_size=100, micro_batch_sizes=(2, 4, 6), min_gpus=1, max_gpus=64, version=0.1)
"""DeepSpeed's rule (xray/config/elastic_rule.py): candidates 2x48 = 4x24 = 96 and 6x12 = 12x6 = 72;
96 allows 10 world sizes (the divisors of 48, 24 and 16), 72 only 9, so the global batch is 96 at
every valid size."""


@pytest.mark.parametrize("world, micro, accumulation", [
    (1, 6, 16),  # 96 per replica: 6 is the largest micro-batch dividing it
    (3, 4, 8),  # 32 per replica: 6 does not divide it, 4 does
    (8, 6, 2),  # 12 per replica
    (16, 6, 1),
    (48, 2, 1),  # 2 per replica: only micro 2
])
def test_one_global_batch_at_every_valid_size(world, micro, accumulation):
    got = elastic_batch(CFG, world)
    assert got == ElasticBatch(world, micro, accumulation)
    assert got.train_batch_size == 96


@pytest.mark.parametrize("world", [5, 7, 20, 64])
def test_a_size_the_rule_refuses_lists_the_valid_ones(world):
    with pytest.raises(ElasticityError, match=r"valid sizes \[1, 2, 3, 4, 6, 8, 12, 16, 24, 48\]"):
        elastic_batch(CFG, world)


def test_no_valid_batch_says_the_fix():
    """v0.2 gives a size outside its list a batch of its own: none fits 51 replicas of micro 2 in 100."""
    with pytest.raises(ElasticityError, match=r"at least 102.*at most 50 replicas"):
        elastic_batch(replace(CFG, version=0.2), 51)


def test_world_size_outside_range():
    cfg = ElasticityConfig(max_train_batch_size=64, micro_batch_sizes=(1,), min_gpus=2, max_gpus=4, version=0.1)
    for world in (1, 5):  # the batch is 1 x 60 (60: the largest highly composite number <= 64)
        with pytest.raises(ElasticityError, match=r"valid sizes \[2, 3, 4\]"):
            elastic_batch(cfg, world)
    assert elastic_batch(cfg, 4).train_batch_size == 60


def test_invalid_blocks():
    with pytest.raises(ElasticityError, match="empty"):
        ElasticityConfig(max_train_batch_size=8, micro_batch_sizes=())
    with pytest.raises(ElasticityError, match="min_gpus"):
        ElasticityConfig(max_train_batch_size=8, micro_batch_sizes=(1,), min_gpus=4, max_gpus=2)
    with pytest.raises(ElasticityError, match="unknown elasticity keys"):
        ElasticityConfig.from_dict({"max_train_batch_size": 8, "micro_batch_sizes": [1], "max_gpu": 2})


def test_apply_elasticity_replaces_the_block():
    ds = {"elasticity": {"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [2, 4, 6],
                         "min_gpus": 1, "max_gpus": 64, "version": 0.1},
          "zero_optimization": {"stage": 3}}
    out = apply_elasticity(ds, 3)
    assert "elasticity" not in out and out["zero_optimization"] == {"stage": 3}
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) \
        == (96, 4, 8)
    assert "elasticity" in ds  # input untouched


def test_apply_elasticity_conflicting_batch_keys():
    block = {"max_train_batch_size": 100, "micro_batch_sizes": [2, 4, 6]}
    with pytest.raises(ElasticityError, match="ignore_non_elastic_batch_info"):
        apply_elasticity({"elasticity": block, "train_batch_size": 32}, 2)
    out = apply_elasticity({"elasticity": {**block, "ignore_non_elastic_batch_info": True},
                            "train_batch_size": 32}, 2)
    # v0.2 (the default) at 2 replicas in the block's list: 96, 48 per replica, micro 6
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) \
        == (96, 6, 8)


def test_disabled_block_keeps_plain_keys():
    out = apply_elasticity({"elasticity": {"enabled": False, "max_train_batch_size": 8, "micro_batch_sizes": [1]},
                            "train_batch_size": 32}, 2)
    assert out == {"train_batch_size": 32}
