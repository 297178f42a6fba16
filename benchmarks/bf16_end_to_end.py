"""What the end-to-end check can see in bf16, measured on the real pretrained model: a Megatron bf16
actor and a vLLM bf16 rollout of SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`), chat
prompts of `examples/arith_chat`, 256 samples of 24 tokens at temperature 1 per seed. Not a speed
benchmark: it calibrates `sync.bf16_mean_tolerance` and shows why the check bounds the mean.

Per seed, one batch B sampled by the rollout at version v (its log-probs b), then:
- correct: the actor at v (o) against b: the gap of a correct bf16 sync (mean, p99, max);
- stale: the actor one optimizer step later (v+1, lr 1e-5, a GRPO-like loss with +-1 advantages;
  n) against b: what the end-to-end check sees when the rollout missed one sync;
- own: |n - o|, the actor's own two bf16 versions per token (rms);
- beta: the rollout's log-probs regressed on the actor's update, <r - o, n - o> / |n - o|^2, for r
  = b (the rollout at v: 0 if the update were visible) and r = the rollout's after the sync to v+1
  (1 if visible).
Prints one JSON line per seed, then the medians over seeds. Measured (Intel Xeon, 2 cores, three
seeds, 5,400-5,600 tokens each): correct mean 0.0463-0.0470 (max 0.45-0.49), stale mean
0.0469-0.0475 (max 0.47-1.46); own rms 0.066, the size of the two engines' gap; beta 0.45-0.49
stale and 0.47-0.55 synced: the update is buried in the bf16 rounding it re-draws, and no
log-prob statistic tells a rollout one step behind from a current one in bf16; the exact part of
the sync carries that proof (every tensor read back bit for bit or by its layer's product).

    .venv/bin/python benchmarks/bf16_end_to_end.py [--seeds 3] [--samples 256]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def chat_prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in (ROOT / "examples/arith_chat/train.jsonl").open()]
    return [tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for r in rows]


def grpo_like(outputs, batch):
    """-mean(A log p) over the response tokens, A = +-1 per sequence."""
    from xray.data import columns as C

    m = batch[C.LOSS_MASK]
    return -(outputs[C.LOGPROBS] * m * batch["advantage"][:, None]).sum() / m.sum()


def gap_stats(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    a = (ours - theirs).abs()
    return {"mean": float(a.mean()), "p99": float(torch.quantile(a, 0.99)), "max": float(a.max())}


def one_seed(actor, rollout, prompts: list[list[int]], seed: int, samples: int, version: int) -> dict:
    from xray.config.schema import SyncConfig
    from xray.data import columns as C
    from xray.sync import sync_weights

    rows = [prompts[(seed * 37 + i) % len(prompts)] for i in range(samples)]
    exp = rollout.generate(rows, {"temperature": 1.0, "max_new_tokens": 24, "seed": seed}, pad_id=2).get()
    m = exp[C.LOSS_MASK] > 0
    b = exp[C.BEHAVIOUR_LOGPROBS].float()[m]
    o = actor.forward(exp).get()[C.LOGPROBS].float()[m]
    g = torch.Generator().manual_seed(seed)
    advantage = torch.randint(0, 2, (len(exp),), generator=g).float() * 2 - 1
    actor.train_step({C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK],
                      C.LOSS_MASK: exp[C.LOSS_MASK], "advantage": advantage}, grpo_like, 32).get()
    n = actor.forward(exp).get()[C.LOGPROBS].float()[m]
    asyncio.run(sync_weights(actor, rollout, version, SyncConfig()))
    sequences = [p + r for p, r in zip(exp[C.PROMPT_IDS], exp[C.RESPONSE_IDS])]
    synced = torch.tensor([x for row in rollout.call("logprobs", sequences, [len(p) for p in exp[C.PROMPT_IDS]]).get()
                           for x in row])
    d = n - o
    return {"seed": seed, "tokens": int(m.sum()), "correct": gap_stats(o, b), "stale": gap_stats(n, b),
            "own_rms": float(d.pow(2).mean().sqrt()), "beta_stale": float(((b - o) * d).sum() / (d * d).sum()),
            "beta_synced": float(((synced - o) * d).sum() / (d * d).sum())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--samples", type=int, default=256)
    args = p.parse_args()
    import ray

    from xray.builtin.smollm2 import smollm2_dir
    from xray.config.optim import OptimConfig
    from xray.config.parallel import ParallelDims
    from xray.config.schema import SyncConfig
    from xray.sync import sync_weights
    from xray.wholemodel import WholeModel
    from xray.workhorse.rollout import RolloutWorkhorse
    from xray.workhorse.train import TrainWorkhorse

    model_dir = str(smollm2_dir(Path(tempfile.mkdtemp()) / "smollm2"))
    ray.init(num_cpus=2)
    actor = WholeModel(TrainWorkhorse, role="actor", parallel=ParallelDims(),
                       init_kwargs=dict(backend="megatron", model_dir=model_dir, optim=OptimConfig(lr=1e-5),
                                        dtype="bfloat16"))
    rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(),
                         init_kwargs=dict(backend="vllm", model_dir=model_dir, max_model_len=512, dtype="bfloat16"))
    try:
        asyncio.run(sync_weights(actor, rollout, 1, SyncConfig()))
        prompts = chat_prompts(model_dir)
        rows = []
        for k in range(args.seeds):
            rows.append(one_seed(actor, rollout, prompts, k, args.samples, version=2 + k))
            print(json.dumps(rows[-1]), flush=True)
        med = lambda f: round(statistics.median(f(r) for r in rows), 4)  # noqa: E731
        print(f"median over {len(rows)} seeds: correct_mean={med(lambda r: r['correct']['mean'])} "
              f"stale_mean={med(lambda r: r['stale']['mean'])} correct_max={med(lambda r: r['correct']['max'])} "
              f"stale_max={med(lambda r: r['stale']['max'])} own_rms={med(lambda r: r['own_rms'])} "
              f"beta_stale={med(lambda r: r['beta_stale'])} beta_synced={med(lambda r: r['beta_synced'])}")
    finally:
        rollout.shutdown()
        actor.shutdown()


if __name__ == "__main__":
    main()
