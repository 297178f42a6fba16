"""`python -m xray.check sync`: one verified weight sync from an actor to a rollout engine.

Builds the actor (a training backend) and the rollout engine (a generation backend) as
WholeModels on a model directory (a tiny random Llama by default), takes one optimizer step on the
actor so the two sides differ, syncs, and verifies: both sides score the same probe sequences.
Ends with `max_abs_logprob_diff=<x> sync_s=<seconds>`; exit code 0 only within the tolerance.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from xray.config.engines import PAIRS, engine, split_pair
from xray.config.optim import OptimConfig
from xray.config.parallel import ParallelDims
from xray.config.schema import SyncConfig
from xray.wholemodel.cluster import shutdown_ray


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=PAIRS[0], help=f"TRAIN-GENERATION pair: {', '.join(PAIRS)}")
    p.add_argument("--tp", type=int, default=1, help="the actor's tensor-parallel size (megatron)")
    p.add_argument("--dp", type=int, default=1, help="the actor's data-parallel size")
    p.add_argument("--replicas", type=int, default=1, help="rollout engine replicas")
    p.add_argument("--model", default=None, help="a local Hugging Face directory (default: a tiny random Llama)")
    p.add_argument("--tolerance", type=float, default=SyncConfig().tolerance)
    p.add_argument("--ray-address", default=None)


def main(args: argparse.Namespace) -> int:
    import torch

    from xray.check.reference import policy_loss, random_batch
    from xray.builtin.tiny_llama import build_tiny_model
    from xray.sync import sync_weights
    from xray.wholemodel import WholeModel
    from xray.workhorse.rollout import RolloutWorkhorse
    from xray.workhorse.train import TrainWorkhorse

    train_backend, gen_backend = split_pair(args.backend)
    model_dir = args.model or str(build_tiny_model(Path(tempfile.mkdtemp(prefix="xray-sync-")) / "tiny"))
    actor_dims = ParallelDims(tp=args.tp, dp=args.dp)
    if engine(train_backend).checks_layout:
        from xray.backends import load_backend

        load_backend(train_backend).check_layout(model_dir, actor_dims)
    extra = {"zero_stage": 3} if engine(train_backend).zero else {}
    actor = WholeModel(TrainWorkhorse, role="actor", parallel=actor_dims, ray_address=args.ray_address,
                       init_kwargs=dict(backend=train_backend, model_dir=model_dir,
                                        optim=OptimConfig(lr=1e-3), **extra))
    rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(dp=args.replicas),
                         init_kwargs=dict(backend=gen_backend, model_dir=model_dir, max_model_len=256))
    try:
        vocab = int(actor.state_dict().get()["model.embed_tokens.weight"].shape[0])
        batch = random_batch(2 * args.dp, 16, vocab, seed=0)
        actor.train_step(batch, policy_loss, 2).get()
        g = torch.Generator().manual_seed(0)
        k = 4 * args.dp * args.replicas
        prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(k)]
        gen = rollout.generate(prompts, dict(temperature=0.0, max_new_tokens=8, seed=0)).get()
        probe = [p + r for p, r in zip(gen["prompt_ids"], gen["response_ids"])]
        # verify with no limit here: the figure is printed, then judged against --tolerance
        report = asyncio.run(sync_weights(actor, rollout, 1, SyncConfig(verify=True, tolerance=float("inf")), probe,
                                          [len(p) for p in prompts]))
    finally:
        actor.shutdown()
        rollout.shutdown()
        shutdown_ray()  # no Workhorse log line may land after the figures
    print(f"{args.backend}: actor tp={args.tp} dp={args.dp} -> {args.replicas} rollout replica(s) on {model_dir}")
    print(f"synced {report.bytes / 1e6:.1f} MB in {report.sync_s:.3f} s; verified in {report.verify_s:.3f} s "
          f"(tolerance {args.tolerance:g})")
    print(f"max_abs_logprob_diff={report.max_abs_logprob_diff:.3e} sync_s={report.sync_s:.3f}")
    return 0 if report.max_abs_logprob_diff <= args.tolerance else 1
