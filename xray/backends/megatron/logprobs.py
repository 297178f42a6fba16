"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Used by the Megatron engine's last pipeline stage. With tensor parallelism each rank holds the
logits of its slice of the vocabulary ([b, s, V/tp]); the full vocabulary is never gathered on
one rank: the softmax normaliser, the target logit and the entropy's expectation are each a sum
over slices, all-reduced over the tensor-parallel group with Megatron's
`reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward: every rank
computes the same loss, so each rank's backward sees the whole gradient of its own slice).
"""
from __future__ import annotations

from typing import Callable

import torch

from xray.data import columns as C


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _single_rank(logits: torch.Tensor, targets: torch.Tensor):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, lambda: -(logp_all.exp() * logp_all).sum(-1)


def _vocab_parallel(logits: torch.Tensor, targets: torch.Tensor, tp_rank: int):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    logits = logits.float()
    local_vocab = logits.shape[-1]
    peak = logits.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - peak                                       # [b, s, V/tp]
    exp = shifted.exp()
    sum_exp = reduce(exp.sum(-1))                                 # [b, s]
    log_norm = sum_exp.log()
    local = targets - tp_rank * local_vocab
    here = (local >= 0) & (local < local_vocab)
    picked = shifted.gather(-1, local.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce(picked * here)                                # [b, s]

    def entropy() -> torch.Tensor:
        expected = reduce((exp * shifted).sum(-1)) / sum_exp      # E_p[shifted logit]
        return log_norm - expected

    return picked - log_norm, entropy


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, Callable]:
    """log p(input_ids[:, t+1] | <= t) [b, T-1] from this rank's logits [b, T, V/tp], and a
    function that computes the entropy [b, T-1] of the same distributions when called."""
    tp, tp_rank = _tp()
    logits, targets = logits[:, :-1], input_ids[:, 1:]
    if tp == 1:
        return _single_rank(logits, targets)
    return _vocab_parallel(logits, targets, tp_rank)


class PolicyOutputs(dict):
    """LOGPROBS, with ENTROPY computed only if a loss function reads `outputs[ENTROPY]`."""

    def __init__(self, logprobs: torch.Tensor, entropy: Callable[[], torch.Tensor]):
        super().__init__({C.LOGPROBS: logprobs})
        self._entropy = entropy

    def __missing__(self, key: str) -> torch.Tensor:
        if key != C.ENTROPY:
            raise KeyError(f"no model output {key!r}; a policy head gives {C.LOGPROBS} and {C.ENTROPY}")
        self[key] = value = self._entropy()
        return value

    def __contains__(self, key: object) -> bool:
        return key == C.ENTROPY or super().__contains__(key)

    def get(self, key: str, default=None):
        return self[key] if key in self else default
