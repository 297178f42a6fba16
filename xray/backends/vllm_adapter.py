"""The actor's LoRA adapter inside a vLLM rollout engine: the adapter-only weight sync.

Sits beside `xray/backends/vllm.py`: an engine built with `lora` (the actor's `actor.lora`) holds
one `AdapterSlot`. A sync then sends only the adapter tensors (`peft` names) through the usual
transports; the engine's `load_weights` hands them to the slot, and at the end of the sync the
slot applies them. The first sync writes them as a `peft` directory and loads it with vLLM's own
loader (`add_lora`, which validates the adapter against the model); every later sync, whose tensor
names must be the first's, replaces the adapter on the worker from memory (`_replace_adapter`: the
steps of vLLM's in-place `add_lora`, `load_inplace=True`, without the round trip through the
disk: the same id and slot, no rebuild). Either way the prefix cache is then dropped (vLLM keys
cached blocks by the adapter's name and path, which stay). Every generation and scoring call
carries the slot's `LoRARequest`, without `load_inplace` (a request with it makes vLLM read the
adapter from disk at every engine step). The directory keeps the first version: vLLM reads it
again only when it has dropped the adapter, which its one slot and one adapter never make it do,
but an in-place reload of base weights does (`VllmEngine.reload`), so that calls `restore`, which
puts the last adapter back from memory. The base weights are the model directory's and never
change in a LoRA run.

Exact check: what vLLM's LoRA kernels read, the adapter's slot of each linear layer's stacked
buffers (A and B per part, B already multiplied by alpha / r, q/k/v and gate/up packed per layer,
padded to the engine's largest rank), each compared bit for bit with what was sent, laid out and
scaled the same way (`HeldCheck`); an adapter that holds no slot (registered, never activated)
fails, and so does a sent tensor that no LoRA layer holds (unchecked).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any

import torch

from xray.backends.base import WeightBucket
from xray.backends.held import HeldCheck
from xray.backends.lora import save_adapter
from xray.config.lora import PEFT_PREFIX, LoraConfig

log = logging.getLogger(__name__)

# vLLM's allowed `max_lora_rank` values (its config's MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# the HF parts of a layer vLLM packs, in its order
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdapterError(RuntimeError):
    """An adapter the vLLM engine cannot take; the message says the fix."""


def engine_kwargs(lora: LoraConfig) -> dict[str, Any]:
    """`vllm.LLM` arguments for an engine that serves the actor's adapter."""
    fits = [r for r in VLLM_RANKS if r >= lora.rank]
    if not fits:
        raise AdapterError(f"lora.rank={lora.rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}; lower it")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


def is_adapter_tensor(name: str) -> bool:
    """Whether a synced tensor is a LoRA adapter tensor (a `peft` name)."""
    return name.startswith(PEFT_PREFIX) and (".lora_A." in name or ".lora_B." in name)


class AdapterSlot:
    """The one adapter a rollout engine generates with, replaced in place at each sync."""

    ID = 1

    def __init__(self, lora: LoraConfig, base_model: str):
        self.lora, self.base_model = lora, base_model
        self.directory = tempfile.mkdtemp(prefix="xray-adapter-")
        self.pending: dict[str, torch.Tensor] = {}
        self.request = None  # no adapter until the first sync: the base model (B = 0 at the start)
        self.names: frozenset[str] = frozenset()  # the first sync's tensor names
        self.current: dict[str, torch.Tensor] = {}  # the adapter applied last

    def add(self, bucket: WeightBucket) -> WeightBucket:
        """Keep the adapter tensors of `bucket` for `apply`; return the others."""
        rest = []
        for name, tensor in bucket:
            if is_adapter_tensor(name):
                self.pending[name] = tensor.detach().clone()  # the wire's bytes are read-only
            else:
                rest.append((name, tensor))
        return rest

    def apply(self, llm, dtype: torch.dtype, held: HeldCheck) -> bool:
        """Load the adapter received since the last call into `llm` in place, and compare what
        vLLM then holds with it. False when nothing was received."""
        from vllm.lora.request import LoRARequest

        if not self.pending:
            return False
        tensors, self.pending = self.pending, {}
        if self.request is None:
            save_adapter(self.directory, tensors, self.lora, self.base_model)
            if not llm.llm_engine.add_lora(LoRARequest("actor", self.ID, self.directory)):
                raise AdapterError(f"vLLM refused the adapter written to {self.directory}")
            # generation carries a request without load_inplace: with it, vLLM would read the
            # adapter from disk again at every engine step
            self.request = LoRARequest("actor", self.ID, self.directory)
            self.names = frozenset(tensors)
            llm.reset_prefix_cache()
            loras = llm.collective_rpc(_active_loras, args=(self.ID,))[0]
        else:
            if set(tensors) != self.names:
                raise AdapterError(
                    f"this sync's adapter has other tensors than the first's ({len(tensors)} against "
                    f"{len(self.names)}; e.g. {sorted(set(tensors) ^ self.names)[:2]}): the adapter's "
                    "targets are fixed for a run; restart the rollout to change them")
            loras = self._replace(llm, tensors)
        self.current = tensors
        self._check(loras, tensors, dtype, held)
        return True

    def restore(self, llm) -> None:
        """Put the last adapter back into `llm` from memory (after an in-place reload of base
        weights, which makes vLLM drop its adapters and read the directory's first version)."""
        if self.current:
            self._replace(llm, self.current)

    def _replace(self, llm, tensors: dict[str, torch.Tensor]) -> dict | None:
        config = dict(self.lora.peft_config(), base_model_name_or_path=self.base_model)
        loras = llm.collective_rpc(_replace_adapter, args=(self.ID, tensors, config))[0]
        # the prefix cache keys blocks by the adapter's name and path, unchanged in place: drop
        # the keys and values computed with the previous adapter
        llm.reset_prefix_cache()
        return loras

    def _check(self, loras: dict | None, sent: dict[str, torch.Tensor], dtype: torch.dtype,
               held: HeldCheck) -> None:
        """Compare each sent adapter tensor with what the kernels read (`_active_loras`: the
        adapter's slot of every LoRA layer, padded to the engine's largest rank and width: its
        leading block); a sent tensor vLLM holds nowhere counts as unchecked (the sync fails)."""
        if loras is None:
            held.skip(list(sent))
            return
        if not loras:
            held.mismatch(f"the adapter holds no slot of the engine's LoRA kernels (registered, not active): "
                          f"{len(sent)} sent tensors unused", list(sent))
            return
        seen = set()
        for module, (a_list, b_list) in loras.items():
            parts = PACKED.get(module.rsplit(".", 1)[-1])
            names = [f"{module.rsplit('.', 1)[0]}.{p}" for p in parts] if parts else [module]
            for name, a, b in zip(names, a_list, b_list):
                a_name, b_name = (f"{PEFT_PREFIX}{name}.lora_{x}.weight" for x in "AB")
                if a_name not in sent:
                    continue
                for n, got, want in ((a_name, a, sent[a_name].to(dtype)),
                                     (b_name, b, sent[b_name].to(dtype) * self.lora.scaling)):
                    seen.add(n)
                    block = got[:want.shape[0], :want.shape[1]] if got.dim() == 2 else got
                    if not held.compare(n, block, want):
                        held.skip([n])
        unused = sorted(set(sent) - seen)
        if unused:
            log.warning("%d sent adapter tensors are in none of the engine's LoRA layers (e.g. %s)", len(unused),
                        unused[0])
            held.skip(unused)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _replace_adapter(worker, adapter_id: int, tensors: dict[str, torch.Tensor], config: dict) -> dict | None:
    """On a vLLM worker: replace the registered adapter `adapter_id` with one built from `tensors`
    (`peft` names, `config` its adapter_config.json) in its slot, as vLLM's in-place `add_lora`
    does after reading the directory; then what its kernels read (`_active_loras`)."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    models = manager._adapter_manager
    helper = PEFTHelper.from_dict(dict(config, vllm_max_position_embeddings=manager.max_position_embeddings))
    helper.validate_legal(manager.lora_config)
    mapper = getattr(models.model, "hf_to_vllm_mapper", None)
    own = {name: t.clone() for name, t in tensors.items()}  # vLLM scales B in place
    lora = manager._lora_model_cls.from_lora_tensors(
        adapter_id, own, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
        skip_prefixes=getattr(models.model, "lora_skip_prefixes", None))
    models.remove_adapter(adapter_id)
    models.add_adapter(lora)
    models.activate_adapter(adapter_id)
    return _active_loras(worker, adapter_id)


def _active_loras(worker, adapter_id: int) -> dict | None:
    """On a vLLM worker: {module: ([A per part], [B per part])} as its LoRA kernels read them: the
    adapter's slot of each layer's stacked buffers (`lora_a_stacked` [slots, 1, rank, in],
    `lora_b_stacked` [slots, 1, out, max rank], B scaled), written when vLLM activates the adapter;
    {} when the adapter holds no slot (registered, never activated: generation would run the base
    model); None when this vLLM keeps them elsewhere."""
    try:
        manager = worker.model_runner.lora_manager._adapter_manager
        slot = list(manager.lora_index_to_id).index(adapter_id)
    except (AttributeError, ValueError):
        return {} if hasattr(worker.model_runner, "lora_manager") else None
    out = {}
    for module, layer in manager.modules.items():
        a_stacked, b_stacked = getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None)
        stacks = (a_stacked, b_stacked)
        if not all(isinstance(x, (tuple, list)) and x for x in stacks) or \
                any(t.dim() != 4 for t in (*a_stacked, *b_stacked)):
            continue  # not a linear layer's slots (the embedding's differ): its tensors stay unchecked
        out[module] = ([a[slot, 0].detach().cpu() for a in a_stacked], [b[slot, 0].detach().cpu() for b in b_stacked])
    return out
