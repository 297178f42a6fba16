"""Tied heads in a vLLM engine: an output layer that shares its weight with another layer (the LM
head of a model with `tie_word_embeddings`, which reads the input embedding's weight).

Called by the vLLM engine (`xray/backends/vllm.py`) around each in-place reload, inside the model
of this process. The head has no checkpoint tensor of its own, so vLLM's reload writes only the
embedding; on CPU each layer keeps a packed copy of its weight for its GEMM (made when the layer
is processed after loading), and the head, which no reload touches, keeps packing the weights it
was built with: its logits come from the old embedding while the embedding reads back new (a
synced SmolLM2 gave log-probs 0.28 nat off HF's with every exact check passing). After a reload
that wrote a head's source, `refresh` processes the head again, and `check` checks the head by its
own product (its logits on a seeded input against the sent embedding's), so the head is a held
tensor with its own verdict (`vllm_held.check_model` checks the embedding).
"""
from __future__ import annotations

import torch

from xray.backends.held import HeldCheck


def tied_heads(model: torch.nn.Module, checkpoint_names: set[str]) -> dict[str, str]:
    """`{head: source}`: each layer whose `weight` is another layer's own tensor and has no
    checkpoint tensor of its own (the head of a tied model: `lm_head` -> `model.embed_tokens`)."""
    owner: dict[int, str] = {}
    heads: dict[str, str] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.is_meta:
            continue
        key = id(weight)
        if key not in owner:
            owner[key] = name
        elif f"{name}.weight" not in checkpoint_names:
            heads[name] = owner[key]
    return heads


def written(heads: dict[str, str], tensor_names: list[str]) -> list[str]:
    """The heads whose source layer is among `tensor_names` (the Hugging Face names just reloaded)."""
    layers = {name.rsplit(".", 1)[0] for name in tensor_names}
    return [head for head, source in heads.items() if source in layers]


def refresh(model: torch.nn.Module, heads: list[str]) -> None:
    """Process each head again as vLLM processes a layer after loading it (on CPU: its GEMM's packed
    copy of the weight made anew from the reloaded tensor)."""
    modules = dict(model.named_modules())
    for head in heads:
        module = modules[head]
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def check(model: torch.nn.Module, heads: dict[str, str], sent: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """Each head of `heads` whose source tensor is in `sent` (`{hf name: tensor}`) checked by its own
    product: its logits for a seeded input against that input times the sent weight (this rank's
    vocabulary range, padding left out); the counts (`HeldCheck.take`), the head named `<head>.weight`."""
    held = HeldCheck()
    modules = dict(model.named_modules())
    for head, source in heads.items():
        weight = sent.get(f"{source}.weight")
        if weight is None:
            continue
        module = modules[head]
        name = f"{head}.weight"
        shard = getattr(module, "shard_indices", None)
        if shard is not None:
            start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
        else:
            start, end = 0, weight.shape[0]
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "apply"):
            held.skip([name])
            continue
        device = module.weight.device

        def logits(x: torch.Tensor, module=module, method=method, n=end - start) -> torch.Tensor:
            return method.apply(module, x.to(device))[:, :n]

        held.compare_product(name, logits, weight.shape[1], weight[start:end], dtype, module.weight.dtype)
    return held.take()
