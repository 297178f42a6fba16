"""Full fine-tuning against LoRA (rank 8, all-linear) on the 27M benchmark model: sync, step, state.

    .venv/bin/python benchmarks/lora.py [--backend megatron|deepspeed] [--model 27M] [--rounds 5]
        [--batch 8] [--seq 128] [--rank 8]

One run builds a benchmark Llama of xray/builtin/tiny_llama.py (random weights, fp32) and starts
two actor + rollout pairs side by side on this node, each a TrainWorkhorse (tp=1, one shard) and
a vLLM RolloutWorkhorse (one replica, fp32): `full` trains every weight and syncs them all;
`lora` trains adapters on every linear layer of the decoder (`actor.lora: {rank: 8, alpha: 32,
target_modules: all-linear}`) and syncs the adapters alone into vLLM's LoRA slot. Each round, for
each pair in turn (so machine noise hits both alike): one train step on the same random batch
(`--batch` rows of `--seq` tokens, `xray.check.reference.policy_loss`, one micro-batch per 4 rows),
then the weight sync verified as a run verifies it, at the same level for both: every sync
complete and exact (`xray.sync.sync_weights` with the run's defaults: manifest, checksums, every
engine tensor checked), and the log-prob probe at one sync in `sync.probe_every`, the same probe
for both (one random sequence of 16 tokens: a LoRA engine scores one sequence per call): each
round times one sync without the probe and one with it, and counts
without + (with - without) / probe_every. Figures are medians over `--rounds` rounds after one
warm-up round.

The line before the last gives what the probe costs a verified LoRA sync at least on this host:
one plain forward of the probe through the base model (`transformers`, one thread, median of 15,
with the pairs stopped) on each side, at one sync in `sync.probe_every`, against 0.1 x the full
sync.

Last line `lora_sync_over_full=<x> lora_step_over_full=<y> lora_state_over_full=<z>`:
  x = LoRA's verified sync seconds / full fine-tuning's (export, transport, load, verification);
  y = LoRA's train step seconds / full fine-tuning's;
  z = the actor Workhorse's trainable-parameter + optimizer-state bytes with LoRA / without
      (`TrainWorkhorse.state_bytes`: Adam's moments and step, the parameters that train).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time

import torch

from xray.backends.base import OptimConfig
from xray.builtin.tiny_llama import BENCH_MODELS, build_tiny_model
from xray.check.reference import policy_loss, random_batch
from xray.config.engines import engine, names
from xray.config.lora import LoraConfig
from xray.config.parallel import ParallelDims
from xray.config.schema import SyncConfig
from xray.sync import sync_weights
from xray.sync.weights import random_probe
from xray.wholemodel import WholeModel
from xray.workhorse.rollout import RolloutWorkhorse
from xray.workhorse.train import TrainWorkhorse

QUIET = {"PYTHONWARNINGS": "ignore", "VLLM_LOGGING_LEVEL": "ERROR"}


def start_pair(model_dir: str, backend: str, lora: LoraConfig | None) -> tuple[WholeModel, WholeModel]:
    extra = {"lora": lora} if lora is not None else {}
    train = dict(backend=backend, model_dir=model_dir, optim=OptimConfig(lr=1e-4), **extra)
    if engine(backend).zero:
        train["zero_stage"] = 1
    actor = WholeModel(TrainWorkhorse, role="actor", parallel=ParallelDims(), init_kwargs=train, env=QUIET)
    rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(),
                         init_kwargs=dict(backend="vllm", model_dir=model_dir, dtype="float32", max_model_len=256,
                                          kv_cache_gib=1, **extra), env=QUIET)
    return actor, rollout


def one_round(pair, batch, version: int, probe, lens) -> tuple[float, float, object]:
    """(train step s, a run's verified sync s on average, the probed sync's report) of one pair:
    the sync after the step without the probe, then once more with it (versions `version` and
    `version` + 1)."""
    actor, rollout = pair
    t0 = time.perf_counter()
    actor.train_step(batch, policy_loss, 4).get()
    step_s = time.perf_counter() - t0
    plain = asyncio.run(sync_weights(actor, rollout, version, SyncConfig()))
    probed = asyncio.run(sync_weights(actor, rollout, version + 1, SyncConfig(), probe, lens))
    without, with_probe = plain.sync_s + plain.verify_s, probed.sync_s + probed.verify_s
    return step_s, without + (with_probe - without) / SyncConfig.probe_every, probed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=names("train"), default=names("train")[0])
    parser.add_argument("--model", choices=sorted(BENCH_MODELS), default="27M")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = BENCH_MODELS[args.model]
    lora = LoraConfig(rank=args.rank, alpha=4.0 * args.rank, target_modules="all-linear")
    batch = random_batch(args.batch, args.seq, spec.vocab_size, seed=0)
    times: dict[str, dict[str, list[float]]] = {"full": {}, "lora": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(f"{tmp}/bench{args.model}", spec, seed=0))
        probe, lens = random_probe(model_dir, 1, 1, seed=0)
        # one sequence for both (a LoRA engine scores one sequence per call; a run probes it so:
        # RLTrainer.probe_size): the same verification level
        probes = {"full": (probe[:1], lens[:1]), "lora": (probe[:1], lens[:1])}
        pairs = {"full": start_pair(model_dir, args.backend, None), "lora": start_pair(model_dir, args.backend, lora)}
        try:
            reports = {}
            for i in range(args.rounds + 1):
                for name, pair in pairs.items():
                    step_s, sync_s, reports[name] = one_round(pair, batch, 2 * i + 1, *probes[name])
                    if i:  # the first round warms up
                        times[name].setdefault("step", []).append(step_s)
                        times[name].setdefault("sync", []).append(sync_s)
            state = {name: pair[0].state_bytes().get()[0] for name, pair in pairs.items()}
        finally:
            for actor, rollout in pairs.values():
                actor.shutdown()
                rollout.shutdown()
        floor_s = plain_forward_s(model_dir, probes["lora"][0])
    report(times, state, reports, args, floor_s)


def plain_forward_s(model_dir: str, probe: list[list[int]], repeats: int = 15) -> float:
    """Median seconds of one `transformers` forward of `probe` through the base model."""
    from xray.check.reference import load_hf

    model, ids = load_hf(model_dir).eval(), torch.tensor(probe)
    times = []
    with torch.no_grad():
        model(ids)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(times: dict, state: dict, reports: dict, args, floor_s: float) -> None:
    m = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    total = {name: s["trainable"] + s["optimizer"] for name, s in state.items()}
    print(f"model {args.model}, {args.backend} actor, LoRA rank {args.rank} all-linear; batch {args.batch} x "
          f"{args.seq}; medians over {args.rounds} rounds")
    for name in ("full", "lora"):
        r = reports[name]
        print(f"{name:<5} step {m[name]['step'] * 1e3:8.1f} ms   verified sync {m[name]['sync'] * 1e3:8.1f} ms "
              f"(a run's average, the probe at 1 sync in {SyncConfig.probe_every}; {r.bytes / 1e6:.2f} MB sent, "
              f"{r.held_exact} engine tensors bit-equal, {r.held_functional} by product, probe diff "
              f"{r.max_abs_logprob_diff:.1e})   trainable {state[name]['trainable'] / 1e6:.2f} MB "
              f"+ optimizer {state[name]['optimizer'] / 1e6:.2f} MB")
    print(f"floor: one plain forward of the probe {floor_s * 1e3:.1f} ms, each side needs one at 1 sync in "
          f"{SyncConfig.probe_every}: {2 * floor_s / SyncConfig.probe_every * 1e3:.1f} ms a sync on average, against "
          f"0.1 x the full sync = {m['full']['sync'] * 100:.1f} ms")
    print(f"lora_sync_over_full={m['lora']['sync'] / m['full']['sync']:.3f} "
          f"lora_step_over_full={m['lora']['step'] / m['full']['step']:.3f} "
          f"lora_state_over_full={total['lora'] / total['full']:.4f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
