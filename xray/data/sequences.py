"""Prompt + response token lists laid out as model inputs: the one place that does it.

Row i holds its prompt, then its response, then right padding. Position t of the `[B, T-1]`
tensors scores token t+1, so a response occupying tokens `p .. p+r-1` is marked in LOSS_MASK at
positions `p-1 .. p+r-2`. PPO's experience and the supervised warm start both use this layout.
"""
from __future__ import annotations

from typing import Sequence

import torch

from xray.data import columns as C
from xray.data.batch import Batch


def pack_sequences(prompt_ids: Sequence[list[int]], response_ids: Sequence[list[int]], pad_id: int = 0,
                   response_logprobs: Sequence[list[float]] | None = None,
                   response_versions: Sequence[list[int]] | None = None,
                   response_masks: Sequence[list[int]] | None = None,
                   routed_experts: Sequence[torch.Tensor] | None = None) -> Batch:
    """INPUT_IDS / ATTENTION_MASK `[B, T]` and LOSS_MASK `[B, T-1]` (1 where token t+1 belongs to
    the response), plus list columns PROMPT_IDS and RESPONSE_IDS; with `response_logprobs` (the
    sampler's log-prob of each response token) also BEHAVIOUR_LOGPROBS `[B, T-1]` at LOSS_MASK, and
    with `response_versions` (the weight version that sampled each response token: a partial
    rollout's tokens span versions) BEHAVIOUR_VERSIONS `[B, T-1]` likewise. With `response_masks`
    (a multi-turn trajectory: 1 on the model's tokens, 0 on the environment's observations,
    `xray/data/trajectory.py`) LOSS_MASK is 1 only on the model's tokens. With `routed_experts` (each
    row's `[tokens - 1, L, K]` experts, from an engine that reports its routing) ROUTED_EXPERTS
    `[B, T, L, K]`, the positions it does not cover (the last token, padding) routed to experts
    0..K-1, which no output at a real position depends on."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses; pair each prompt "
                         "with exactly one response (repeat prompts for several samples)")
    seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width - 1, dtype=torch.float32)
    for i, (p, s) in enumerate(zip(prompt_ids, seqs)):
        if not p:
            raise ValueError(f"row {i} has an empty prompt; every prompt needs at least one token (BOS)")
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, :len(s)] = 1
        loss_mask[i, len(p) - 1:len(s) - 1] = 1.0
        if response_masks is not None:
            mask = list(response_masks[i])
            if len(mask) != len(s) - len(p):
                raise ValueError(f"row {i}: its response mask has {len(mask)} entries for {len(s) - len(p)} tokens")
            loss_mask[i, len(p) - 1:len(s) - 1] = torch.tensor(mask, dtype=torch.float32)
    tensors = {C.INPUT_IDS: ids, C.ATTENTION_MASK: attn, C.LOSS_MASK: loss_mask}
    if response_logprobs is not None:
        behaviour = torch.zeros(len(seqs), width - 1, dtype=torch.float32)
        for i, (p, lp) in enumerate(zip(prompt_ids, response_logprobs)):
            behaviour[i, len(p) - 1:len(p) - 1 + len(lp)] = torch.tensor(list(lp), dtype=torch.float32)
        tensors[C.BEHAVIOUR_LOGPROBS] = behaviour
    if response_versions is not None:
        versions = torch.zeros(len(seqs), width - 1, dtype=torch.int32)
        for i, (p, v) in enumerate(zip(prompt_ids, response_versions)):
            versions[i, len(p) - 1:len(p) - 1 + len(v)] = torch.tensor(list(v), dtype=torch.int32)
        tensors[C.BEHAVIOUR_VERSIONS] = versions
    if routed_experts is not None:
        tensors[C.ROUTED_EXPERTS] = _routing_column(routed_experts, width)
    return Batch(tensors,
                 {C.PROMPT_IDS: [list(p) for p in prompt_ids], C.RESPONSE_IDS: [list(r) for r in response_ids]})


def _routing_column(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """`[B, width, L, K]` int16 of each row's routing, the rest experts 0..K-1."""
    layers, k = rows[0].shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(rows), width, layers, k).clone()
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
