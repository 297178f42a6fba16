"""The torch modules the DeepSpeed engine wraps, and what their forward pass returns per role.

Sits inside the DeepSpeed training backend. Actor and reference are the Hugging Face causal LM
as it is; the critic is the same transformer trunk with a seeded scalar value head. Nothing here
imports DeepSpeed: tests build the same modules to compare against the sharded engine.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from xray.backends.hf_logprobs import token_logprobs
from xray.backends.hf_routing import replayed
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.packing import pack_rows

if TYPE_CHECKING:
    from xray.config.lora import LoraConfig

ROLES = ("actor", "reference", "critic")
ROUTER_AUX = "router_aux_loss"
"""`role_outputs`' key for a mixture of experts' load-balancing loss (a scalar; the engine adds it)."""


class RoleError(ValueError):
    """An unknown model role."""


class ValueModel(torch.nn.Module):
    """A transformer trunk and a linear value head: one value per position, [B, T] -> [B, T]."""

    def __init__(self, trunk: torch.nn.Module, hidden_size: int, seed: int):
        super().__init__()
        self.model = trunk
        self.value_head = torch.nn.Linear(hidden_size, 1, bias=True)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # small head, as OpenRLHF: std 1/(hidden+1), so early values are near 0
            self.value_head.weight.copy_(torch.randn(self.value_head.weight.shape, generator=g) / (hidden_size + 1))
            self.value_head.bias.zero_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **packed) -> torch.Tensor:
        """`packed`: a packed sequence's position ids and row offsets (`role_outputs`)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            **packed).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def load_model(model_dir: str, role: str, seed: int, dtype: torch.dtype = torch.float32,
               zero3_config: dict | None = None, lora: "LoraConfig | None" = None,
               packing: bool = False, checkpointing: bool = False) -> torch.nn.Module:
    """The module for `role`, its weights read from a Hugging Face directory.

    With `zero3_config` (a ZeRO stage 3 DeepSpeed config), transformers builds the model inside
    `deepspeed.zero.Init` and loads the checkpoint shard by shard, so no process ever holds the
    whole model (transformers' `HfDeepSpeedConfig` switch, held only while loading). With `lora`,
    the target layers get adapters and only they (and a critic's value head) train. With
    `packing`, the model attends row by row in packed sequences (`xray/backends/hf_packed.py`).
    With `checkpointing`, each decoder layer keeps only its input in a training forward and runs
    again in the backward (transformers' gradient checkpointing, non-reentrant: the same gradients,
    also for adapters behind a frozen embedding)."""
    from transformers import AutoModelForCausalLM

    if role not in ROLES:
        raise RoleError(f"unknown role {role!r}; the DeepSpeed engine builds one of {ROLES}")
    if zero3_config is not None:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

        switch = HfDeepSpeedConfig(zero3_config)  # noqa: F841 - transformers reads it through a weakref
        try:
            causal = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        finally:
            unset_hf_deepspeed_config()
    else:
        causal = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if checkpointing:
        causal.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if packing:
        from xray.backends.hf_packed import use_rows_attention

        use_rows_attention(causal)
    module = causal if role != "critic" else \
        ValueModel(causal.get_decoder(), causal.config.hidden_size, seed).to(dtype)
    if lora is not None and role != "reference":
        from xray.backends.deepspeed.lora import add_adapters

        add_adapters(module, lora, seed)
    return module


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position but the last: [B, T, V] -> [B, T-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def router_aux_coef(model_dir: str, moe) -> float:
    """The weight of the router's load-balancing loss (`moe`, a `MoeConfig`): 0 for none; refused on
    a model without experts."""
    import json
    from pathlib import Path

    if not moe.balanced:
        return 0.0
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if not (config.get("num_experts") or config.get("num_local_experts")):
        raise ValueError(f"moe.load_balancing={moe.load_balancing} on {model_dir}, a model without experts; "
                         "leave <role>.moe unset for a dense model")
    return moe.aux_loss_coef


def role_outputs(module: torch.nn.Module, batch: Batch, role: str, entropy: bool = True,
                 packed: bool = False, router_aux: bool = False) -> dict[str, torch.Tensor]:
    """The outputs a loss function receives: LOGPROBS and (if `entropy`) ENTROPY [B, T-1] for
    actor and reference, VALUES [B, T-1] for the critic (value at position t predicts token t+1).
    `packed`: the rows run as one sequence without padding (`xray/data/packing.py`; the module
    attends with `xray.backends.hf_packed.ROWS`), their outputs laid back out as the rows'.
    `router_aux`: also a mixture of experts' load-balancing loss over the batch's tokens under
    `ROUTER_AUX` (Hugging Face's `load_balancing_loss_func`, unweighted). A batch with ROUTED_EXPERTS
    routes each token to those experts (routing replay)."""
    ids, mask = batch[C.INPUT_IDS], batch[C.ATTENTION_MASK]
    inputs, unpack = {"input_ids": ids, "attention_mask": mask}, (lambda t: t)
    if packed:
        pack = pack_rows(ids, mask)
        inputs = {"input_ids": pack.ids, "position_ids": pack.positions, "cu_seq_lens_q": pack.cu_seqlens,
                  "cu_seq_lens_k": pack.cu_seqlens, "max_length_q": pack.max_len, "max_length_k": pack.max_len}
        unpack = pack.unpack
    if role == "critic":
        values = unpack(module(**inputs)[..., None])[..., 0]
        return {C.VALUES: values[:, :-1].float()}
    routing = batch.tensors.get(C.ROUTED_EXPERTS)  # the rollout's routing, replayed (`hf_routing.replayed`)
    with replayed(module, routing, mask) if routing is not None else contextlib.nullcontext():
        result = module(**inputs, use_cache=False, **({"output_router_logits": True} if router_aux else {}))
    logits = unpack(result.logits)
    out = {C.LOGPROBS: token_logprobs(logits, ids)}
    if router_aux:
        out[ROUTER_AUX] = result.aux_loss
    if entropy:
        out[C.ENTROPY] = entropy_from_logits(logits)
    return out
