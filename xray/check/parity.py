"""`python -m xray.check parity`: a sharded training backend against the unsharded HF model.

Builds the actor as a WholeModel of TrainWorkhorses with the asked layout (on a tiny random Llama
when no `--model` is given), computes per-token log-probs of random token ids on both sides, then
takes one optimizer step on both with the same data and settings, and compares every exported
weight. Prints the figures and ends with
`max_abs_logprob_diff=<x> max_rel_param_diff_after_step=<y>`; exit code 0 only within tolerance.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from xray.backends import load_backend
from xray.config.engines import engine, names
from xray.config.optim import OptimConfig
from xray.config.parallel import LayoutError, ParallelDims
from xray.wholemodel.cluster import shutdown_ray

log = logging.getLogger(__name__)
LOGPROB_TOL = 1e-4
PARAM_TOL = 1e-5


@dataclass(frozen=True)
class ParityResult:
    max_abs_logprob_diff: float
    max_rel_param_diff_after_step: float

    @property
    def ok(self) -> bool:
        return self.max_abs_logprob_diff <= LOGPROB_TOL and self.max_rel_param_diff_after_step <= PARAM_TOL

    def line(self) -> str:
        return (f"max_abs_logprob_diff={self.max_abs_logprob_diff:.3e} "
                f"max_rel_param_diff_after_step={self.max_rel_param_diff_after_step:.3e}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=names("train"), required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--zero", type=int, default=3, choices=(1, 2, 3), help="ZeRO stage (deepspeed)")
    p.add_argument("--model", default=None, help="a local Hugging Face directory (default: a tiny random Llama)")
    p.add_argument("--arch", default="llama", choices=("llama", "qwen2"), help="tiny model architecture")
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--lr", type=float, default=OptimConfig().lr, help="AdamW lr of the compared step")
    p.add_argument("--ray-address", default=None)


def check_before_start(backend: str, model_dir: str, parallel: ParallelDims) -> None:
    """Layout errors surface here, before any Workhorse starts."""
    e = engine(backend, "train")
    if e.checks_layout:
        load_backend(backend).check_layout(model_dir, parallel)
    if (parallel.tp != 1 and not e.tensor_parallel) or (parallel.pp != 1 and not e.pipeline_parallel):
        raise LayoutError(f"the {backend} backend has no tensor or pipeline parallelism; use --tp 1 --pp 1")


def run_parity(backend: str, model_dir: str, parallel: ParallelDims, zero: int = 3, seq_len: int = 24,
               lr: float = OptimConfig().lr, ray_address: str | None = None) -> ParityResult:
    import torch

    from xray.check.reference import (hf_logprobs, load_hf, max_rel_diff, policy_loss, random_batch,
                                      reference_train_step)
    from xray.data import columns as C
    from xray.wholemodel import WholeModel
    from xray.workhorse.train import TrainWorkhorse

    check_before_start(backend, model_dir, parallel)
    optim = OptimConfig(lr=lr, grad_clip=1.0)
    micro = 2
    hf = load_hf(model_dir)
    batch = random_batch(parallel.dp * micro * 2, seq_len, hf.config.vocab_size, seed=1)
    extra = {"zero_stage": zero} if engine(backend).zero else {}
    wm = WholeModel(TrainWorkhorse, role="actor", parallel=parallel, ray_address=ray_address,
                    init_kwargs=dict(backend=backend, model_dir=model_dir, optim=optim, **extra))
    try:
        logp = wm.forward(batch).get()[C.LOGPROBS]
        metrics = wm.train_step(batch, policy_loss, micro).get()
        exported = wm.state_dict().get()
    finally:
        wm.shutdown()
    with torch.no_grad():
        ref_logp = hf_logprobs(hf, batch)
    mask = batch[C.ATTENTION_MASK][:, 1:].bool()
    logprob_diff = float((logp - ref_logp).abs()[mask].max())
    ref_losses = reference_train_step(hf, batch, policy_loss, optim, micro)
    reference = {k: v for k, v in hf.state_dict().items() if k in exported or not _tied_alias(hf, k)}
    param_diff = max_rel_diff(exported, reference)
    log.info("loss: sharded %.6f, reference %.6f", metrics.get("loss", float("nan")), ref_losses[0])
    return ParityResult(logprob_diff, param_diff)


def _tied_alias(model, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def main(args: argparse.Namespace) -> int:
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model

    parallel = ParallelDims(args.tp, args.pp, args.dp)
    model_dir = args.model
    if model_dir is None:
        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="xray-parity-")) / "tiny",
                                         TinySpec(arch=args.arch, num_layers=max(2, args.pp)), seed=0))
    result = run_parity(args.backend, model_dir, parallel, args.zero, args.seq_len, args.lr, args.ray_address)
    shutdown_ray()  # no Workhorse log line may land after the figures
    layout = f"tp={parallel.tp} pp={parallel.pp} dp={parallel.dp}" + \
        (f" zero={args.zero}" if engine(args.backend).zero else "")
    print(f"{args.backend} {layout} on {model_dir}")
    print(f"per-token log-probs vs Hugging Face: max abs diff {result.max_abs_logprob_diff:.3e} "
          f"(tolerance {LOGPROB_TOL:g})")
    print(f"weights after one step vs single-process torch: max rel diff "
          f"{result.max_rel_param_diff_after_step:.3e} (tolerance {PARAM_TOL:g})")
    print(result.line())
    return 0 if result.ok else 1
