"""Restoring a DeepSpeed checkpoint into another data-parallel size, through a universal checkpoint.

ZeRO's optimizer files are one per data-parallel rank, and DeepSpeed refuses them at another
world size. `DeepSpeedEngine.load` asks `saved_dp`; when it differs, global rank 0 converts the
checkpoint once with DeepSpeed's own `ds_to_universal` (into `<tag>_universal` beside it, named by
a `latest_universal` file) while the others wait, and every rank loads that with DeepSpeed's
`load_universal` switched on for the one call: weights, Adam state and step come back exactly
(see FACTS.md, "Checkpoints across layouts").
"""
from __future__ import annotations

import argparse
import glob
import os

import torch.distributed as dist

UNIVERSAL_SUFFIX = "_universal"


def client_state(step: int) -> dict:
    """What xray's DeepSpeed checkpoints carry beside DeepSpeed's own state: the step, and the
    `universal_checkpoint_info` that DeepSpeed's conversion of a ZeRO-1/2 checkpoint requires the
    client to write (its format version; a Hugging Face model with no tensor parallelism inside
    DeepSpeed needs none of its merge patterns)."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {"xray_step": step, UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY:
                                                           UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def saved_dp(directory: str, tag: str) -> int:
    """Data-parallel ranks that wrote the checkpoint `tag` (its ZeRO optimizer files); 0 if none."""
    return len(glob.glob(os.path.join(directory, tag, "*optim_states.pt")))


def ensure_universal(directory: str, tag: str, rank: int) -> str:
    """The universal form of checkpoint `tag` (converted by rank 0 if not yet there; every rank
    returns when it exists); its tag."""
    universal = tag + UNIVERSAL_SUFFIX
    if rank == 0 and not os.path.isfile(os.path.join(directory, "latest_universal")):
        from deepspeed.checkpoint import ds_to_universal

        args = argparse.Namespace(input_folder=os.path.join(directory, tag),
                                  output_folder=os.path.join(directory, universal), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)  # checkpoints written before `client_state` had it
        ds_to_universal.main(args)
        with open(os.path.join(directory, "latest_universal"), "w") as f:
            f.write(universal)
    dist.barrier()
    return universal


def load_universal(engine, directory: str, trains: bool):
    """`engine.load_checkpoint` of the universal checkpoint in `directory` (its `latest_universal`)."""
    engine._config.load_universal_checkpoint = True  # DeepSpeed reads this switch at load time
    try:
        return engine.load_checkpoint(directory, tag=None, load_optimizer_states=trains,
                                      load_lr_scheduler_states=trains)
    finally:
        engine._config.load_universal_checkpoint = False
