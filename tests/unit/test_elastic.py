"""Elastic batch arithmetic (xray.config.elasticity) and its DeepSpeed keys (xray.backends.elastic),
checked against hand-computed batches."""
import pytest

from xray.backends.elastic import apply_elasticity
from xray.config.elasticity import ElasticBatch, ElasticityConfig, ElasticityError, elastic_batch

pytestmark = pytest.mark.unit

CFG = ElasticityConfig(max_train_batch_size=100, micro_batch_sizes=(2, 4, 6), min_gpus=1, max_gpus=64)


@pytest.mark.parametrize("world, micro, accumulation, total", [
    # 1 replica: 2*50=100, 4*25=100, 6*16=96 -> 100, larger micro wins the tie
    (1, 4, 25, 100),
    # 3 replicas: 2*16*3=96, 4*8*3=96, 6*5*3=90 -> 96 with micro 4
    (3, 4, 8, 96),
    # 8 replicas: 2*6*8=96, 4*3*8=96, 6*2*8=96 -> all 96, micro 6
    (8, 6, 2, 96),
    # 20 replicas: 2*2*20=80, 4*1*20=80, 6 does not fit -> 80 with micro 4
    (20, 4, 1, 80),
    # 7 replicas: 2*7*7=98, 4*3*7=84, 6*2*7=84 -> 98 with micro 2
    (7, 2, 7, 98),
    # 50 replicas: only micro 2 fits once -> 100
    (50, 2, 1, 100),
])
def test_largest_batch_for_world_size(world, micro, accumulation, total):
    got = elastic_batch(CFG, world)
    assert got == ElasticBatch(world, micro, accumulation)
    assert got.train_batch_size == total


def test_no_valid_batch_says_the_fix():
    with pytest.raises(ElasticityError, match=r"at least 102.*at most 50 replicas"):
        elastic_batch(CFG, 51)


def test_world_size_outside_range():
    cfg = ElasticityConfig(max_train_batch_size=64, micro_batch_sizes=(1,), min_gpus=2, max_gpus=4)
    with pytest.raises(ElasticityError, match="outside"):
        elastic_batch(cfg, 1)
    with pytest.raises(ElasticityError, match="outside"):
        elastic_batch(cfg, 5)
    assert elastic_batch(cfg, 4).train_batch_size == 64


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
    # 2 replicas: 2*25*2=100, 4*12*2=96, 6*8*2=96 -> 100 with micro 2
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) \
        == (100, 2, 25)


def test_disabled_block_keeps_plain_keys():
    out = apply_elasticity({"elasticity": {"enabled": False, "max_train_batch_size": 8, "micro_batch_sizes": [1]},
                            "train_batch_size": 32}, 2)
    assert out == {"train_batch_size": 32}
