"""DeepSpeed's `elasticity` block as the plain batch keys every DeepSpeed version accepts.

Sits beside the training backends. The block's fields and the batch arithmetic are the config
layer's (`xray/config/elasticity.py`); this module writes the batch a world size gets as
DeepSpeed's config keys. DeepSpeed 0.19.8 itself no longer accepts the block (it raises "Elastic
training has been removed"), so `apply_elasticity` turns it into the three plain batch keys
(`train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`). Pure
Python: no torch, no DeepSpeed.
"""
from __future__ import annotations

from typing import Any, Mapping

from xray.config.elasticity import ElasticBatch, ElasticityConfig, ElasticityError, elastic_batch

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def deepspeed_keys(batch: ElasticBatch) -> dict[str, int]:
    """The three DeepSpeed config keys for `batch`."""
    return {"train_batch_size": batch.train_batch_size,
            "train_micro_batch_size_per_gpu": batch.micro_batch_size,
            "gradient_accumulation_steps": batch.gradient_accumulation_steps}


def apply_elasticity(ds_config: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """A copy of a DeepSpeed config whose `elasticity` block is replaced by the plain batch keys
    for `world_size`. A config without the block, or with it disabled, keeps its batch keys."""
    out = dict(ds_config)
    block = out.pop("elasticity", None)
    if block is None:
        return out
    cfg = ElasticityConfig.from_dict(block)
    if not cfg.enabled:
        return out
    given = [k for k in BATCH_KEYS if k in out]
    if given and not cfg.ignore_non_elastic_batch_info:
        raise ElasticityError(
            f"the config sets {given} and an enabled elasticity block, which recomputes them; remove "
            "those keys or set elasticity.ignore_non_elastic_batch_info: true")
    out.update(deepspeed_keys(elastic_batch(cfg, world_size)))
    return out
