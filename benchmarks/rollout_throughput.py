"""Rollout throughput: the vLLM engine against Hugging Face `generate`, vLLM bf16 against fp32, or
an fp8-quantized vLLM rollout against bf16 (with the default job's eval with and without it).

    .venv/bin/python benchmarks/rollout_throughput.py [--dtype float32|bfloat16] [--model 27M|110M]
        [--prompts 128] [--new-tokens 128] [--repeats 3] [--threads 1]
    .venv/bin/python benchmarks/rollout_throughput.py --quantization fp8 [--model 110M] [--no-eval]
        [--train-args "--trainer.steps=40 ..."]

One run builds a benchmark Llama of xray/builtin/tiny_llama.py (random weights), then times, on the same
prompts (random token ids, 16 to 48 long), the same sampling (temperature 1, a fixed seed) and the
same number of torch threads, each engine's calls after a warm-up call (tokens/s: the median over
`--repeats` calls). Tokens counted are the generated response tokens. The engines run one after
the other (two in-process vLLM engines do not share a process), each on a quiet machine's share.

`--dtype float32` (default model 27M): Hugging Face `generate` (fp32, the whole batch at once, left
padding, KV cache), then the vLLM engine (xray.backends.vllm) in fp32 and in bf16. Last line
`vllm_vs_hf=<fp32 vLLM tokens/s / HF tokens/s> tokens_per_s=<fp32 vLLM tokens/s>`.

`--dtype bfloat16` (default model 110M): the vLLM engine in fp32, then in bf16. Last line
`bf16_over_fp32=<bf16 tokens/s / fp32 tokens/s> tokens_per_s_bf16=<bf16 tokens/s>`; the line above
it gives the host's bf16/fp32 matmul ratio (measured in the same run), the ceiling of the first.

`--quantization fp8` (default model 110M): the vLLM engine in bf16, then in bf16 quantized to fp8
as `rollout.quantization=fp8` builds it (per channel on CPU: without fp8 hardware the ratio is
below 1; the speed is a GPU matter). Then, unless `--no-eval`, the default job
(`python -m xray.train ppo`, configs/ppo_tiny_cpu.yaml, plus `--train-args`) twice, as
subprocesses: as it is, and with quantized makers (`--rollout.quantization=fp8
--rollout.dtype=bfloat16`); each run's eval after training is read from its `eval.json`. Last line
`quant_over_bf16=<fp8 tokens/s / bf16 tokens/s> eval_gap=<eval without - eval with>` (`skipped`
with `--no-eval`).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from xray.builtin.tiny_llama import BENCH_MODELS, build_tiny_model


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 49, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, seed: int) -> int:
    """One batched HF sampling call; returns the number of generated tokens."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    return int(out[:, width:].numel())


def time_hf(model_dir: str, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_generate(model, prompts[:8], 8, seed=0)  # warm-up
    start = time.perf_counter()
    tokens = hf_generate(model, prompts, new_tokens, seed=1)
    return tokens / (time.perf_counter() - start)


def time_vllm(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, repeats: int,
              quantization: str = "none") -> float:
    """Median tokens/s of `repeats` sampling calls of one vLLM engine, after a warm-up call."""
    from xray.backends import load_backend

    engine = load_backend("vllm").build_engine(model_dir, dtype=dtype, max_model_len=512, kv_cache_gib=2,
                                               quantization=quantization)
    sampling = {"temperature": 1.0, "max_new_tokens": new_tokens, "seed": 1}
    engine.generate(prompts, sampling)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        rates.append(sum(len(r) for r in out["response_ids"]) / (time.perf_counter() - start))
    engine.shutdown()
    del engine
    gc.collect()
    return statistics.median(rates)


def matmul_ratio(n: int = 2048, reps: int = 10) -> float:
    """The host's bf16 over fp32 matmul FLOP/s (medians of `reps`), with the current threads."""
    speed = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        speed[dtype] = 1 / statistics.median(times)
    return speed[torch.bfloat16] / speed[torch.float32]


def default_job_eval(run_dir: Path, extra: list[str]) -> float:
    """`python -m xray.train ppo` (the default job) with `extra` arguments into `run_dir`; its eval
    after training (`eval.json`)."""
    command = [sys.executable, "-m", "xray.train", "ppo", "--output-dir", str(run_dir), *extra]
    print("running:", shlex.join(command[1:]), flush=True)
    p = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"the run failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return float(json.loads((run_dir / "eval.json").read_text())["eval_after"])


def eval_gap(train_args: list[str], quantization: str) -> float:
    """Eval after training of the default job without quantized makers minus with them."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = default_job_eval(Path(tmp) / "plain", train_args)
        quant = default_job_eval(Path(tmp) / "quantized", [*train_args, f"--rollout.quantization={quantization}",
                                                          "--rollout.dtype=bfloat16"])
    print(f"default job eval after training: {plain:.3f} without quantized makers, {quant:.3f} with {quantization}")
    return plain - quant


def quantized_main(args: argparse.Namespace) -> None:
    """`--quantization`: bf16 against quantized tokens/s, then the default job's eval gap."""
    name = args.model or "110M"
    spec = BENCH_MODELS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(os.path.join(tmp, f"bench{name}"), spec, seed=0))
        prompts = make_prompts(args.prompts, spec.vocab_size)
        print(f"{args.prompts} prompts x {args.new_tokens} new tokens, BENCH_{name}, {args.threads} threads")
        bf16 = time_vllm(model_dir, prompts, args.new_tokens, "bfloat16", args.repeats)
        print(f"vllm bf16: {bf16:,.0f} tokens/s")
        quant = time_vllm(model_dir, prompts, args.new_tokens, "bfloat16", args.repeats, args.quantization)
        print(f"vllm bf16 + {args.quantization}: {quant:,.0f} tokens/s ({quant / bf16:.2f}x bf16)", flush=True)
    gap = "skipped" if args.no_eval else f"{eval_gap(shlex.split(args.train_args), args.quantization):.3f}"
    print(f"quant_over_bf16={quant / bf16:.3f} eval_gap={gap}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--model", choices=sorted(BENCH_MODELS), default=None,
                        help="benchmark model (default: 27M in fp32, 110M in bf16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine (median)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every engine (the in-process vLLM engine uses the "
                             "process's setting). 1 by default: on a 2-core machine shared with "
                             "other jobs, 2 threads ran 5-20x slower than 1 (oversubscription)")
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="time a quantized rollout against bf16 (then the default job's eval gap)")
    parser.add_argument("--no-eval", action="store_true", help="with --quantization: skip the two default jobs")
    parser.add_argument("--train-args", default="", help="with --quantization: extra arguments of both default "
                                                         "jobs, e.g. '--trainer.steps=40'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quantization:
        quantized_main(args)
        return
    bf16 = args.dtype == "bfloat16"
    name = args.model or ("110M" if bf16 else "27M")
    spec = BENCH_MODELS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(os.path.join(tmp, f"bench{name}"), spec, seed=0))
        prompts = make_prompts(args.prompts, spec.vocab_size)
        print(f"{args.prompts} prompts x {args.new_tokens} new tokens, BENCH_{name}, {args.threads} threads")
        hf = None
        if not bf16:
            hf = time_hf(model_dir, prompts, args.new_tokens)
            print(f"hf_generate fp32: {hf:,.0f} tokens/s")
        vllm32 = time_vllm(model_dir, prompts, args.new_tokens, "float32", args.repeats)
        print(f"vllm fp32: {vllm32:,.0f} tokens/s")
        vllm16 = time_vllm(model_dir, prompts, args.new_tokens, "bfloat16", args.repeats)
        print(f"vllm bf16: {vllm16:,.0f} tokens/s (bf16 over fp32: {vllm16 / vllm32:.2f}x)")
    if bf16:
        print(f"host bf16/fp32 matmul ratio {matmul_ratio():.2f} ({args.threads} threads): the ceiling of a bf16 speed-up")
        print(f"bf16_over_fp32={vllm16 / vllm32:.3f} tokens_per_s_bf16={vllm16:.0f}")
    else:
        print(f"vllm_vs_hf={vllm32 / hf:.2f} tokens_per_s={vllm32:.0f}")


if __name__ == "__main__":
    main()
