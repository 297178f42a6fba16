"""ZeRO-3 memory per process: dp=2 against dp=1 on the same model, in one run.

Builds the 27M-parameter benchmark Llama (xray.builtin.tiny_llama.BENCH_27M), then trains one step with
the DeepSpeed engine at ZeRO stage 3 on 1 process and on 2 processes (gloo, CPU) with the same
global batch, and counts the bytes each process holds afterwards in parameters, gradients and
optimizer state.

How bytes are counted: every live tensor in the process (found through the garbage collector),
deduplicated by storage, so that a flat buffer and the parameter views into it count once. That
total is what the process holds between steps: parameter shards, fp32 master partitions, Adam
moments, gradient partitions and DeepSpeed's buckets; the breakdown names the parameter shards
and the Adam moments, the rest is "other" (master copy, gradients, buckets). The batch itself is
a few KB. "peak RSS" is the process's high-water mark, libraries included (about 0.5 GiB of it is
torch, transformers and DeepSpeed themselves), for context only.

Run: `.venv/bin/python benchmarks/zero_memory.py` (about a minute on 2 cores). The last line is
`zero3_dp2_over_dp1=<ratio>`: the largest dp=2 process over the dp=1 process (ideal 0.5).
"""
from __future__ import annotations

import argparse
import gc
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: xray and tests

import torch  # noqa: E402

from tests.dist_harness import run_distributed  # noqa: E402
from xray.backends.base import OptimConfig  # noqa: E402
from xray.check.reference import policy_loss, random_batch  # noqa: E402
from xray.config.parallel import ParallelDims  # noqa: E402
from xray.builtin.tiny_llama import BENCH_27M, build_tiny_model  # noqa: E402


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def held_bytes(engine) -> dict[str, int]:
    """Bytes of all live tensors (dedup by storage), with parameter shards and Adam moments named."""
    gc.collect()
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    params = [getattr(p, "ds_tensor", p) for p in engine.engine.module.parameters()]
    moments = [v for state in engine.optimizer.optimizer.state.values() for v in state.values()]
    total = _storage_bytes(live)
    p_bytes, m_bytes = _storage_bytes(params), _storage_bytes(moments)
    return {"total": total, "param_shards": p_bytes, "adam_moments": m_bytes, "other": total - p_bytes - m_bytes}


def _measure(rank, world, model_dir, batch, micro):
    from xray.backends.deepspeed import build_engine

    engine = build_engine(model_dir, ParallelDims(dp=world), "actor", OptimConfig(lr=1e-5), seed=0, zero_stage=3)
    t0 = time.perf_counter()
    metrics = engine.train_step(batch.split(world)[rank], policy_loss, micro)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux
    return {**held_bytes(engine), "step_s": time.perf_counter() - t0, "loss": metrics["loss"], "peak_rss": peak_rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "bench27m", BENCH_27M))
        n_params = sum(t.numel() for t in _load_state(model_dir).values())
        batch = random_batch(args.batch, args.seq_len, BENCH_27M.vocab_size, seed=0)
        micro = args.batch // 2
        dp1 = run_distributed(_measure, 1, model_dir, batch, micro)
        dp2 = run_distributed(_measure, 2, model_dir, batch, micro)
    mib = 1 << 20
    print(f"model: {n_params / 1e6:.1f}M parameters, fp32 ({n_params * 4 / mib:.0f} MiB of weights)")
    print(f"{'run':<12}{'total MiB':>10}{'params':>9}{'adam':>9}{'other':>9}{'peak RSS':>10}{'step s':>8}{'loss':>10}")
    for name, rows in (("dp=1", dp1), ("dp=2", dp2)):
        for rank, r in enumerate(rows):
            print(f"{name} r{rank:<6}{r['total'] / mib:>10.1f}{r['param_shards'] / mib:>9.1f}"
                  f"{r['adam_moments'] / mib:>9.1f}{r['other'] / mib:>9.1f}{r['peak_rss'] / mib:>10.0f}"
                  f"{r['step_s']:>8.2f}{r['loss']:>10.4f}")
    ratio = max(r["total"] for r in dp2) / dp1[0]["total"]
    print(f"zero3_dp2_over_dp1={ratio:.3f}")


def _load_state(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


if __name__ == "__main__":
    main()
