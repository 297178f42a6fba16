"""xray's GRPO step at GPU size against TRL's `GRPOTrainer`: a Qwen3-0.6B-shaped model on one GPU.

    python3 benchmarks/gpu_grpo.py [--steps 3] [--warmup 1] [--prompts 64] [--samples 8]
        [--prompt-tokens 32 256] [--response-tokens 256] [--micro 8] [--backend megatron-vllm] [--no-trl]
    .venv/bin/python benchmarks/gpu_grpo.py --cpu-dry-run [--trl-on-cpu]

Model: Qwen3-0.6B's shape (`QWEN3_0_6B`: hidden 1024, 28 layers, 16 heads of 128, 8 KV heads, SwiGLU
3072, vocabulary 151,936, tied embeddings; 596M parameters), random weights (seed 0, fp32 on disk),
built here with `xray.builtin.tiny_llama`, with a word-level tokenizer of its own (`w<id>` per id:
the text of any id sequence tokenizes back to it). A random model's EOS (p ~ 1/151,936 a token)
almost never comes, so every response runs to `--response-tokens` in both trainers.
Job, the same for both: `--prompts` prompts a step (random words, `--prompt-tokens` LO HI long,
seeded; by default 32-255 tokens, so that sequences are 288-511 tokens) x `--samples` responses of
`--response-tokens`, temperature 1; reward `even_words` (the share of response words with an even
id: graded, so groups have non-zero advantages); GRPO with group mean/std advantages, clip 0.2, a
k3 KL loss to the reference at 0.001 (so both run a reference forward), one optimizer step per
batch (the whole batch one mini-batch; micro-batches of `--micro`), AdamW lr 1e-6, beta2 0.95,
weight decay 0.01, grad clip 1.0, no activation recomputation, bf16.
xray: `python -m xray.train grpo`'s own machinery on `configs/grpo_gpu_1x.yaml` with the job's
overrides (`xray_config`): actor, reference and the rollout colocated on GPU 0 (the rollout sleeps
while the actor trains, and the weights reach it by CUDA IPC), each step through `RLTrainer.step`.
TRL (when installed): `GRPOTrainer` in this process on the same GPU after xray has shut down, from
the same model directory and prompts, at its own defaults otherwise (HF `generate`, fp32 weights
under bf16 autocast).
Figures, medians over `--steps` steps after `--warmup`:
- xray's step split by phase (seconds): generate, score (the reward and the forwards the loss
  needs, concurrently), of which reference (the reference Workhorse's busy time), train, sync, the
  rollout's sleep and wake, and the driver's time between them;
- tokens/s: a step's prompt + response tokens / step seconds (xray and TRL);
- train_mfu: the train phase's model FLOPs (6 x matmul parameters x tokens + 12 x layers x query
  width x sum of squared sequence lengths: the full-attention convention) / train-phase seconds /
  the device's bf16 matmul peak measured in this run (8192^3 products on a GPU, median of 10,
  before and after the runs, the larger kept);
- xray_over_trl: xray's median seconds a step / TRL's (below 1: xray is faster).
Last line: `xray_over_trl=<x> train_mfu=<y> gpu=<device name>` (`nan` where TRL did not run).

`--cpu-dry-run` runs the same code path on the CPU at a tiny size (`DRY_SPEC`, 2 prompts x 2
samples x 8 tokens, 1 timed step), with TRL skipped unless `--trl-on-cpu` (about 90 s on 2 loaded
cores; run by hand: the suite, at its time budget, runs the pieces in tests/unit/test_gpu_grpo_bench.py).
On the lent GPU machine: `bash tests/gpu/run_on_device.sh grpo`.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from xray.builtin.tiny_llama import TinySpec

QWEN3_0_6B = TinySpec(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                      num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1_000_000.0, tie_word_embeddings=True)
DRY_SPEC = TinySpec(arch="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512,
                    rope_theta=1_000_000.0, tie_word_embeddings=True)
"""The dry run's model: Qwen3's traits (query width apart from hidden, GQA, tied embeddings) in small."""
SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the pad, BOS and EOS ids tiny_llama configures
KL_COEF, LR = 0.001, 1e-6


class Job(NamedTuple):  # not a dataclass: xray's reward loader imports this file as a module it does not register
    spec: TinySpec
    prompts: int
    samples: int
    prompt_tokens: tuple[int, int]
    """Prompt lengths are drawn from [lo, hi)."""
    response_tokens: int
    micro: int
    steps: int
    warmup: int
    device: str
    """`cuda` or `cpu` (the dry run)."""

    @property
    def completions(self) -> int:
        return self.prompts * self.samples


def even_words(completions: list, **_: object) -> list[float]:
    """The share of a response's words whose id is even (TRL's reward convention)."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in str(text).split() if w[:1] == "w" and w[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0)
    return out


def save_word_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer: ids 0-2 the special tokens, id i >= 3 the word `w<i>`; no BOS added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            model_max_length=4096).save_pretrained(str(directory))


def write_prompts(path: Path, job: Job, rows: int) -> list[dict]:
    """`rows` seeded prompts of random words, lengths in `job.prompt_tokens`, as a JSONL file."""
    rng = random.Random(0)
    lo, hi = job.prompt_tokens
    out = [{"prompt": " ".join(f"w{rng.randrange(len(SPECIALS), job.spec.vocab_size)}"
                               for _ in range(rng.randrange(lo, hi)))} for _ in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return out


def train_flops(spec: TinySpec, sequence_lengths: list[float]) -> float:
    """Model FLOPs of one forward and backward over sequences of these lengths (see the docstring)."""
    d = spec.head_dim or spec.hidden_size // spec.num_heads
    q, kv, h = spec.num_heads * d, spec.num_kv_heads * d, spec.hidden_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size
    matmul_params = spec.num_layers * per_layer + spec.vocab_size * h  # the output layer, tied or not
    tokens = sum(sequence_lengths)
    return 6 * matmul_params * tokens + 12 * spec.num_layers * q * sum(n * n for n in sequence_lengths)


def measured_peak(device: str) -> float:
    """The bf16 matmul FLOP/s of `device`, measured now (`benchmarks/megatron_train.py`'s probe)."""
    from megatron_train import matmul_peak  # this directory is on sys.path when run as a script

    peak = matmul_peak(torch.bfloat16, n=8192 if device == "cuda" else 512, device=device)
    if device == "cuda":
        torch.cuda.empty_cache()  # the rollout and the trained roles share the GPU next
    return peak


def xray_config(job: Job, model_dir: Path, data: Path, eval_size: int, out: Path) -> Path:
    """configs/grpo_gpu_1x.yaml with the job's settings; for the dry run, its one device is a CPU."""
    import yaml

    from algorithms.specs import default_config

    cfg = yaml.safe_load((default_config("grpo").parent / "grpo_gpu_1x.yaml").read_text())
    cfg["model"] = {"path": str(model_dir), "dtype": "bfloat16"}
    cfg["actor"].update(micro_batch_size=job.micro, activation_checkpointing=False)
    cfg["actor"]["optim"].update(lr=LR)
    cfg["reference"]["micro_batch_size"] = 2 * job.micro
    cfg["rollout"].update(max_new_tokens=job.response_tokens, n_samples=job.samples)
    cfg["reward"] = {"function": f"{Path(__file__).resolve()}:even_words"}
    cfg["ppo"].update(rollout_batch_size=job.prompts, mini_batch_size=job.completions, ppo_epochs=1,
                      kl_coef=KL_COEF, cliprange=0.2, loss_agg_mode="token-mean")
    cfg["data"] = {"path": str(data), "max_prompt_tokens": job.prompt_tokens[1], "on_long_prompt": "reject",
                   "eval_size": eval_size}
    cfg["trainer"] = {"steps": job.steps + job.warmup, "max_restarts": 0}
    if job.device == "cpu":
        cfg["threads_per_worker"] = 2
        cfg["device_groups"] = {"nproc_per_node": 1, "cpu_group": {"device": "CPU", "ranks": [0],
                                                                   "workers": ["actor", "reference", "rollout"]}}
        cfg["rollout"].pop("gpu_memory_utilization", None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def drain(models) -> dict[str, list]:
    """Every Workhorse's busy intervals since the last drain, by role."""
    return {m.role: [tuple(i) for shard in m.busy_time().get() for i in shard["intervals"]] for m in models.all()}


def timed_step(trainer, rows: list[dict], job: Job) -> dict[str, float]:
    """One step through `RLTrainer.step`: its wall seconds, phases, reference busy time, tokens, FLOPs."""
    import asyncio

    from xray.workhorse.busy import covered_seconds

    drain(trainer.models)
    start = time.time()
    metrics = asyncio.run(trainer.step(rows))
    end = time.time()
    busy = drain(trainer.models)
    phases = {k[5:-2]: v for k, v in metrics.items() if k.startswith("time/")}
    response = metrics["response_length"]
    lengths = [len(r["prompt_ids"]) + response for r in rows for _ in range(job.samples)]
    out = {"step": end - start, **phases, "reference": covered_seconds(busy.get("reference", []), start, end),
           "tokens": sum(lengths), "train_flops": train_flops(job.spec, lengths), "reward": metrics["reward/mean"]}
    out["driver"] = out["step"] - sum(phases.values())
    return out


def run_xray(job: Job, model_dir: Path, data: Path, eval_size: int, backend: str, out: Path) -> list[dict]:
    """The job's steps through xray's run machinery; one `timed_step` record per step."""
    from algorithms.rl import rl_trainer
    from xray.run.outputs import RunDir
    from xray.train import resolve

    config = xray_config(job, model_dir, data, eval_size, out / "cfg")
    _, cfg, plan, _, _ = resolve(["grpo", "--backend", backend, "--config", str(config)])
    with rl_trainer(cfg, plan, RunDir(out / "run"), algo="grpo") as (trainer, data):
        steps = [timed_step(trainer, data.next_train_rows(), job) for _ in range(job.warmup + job.steps)]
    return steps[job.warmup:]


def trl_missing() -> str | None:
    """Why TRL cannot run here, or None."""
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed: pip install trl datasets, or on the lent GPU machine "
                "carry their wheels (tests/gpu/fetch_wheels.sh --with-vllm)")
    return None


def run_trl(job: Job, model_dir: Path, prompts: list[dict], out: Path) -> list[float]:
    """TRL's `GRPOTrainer` on the same job; its seconds per optimizer step (generation included)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from vs_trl import StepTimes

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=job.micro,
                      gradient_accumulation_steps=job.completions // job.micro, num_generations=job.samples,
                      max_completion_length=job.response_tokens, learning_rate=LR, lr_scheduler_type="constant",
                      warmup_steps=0, max_steps=job.warmup + job.steps, beta=KL_COEF, epsilon=0.2,
                      temperature=1.0, scale_rewards="group", loss_type="dapo", num_iterations=1,
                      max_grad_norm=1.0, adam_beta2=0.95, weight_decay=0.01, use_cpu=job.device == "cpu",
                      bf16=True, gradient_checkpointing=False, report_to=[], save_strategy="no",
                      logging_steps=1, disable_tqdm=True, seed=1, dataloader_num_workers=0)
    times = StepTimes()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=even_words, args=args,
                          train_dataset=Dataset.from_list(prompts), callbacks=[times.callback])
    trainer.train()
    del trainer
    if job.device == "cuda":
        torch.cuda.empty_cache()
    return times.seconds[job.warmup:]


def report(job: Job, steps: list[dict], trl_s: list[float] | None, peak: float, device: str) -> str:
    """Print the figures; return the last line."""
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    order = ["generate", "rollout_sleep", "score", "reference", "train", "rollout_wake", "sync", "driver"]
    others = sorted(set(med) - set(order) - {"step", "tokens", "train_flops", "reward"})
    phases = " ".join(f"{k}={med[k]:.3f}" for k in order + others if k in med)
    print(f"xray phases, median s over {len(steps)} steps: {phases}  (reference: busy inside score)")
    train_mfu = med["train_flops"] / med["train"] / peak
    print(f"xray: {med['step']:.2f} s/step, {med['tokens'] / med['step']:.0f} tokens/s "
          f"({med['tokens']:.0f} prompt+response tokens a step), reward {med['reward']:.3f}; train phase "
          f"{med['train_flops'] / med['train'] / 1e12:.1f} TFLOP/s of a measured bf16 peak of {peak / 1e12:.1f} "
          f"TFLOP/s: MFU {train_mfu:.3f}", flush=True)
    ratio = math.nan
    if trl_s:
        trl = statistics.median(trl_s)
        ratio = med["step"] / trl
        print(f"TRL: {trl:.2f} s/step (steps {[round(s, 2) for s in trl_s]}), "
              f"{med['tokens'] / trl:.0f} tokens/s at xray's token count", flush=True)
    return f"xray_over_trl={ratio:.3f} train_mfu={train_mfu:.3f} gpu={device}"


def parse_job(argv: list[str] | None = None) -> tuple[Job, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 256), metavar=("LO", "HI"))
    ap.add_argument("--response-tokens", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8, help="micro-batch rows of both trainers")
    ap.add_argument("--backend", default="megatron-vllm", help="xray's TRAIN-GENERATION pair")
    ap.add_argument("--no-trl", action="store_true", help="xray alone")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same code path at a tiny size on the CPU")
    ap.add_argument("--trl-on-cpu", action="store_true", help="with --cpu-dry-run: run TRL too")
    args = ap.parse_args(argv)
    job = Job(QWEN3_0_6B, args.prompts, args.samples, tuple(args.prompt_tokens), args.response_tokens,
              args.micro, args.steps, args.warmup, "cuda")
    if args.cpu_dry_run:
        job = job._replace(spec=DRY_SPEC, prompts=2, samples=2, prompt_tokens=(4, 9), response_tokens=8,
                           micro=2, steps=1, warmup=1, device="cpu")
    return job, args


def trl_skip_reason(job: Job, args: argparse.Namespace) -> str | None:
    if args.no_trl:
        return "--no-trl"
    if job.device == "cpu" and not args.trl_on_cpu:
        return "--cpu-dry-run (add --trl-on-cpu to run it)"
    return trl_missing()


def main(argv: list[str] | None = None) -> None:
    job, args = parse_job(argv)
    if job.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark is sized for a GPU; --cpu-dry-run runs its code path "
                         "on the CPU at a tiny size")
    logging.basicConfig(level=logging.WARNING)
    device = torch.cuda.get_device_name(0).replace(" ", "_") if job.device == "cuda" else "cpu"
    peak = measured_peak(job.device)
    print(f"device {device}: measured bf16 matmul peak {peak / 1e12:.1f} TFLOP/s; job {job.prompts} prompts x "
          f"{job.samples} samples, prompts of {job.prompt_tokens[0]}-{job.prompt_tokens[1] - 1} tokens, "
          f"responses of {job.response_tokens}; backend {args.backend}", flush=True)
    from xray.builtin.tiny_llama import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        model_dir = build_tiny_model(tmp / "model", job.spec, seed=0)
        save_word_tokenizer(model_dir, job.spec.vocab_size)
        eval_size = 2
        prompts = write_prompts(tmp / "prompts.jsonl", job, max(4 * job.prompts, 8) + eval_size)
        print(f"model and prompts built in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        steps = run_xray(job, model_dir, tmp / "prompts.jsonl", eval_size, args.backend, tmp / "xray")
        from xray.train import shutdown_ray

        shutdown_ray()  # the GPU is TRL's alone from here
        print(f"xray: started, {job.warmup + job.steps} steps, shut down: {time.perf_counter() - t0:.0f} s",
              flush=True)
        reason = trl_skip_reason(job, args)
        print(f"TRL skipped: {reason}" if reason else "TRL: running", flush=True)
        trl_s = None if reason else run_trl(job, model_dir, prompts, tmp / "trl")
    peak = max(peak, measured_peak(job.device))
    print(report(job, steps, trl_s, peak, device), flush=True)


if __name__ == "__main__":
    main()
