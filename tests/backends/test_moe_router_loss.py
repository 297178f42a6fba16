"""The router's load-balancing loss as an option of the training loss (`<role>.moe`), on both engines
(a tiny Qwen3-MoE, fp32, one process each).

DeepSpeed (ZeRO-3): the step equals Hugging Face's with `output_router_logits`, the policy loss plus
`aux_loss_coef` x the model's own `aux_loss` over the same micro-batch: the loss, the router loss
metric and the gradient norm within 1e-5. Megatron: its router adds the loss in the backward
(Megatron's per-layer Switch loss, padding left out: the `router_aux_loss` metric equals that
formula over HF's router logits within 1e-5; HF's pools the layers and counts top-k times over):
the router's gradient moves with it, and linearly in the weight: g(2c) - g(0) = 2 (g(c) - g(0))
within 1e-4 relative. The defaults (`load_balancing: none`) are HF's training loss without router logits,
which `test_megatron_parity` and `test_deepspeed_architectures` hold to 1e-5.
"""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.check import reference as R
from xray.config.moe import MoeConfig
from xray.data import columns as C

pytestmark = pytest.mark.backends

BATCH, SEQ = 8, 24
COEF = 0.05
OPTIM = OptimConfig()
UNCLIPPED = OptimConfig(grad_clip=0.0)  # the gradients read back are the loss's own


@functools.lru_cache(maxsize=None)
def model_dir() -> str:
    return str(build_tiny_model(tempfile.mkdtemp(prefix="xray-router-"), TinySpec(arch="qwen3_moe"), seed=0))


def _batch():
    return R.random_batch(BATCH, SEQ, TinySpec().vocab_size, seed=1)


def _megatron(rank, world, directory):
    from megatron.core import parallel_state

    from xray.backends.megatron import build_engine
    from xray.config.parallel import ParallelDims

    grads, aux = [], []
    for coef in (0.0, COEF, 2 * COEF):
        moe = MoeConfig("aux_loss", coef) if coef else MoeConfig()
        engine = build_engine(directory, ParallelDims(), "actor", UNCLIPPED, seed=0, moe=moe)
        aux.append(engine.train_step(_batch(), R.policy_loss, BATCH).get("router_aux_loss"))
        grads.append({n: p.grad.clone().numpy() for n, p in engine.model.named_parameters() if "router" in n})
    parallel_state.destroy_model_parallel()
    return grads, aux


def _deepspeed(rank, world, directory):
    from xray.backends.deepspeed import build_engine
    from xray.config.parallel import ParallelDims

    engine = build_engine(directory, ParallelDims(), "actor", OPTIM, 0, 3, moe=MoeConfig("aux_loss", COEF))
    return engine.train_step(_batch(), R.policy_loss, BATCH)


def test_deepspeed_adds_hugging_faces_router_loss():
    metrics = run_distributed(_deepspeed, 1, model_dir())[0]
    model, batch = R.load_hf(model_dir()), _batch()
    out = model(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK], output_router_logits=True)
    policy, _ = R.policy_loss({C.LOGPROBS: R.token_logprobs(out.logits, batch[C.INPUT_IDS])}, batch)
    loss = policy + COEF * out.aux_loss
    loss.backward(retain_graph=True)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert metrics["router_aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    model.zero_grad()
    policy.backward()  # without the router loss the norm is another
    assert abs(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
               - norm) > 1e-4 * norm


def megatron_router_loss(batch) -> float:
    """Megatron's load-balancing loss (`switch_load_balancing_loss_func`, padding left out) summed
    over the layers, from HF's router logits of the same weights: per layer, experts / (top-k x
    tokens^2) x sum over experts of (tokens routed to it) x (its summed probability)."""
    spec = TinySpec(arch="qwen3_moe")
    with torch.no_grad():
        out = R.load_hf(model_dir())(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK],
                                     output_router_logits=True)
    valid = batch[C.ATTENTION_MASK].reshape(-1).bool()
    total = 0.0
    for logits in out.router_logits:
        scores = torch.softmax(logits[valid].float(), dim=-1)
        routed = torch.zeros_like(scores).scatter(1, scores.topk(spec.experts_per_token, dim=-1).indices, 1.0)
        tokens = len(scores)
        share = float((routed.sum(0) * scores.sum(0)).sum())
        total += share * spec.num_experts / (spec.experts_per_token * tokens ** 2)
    return total


def test_megatron_router_loss_moves_the_router_linearly():
    (g0, g1, g2), aux = run_distributed(_megatron, 1, model_dir())[0]
    assert aux[0] is None and aux[1] == pytest.approx(megatron_router_loss(_batch()), rel=1e-5) and aux[2] == aux[1]
    assert g0.keys() == g1.keys() and len(g0) == TinySpec().num_layers
    for name in g0:
        a, b, c = (torch.from_numpy(g[name]) for g in (g0, g1, g2))
        moved = (b - a).norm()
        assert moved > 1e-3 * a.norm(), f"{name}: the router loss did not reach the router's gradient"
        assert ((c - a) - 2 * (b - a)).norm() <= 1e-4 * moved, name
