"""Supervised warm start: (prompt ids, target text) pairs packed into a training Batch, and the
loss (`python -m xray.train sft` trains a built-in task's answers this way before PPO).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.sequences import pack_sequences


def target_ids(target: object, tokenizer) -> list[int]:
    """A supervised target's token ids followed by EOS (the model learns to stop after it)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; a warm start must teach the model to stop")
    return list(tokenizer(str(target), add_special_tokens=False).input_ids) + [eos]


def sft_batch(prompt_ids: Sequence[list[int]], targets: Sequence[str], tokenizer) -> Batch:
    """Prompts followed by each target's tokens and EOS, trained on the target and EOS only."""
    responses = [target_ids(t, tokenizer) for t in targets]
    return pack_sequences(prompt_ids, responses, pad_id=tokenizer.pad_token_id or 0)


@dataclass(frozen=True)
class SFTLoss:
    """The warm start's `LossFn`: mean negative log-likelihood of the LOSS_MASK tokens."""

    def __call__(self, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logp = outputs[C.LOGPROBS]
        mask = batch[C.LOSS_MASK].to(logp.dtype)
        count = mask.sum().clamp(min=1.0)
        loss = -(logp * mask).sum() / count
        with torch.no_grad():
            token_acc = ((logp > -0.6931471805599453).to(logp.dtype) * mask).sum() / count
        return loss, {"sft_loss": float(loss.detach()), "token_p_gt_half": float(token_acc)}
