"""Rollout throughput: the vLLM engine against Hugging Face `generate`, on BENCH_27M.

    .venv/bin/python benchmarks/rollout_throughput.py [--prompts 128] [--new-tokens 128]

One run builds the 27M-parameter Llama of xray/models/tiny.py (random weights), then times, on
the same prompts (random token ids, 16 to 48 long), the same sampling (temperature 1, a fixed
seed) and the same number of torch threads, each engine's second call (the first one warms up):
  - Hugging Face `generate`, fp32, the whole batch at once (left padding, KV cache);
  - the vLLM engine (xray.backends.vllm), fp32, then bf16.
Tokens counted are the generated response tokens. The last line is
`vllm_vs_hf=<fp32 vLLM tokens/s over HF tokens/s> tokens_per_s=<fp32 vLLM tokens/s>`.
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch

from xray.models.tiny import BENCH_27M, build_tiny_model


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


def time_vllm(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str) -> float:
    from xray.backends import load_backend

    engine = load_backend("vllm").build_engine(model_dir, dtype=dtype, max_model_len=512, kv_cache_gib=2)
    sampling = {"temperature": 1.0, "max_new_tokens": new_tokens, "seed": 1}
    engine.generate(prompts, sampling)  # warm-up
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    del engine
    gc.collect()
    return sum(len(r) for r in out["response_ids"]) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every engine (the in-process vLLM engine uses the "
                             "process's setting). 1 by default: on a 2-core machine shared with "
                             "other jobs, 2 threads ran 5-20x slower than 1 (oversubscription)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(os.path.join(tmp, "bench27m"), BENCH_27M, seed=0))
        prompts = make_prompts(args.prompts, BENCH_27M.vocab_size)
        print(f"{args.prompts} prompts x {args.new_tokens} new tokens, BENCH_27M, {args.threads} threads")
        hf = time_hf(model_dir, prompts, args.new_tokens)
        print(f"hf_generate fp32: {hf:,.0f} tokens/s")
        vllm32 = time_vllm(model_dir, prompts, args.new_tokens, "float32")
        print(f"vllm fp32: {vllm32:,.0f} tokens/s")
        vllm16 = time_vllm(model_dir, prompts, args.new_tokens, "bfloat16")
        print(f"vllm bf16: {vllm16:,.0f} tokens/s (bf16 over fp32: {vllm16 / vllm32:.2f}x)")
    print(f"vllm_vs_hf={vllm32 / hf:.2f} tokens_per_s={vllm32:.0f}")


if __name__ == "__main__":
    main()
