"""The experts a Hugging Face mixture of experts routes each token to: recorded while it generates,
and replayed in a forward (routing replay, `<role>.moe.routing_replay`).

Used by the DeepSpeed-Inference rollout engine, which runs the Hugging Face module and so can
report its routing (`RoutingRecorder`), and by the DeepSpeed training engine, whose forwards take
the rollout's routing instead of their own (`replayed`); tests use both on plain transformers
models. transformers 5's MoE blocks (Qwen3-MoE, Qwen2-MoE) call their router (`mlp.gate`, with
`top_k` and `norm_topk_prob`) on the flattened tokens `[B * T, H]` (row-major) and take back
`(logits, top-k weights, top-k indices)`: a forward hook reads the indices, or replaces them and
the weights (the router's own probabilities at the replayed experts, renormalised where
`norm_topk_prob` says), so the experts run on the replayed choice with gradients through the
router as usual.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of a transformers model, in layer order."""
    return [m for name, m in module.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]


class RoutingRecorder:
    """While open (`with recorder:`), every router call's top-k indices, per call: `calls[c][l]` is
    layer l's `[B * T_c, K]` of forward call c (generation: the prefill, then one token a step)."""

    def __init__(self, module: torch.nn.Module):
        self.gates = routers(module)
        self.calls: list[list[torch.Tensor]] = []
        self._hooks = []

    def _hook(self, layer: int):
        def record(_module, _inputs, output):
            if layer == 0:
                self.calls.append([])
            self.calls[-1].append(output[2].detach().to("cpu", torch.int16))
        return record

    def __enter__(self) -> "RoutingRecorder":
        self._hooks = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()

    def rows(self, batch: int, width: int, prompt_lens: list[int], response_lens: list[int]) -> list[torch.Tensor]:
        """Each row's routing `[prompt + response - 1, L, K]` from a left-padded generation of `batch`
        prompts padded to `width`: the prompt's positions from the prefill, then each generated
        token's from the step that fed it (the last token is never fed)."""
        prefill = torch.stack(self.calls[0], dim=1).view(batch, width, len(self.gates), -1)
        steps = [torch.stack(c, dim=1).view(batch, len(self.gates), -1) for c in self.calls[1:]]
        out = []
        for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
            fed = [prefill[i, width - p:]] + [s[i][None] for s in steps[:max(r - 1, 0)]]
            out.append(torch.cat(fed))
        return out


@contextlib.contextmanager
def replayed(module: torch.nn.Module, routing: torch.Tensor, valid: torch.Tensor) -> Iterator[None]:
    """Inside, `module`'s forward routes each token of its `[B, T]` input as `routing` `[B, T, L, K]`
    says (positions where `valid` is 0 keep their own choice)."""
    gates = routers(module)
    if routing.shape[2] != len(gates):
        raise ValueError(f"the routing covers {routing.shape[2]} MoE layers, the model has {len(gates)}")

    def hook(layer: int):
        def replace(gate, _inputs, output):
            logits, _, own = output
            chosen = routing[:, :, layer].reshape(-1, routing.shape[-1]).to(own.device, torch.long)
            chosen = torch.where(valid.reshape(-1, 1).to(own.device) != 0, chosen, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(1, chosen)
            if getattr(gate, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return replace

    hooks = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
