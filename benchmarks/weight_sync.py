"""Weight sync actor -> rollout against one in-memory copy of the same state dict, on BENCH_27M.

    .venv/bin/python benchmarks/weight_sync.py [--repeats 7] [--bucket-mb 64] [--probes 4] [--probe-len 16]

One run builds the "27M" Llama of xray/models/tiny.py (BENCH_27M: 6 layers, hidden 512, vocabulary
8192, 27.4M parameters with the untied output layer; random weights) in a temporary directory,
starts an actor WholeModel (TrainWorkhorse on Megatron, tp=1) and a rollout WholeModel
(RolloutWorkhorse on vLLM, one replica, fp32), then times, round by round so machine noise hits
all three alike:
  - `sync`:          `xray.sync.sync_weights` with verification off (export, object store,
                     reload in vLLM, version bump);
  - `verified sync`: `sync_weights` with verification on (`--probes` random sequences of
                     `--probe-len` tokens, the second half scored by both sides);
  - `copy`:          one `{name: tensor.clone()}` of the exported state dict in the driver, with
                     as many torch threads as a Workhorse has (1).
The sync is also split by the Workhorses' busy time (`Workhorse.busy_time`): the actor's export,
the rollout's reload, and the rest (object store put and transfer, Ray calls). Figures are medians
over `--repeats` rounds after one warm-up round. The last line is
`sync_over_copy=<sync s / copy s> verify_share=<verification s / verified sync s>` (the share of a
verified sync spent verifying; verification / plain sync is printed above it).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time

import torch

from xray.config.parallel import ParallelDims
from xray.config.schema import SyncConfig
from xray.models.tiny import BENCH_27M, build_tiny_model
from xray.sync import sync_weights
from xray.wholemodel import WholeModel
from xray.workhorse.base import covered_seconds
from xray.workhorse.rollout import RolloutWorkhorse
from xray.workhorse.train import TrainWorkhorse


def probe_sequences(count: int, vocab: int, length: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """`count` random token sequences of `length`, the first half of each being its prompt."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]
    return seqs, [length // 2] * count


def start_models(model_dir: str) -> tuple[WholeModel, WholeModel]:
    actor = WholeModel(TrainWorkhorse, role="actor", parallel=ParallelDims(),
                       init_kwargs=dict(backend="megatron", model_dir=model_dir),
                       env={"PYTHONWARNINGS": "ignore"})
    rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(),
                         init_kwargs=dict(backend="vllm", model_dir=model_dir, dtype="float32",
                                          max_model_len=256, kv_cache_gib=1),
                         env={"VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"})
    return actor, rollout


def time_copy(state: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    copy = {k: v.clone() for k, v in state.items()}
    elapsed = time.perf_counter() - t0
    assert len(copy) == len(state)
    return elapsed


def busy(model: WholeModel) -> list[tuple[float, float]]:
    """The model's busy intervals (epoch seconds, all shards) since the last read."""
    return [tuple(i) for shard in model.busy_time().get() for i in shard["intervals"]]


def one_round(actor: WholeModel, rollout: WholeModel, version: int, bucket_mb: int,
              probe: list[list[int]], prompt_lens: list[int], state: dict[str, torch.Tensor]):
    """A plain sync, a verified sync and a copy: their seconds, and where the sync time went."""
    plain = SyncConfig(verify=False, bucket_mb=bucket_mb)
    checked = SyncConfig(verify=True, bucket_mb=bucket_mb)
    busy(actor), busy(rollout)
    a = asyncio.run(sync_weights(actor, rollout, version, plain))
    exported, reloaded = busy(actor), busy(rollout)
    t = {"sync": a.sync_s, "export": covered_seconds(exported), "reload": covered_seconds(reloaded),
         "busy": covered_seconds(exported + reloaded)}
    start = time.time()
    b = asyncio.run(sync_weights(actor, rollout, version + 1, checked, probe, prompt_lens))
    lo = start + b.sync_s  # where the verification starts
    forward, scored = busy(actor), busy(rollout)
    t.update(verified_sync=b.sync_s + b.verify_s, verify=b.verify_s,
             verify_actor=covered_seconds(forward, lo), verify_rollout=covered_seconds(scored, lo),
             verify_busy=covered_seconds(forward + scored, lo))
    t["copy"] = time_copy(state)
    return t, a, b


def report(times: dict[str, list[float]], nbytes: int, params: int, diff: float, args) -> None:
    m = {k: statistics.median(v) * 1e3 for k, v in times.items()}  # ms
    print(f"model: {params / 1e6:.1f}M parameters, {nbytes / 1e6:.1f} MB fp32; bucket {args.bucket_mb} MiB; "
          f"probe {args.probes} x {args.probe_len} tokens; medians over {args.repeats} rounds, ms")
    print(f"copy            {m['copy']:8.1f}   ({nbytes / m['copy'] / 1e6:.1f} GB/s, 1 thread)")
    print(f"sync            {m['sync']:8.1f}   ({nbytes / m['sync'] / 1e6:.2f} GB/s)")
    print(f"  busy          {m['busy']:8.1f}   (actor export {m['export']:.1f}: gather to HF tensors; "
          f"rollout reload {m['reload']:.1f}: vLLM reload_weights; they overlap)")
    print(f"  rest          {m['sync'] - m['busy']:8.1f}   (object store put and transfer, Ray calls)")
    print(f"verified sync   {m['verified_sync']:8.1f}")
    print(f"  verification  {m['verify']:8.1f}   (busy {m['verify_busy']:.1f}: actor forward "
          f"{m['verify_actor']:.1f}, vLLM log-probs {m['verify_rollout']:.1f}, concurrently)")
    print(f"max_abs_logprob_diff={diff:.2e}; verification / plain sync = {m['verify'] / m['sync']:.3f}")
    print(f"sync_over_copy={m['sync'] / m['copy']:.3f} verify_share={m['verify'] / m['verified_sync']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up)")
    parser.add_argument("--bucket-mb", type=int, default=SyncConfig.bucket_mb, help="sync bucket size")
    parser.add_argument("--probes", type=int, default=4, help="probe sequences of the verification")
    parser.add_argument("--probe-len", type=int, default=16, help="tokens per probe; the second half is scored")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(f"{tmp}/bench27m", BENCH_27M, seed=0))
        actor, rollout = start_models(model_dir)
        try:
            state = actor.state_dict().get()
            nbytes = sum(v.numel() * v.element_size() for v in state.values())
            probe, prompt_lens = probe_sequences(args.probes, BENCH_27M.vocab_size, args.probe_len)
            for round_ in range(args.repeats + 1):  # round 0 warms up
                t, plain, checked = one_round(actor, rollout, 2 * round_ + 1, args.bucket_mb, probe,
                                              prompt_lens, state)
                assert plain.bytes == nbytes and checked.max_abs_logprob_diff <= SyncConfig.tolerance
                for k, v in t.items():
                    times.setdefault(k, []).extend([v] if round_ else [])
        finally:
            rollout.shutdown()
            actor.shutdown()
    report(times, nbytes, sum(v.numel() for v in state.values()), checked.max_abs_logprob_diff, args)


if __name__ == "__main__":
    main()
