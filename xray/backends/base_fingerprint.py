"""The fingerprint of a model directory's weights: what a LoRA run checks the rollout's base model by.

A LoRA run syncs the actor's adapter alone (`xray/backends/vllm_adapter.py`); the rollout's base
weights are the ones it loaded at its start and are never compared with the actor's by the sync.
Each Workhorse fingerprints the directory it loaded (`Workhorse.base_fingerprint`) and the run's
first sync compares the actor's with every rollout replica's (`xray/run/verify.py`): a rollout
started from another base model (another checkpoint, another revision, a fine-tuned copy) fails
there, before a step trains on what it samples.

The fingerprint is XXH3-128 over every tensor of the directory's safetensors files in name order:
its name, dtype, shape and the bytes of `ROWS` rows spread over it (all of a smaller or 1-D
tensor), read alone from the files (0.13 s for SmolLM2-135M's 540 MB, where hashing every byte took
1.7 s). It identifies a checkpoint (another one, a fine-tuned copy or another
revision differs in almost every row); it does not prove every byte, which is not its job.
"""
from __future__ import annotations

from pathlib import Path

ROWS = 16
"""Rows of each tensor (evenly spaced, the first and the last among them) that the fingerprint reads."""


def fingerprint(model_dir: str | Path | None) -> str | None:
    """The hex fingerprint of the weights in `model_dir`'s safetensors files; None when it has none
    (weights in another format: nothing to compare)."""
    import torch
    import xxhash
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir else []
    if not files:
        return None
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({name: path for name in f.keys()})
    digest = xxhash.xxh3_128()
    handles = {path: safe_open(str(path), framework="pt") for path in files}
    for name in sorted(where):
        part = handles[where[name]].get_slice(name)
        shape = list(part.get_shape())
        if len(shape) <= 1 or shape[0] <= ROWS:
            t = part[:]
        else:
            rows = sorted({round(i * (shape[0] - 1) / (ROWS - 1)) for i in range(ROWS)})
            t = torch.cat([part[r:r + 1] for r in rows])
        digest.update(f"{name}|{t.dtype}|{shape}|".encode())
        digest.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()
