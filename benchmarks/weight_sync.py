"""Weight sync actor -> rollout against the rollout engine's own reload, per transport.

    .venv/bin/python benchmarks/weight_sync.py [--model 27M|110M] [--repeats 7] [--bucket-mb 64]
        [--probes 4] [--probe-len 16]

One run builds a benchmark Llama of xray/builtin/tiny_llama.py (BENCH_27M: 27.4M parameters; BENCH_110M:
110.1M; random weights, fp32) in a temporary directory, starts an actor WholeModel (TrainWorkhorse
on Megatron, tp=1) and a rollout WholeModel (RolloutWorkhorse on vLLM, one replica, fp32) on this
node, then times, round by round so that machine noise hits all alike:
  - `reload`:    the rollout engine's own in-place reload (`VllmEngine.reload`) of the same tensors
                 already in its memory (`RolloutWorkhorse.time_reload`, median of 3): the floor;
  - `objstore`, `pg`, `shm`, `auto`: `xray.sync.sync_weights` verified as a run's sync between
                 two probes is (`sync.verify` on, no probe: the complete and exact parts, checksums
                 and every engine tensor checked, bit for bit or by its product) with
                 `sync.transport` forced to the object store, to the process group, to the actor's
                 shared-memory slots, or chosen automatically (the whole sync: export, transport,
                 load, the checks, the version bump);
  - `unverified`: auto with `sync.verify` off (no checksum, no check of what the engine holds);
  - `probed`:    auto with the probe too (`--probes` random sequences of `--probe-len` tokens, the
                 second half scored by both sides), as a run's first, last and every
                 `--probe-every`-th sync.
A run's verified sync costs on average `verified` = auto + (probed - auto) / probe_every: the
syncs between two probes are checked end to end by the next step's own log-probs, which the step
computes anyway. Figures are medians over `--repeats` rounds after one warm-up round. The last
line is `sync_over_reload=<auto s / reload s> verify_share=<(verified - unverified) s / verified s>
pg_over_objstore=<pg s / objstore s> auto_over_best=<auto s / the fastest of pg, objstore and shm>
unchecked=<engine tensors the last sync left unchecked> coverage=<checked / held>` (on one CPU node
`auto` takes the slots), where coverage is the smallest, over every rollout engine, dtype and tp
the project supports on CPU (`COVERAGE_LAYOUTS`: vLLM and DeepSpeed-Inference, fp32 and bf16, tp 1
and 2, and vLLM's fp8), of the engine tensors the sync wrote that its held check gave a verdict
(bit for bit, or by their layer's product) over those it wrote (`SyncReport.held_tensors`), each
layout measured by one verified sync from the same actor (`--no-coverage` skips them).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile

import torch

from xray.config.engines import engine as engine_row
from xray.config.parallel import ParallelDims
from xray.config.schema import SyncConfig
from xray.builtin.tiny_llama import BENCH_MODELS, build_tiny_model
from xray.sync import sync_weights
from xray.wholemodel import WholeModel
from xray.workhorse.busy import covered_seconds
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


COVERAGE_LAYOUTS = [(engine, dtype, tp, "none") for engine in ("vllm", "dsinfer")
                    for dtype in ("float32", "bfloat16") for tp in (1, 2)] + [("vllm", "bfloat16", 1, "fp8")]
"""(engine, dtype, tp, quantization) of the rollout layouts whose held-check coverage is measured."""


def coverage(actor: WholeModel, model_dir: str, version: int) -> dict[tuple, tuple[int, int, int]]:
    """Per rollout layout of `COVERAGE_LAYOUTS`: (checked exactly, checked by product, held), from one
    verified sync of the actor's weights into a fresh rollout of that layout."""
    out = {}
    for engine, dtype, tp, quantization in COVERAGE_LAYOUTS:
        row = engine_row(engine)
        options = {**({"kv_cache_gib": 1} if "kv_cache_gib" in row.options else {}),
                   **({"quantization": quantization} if quantization != "none" else {})}
        rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(tp=tp),
                             init_kwargs=dict(backend=engine, model_dir=model_dir, dtype=dtype, max_model_len=256,
                                              **options),
                             env={"VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"})
        try:
            r = asyncio.run(sync_weights(actor, rollout, version, SyncConfig()))
        finally:
            rollout.shutdown()
        out[(engine, dtype, tp, quantization)] = (r.held_exact, r.held_functional, r.held_tensors)
        version += 1
    return out


def busy(model: WholeModel) -> list[tuple[float, float]]:
    """The model's busy intervals (epoch seconds, all shards) since the last read."""
    return [tuple(i) for shard in model.busy_time().get() for i in shard["intervals"]]


def one_round(actor: WholeModel, rollout: WholeModel, version: int, bucket_mb: int,
              probe: list[list[int]], prompt_lens: list[int]) -> tuple[dict[str, float], list]:
    """Seconds of the floor, of a sync by each transport and of a verified sync; their reports."""
    t = {"reload": rollout.call("time_reload", 3).get()[0]}
    reports = []
    for name in ("objstore", "pg", "shm", "auto", "unverified"):
        busy(actor), busy(rollout)
        cfg = SyncConfig(verify=name != "unverified", bucket_mb=bucket_mb,
                         transport="auto" if name == "unverified" else name)
        r = asyncio.run(sync_weights(actor, rollout, version, cfg))
        version += 1
        t[name] = r.sync_s + r.verify_s
        if name == "objstore":
            t["export"], t["load"] = covered_seconds(busy(actor)), covered_seconds(busy(rollout))
        reports.append(r)
    r = asyncio.run(sync_weights(actor, rollout, version, SyncConfig(bucket_mb=bucket_mb), probe, prompt_lens))
    t["probed"] = r.sync_s + r.verify_s
    return t, reports + [r]


def report(times: dict[str, list[float]], nbytes: int, params: int, reports: list, args,
           covered: dict[tuple, tuple[int, int, int]]) -> None:
    m = {k: statistics.median(v) * 1e3 for k, v in times.items()}  # ms
    print(f"model {args.model}: {params / 1e6:.1f}M parameters, {nbytes / 1e6:.1f} MB fp32; bucket {args.bucket_mb} "
          f"MiB; probe {args.probes} x {args.probe_len} tokens; medians over {args.repeats} rounds, ms")
    print(f"reload (floor)  {m['reload']:8.1f}   (vLLM reload_weights of tensors in its memory)")
    print(f"objstore sync   {m['objstore']:8.1f}   (actor export {m['export']:.1f}, rollout load {m['load']:.1f}, "
          "overlapping)")
    print(f"pg sync         {m['pg']:8.1f}")
    print(f"shm sync        {m['shm']:8.1f}   (the actor's shared-memory slots)")
    auto = reports[3]
    print(f"auto sync       {m['auto']:8.1f}   (chose {auto.transport}; {auto.held_exact} engine tensors bit-equal, "
          f"{auto.held_functional} checked by their product, {auto.unchecked} unchecked)")
    print(f"unverified      {m['unverified']:8.1f}   (auto, sync.verify off: no checksum, no check)")
    print(f"probed sync     {m['probed']:8.1f}   (auto with the probe, probe diff {reports[-1].max_abs_logprob_diff:.2e})")
    verified = m["auto"] + (m["probed"] - m["auto"]) / args.probe_every
    print(f"verified sync   {verified:8.1f}   (a run's average: the probe at 1 sync in {args.probe_every})")
    for (engine, dtype, tp, quantization), (exact, functional, held) in covered.items():
        print(f"coverage {engine:7s} {dtype:8s} tp={tp} {quantization:4s}  {exact} exact + {functional} by product "
              f"of {held} held: {(exact + functional) / held:.3f}")
    ratios = [(exact + functional) / held for exact, functional, held in covered.values()]
    auto_cov = (auto.held_exact + auto.held_functional) / auto.held_tensors
    best = min(m["pg"], m["objstore"], m["shm"])
    print(f"sync_over_reload={m['auto'] / m['reload']:.3f} verify_share={(verified - m['unverified']) / verified:.3f} "
          f"pg_over_objstore={m['pg'] / m['objstore']:.3f} auto_over_best={m['auto'] / best:.3f} "
          f"unchecked={auto.unchecked + reports[-1].unchecked} coverage={min([auto_cov, *ratios]):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(BENCH_MODELS), default="27M")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up)")
    parser.add_argument("--bucket-mb", type=int, default=SyncConfig.bucket_mb, help="sync bucket size")
    parser.add_argument("--probes", type=int, default=4, help="probe sequences of the verification")
    parser.add_argument("--probe-len", type=int, default=16, help="tokens per probe; the second half is scored")
    parser.add_argument("--probe-every", type=int, default=SyncConfig.probe_every,
                        help="a run's syncs per probe (sync.probe_every)")
    parser.add_argument("--no-coverage", action="store_true", help="skip the coverage of each rollout layout")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    spec = BENCH_MODELS[args.model]
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(f"{tmp}/bench{args.model}", spec, seed=0))
        actor, rollout = start_models(model_dir)
        try:
            state = actor.state_dict().get()
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            params = sum(t.numel() for t in state.values())
            del state
            probe, lens = probe_sequences(args.probes, spec.vocab_size, args.probe_len)
            version = 1
            for i in range(args.repeats + 1):
                t, reports = one_round(actor, rollout, version, args.bucket_mb, probe, lens)
                version += len(reports)
                assert all(r.bytes == nbytes for r in reports)
                assert reports[-1].max_abs_logprob_diff <= SyncConfig.tolerance
                if i:  # the first round warms up
                    for k, v in t.items():
                        times.setdefault(k, []).append(v)
            rollout, held = None, rollout
            held.shutdown()  # the layouts' rollouts take its place
            covered = {} if args.no_coverage else coverage(actor, model_dir, version)
        finally:
            actor.shutdown()
            if rollout is not None:
                rollout.shutdown()
    report(times, nbytes, params, reports, args, covered)


if __name__ == "__main__":
    main()
