"""The single-process reference that sharded backends are checked against.

A plain Hugging Face model on one process, fp32: per-token log-probabilities, and one optimizer
step with the same AdamW, warm-up, micro-batching and gradient clipping as the backends. The
parity check (`python -m xray.check parity`) and the backend tests compare against these.

Loss semantics every backend follows: data-parallel replicas take consecutive equal slices of
the global batch, and each slice is split into micro-batches of `micro_batch_size` rows
(consecutive rows, or grouped by length for a loss with `by_length`: `xray.data.lengths`); the
step's gradient is the mean over all micro-batches of the loss function's value (a mean inside
its micro-batch, or its share of its slice's mean when grouped by length).
"""
from __future__ import annotations

import torch

from xray.backends.base import LossFn, OptimConfig
from xray.backends.hf_logprobs import hf_logprobs, load_hf, token_logprobs  # noqa: F401 - re-exported
from xray.backends.optim import build_optimizer, build_scheduler
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.lengths import train_micro_batches


def policy_loss(outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """A simple, non-trivial loss for parity tests: masked mean of -logprob * weight."""
    logp = outputs[C.LOGPROBS]
    mask = batch[C.LOSS_MASK].to(logp.dtype)
    weight = batch["weight"].to(logp.dtype) if "weight" in batch else torch.ones_like(logp)
    loss = -(logp * weight * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"policy_loss": float(loss.detach())}


def reference_train_step(model: torch.nn.Module, batch: Batch, loss_fn: LossFn, optim: OptimConfig,
                         micro_batch_size: int, steps: int = 1) -> list[float]:
    """Run `steps` optimizer steps of `model` on `batch` in place, micro-batched as one replica
    would; return the loss of each step."""
    optimizer = build_optimizer(model.parameters(), optim)
    scheduler = build_scheduler(optimizer, optim)
    micro = train_micro_batches(batch, loss_fn, micro_batch_size)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro:
            out = {C.LOGPROBS: hf_logprobs(model, mb)}
            loss, _ = loss_fn(out, mb)
            (loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(total)
    return losses


def random_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0, prompt_len: int = 4) -> Batch:
    """Random token ids with right padding on odd rows and a loss mask on the response part."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch_size, seq_len), generator=g)
    attn = torch.ones(batch_size, seq_len, dtype=torch.long)
    for i in range(1, batch_size, 2):
        attn[i, seq_len - 1 - (i % 3):] = 0
    ids = ids * attn  # pad id 0 on padding
    loss_mask = attn[:, 1:].clone().float()
    loss_mask[:, : prompt_len - 1] = 0
    weight = torch.randn(batch_size, seq_len - 1, generator=g)
    return Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: attn, C.LOSS_MASK: loss_mask, "weight": weight})


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a-b| / max|b| (names must match)."""
    if sorted(a) != sorted(b):
        missing, extra = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        raise KeyError(f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    worst = 0.0
    for k in b:
        denom = b[k].abs().max().clamp(min=1e-12)
        worst = max(worst, float((a[k].float() - b[k].float()).abs().max() / denom))
    return worst
