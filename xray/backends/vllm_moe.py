"""Mixture-of-experts blocks in the vLLM engine: which sent tensors make one block, the kernel
re-preparation an in-place reload needs, and the check of a reloaded block.

Used by the vLLM engine (`xray/backends/vllm.py`) and its held check (`xray/backends/vllm_held.py`).
An MoE block (`model.layers.i.mlp` of Qwen3-MoE, Qwen2-MoE) is its router (`mlp.gate.weight`), its
experts (transformers 5's fused `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I],
or per-expert `mlp.experts.e.{gate,up,down}_proj.weight`) and, in Qwen2-MoE, a shared expert and
its gate. The engine reloads a block only when all of its tensors have arrived (the fused-layer
stager treats the block as one layer): vLLM keeps each block's experts as one stacked tensor per
projection, and a block reloaded in part gives wrong outputs.

vLLM's CPU experts keep their weights packed for the kernel. Its in-place reload writes the raw
tensors over the packed ones and leaves the kernel reading them as packed: silently wrong
outputs (0.2-0.4 nat on the tiny model). `reprepare` packs them again, on the reloaded blocks only
(packing a packed tensor again is wrong too).

The held check of a block is functional: the block's own forward (router, top-k, experts, in the
engine's kernels) on a probe input against the same computation in torch from the tensors sent,
so a reload that is not exact, packed or not, fails the sync. Random tokens alone leave experts
idle (16 tokens at top-8 of 128 experts run about two thirds of them), so the probe adds tokens
routed on purpose (`routed_probe`: each solves the sent router for logits that put a chosen set of
top-k experts first), and every expert of the block runs with a real share of the output; the
bound is per token, scaled by the rms of that token's output in the engine's dtype (no absolute
floor). Each sent tensor of the block counts as checked functionally, or the block is named as
mismatched.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from xray.backends.expert_names import expert_part

log = logging.getLogger(__name__)

PROBE_TOKENS = 16
"""Random rows of the seeded input a block's check runs, beside the routed ones (`routed_probe`)."""
RELATIVE_BOUND = {torch.float32: 1e-4, torch.bfloat16: 6e-2}
"""A block's largest |engine - sent| output element per token, over the rms of that token's output:
its kernels' rounding in the engine's dtype (others: the bf16 bound)."""


@dataclass(frozen=True)
class Routing:
    """How a model's router picks experts, from its `config.json`."""

    top_k: int
    """Experts per token (`num_experts_per_tok`)."""
    renormalize: bool
    """The top-k probabilities are divided by their sum (`norm_topk_prob`)."""
    num_experts: int
    """Experts per block (`num_experts`; transformers 5 saves Qwen3-MoE's as `num_local_experts`)."""

    @staticmethod
    def of(model_dir: str | Path) -> "Routing | None":
        """The routing of the model in `model_dir`; None for a model without experts."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if not experts:
            return None
        return Routing(int(cfg["num_experts_per_tok"]), bool(cfg.get("norm_topk_prob", False)), int(experts))

    def units(self, name: str) -> set[str]:
        """What of its block a tensor carries, in per-expert terms: transformers 5 saves one
        tensor per expert and projection (`experts.e.gate_proj.weight`) but its models' state
        dicts hold the experts fused (`experts.gate_up_proj`), and a block is whole when both
        projections of every expert have arrived under either name."""
        part = name[name.index(".mlp.") + len(".mlp."):]
        if part == "experts.gate_up_proj":
            return {f"experts.{e}.{p}" for e in range(self.num_experts) for p in ("gate", "up")}
        if part == "experts.down_proj":
            return {f"experts.{e}.down" for e in range(self.num_experts)}
        if one := expert_part(name):
            return {f"experts.{one.expert}.{one.proj}"}
        return {part}


def fused_aliases(names: list[str]) -> dict[str, list[str]]:
    """The fused expert names (`<block>.experts.gate_up_proj`, `down_proj`) that write a
    checkpoint's per-expert tensors (`<block>.experts.e.{gate,up,down}_proj.weight`), each with
    the names it stands for: what the weight sync's completeness check counts a fused tensor as."""
    out: dict[str, list[str]] = {}
    for name in names:
        if one := expert_part(name):
            out.setdefault(one.fused, []).append(name)
    return {k: sorted(v) for k, v in out.items()}


def reprepare(model: torch.nn.Module, blocks: set[str]) -> int:
    """After vLLM's in-place reload of `blocks`: pack each one's CPU experts' weights for the
    kernel again (see the module docstring); blocks not reloaded keep theirs. Other devices'
    experts are left to vLLM. Returns how many expert modules were prepared."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    prepared = 0
    for name, module in model.named_modules():
        if not any(name.startswith(block + ".") for block in blocks):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            prepared += 1
    return prepared


def expected_output(x: torch.Tensor, tensors: dict[str, torch.Tensor], routing: Routing) -> torch.Tensor:
    """The block's output for `x` [N, H] in fp32, computed from its sent tensors as transformers
    does: softmax router, top-k (renormalised if the model says so), SwiGLU experts weighted by
    their probabilities; plus the shared expert gated by a sigmoid where the block has one."""
    short = {name[name.index(".mlp.") + len(".mlp."):]: t.float() for name, t in tensors.items()}
    gate_up, down = _stacked_experts(short)
    probs = torch.softmax(x @ short["gate.weight"].T, dim=-1)
    weights, chosen = probs.topk(routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for slot in range(routing.top_k):
        for e in chosen[:, slot].unique().tolist():
            rows = chosen[:, slot] == e
            g, u = (x[rows] @ gate_up[e].T).chunk(2, dim=-1)
            out[rows] += weights[rows, slot, None] * ((torch.nn.functional.silu(g) * u) @ down[e].T)
    if "shared_expert.gate_proj.weight" in short:
        s = {p: short[f"shared_expert.{p}_proj.weight"] for p in ("gate", "up", "down")}
        shared = (torch.nn.functional.silu(x @ s["gate"].T) * (x @ s["up"].T)) @ s["down"].T
        out += torch.sigmoid(x @ short["shared_expert_gate.weight"].T) * shared
    return out


def _stacked_experts(short: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) from fused or per-expert names."""
    if "experts.gate_up_proj" in short:
        return short["experts.gate_up_proj"], short["experts.down_proj"]
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in short.items():
        if one := expert_part("x.mlp." + name):
            parts.setdefault(one.expert, {})[one.proj] = t
    order = sorted(parts)
    return (torch.stack([torch.cat([parts[e]["gate"], parts[e]["up"]]) for e in order]),
            torch.stack([parts[e]["down"] for e in order]))


def routed_probe(router: torch.Tensor, routing: Routing, seed: int = 0) -> torch.Tensor:
    """Probe rows [N, H] for one block: `PROBE_TOKENS` seeded random rows, then one row per set of
    top-k experts, the sets covering every expert, each row the least-norm solution of
    `router @ x = z` for logits z that rank its set first, 0.4 apart, the others 2 below the last
    (so the routing is not decided by rounding in the engine's dtype)."""
    experts, hidden = router.shape
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(PROBE_TOKENS, hidden, generator=g, dtype=torch.float64)]
    k = routing.top_k
    order = torch.randperm(experts, generator=g).tolist()
    targets = []
    for start in range(0, experts, k):
        chosen = [order[(start + j) % experts] for j in range(k)]
        z = torch.full((experts,), 2.0 - 0.4 * k - 2.0, dtype=torch.float64)
        z[chosen] = torch.tensor([2.0 - 0.4 * j for j in range(k)], dtype=torch.float64)
        targets.append(z)
    z = torch.stack(targets, dim=1)  # [E, sets]
    rows.append(torch.linalg.lstsq(router.double(), z).solution.T)  # [sets, H]
    return torch.cat(rows).float()


def experts_run(x: torch.Tensor, router: torch.Tensor, routing: Routing) -> set[int]:
    """The experts the router sends some row of `x` to."""
    return set(torch.softmax(x @ router.float().T, dim=-1).topk(routing.top_k, dim=-1).indices.flatten().tolist())


def check_block(held, block: str, module: torch.nn.Module, tensors: dict[str, torch.Tensor], routing: Routing,
                vllm_config, dtype: torch.dtype) -> None:
    """Run the engine's block `module` on the probe (`routed_probe`, in the engine's dtype) and
    compare it with `expected_output` per token, within `RELATIVE_BOUND` of the rms of that
    token's output; `held` (a `HeldCheck`) counts the block's tensors as checked functionally, or
    names the block as mismatched, or (a probe that could not run every expert) as unchecked."""
    from vllm.forward_context import set_forward_context

    router = next(t for n, t in tensors.items() if n.endswith(".mlp.gate.weight"))
    x = routed_probe(router, routing).to(dtype).float()
    idle = routing.num_experts - len(experts_run(x, router, routing))
    if idle:
        log.warning("%s: the held check's probe runs %d of %d experts; the block's tensors count as unchecked",
                    block, routing.num_experts - idle, routing.num_experts)
        held.skip(list(tensors))
        return
    device = next(module.parameters()).device
    with torch.no_grad(), set_forward_context(None, vllm_config):
        got = module(x.to(device=device, dtype=dtype))
    got = (got[0] if isinstance(got, tuple) else got).float().cpu().reshape(x.shape)
    want = expected_output(x, tensors, routing)
    scale = want.pow(2).mean(-1).sqrt() + torch.finfo(torch.float32).tiny
    worst = float(((got - want).abs().amax(-1) / scale).max())
    bound = RELATIVE_BOUND.get(dtype, RELATIVE_BOUND[torch.bfloat16])
    if worst <= bound:
        held.passed("functional", list(tensors))
    else:
        held.mismatch(f"{block} (MoE block: a token's output {worst:.3g} of its rms from the sent tensors' "
                      f"output, bound {bound:g})", list(tensors))
