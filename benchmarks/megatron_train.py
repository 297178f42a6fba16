"""Train-step throughput of the Megatron engine vs a plain Hugging Face + torch AdamW loop.

One process, tp=pp=dp=1, the BENCH_27M model of xray/models/tiny.py, fp32, the same batch, loss
(xray.check.reference.policy_loss), micro-batching, clipping and AdamW for both. The two loops
alternate (one step each per round) so that machine noise hits both alike; on a shared machine
the fastest step of each (best of `--rounds`) is the figure compared, the median is printed
beside it. Achieved FLOP/s are set against a measured fp32 matmul peak (best of several tries,
before and after the steps).

    .venv/bin/python benchmarks/megatron_train.py [--batch 8] [--seq 256] [--micro 4] [--rounds 10]
        [--threads N]

CPU time per step is printed too: on a machine shared with other jobs it moves far less than
wall time (with --threads 1 it is the step's compute alone).

The last line is `megatron_vs_hf=<tokens/s ratio> mfu=<achieved FLOP/s / matmul peak>`.
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
from xray.models.tiny import BENCH_27M, build_tiny_model


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """Measured fp32 matmul FLOP/s (best of `reps`) with torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def train_flops_per_token(seq: int) -> float:
    """6 x matmul parameters (embedding lookup excluded, output layer included) plus attention's
    12 x layers x hidden x seq (the usual convention, full rather than causal attention)."""
    s = BENCH_27M
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


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from xray.backends.megatron import build_engine

    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="xray-bench-"), BENCH_27M, seed=0))
    optim = OptimConfig(lr=1e-5)
    batch = R.random_batch(args.batch, args.seq, BENCH_27M.vocab_size, seed=0)
    engine = build_engine(model_dir, ParallelDims(), "actor", optim, seed=0)
    hf = HFLoop(model_dir, optim)
    print(f"threads={torch.get_num_threads()} batch={args.batch}x{args.seq} micro={args.micro}")

    mega_step = lambda: engine.train_step(batch, R.policy_loss, args.micro)  # noqa: E731
    hf_step = lambda: hf.step(batch, args.micro)  # noqa: E731
    peak = matmul_peak()
    mega_step(), hf_step()  # warm-up
    times: dict[str, list[float]] = {"megatron": [], "hf": []}
    cpu: dict[str, list[float]] = {"megatron": [], "hf": []}
    for _ in range(args.rounds):
        for name, step in (("megatron", mega_step), ("hf", hf_step)):
            wall, used = _timed(step)
            times[name].append(wall)
            cpu[name].append(used)
    tokens = args.batch * args.seq
    tps = {k: tokens / min(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k}: step {min(v) * 1e3:.0f} ms best, {statistics.median(v) * 1e3:.0f} ms median "
              f"of {len(v)} (CPU time {statistics.median(cpu[k]) * 1e3:.0f} ms median); "
              f"{tps[k]:,.0f} tokens/s")
    peak = max(peak, matmul_peak())
    achieved = tps["megatron"] * train_flops_per_token(args.seq)
    print(f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; megatron achieved {achieved / 1e9:.1f} GFLOP/s, "
          f"hf {tps['hf'] * train_flops_per_token(args.seq) / 1e9:.1f} GFLOP/s")
    dist.destroy_process_group()
    print(f"megatron_vs_hf={tps['megatron'] / tps['hf']:.3f} mfu={achieved / peak:.3f}")


if __name__ == "__main__":
    main()
