"""The rollout/actor log-prob gap of a mixture of experts under GRPO: how far the trained model's
log-probs of the rollout's own tokens are from the rollout engine's, with and without routing
replay.

    .venv/bin/python benchmarks/moe_gap.py [--backend megatron-vllm|deepspeed-vllm|megatron-dsinfer|deepspeed-dsinfer]
                                           [--dtype bfloat16] [--steps 6] [--seed 3] [--ep 1]

The model is a tiny Qwen3-MoE built from transformers' config class over the character tokenizer
(2 layers of 8 experts, 2 per token, hidden 64, random weights, seeded), trained `--steps` GRPO
steps on `builtin:arith` (8 prompts x 4 samples a step, a graded reward: the share of digits in
the completion, so that the weights move), the actor at dp=2 (on Megatron with its experts split
over `--ep` of the two replicas) and the rollout on vLLM or DeepSpeed-Inference, every sync
verified. Each step the actor's log-probs of the samples (its forward before training, with the
weights the rollout generated with) are compared with the engine's, token by token: the metric
`rollout_logprob_gap_mean`, the mean of |actor - rollout| over response tokens. The figure is the
mean of that over the steps. In bf16 the two sides round differently, and a token whose router
scores nearly tie goes to other experts on the two sides; routing replay (the training forward
taking the experts the rollout chose, `actor.moe.routing_replay`) removes the second part. On a
`*-dsinfer` pair, whose rollout runs the Hugging Face model and reports its routing, the run is
made twice from the same seed, without and with replay. vLLM 0.32 reports the experts it chose
(`enable_return_routed_experts`) only with its Model Runner V2, which needs Triton and so a GPU:
on the vLLM pairs the plan refuses replay and `gap_with` is `none`.
Last line: `gap_without=<mean per-token gap over the steps> gap_with=<the same with replay, or none>`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
from pathlib import Path

from xray.config.engines import PAIRS, engine, split_pair

ROOT = Path(__file__).resolve().parents[1]


def digit_share(prompts: list[str], completions: list[str], **_) -> list[float]:
    """A graded reward a random model earns sometimes: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def build_model(directory: Path, seed: int) -> Path:
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model
    from xray.data.tokenizer import VOCAB_SIZE, save_char_tokenizer

    spec = TinySpec(arch="qwen3_moe", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_heads=2,
                    num_kv_heads=2, max_position_embeddings=128, num_experts=8, moe_intermediate_size=32)
    build_tiny_model(directory, spec, seed=seed)
    save_char_tokenizer(directory)
    return directory


def settings(args, model: Path, out: Path) -> list[str]:
    """`python -m xray.train grpo` arguments of the run."""
    zero = ["--actor.zero_stage=3"] if engine(split_pair(args.backend)[0]).zero else [f"--actor.ep={args.ep}"]
    return ["grpo", "--backend", args.backend, "--config", str(ROOT / "configs/critic_free_tiny_cpu.yaml"),
            f"--model.path={model}", f"--model.dtype={args.dtype}", f"--seed={args.seed}",
            "--device_groups.nproc_per_node=3", "--device_groups.train_group.ranks=[0, 1]",
            "--device_groups.train_group.workers=[actor]", "--device_groups.rollout_group.ranks=[2]",
            "--actor.dp=2", *zero, "--actor.micro_batch_size=8", "--actor.optim.lr=1e-3", "--critic_free.kl_in=none",
            "--rollout.n_samples=4", "--rollout.max_new_tokens=8", "--ppo.rollout_batch_size=8",
            "--ppo.mini_batch_size=16", "--ppo.ppo_epochs=1", "--data.eval_size=8",
            f"--reward.function={Path(__file__).resolve()}:digit_share", "--trainer.max_restarts=0",
            "--trainer.memory_snapshots=false", "--output-dir", str(out)]


def gaps_of(args, replay: bool, tmp: Path) -> tuple[list[float], list[float]]:
    """Each step's mean and largest per-token gap of one run (`replay`: the actor's forwards replay the
    rollout's routing)."""
    from algorithms.rl import rl_trainer
    from xray.run.outputs import RunDir
    from xray.train import resolve

    model = build_model(tmp / "model", args.seed)
    extra = ["--actor.moe.routing_replay=true"] if replay else []
    _, cfg, plan, _, _ = resolve(settings(args, model, tmp / "run") + extra)
    gaps, worst = [], []
    with rl_trainer(cfg, plan, RunDir(tmp / "run"), algo="grpo") as (trainer, data):
        for step in range(1, args.steps + 1):
            metrics = asyncio.run(trainer.step(data.next_train_rows()))
            gaps.append(metrics["rollout_logprob_gap_mean"])
            worst.append(metrics["rollout_logprob_gap_max"])
            print(f"{'with' if replay else 'without'} replay, step {step}: gap mean {gaps[-1]:.3g} "
                  f"max {metrics['rollout_logprob_gap_max']:.3g} reward {metrics['reward/mean']:.3f}", flush=True)
    return gaps, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=PAIRS[0], choices=PAIRS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--ep", type=int, default=1, choices=[1, 2], help="megatron: the experts split over 2 replicas")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    reports = engine(split_pair(args.backend)[1]).reports_routing  # the rollout engine reports its routing
    with tempfile.TemporaryDirectory(prefix="xray-moe-gap-") as tmp:
        without, worst_without = gaps_of(args, False, Path(tmp) / "without")
        with_replay, worst_with = gaps_of(args, True, Path(tmp) / "with") if reports else (None, None)
    print(f"{args.backend} {args.dtype} ep={args.ep}: the per-token gap, mean over {args.steps} steps, without and "
          + ("with routing replay (the same seed, samples and steps)" if reports else
             "(no replay: vLLM on CPU does not report its routing; the plan refuses it)"))
    gap_with = f"{statistics.mean(with_replay):.4g}" if with_replay is not None else "none"
    print(f"the largest token gap of a step, mean over the steps: without {statistics.mean(worst_without):.4g}"
          + (f", with {statistics.mean(worst_with):.4g}" if worst_with is not None else ""))
    print(f"gap_without={statistics.mean(without):.4g} gap_with={gap_with}")


if __name__ == "__main__":
    main()
