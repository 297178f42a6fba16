"""Train-step throughput of the Megatron engine: against a plain Hugging Face loop, or bf16 against fp32.

One process, tp=pp=dp=1, a benchmark model of xray/builtin/tiny_llama.py (random weights), the same batch,
loss (xray.check.reference.policy_loss), micro-batching, clipping and AdamW for both sides, which
alternate (one step each per round) so that machine noise hits both alike. Figures are medians
over `--rounds` rounds after one warm-up step each.

    .venv/bin/python benchmarks/megatron_train.py [--dtype float32|bfloat16] [--model 27M|110M]
        [--batch 8] [--seq 256] [--micro 4] [--rounds 7] [--threads N]

`--dtype float32` (default model 27M): the Megatron engine against a plain HF + torch AdamW loop,
both fp32. Last line `megatron_vs_hf=<HF median step s / Megatron median step s> mfu=<Megatron's
achieved FLOP/s / the fp32 matmul peak>`.

`--dtype bfloat16` (default model 110M): the Megatron engine in bf16 (bf16 weights, fp32 main
weights and gradient reduction: `model.dtype: bfloat16`) against the same engine in fp32. Last line
`bf16_over_fp32=<fp32 median step s / bf16 median step s> mfu_bf16=<bf16 achieved FLOP/s / the bf16
matmul peak>`; the line above it gives the host's bf16/fp32 matmul ratio, the ceiling of the first.

`--device cuda` (a lent GPU; default model 1B, `--dtype bfloat16`): the bf16 engine alone, in a
world of one over NCCL. Last line `tokens_per_s=<median tokens/s> mfu=<achieved FLOP/s / the GPU's
bf16 matmul peak measured in the same run (8192^3 products, median of 10)>`.

Matmul peaks are measured in the same run (2048^2 matmuls, median of 10, before and after the
steps, the larger kept), with the steps' thread count. CPU time per step is printed too: on a
machine shared with other jobs it moves far less than wall time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from xray.backends.base import OptimConfig
from xray.backends.optim import build_optimizer, build_scheduler
from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import BENCH_MODELS, TinySpec, build_tiny_model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 10, device: str = "cpu") -> float:
    """Measured matmul FLOP/s in `dtype` on `device` (median of `reps`; on the CPU with torch's
    current thread count)."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times)


def train_flops_per_token(s: TinySpec, seq: int) -> float:
    """6 x matmul parameters (embedding lookup excluded, output layer included) plus attention's
    12 x layers x hidden x seq (the usual convention, full rather than causal attention)."""
    d_head = s.hidden_size // s.num_heads
    attn = s.hidden_size * d_head * (s.num_heads + 2 * s.num_kv_heads) + s.num_heads * d_head * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    matmul_params = s.num_layers * (attn + mlp) + s.vocab_size * s.hidden_size
    return 6 * matmul_params + 12 * s.num_layers * s.hidden_size * seq


class HFLoop:
    """The plain loop: HF forward, log-probs, backward per micro-batch, clip, AdamW step."""

    def __init__(self, model_dir: str, optim: OptimConfig):
        self.model = R.load_hf(model_dir)
        self.model.train()
        self.optim = optim
        self.optimizer = build_optimizer(self.model.parameters(), optim)
        self.scheduler = build_scheduler(self.optimizer, optim)

    def step(self, batch, micro: int) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        chunks = batch.chunks(micro)
        total = 0.0
        for mb in chunks:
            loss, _ = R.policy_loss({C.LOGPROBS: R.hf_logprobs(self.model, mb)}, mb)
            (loss / len(chunks)).backward()
            total += float(loss.detach()) / len(chunks)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return total


def _timed(fn, device: str = "cpu") -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads) of one call."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def _alternate(steps: dict, rounds: int, device: str = "cpu") -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of each step function, one call each per round, after a warm-up call."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            wall, used = _timed(step, device)
            times[name].append(wall)
            cpu[name].append(used)
    return times, cpu


def cuda_main(args) -> None:
    """The bf16 engine alone on a GPU: tokens/s and MFU against the GPU's measured bf16 peak."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from xray.backends.megatron import build_engine

    name = args.model or "1B"
    spec = BENCH_MODELS[name]
    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="xray-bench-"), spec, seed=0))
    batch = R.random_batch(args.batch, args.seq, spec.vocab_size, seed=0)
    engine = build_engine(model_dir, ParallelDims(), "actor", OptimConfig(lr=1e-5), seed=0, device="cuda",
                          dtype="bfloat16")
    print(f"model {name} on {torch.cuda.get_device_name()}, batch={args.batch}x{args.seq} micro={args.micro}")
    times, _ = _alternate({"megatron bf16": lambda: engine.train_step(batch, R.policy_loss, args.micro)},
                          args.rounds, "cuda")
    peak = matmul_peak(torch.bfloat16, n=8192, device="cuda")
    step = statistics.median(times["megatron bf16"])
    tokens = args.batch * args.seq
    achieved = tokens / step * train_flops_per_token(spec, args.seq)
    print(f"step {step * 1e3:.0f} ms median of {len(times['megatron bf16'])}; achieved {achieved / 1e12:.0f} "
          f"TFLOP/s; bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; peak memory "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    dist.destroy_process_group()
    print(f"tokens_per_s={tokens / step:.0f} mfu={achieved / peak:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--model", choices=sorted(BENCH_MODELS), default=None,
                        help="benchmark model (default: 27M in fp32, 110M in bf16)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        cuda_main(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = args.dtype == "bfloat16"
    name = args.model or ("110M" if bf16 else "27M")
    spec = BENCH_MODELS[name]

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from xray.backends.megatron import build_engine

    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="xray-bench-"), spec, seed=0))
    optim = OptimConfig(lr=1e-5)
    batch = R.random_batch(args.batch, args.seq, spec.vocab_size, seed=0)
    engine = build_engine(model_dir, ParallelDims(), "actor", optim, seed=0)
    if bf16:
        other = build_engine(model_dir, ParallelDims(), "actor", optim, seed=0, dtype="bfloat16")
        steps = {"megatron bf16": lambda: other.train_step(batch, R.policy_loss, args.micro),
                 "megatron fp32": lambda: engine.train_step(batch, R.policy_loss, args.micro)}
    else:
        hf = HFLoop(model_dir, optim)
        steps = {"megatron": lambda: engine.train_step(batch, R.policy_loss, args.micro),
                 "hf": lambda: hf.step(batch, args.micro)}
    print(f"model {name}, threads={torch.get_num_threads()} batch={args.batch}x{args.seq} micro={args.micro}")
    peaks = {t: matmul_peak(t) for t in (torch.float32, torch.bfloat16)}
    times, cpu = _alternate(steps, args.rounds)
    peaks = {t: max(p, matmul_peak(t)) for t, p in peaks.items()}
    tokens, flops = args.batch * args.seq, train_flops_per_token(spec, args.seq)
    median = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k}: step {median[k] * 1e3:.0f} ms median of {len(v)} (range {min(v) * 1e3:.0f}-"
              f"{max(v) * 1e3:.0f}; CPU time {statistics.median(cpu[k]) * 1e3:.0f} ms median); "
              f"{tokens / median[k]:,.0f} tokens/s, {tokens / median[k] * flops / 1e9:.1f} GFLOP/s")
    ratio = peaks[torch.bfloat16] / peaks[torch.float32]
    print(f"matmul peaks: fp32 {peaks[torch.float32] / 1e9:.0f} GFLOP/s, bf16 {peaks[torch.bfloat16] / 1e9:.0f} "
          f"GFLOP/s (host bf16/fp32 ratio {ratio:.2f}: the ceiling of a bf16 speed-up)")
    dist.destroy_process_group()
    if bf16:
        achieved = tokens / median["megatron bf16"] * flops
        print(f"bf16_over_fp32={median['megatron fp32'] / median['megatron bf16']:.3f} "
              f"mfu_bf16={achieved / peaks[torch.bfloat16]:.3f}")
    else:
        achieved = tokens / median["megatron"] * flops
        print(f"megatron_vs_hf={median['hf'] / median['megatron']:.3f} mfu={achieved / peaks[torch.float32]:.3f}")


if __name__ == "__main__":
    main()
