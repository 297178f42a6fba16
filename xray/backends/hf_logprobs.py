"""Per-token log-probabilities of a plain Hugging Face causal LM: the one definition every path
shares (the Hugging Face reference and reward Workhorses, DeepSpeed's model wrapper, and the
single-process reference of `xray.check`). Sits under the backends; imports no engine library.
"""
from __future__ import annotations

import torch

from xray.data import columns as C
from xray.data.batch import Batch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | <= t) from logits [B, T, V] -> [B, T-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def load_hf(model_dir: str) -> torch.nn.Module:
    """A Hugging Face causal LM from `model_dir`, in fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-token log-probs [B, T-1] of the Hugging Face model on INPUT_IDS / ATTENTION_MASK."""
    out = model(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK], use_cache=False)
    return token_logprobs(out.logits, batch[C.INPUT_IDS])
