"""Weight sync actor -> rollout, and its verification. Called by the algorithm after each update.

The actor's exporting shard streams full Hugging Face tensors in bounded buckets to every rollout
replica (`TrainWorkhorse.push_weights`), which loads them in place and takes the new weight
version. `sync.transport` picks the way, each a file of `xray/transport` holding its sender and
receiver (this package is the driver's verified sync only): through the object store in the
buckets' wire form (`xray/transport/wire.py`), through the exporting shard's own shared-memory
slots (`xray/transport/shm.py`: one node, CPU), through its GPU buffers by CUDA IPC
(`xray/transport/ipc.py`: the rollout on the actor's own GPU), over a process group of the
exporting shard and the rollout shards (`xray/transport/pg.py`: gloo on CPU, NCCL on GPU), or
`auto`: the slots when every rollout shard shares the exporting shard's node on CPU (the object
store if /dev/shm has no room), CUDA IPC when every one shares its GPU (the object store when
only some do), else the group. A staged sync (`stage` / `deliver`, asynchronous runs) always goes
through the object store, which holds the version until every replica has taken it. Through the
object store and the slots a bucket travels in its wire form (`xray.transport.wire.pack_bucket`):
each tensor as a flat NumPy byte view, which Ray moves out of band, so putting a bucket costs one
copy into the object store and reading it on the same node costs none (a pickled torch tensor is
copied in band on both sides, several times slower). By CUDA IPC and over the group it travels in
its flat form, one buffer on the sender's device (`xray.transport.wire.pack_into`): on a GPU the
bytes never pass through host memory.

Verification, unless the config turns it off (`sync.verify`), has three parts, after the actor's
own check of its export (`xray/sync/export_check.py`: each tensor it gathered against the digests
of the shards it was made from, and its data-parallel replicas against each other):
- complete (`xray/sync/manifest.py`): the sender's manifest of every tensor against what each
  replica loaded, what its engine needs and takes, and what it never reloaded; and each tensor's
  dtype, shape and byte count as it arrived against the manifest's;
- exact: each tensor travels with an order-sensitive checksum of its bytes in the family its
  transport names for where the bytes lie ("xxh3" in host memory, "pw64" on a GPU:
  `xray.transport.wire`), named by the sender and recomputed on arrival in that family (a
  tensor changed, reordered or shifted in transit; a family other than the transport's raises),
  and each engine checks every tensor it holds against what it was sent, in its own dtype
  (`xray/backends/held.py`): bit for bit where it can be read back, else by its own layer's
  product on a seeded input; any difference, and any tensor left unchecked, fails the sync, and
  so does a check that does not give exactly one verdict to each tensor the sync wrote
  (`xray/sync/coverage.py`: per replica, exact + functional + unchecked = the tensors it holds,
  measured; `SyncReport` carries them, None when verification is off);
- end to end: a few probe sequences are scored by both sides, concurrently, the actor's per-token
  log-probabilities against the engine's own: the largest gap within `sync.tolerance` when both
  sides are fp32, the mean gap within `sync.bf16_mean_tolerance` when either is bf16 (two bf16
  implementations of one model differ on a rare token by far more than a missed update, but
  not on average: `xray/sync/end_to_end.py`; the exact part carries the proof of each tensor).
  A run probes at its first sync, every `sync.probe_every` and its last; the next step's own
  rollout log-probs check the others before it trains (`xray/run/step.py`).
With a quantized rollout (`rollout.quantization`), the exact part compares the engine's fp8 codes
and scales with our own quantization of the tensors it received (`xray/backends/quantize.py`),
code for code; the probe is kept as a loose sanity bound only (`QUANTIZED_PROBE_FACTOR` x
`sync.bf16_mean_tolerance` on the mean gap): quantized log-probs differ from the actor's by design, by more than any
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
from dataclasses import dataclass

import torch

from xray.config.schema import SyncConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.sync.coverage import check_coverage
from xray.sync.end_to_end import GapBound
from xray.sync.export_check import check_export
from xray.sync.manifest import check_complete, check_received
from xray.transport.errors import WeightSyncError

log = logging.getLogger(__name__)


def check_exact(version: int, replicas: list[dict], manifest=None, adapter: bool = False) -> dict:
    """Judge the checks the rollout replicas report (`RolloutWorkhorse.finish_sync`): first
    completeness against the sender's `manifest` and each tensor's dtype, shape and byte count as
    received against it (`xray/sync/manifest.py`), then a tensor changed in transit, held
    otherwise than sent (a quantized layer: otherwise than our quantization of what was sent) or
    left unchecked, then a held check that does not cover exactly what each engine holds of the
    sync (`xray/sync/coverage.py`) raises WeightSyncError. Returns the totals, measured: tensors
    checked exactly and functionally, left unchecked, held (written by the sync), the dtypes the
    replicas hold, and whether any is quantized."""
    check_complete(version, manifest, replicas, adapter)
    check_received(version, manifest, replicas)
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
    check_coverage(version, replicas)
    return {"exact": sum(r.get("held", {}).get("exact", 0) for r in replicas),
            "functional": sum(r.get("held", {}).get("functional", 0) for r in replicas),
            "unchecked": unchecked, "holds": sum(len(r.get("holds") or []) for r in replicas),
            "dtypes": sorted({r["dtype"] for r in replicas if "dtype" in r}),
            "quantized": any(r.get("quantization", "none") != "none" for r in replicas)}


QUANTIZED_PROBE_FACTOR = 4.0
"""A quantized rollout's bound on the mean gap, in units of `sync.bf16_mean_tolerance` (0.6 nat by
default): fp8 log-probs differ from the actor's by design, on average by 0.04-0.05 nat against
fp32 at 27M (FACTS.md) and 0.017 on the tiny test model (0.57 on its worst token), so the bound
only catches NaN or a model computing garbage, never a wrong weight."""


def probe_bound(cfg: SyncConfig, dtypes: list[str], quantized: bool = False) -> GapBound:
    """The end-to-end bound for these dtypes: the largest gap within `cfg.tolerance` when every side
    is fp32, else the mean gap within `cfg.bf16_mean_tolerance` (`QUANTIZED_PROBE_FACTOR` times
    that when the rollout is quantized): `xray/sync/end_to_end.py` says why."""
    if quantized:
        return GapBound("mean", QUANTIZED_PROBE_FACTOR * cfg.bf16_mean_tolerance)
    if set(dtypes) <= {"float32"}:
        return GapBound("max", cfg.tolerance)
    return GapBound("mean", cfg.bf16_mean_tolerance)


@dataclass(frozen=True)
class SyncReport:
    """What one sync cost and how well the two sides agree."""

    version: int
    bytes: int
    sync_s: float
    verify_s: float
    max_abs_logprob_diff: float
    """The probe's largest |actor - engine| log-prob per token; NaN when the sync ran no probe."""
    held_exact: int | None = None
    """Engine tensors (over all replicas) found equal, bit for bit, to what was sent; None (not
    measured) when verification is off, as every count below."""
    held_functional: int | None = None
    """Engine layers that cannot be read back (vLLM on CPU: its linear layers) whose product with a
    seeded input matched the one computed from what was sent (`xray/backends/held.py`)."""
    unchecked: int | None = None
    """Engine tensors the replicas' held checks counted as unchecked (any fails the sync, so a
    report holds 0: measured, summed over the replicas' reports)."""
    held_tensors: int | None = None
    """Engine tensors (over all replicas) the sync wrote: held_exact + held_functional + unchecked,
    enforced per replica (`xray/sync/coverage.py`)."""
    transport: str = "objstore"
    """How the bytes travelled: "objstore", "shm", "ipc" or "pg" (`sync.transport`)."""
    mean_abs_logprob_diff: float = float("nan")
    """The probe's mean |actor - engine| log-prob per token (bounded in bf16); NaN without a probe."""
    export_checked: int | None = None
    """Tensors the actor's export checked against its shards' digests before sending
    (`xray/sync/export_check.py`; a mismatch or a diverged replica fails the sync); None when not
    measured (verification off, an adapter-only sync)."""

    def counts(self) -> dict[str, float]:
        """The held counts as step metrics (`sync/held_exact`, `sync/held_functional`,
        `sync/unchecked`, and `sync/export_checked` where measured); empty when they were not
        measured (verification off): absent, not 0."""
        if self.unchecked is None:
            return {}
        out = {"sync/held_exact": float(self.held_exact), "sync/held_functional": float(self.held_functional),
               "sync/unchecked": float(self.unchecked)}
        return out if self.export_checked is None else {**out, "sync/export_checked": float(self.export_checked)}


def measured(exact: dict | None, export_checked: int | None = None) -> dict:
    """The SyncReport fields of `check_exact`'s totals and `check_export`'s count (none when the
    sync was not verified)."""
    if exact is None:
        return {}
    out = {"held_exact": exact["exact"], "held_functional": exact["functional"], "unchecked": exact["unchecked"],
           "held_tensors": exact["holds"]}
    return out if export_checked is None else {**out, "export_checked": export_checked}


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
                     lengths: list[int]) -> tuple[dict[str, float], tuple[int, int]]:
    """The `rollout_gap` of |actor - engine| over the response tokens (mean and max), and where the
    largest is (row, token position)."""
    largest, where, gaps = 0.0, (-1, -1), []
    for row, (p, n, theirs) in enumerate(zip(prompt_lens, lengths, engine_logp)):
        ours = actor_logp[row, p - 1:n - 1].to(torch.float32)  # position t-1 predicts token t
        if len(theirs) != len(ours):
            raise WeightSyncError(f"row {row}: the engine scored {len(theirs)} tokens, the actor {len(ours)}")
        diff = (ours - torch.tensor(theirs, dtype=torch.float32)).abs()
        gaps.append(diff)
        if diff.numel() and float(diff.max()) > largest:
            largest, where = float(diff.max()), (row, p + int(diff.argmax()))
    every = torch.cat(gaps) if gaps else torch.zeros(0)
    if not every.numel():
        return {"rollout_logprob_gap_mean": 0.0, "rollout_logprob_gap_max": 0.0}, where
    return {"rollout_logprob_gap_mean": float(every.mean()), "rollout_logprob_gap_max": float(every.max())}, where


def check_logprobs(actor_logp: torch.Tensor, engine_logp: list[list[float]], probe: list[list[int]],
                   prompt_lens: list[int], version: int, bound: GapBound) -> dict[str, float]:
    """The probe's gap (`rollout_gap`'s mean and max of |actor - engine| log-prob over its response
    tokens); WeightSyncError beyond `bound` (`probe_bound`)."""
    gap, (row, pos) = compare_logprobs(actor_logp, engine_logp, prompt_lens, [len(s) for s in probe])
    if not bound.holds(gap):  # also catches NaN
        ours = float(actor_logp[row, pos - 1]) if row >= 0 else float("nan")
        raise WeightSyncError(
            f"weight sync to version {version} failed verification: the rollout engine's log-probs differ "
            f"from the actor's by {gap['rollout_logprob_gap_mean']:.3e} on average and up to "
            f"{gap['rollout_logprob_gap_max']:.3e} (bound: {bound}), the largest at probe row {row}, token "
            f"position {pos}, where the actor's log-prob is {ours:.4g}. A tensor was lost or changed in transit, "
            "or the two sides map names differently")
    return gap


NO_PROBE = {"rollout_logprob_gap_mean": float("nan"), "rollout_logprob_gap_max": float("nan")}
"""The probe's gap of a sync that ran none."""

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
    that step trains on them, `xray/run/step.py`); `max_abs_logprob_diff` is NaN without.

    With `overlap`, everything is queued at once: the actor's probe forward runs on the actor as
    soon as its last bucket is sent, while the rollout replicas still load, and the engine's probe
    is queued (Ray waits, not the caller) behind the replicas' `finish_sync`, so only the engine's
    side of the probe adds to the sync's time. Without it (actor and rollout on the same devices,
    where running both at once only makes them take turns, and on a CPU oversubscribes its cores),
    the actor's probe runs first, then the push and the engine's probe (both queued on the actor at
    once: it runs them in order, with no round trip to the caller between them). `actor_probe`:
    that forward over `probe` (a Pending), already queued by the caller right behind the actor's
    last update (`RLTrainer.train`), so the actor runs it while the caller still reads the
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
    gap, verify_s, exact, exported = NO_PROBE, 0.0, None, None
    if cfg.verify:
        exported = check_export(version, pushed.get("export"))
        exact = check_exact(version, reports, pushed.get("manifest"), pushed.get("adapter", False))
    if probing:
        if overlap:
            actor_out, engine_logp = await asyncio.gather(actor_call, engine_call)
        else:
            engine_logp = await engine_call
        bound = probe_bound(cfg, exact["dtypes"] + [pushed["dtype"]], exact["quantized"])
        gap = check_logprobs(actor_out[C.LOGPROBS], engine_logp, probe, prompt_lens, version, bound)
    verify_s = time.perf_counter() - t0 - sync_s if cfg.verify else 0.0
    log.debug("weight sync v%d: %.1f MB in %.2f s, verify %.2f s (gap %s)", version,
              pushed["bytes"] / 1e6, sync_s, verify_s, gap)
    return SyncReport(version, pushed["bytes"], sync_s, verify_s, gap["rollout_logprob_gap_max"],
                      mean_abs_logprob_diff=gap["rollout_logprob_gap_mean"], transport=pushed["transport"],
                      **measured(exact, exported))


def sync_to(actor, rollout, verify: bool = True, tolerance: float = 1e-3, bucket_mb: int = 64) -> dict:
    """Push the weights of `actor` (a WholeModel) into `rollout` (a vllm or dsinfer WholeModel) in
    place, as the next weight version (`actor.pushed_version` + 1), and (with `verify`) check that
    both score a few random probe sequences alike within `tolerance`: `sync_weights` for notebooks
    and scripts, blocking. Returns the sync's figures (version, bytes, sync_s, verify_s,
    max_abs_logprob_diff); a failed check raises WeightSyncError."""
    import dataclasses

    from xray.wholemodel.handle import blocking

    actor.pushed_version += 1
    version = actor.pushed_version
    probe, prompt_lens = random_probe(actor.init_kwargs.get("model_dir"), actor.parallel.dp, rollout.parallel.dp,
                                      seed=version)
    cfg = SyncConfig(verify=verify, tolerance=tolerance, bucket_mb=bucket_mb)
    return dataclasses.asdict(blocking(sync_weights(actor, rollout, version, cfg, probe, prompt_lens)))


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
    gap, verify_s, exact, exported = NO_PROBE, 0.0, None, None
    if cfg.verify:
        exported = check_export(staged.version, export.get("export"))
        exact = check_exact(staged.version, list(replicas), export.get("manifest"))
    if cfg.verify and staged.actor_probe is not None:
        engine_logp = await rollout.call("logprobs", staged.probe, staged.prompt_lens)
        actor_out = await staged.actor_probe
        gap = check_logprobs(actor_out[C.LOGPROBS], engine_logp, staged.probe, staged.prompt_lens,
                             staged.version, probe_bound(cfg, exact["dtypes"] + [export["dtype"]], exact["quantized"]))
        verify_s = time.perf_counter() - t0 - sync_s
    log.debug("weight sync v%d (staged): %.1f MB in %.2f s, verify %.2f s (gap %s)", staged.version,
              export["bytes"] / 1e6, sync_s, verify_s, gap)
    return SyncReport(staged.version, export["bytes"], sync_s, verify_s, gap["rollout_logprob_gap_max"],
                      mean_abs_logprob_diff=gap["rollout_logprob_gap_mean"], **measured(exact, exported))
