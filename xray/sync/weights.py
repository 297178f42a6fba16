"""Weight sync actor -> rollout, and its verification. Called by the algorithm after each update.

The actor's exporting shard streams full Hugging Face tensors in bounded buckets to every rollout
replica (`TrainWorkhorse.push_weights`), which loads them in place and takes the new weight
version. `sync.transport` picks the way: through the object store (below), through the exporting
shard's own shared-memory slots (`xray/sync/shm.py`: one node, CPU), through its GPU buffers by
CUDA IPC (`xray/sync/ipc.py`: the rollout on the actor's own GPU), over a process group of the
exporting shard and the rollout shards (`xray/sync/group.py`: gloo on CPU, NCCL on GPU), or
`auto`: the slots when every rollout shard shares the exporting shard's node on CPU (the object
store if /dev/shm has no room), CUDA IPC when every one shares its GPU (the object store when
only some do), else the group. A staged sync (`stage` / `deliver`, asynchronous runs) always goes through the object
store, which holds the version until every replica has taken it. A bucket travels in its wire form (`pack_bucket`): each tensor
as a flat NumPy byte view, which Ray moves out of band, so putting a bucket costs one copy into
the object store and reading it on the same node costs none (a pickled torch tensor is copied
in band on both sides, several times slower).

Verification, unless the config turns it off (`sync.verify`), has three parts:
- complete (`xray/sync/manifest.py`): the sender's manifest of every tensor against what each
  replica loaded, what its engine needs and takes, and what it never reloaded;
- exact: each tensor travels with an order-sensitive checksum of its bytes (`checksum`),
  recomputed on arrival (a tensor changed, reordered or shifted in transit), and each engine
  checks every tensor it holds against what it was sent, in its own dtype
  (`xray/backends/held.py`): bit for bit where it can be read back, else by its own layer's
  product on a seeded input; any difference, and any tensor left unchecked, fails the sync;
- end to end: a few probe sequences are scored by both sides, concurrently, the actor's per-token
  log-probabilities against the engine's own, within `sync.tolerance` when both sides are fp32
  and `sync.bf16_tolerance` when either is bf16 (two bf16 implementations of one model differ by
  far more than a missed update: there the exact part carries the proof). A run probes at its
  first sync, every `sync.probe_every` and its last; the next step's own rollout log-probs check
  the others before it trains (`algorithms/ppo/trainer.py`).
With a quantized rollout (`rollout.quantization`), the exact part compares the engine's fp8 codes
and scales with our own quantization of the tensors it received (`xray/backends/quantize.py`),
code for code; the probe is kept as a loose sanity bound only (`QUANTIZED_PROBE_FACTOR` x
`sync.bf16_tolerance`): quantized log-probs differ from the actor's by design, by more than any
missed update moves them, so the probe cannot verify the weights; it still catches NaN (an int8
engine reloaded in place gives NaN without an error) and a model that computes garbage.
A failure raises `WeightSyncError` naming the version and what differs: a wrong sync never
drifts silently. `sync_weights` is a coroutine: a run awaits it on its one event loop (a script:
`asyncio.run(sync_weights(...))`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from xray.backends.base import WeightBucket
from xray.config.schema import SyncConfig
from xray.data import columns as C
from xray.data.batch import Batch

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The rollout engine does not agree with the actor after a sync."""


def check_exact(version: int, replicas: list[dict], manifest=None, adapter: bool = False) -> dict:
    """Judge the checks the rollout replicas report (`RolloutWorkhorse.finish_sync`): first
    completeness against the sender's `manifest` (`xray/sync/manifest.py`), then a tensor changed
    in transit, held otherwise than sent (a quantized layer: otherwise than our quantization of
    what was sent) or left unchecked raises WeightSyncError. Returns the totals: tensors checked
    exactly and functionally, the dtypes the replicas hold, and whether any is quantized."""
    from xray.sync.manifest import check_complete

    check_complete(version, manifest, replicas, adapter)
    transit = sorted({n for r in replicas for n in r.get("changed_in_transit", [])})
    held = sorted({n for r in replicas for n in r.get("held", {}).get("mismatched", [])})
    if transit or held:
        what = (f"{len(transit)} tensor(s) changed in transit ({', '.join(transit[:3])})" if transit else
                f"the engine holds {len(held)} tensor(s) otherwise than sent ({'; '.join(held[:3])})")
        raise WeightSyncError(f"weight sync to version {version} failed verification: {what}. A tensor was "
                              "lost or changed in transit, or the two sides map names differently")
    unchecked = sum(r.get("held", {}).get("unchecked", 0) for r in replicas)
    if unchecked:
        raise WeightSyncError(f"weight sync to version {version}: {unchecked} engine tensor(s) could be neither "
                              "read back nor checked functionally; this engine's layout is not known to the "
                              "held check (xray/backends/held.py): teach it the layout")
    return {"exact": sum(r.get("held", {}).get("exact", 0) for r in replicas),
            "functional": sum(r.get("held", {}).get("functional", 0) for r in replicas),
            "dtypes": sorted({r["dtype"] for r in replicas if "dtype" in r}),
            "quantized": any(r.get("quantization", "none") != "none" for r in replicas)}


QUANTIZED_PROBE_FACTOR = 4.0
"""A quantized rollout's probe bound, in units of `sync.bf16_tolerance` (2 nats by default): fp8
log-probs differ from the actor's by design, on average by 0.04-0.05 nat against fp32 at 27M
(FACTS.md), and on a sampled token by up to 0.57 nat already on the tiny test model (mean 0.017),
so the bound only catches NaN or a model computing garbage, never a wrong weight."""


def probe_tolerance(cfg: SyncConfig, dtypes: list[str], quantized: bool = False) -> float:
    """The probe's tolerance: `cfg.tolerance` when every side is fp32, else `cfg.bf16_tolerance`,
    and `QUANTIZED_PROBE_FACTOR` times that when the rollout is quantized."""
    if quantized:
        return QUANTIZED_PROBE_FACTOR * cfg.bf16_tolerance
    return cfg.tolerance if set(dtypes) <= {"float32"} else cfg.bf16_tolerance


@dataclass(frozen=True)
class SyncReport:
    """What one sync cost and how well the two sides agree."""

    version: int
    bytes: int
    sync_s: float
    verify_s: float
    max_abs_logprob_diff: float
    """NaN when verification is off."""
    held_exact: int = 0
    """Engine tensors (over all replicas) found equal, bit for bit, to what was sent."""
    held_functional: int = 0
    """Engine layers that cannot be read back (vLLM on CPU: its linear layers) whose product with a
    seeded input matched the one computed from what was sent (`xray/backends/held.py`)."""
    unchecked: int = 0
    """Engine tensors left unchecked: always 0 in a verified sync (any fails it)."""
    transport: str = "objstore"
    """How the bytes travelled: "objstore", "shm", "ipc" or "pg" (`sync.transport`)."""


# One tensor on the wire: (Hugging Face name, torch dtype name, shape, its bytes as a flat uint8
# array, the checksum of those bytes).
WireTensor = tuple[str, str, tuple[int, ...], "numpy.ndarray", int]


def bytes_tensor(data) -> torch.Tensor:
    """A uint8 tensor viewing a NumPy byte array (read-only memory: never write into it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def checksum(data) -> int:
    """An order-sensitive checksum of a byte array (NumPy, or a torch uint8 tensor on any device).

    In host memory: XXH3-64 of the bytes (a real hash: two rows swapped, bytes shifted by an
    offset, any change of order or value changes it), at memory speed, as fast as a plain sum of
    64-bit words (6.4 ms against 6.2 ms for 108 MB on the developers' CPU). In GPU memory (the
    CUDA IPC and NCCL transports, whose two ends both hold the bytes on a GPU): a position-weighted
    sum computed there, `position_weighted`."""
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return position_weighted(data)
    import xxhash

    array = data.numpy() if isinstance(data, torch.Tensor) else data
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


CHECKSUM_BLOCK = 512
"""Words per block of `position_weighted`."""


def position_weighted(data: torch.Tensor) -> int:
    """A checksum of a uint8 tensor that sees order, computed where the tensor lives: its bytes as
    64-bit words w_i (the last < 8 bytes and the words past the last whole block of
    `CHECKSUM_BLOCK` on their own), sum(w_i) + K x sum((i + 1) w_i) modulo 2^64 (K odd), the
    weighted sum taken as block sums weighted by block and column sums weighted by column. Two
    words swapped change it unless they hold the same value."""
    whole = data.numel() // 8 * 8
    head = data[:whole] if data.storage_offset() % 8 == 0 else data[:whole].clone()
    words = head.view(torch.int64)
    blocks = words.numel() // CHECKSUM_BLOCK
    grid = words[:blocks * CHECKSUM_BLOCK].view(blocks, CHECKSUM_BLOCK)
    rows, cols = grid.sum(1), grid.sum(0)
    rest = words[blocks * CHECKSUM_BLOCK:]
    at = lambda n, start: torch.arange(start, start + n, device=data.device, dtype=torch.int64)  # noqa: E731
    weighted = (CHECKSUM_BLOCK * (rows * at(blocks, 0)).sum() + (cols * at(CHECKSUM_BLOCK, 1)).sum()
                + (rest * at(rest.numel(), blocks * CHECKSUM_BLOCK + 1)).sum())
    plain = words.sum() + data[whole:].to(torch.int64).sum()
    return (int(plain) + 0x9E3779B97F4A7C15 * int(weighted)) % 2**64


def pack_bucket(bucket: WeightBucket, checksums: bool = True) -> list[WireTensor]:
    """The wire form of a bucket: byte views of the tensors (no copy for contiguous CPU tensors),
    each with its checksum (None without `checksums`: an unverified sync, `sync.verify: false`,
    whose receiver then checks nothing, `verified`)."""
    wire = []
    for name, tensor in bucket:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        wire.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data,
                     checksum(data) if checksums else None))
    return wire


def verified(layout: list) -> bool:
    """Whether a bucket's wire form or layout carries checksums (the last field of each entry):
    the receiver checks it (checksums, what the engine holds) only then."""
    return all(entry[-1] is not None for entry in layout)


def unpack_bucket(wire: list[WireTensor]) -> WeightBucket:
    """Tensors viewing the wire's bytes (read-only object-store memory on the receiving side:
    load them by copying, never write into them)."""
    return [(name, bytes_tensor(data).view(getattr(torch, dtype)).view(shape))
            for name, dtype, shape, data, _ in wire]


def changed_in_transit(wire: list[WireTensor]) -> list[str]:
    """Names of the tensors whose bytes no longer match their checksum."""
    return [name for name, _, _, data, sent in wire if sent is not None and checksum(data) != sent]


def random_probe(model_dir: str | None, actor_dp: int, rollout_dp: int, seed: int, length: int = 16,
                 prompt_len: int = 4) -> tuple[list[list[int]], list[int]]:
    """Seeded random token sequences for verifying a sync: at least 4, a multiple of both dp sizes,
    token ids drawn from the model's vocabulary (`config.json` in `model_dir`)."""
    import json
    import math
    from pathlib import Path

    if model_dir is None:
        raise ValueError("the model's directory is unknown (not built by from_pretrained): pass probe sequences "
                         "to xray.sync.sync_weights yourself")
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    k = actor_dp * rollout_dp // math.gcd(actor_dp, rollout_dp)
    count = k * max(1, math.ceil(4 / k))
    g = torch.Generator().manual_seed(seed)
    probe = torch.randint(0, vocab, (count, length), generator=g).tolist()
    return probe, [prompt_len] * count


def pad_sequences(sequences: list[list[int]], pad_id: int = 0) -> Batch:
    """Right-padded INPUT_IDS / ATTENTION_MASK for token-id lists."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: mask})


def compare_logprobs(actor_logp: torch.Tensor, engine_logp: list[list[float]], prompt_lens: list[int],
                     lengths: list[int]) -> tuple[float, tuple[int, int]]:
    """Max |actor - engine| over response tokens, and its (row, token position)."""
    worst, where = 0.0, (-1, -1)
    for row, (p, n, theirs) in enumerate(zip(prompt_lens, lengths, engine_logp)):
        ours = actor_logp[row, p - 1:n - 1]  # position t-1 predicts token t
        if len(theirs) != len(ours):
            raise WeightSyncError(f"row {row}: the engine scored {len(theirs)} tokens, the actor {len(ours)}")
        diff = (ours - torch.tensor(theirs, dtype=ours.dtype)).abs()
        if diff.numel() and float(diff.max()) > worst:
            worst, where = float(diff.max()), (row, p + int(diff.argmax()))
    return worst, where


def check_logprobs(actor_logp: torch.Tensor, engine_logp: list[list[float]], probe: list[list[int]],
                   prompt_lens: list[int], version: int, tolerance: float) -> float:
    """The worst |actor - engine| log-prob over the probe; WeightSyncError above `tolerance`."""
    worst, (row, pos) = compare_logprobs(actor_logp, engine_logp, prompt_lens, [len(s) for s in probe])
    if not worst <= tolerance:  # also catches NaN
        ours = float(actor_logp[row, pos - 1]) if row >= 0 else float("nan")
        raise WeightSyncError(
            f"weight sync to version {version} failed verification: the rollout engine's log-probs differ "
            f"from the actor's by {worst:.3e} (tolerance {tolerance:g}) at probe row {row}, token position "
            f"{pos}, where the actor's log-prob is {ours:.4g}. A tensor was lost or changed in transit, or the "
            "two sides map names differently")
    return worst


LANDED_DEADLINE_S = 1800.0
"""How long a sync waits for the rollout replicas to load what the actor sent (the push's own
deadline): a replica that never answers fails the sync instead of hanging the run."""


async def landed(pushed: dict, version: int) -> list[dict]:
    """The rollout replicas' `finish_sync` reports of a push (`TrainWorkhorse.push_weights` answers
    once the last bucket is sent; the replicas may still be loading). A load that failed raises."""
    from ray.exceptions import ActorDiedError, ObjectLostError, OwnerDiedError

    from xray.wholemodel.errors import ShardFailure, WorkhorseDied

    try:
        await asyncio.wait_for(asyncio.gather(*pushed["loads"]), LANDED_DEADLINE_S)
        return list(await asyncio.wait_for(asyncio.gather(*pushed["finishes"]), LANDED_DEADLINE_S))
    except asyncio.TimeoutError:
        raise WeightSyncError(f"weight sync to version {version}: the rollout replicas did not finish loading "
                              f"within {LANDED_DEADLINE_S:.0f} s; see their logs (xray.report) for the stuck "
                              "replica") from None
    except (ActorDiedError, OwnerDiedError, ObjectLostError) as exc:  # the sender (their owner) or a replica died
        failure = ShardFailure(0, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", str(exc))
        raise WorkhorseDied("rollout", "sync", [failure], len(pushed["loads"]) or 1) from exc


async def sync_weights(actor, rollout, version: int, cfg: SyncConfig, probe: list[list[int]] | None = None,
                       prompt_lens: list[int] | None = None, corrupt: str | None = None,
                       replica: int = 0, overlap: bool = True, actor_probe=None) -> SyncReport:
    """Push the actor's weights (exported from its data-parallel `replica`) to every rollout
    replica at `version`, then verify (cfg.verify): the complete and exact parts always, the
    log-prob probe when `probe` sequences are given (a run gives them at its first sync, every
    `sync.probe_every` and its last: the next step's rollout log-probs check the others, before
    that step trains on them, `algorithms/ppo/trainer.py`); `max_abs_logprob_diff` is NaN without.

    With `overlap`, everything is queued at once: the actor's probe forward runs on the actor as
    soon as its last bucket is sent, while the rollout replicas still load, and the engine's probe
    is queued (Ray waits, not the caller) behind the replicas' `finish_sync`, so only the engine's
    side of the probe adds to the sync's time. Without it (actor and rollout on the same devices,
    where running both at once only makes them take turns, and on a CPU oversubscribes its cores),
    the actor's probe runs first, then the push and the engine's probe (both queued on the actor at
    once: it runs them in order, with no round trip to the caller between them). `actor_probe`:
    that forward over `probe` (a Pending), already queued by the caller right behind the actor's
    last update (`PPOTrainer.train`), so the actor runs it while the caller still reads the
    update's answers."""
    probing = cfg.verify and bool(probe)
    t0 = time.perf_counter()
    actor_out, first_s = None, 0.0
    if probing and not overlap:
        actor_call = actor.forward(pad_sequences(probe)) if actor_probe is None else actor_probe
    push = actor.push_weights(rollout.shard_handles(), version, cfg.bucket_mb << 20, corrupt, replica, cfg.transport,
                              cfg.verify)
    if probing and overlap:
        actor_call = actor.forward(pad_sequences(probe))
    if probing and not overlap:
        actor_out = await actor_call
        first_s = time.perf_counter() - t0
    pushed = await push
    if probing:
        engine_call = rollout.call("logprobs", probe, prompt_lens, after=tuple(pushed["finishes"]))
    reports = await landed(pushed, version)
    sync_s = time.perf_counter() - t0 - first_s
    diff, verify_s = float("nan"), 0.0
    if cfg.verify:
        exact = check_exact(version, reports, pushed.get("manifest"), pushed.get("adapter", False))
    if probing:
        if overlap:
            actor_out, engine_logp = await asyncio.gather(actor_call, engine_call)
        else:
            engine_logp = await engine_call
        tolerance = probe_tolerance(cfg, exact["dtypes"] + [pushed["dtype"]], exact["quantized"])
        diff = check_logprobs(actor_out[C.LOGPROBS], engine_logp, probe, prompt_lens, version, tolerance)
    verify_s = time.perf_counter() - t0 - sync_s if cfg.verify else 0.0
    log.debug("weight sync v%d: %.1f MB in %.2f s, verify %.2f s (max diff %.2e)", version,
              pushed["bytes"] / 1e6, sync_s, verify_s, diff)
    held = (exact["exact"], exact["functional"]) if cfg.verify else (0, 0)
    return SyncReport(version, pushed["bytes"], sync_s, verify_s, diff, *held, 0, pushed["transport"])


@dataclass
class Staged:
    """A weight version exported into the object store (`stage`), with the actor's probe log-probs
    at that instant, waiting to be delivered to rollout replicas (`deliver`)."""

    version: int
    export: object
    """Pending answer of `stage_weights`: {"buckets": [ref, ...], "bytes": n, "dtype": name}."""
    actor_probe: object | None
    """Pending actor forward over the probe (None when verification is off or this version runs
    no probe: `deliver` then checks it completely and exactly only)."""
    probe: list[list[int]] | None
    prompt_lens: list[int] | None
    started: float


def stage(actor, version: int, cfg: SyncConfig, probe: list[list[int]] | None = None,
          prompt_lens: list[int] | None = None, replica: int = 0) -> Staged:
    """Queue, on the actor, the export of its current weights (from data-parallel `replica`) into
    the object store and the probe forward that will verify them, and return at once. Whatever
    the caller queues on the actor afterwards (the next training step) runs after both, so they
    see exactly this version, while the rollout replicas take it whenever they are free."""
    export = actor.stage_weights(cfg.bucket_mb << 20, replica)
    actor_probe = actor.forward(pad_sequences(probe)) if cfg.verify and probe else None
    return Staged(version, export, actor_probe, probe, prompt_lens, time.perf_counter())


async def on_every_shard(role: str, method: str, refs: list) -> list:
    """The answers of direct calls on a model's shards (one ref per rank); a failure raises what a
    call through the WholeModel raises (`WorkhorseDied` when a process is gone), so that a run's
    recovery sees a rollout Workhorse lost during a sync as it sees one lost anywhere else."""
    from xray.wholemodel.errors import WholeModelError, WorkhorseDied
    from xray.wholemodel.pending import shard_failure

    answers = await asyncio.gather(*refs, return_exceptions=True)
    failed = [shard_failure(role, rank, a) for rank, a in enumerate(answers) if isinstance(a, BaseException)]
    if not failed:
        return list(answers)
    error = WorkhorseDied if any(died for _, died in failed) else WholeModelError
    raise error(role, method, [failure for failure, _ in failed], len(refs))


async def deliver(staged: Staged, rollout, cfg: SyncConfig) -> SyncReport:
    """Load a staged version into every replica of `rollout`, then verify it as `sync_weights`
    does (complete and exact; the engine's probe log-probs against the actor's of the same
    instant where the version was staged with a probe)."""
    t0 = time.perf_counter()
    export = await staged.export
    targets = rollout.shard_handles()
    for t in targets:  # ahead of the loads (this caller's calls run in order): a sync left unfinished
        t.abort_sync.remote()  # (a delivery cancelled between its loads and finish_sync) is forgotten
    for ref in export["buckets"]:  # in order; each target loads one bucket after the other
        await on_every_shard(rollout.role, "load_bucket", [t.load_bucket.remote(ref) for t in targets])
    replicas = await on_every_shard(rollout.role, "finish_sync",
                                    [t.finish_sync.remote(staged.version) for t in targets])
    sync_s = time.perf_counter() - t0
    diff, verify_s = float("nan"), 0.0
    if cfg.verify:
        exact = check_exact(staged.version, list(replicas), export.get("manifest"))
    if cfg.verify and staged.actor_probe is not None:
        engine_logp = await rollout.call("logprobs", staged.probe, staged.prompt_lens)
        actor_out = await staged.actor_probe
        diff = check_logprobs(actor_out[C.LOGPROBS], engine_logp, staged.probe, staged.prompt_lens,
                              staged.version, probe_tolerance(cfg, exact["dtypes"] + [export["dtype"]],
                                                              exact["quantized"]))
        verify_s = time.perf_counter() - t0 - sync_s
    log.debug("weight sync v%d (staged): %.1f MB in %.2f s, verify %.2f s (max diff %.2e)", staged.version,
              export["bytes"] / 1e6, sync_s, verify_s, diff)
    held = (exact["exact"], exact["functional"]) if cfg.verify else (0, 0)
    return SyncReport(staged.version, export["bytes"], sync_s, verify_s, diff, *held)
