"""The step's sync and its verification policy, the same for every RL algorithm: when a sync runs
the separate log-prob probe, which sequences it probes, the end-to-end check of the last sync on
each step's own samples (before the batch is trained on), and bringing the rollout back to the
actor's weights after a resume. `RLTrainer` (`xray/run/step.py`) mixes it in; the asynchronous
trainer (`xray/run/detached/trainer.py`) uses the same policy for its pushes. How bytes travel and
how the engine's copy is checked are `xray/sync`'s.
"""
from __future__ import annotations

import asyncio
import math

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.sync import WeightSyncError, sync_weights
from xray.sync.end_to_end import GapBound, rollout_gap
from xray.sync.weights import pad_sequences, probe_bound


class SyncVerification:
    """The verification policy of a trainer with `cfg`, `models`, `state`, `policy_loss`,
    `overlap_sync`, `sampling()` and `wake_rollout()`."""

    synced: bool = False
    """Whether this process has synced the rollout once (its first sync probes)."""
    queued_probe = None
    """Without `overlap_sync`: (probe sequences, the actor's forward over them), queued by
    `train` right behind the step's last update; the next `sync` takes it if its probe is the
    same (a step that failed between the two leaves a stale one, which is dropped)."""

    @staticmethod
    def gap(old: torch.Tensor, exp: Batch, mask: torch.Tensor) -> dict[str, float]:
        """`rollout_logprob_gap_mean` / `_max` (`rollout_gap`) when the rollout gave its log-probs."""
        return rollout_gap(old, exp[C.BEHAVIOUR_LOGPROBS], mask) if C.BEHAVIOUR_LOGPROBS in exp else {}

    def check_end_to_end(self, old: torch.Tensor, exp: Batch, mask: torch.Tensor) -> dict[str, float]:
        """The end-to-end check of the last sync, for free: the rollout's log-probs of this step's
        samples against the actor's recomputation of the same tokens (`old`, same weights in a
        synchronous run), per token, within the probe's bound for the dtypes (`probe_bound`: the
        largest gap in fp32, the mean in bf16), before the batch is trained on: a bad sync fails the
        run before it does harm. The gap metrics; WeightSyncError beyond the bound."""
        gap = self.gap(old, exp, mask)
        if gap and self.cfg.sync.verify and not self.end_to_end_bound().holds(gap):  # or NaN
            self.end_to_end_failed(gap)
        return gap

    def end_to_end_bound(self) -> GapBound:
        """The end-to-end check's bound on |rollout - actor| log-probs: the probe's for the dtypes."""
        dtypes = [self.cfg.model.dtype, self.cfg.rollout.dtype or self.cfg.model.dtype]
        return probe_bound(self.cfg.sync, dtypes, self.cfg.rollout.quantization != "none")

    def end_to_end_failed(self, gap: dict[str, float]) -> None:
        raise WeightSyncError(
            f"weight version {self.state.step} failed the end-to-end check: the rollout's log-probs of this "
            f"step's samples differ from the actor's by {gap['rollout_logprob_gap_mean']:.3e} on average and up "
            f"to {gap['rollout_logprob_gap_max']:.3e} (bound: {self.end_to_end_bound()}); the engine computes "
            "otherwise than the actor (a wrong name mapping, or a tensor the exact checks cannot see). The batch "
            "was not trained on")

    @property
    def checks_end_to_end(self) -> bool:
        """Whether each step checks the last sync end to end: it recomputes the actor's log-probs
        of its samples (`check_end_to_end`), or its policy loss compares the training forward's
        (`PolicyLoss.end_to_end_bound`); a trainer that does neither probes at every sync."""
        loss = self.policy_loss
        return not getattr(loss, "on_policy", False) or getattr(loss, "end_to_end_bound", None) is not None

    def probes_at(self, version: int) -> bool:
        """Whether the sync to `version` runs the separate log-prob probe: the first sync of this
        process, every `sync.probe_every`, the run's last, and every sync where no step checks
        end to end."""
        every = self.probe_interval()
        return (not self.synced or not self.checks_end_to_end or version % every == 0
                or version >= self.cfg.trainer.steps)

    def probe_interval(self) -> int:
        """`sync.probe_every`, checked: ValueError below 1."""
        every = self.cfg.sync.probe_every
        if every < 1:
            raise ValueError(f"sync.probe_every={every}; give 1 (probe every sync) or more")
        return every

    def probe_size(self) -> int:
        """Probe sequences per sync: at least 4, divisible by the actor's and rollout's dp. A vLLM
        engine serving a LoRA adapter scores one sequence per call (batched prompt log-probs break
        there, FACTS.md: ~50 ms a call on CPU), so an adapter sync probes with one sequence per
        replica; its exact check already compares every adapter tensor bit for bit."""
        a, r = self.models.actor.parallel.dp, self.models.rollout.parallel.dp
        k = a * r // math.gcd(a, r)
        plan = self.models.plan
        least = 1 if plan is not None and plan.lora_sync == "adapters" else 4
        return k * max(1, math.ceil(least / k))

    def probe(self, exp: Batch) -> tuple[list[list[int]], list[int]]:
        """A few of this step's sequences, for verifying the sync."""
        k = self.probe_size()
        if len(exp) < k:
            raise ValueError(f"a step of {len(exp)} samples is too small to verify a sync with {k} probes; "
                             "raise ppo.rollout_batch_size")
        prompts, responses = exp[C.PROMPT_IDS][:k], exp[C.RESPONSE_IDS][:k]
        return [p + r_ for p, r_ in zip(prompts, responses)], [len(p) for p in prompts]

    def early_probe(self, exp: Batch) -> list[list[int]] | None:
        """The probe sequences `train` queues on the actor behind its last update when a sync
        verifies without overlap (actor and rollout share devices), else None."""
        probing = self.cfg.sync.verify and not self.overlap_sync
        return self.probe(exp)[0] if probing and self.probes_at(self.state.step + 1) else None

    def queue_probe(self, probe: list[list[int]] | None) -> None:
        """Queue the actor's forward over `probe` behind the updates queued so far (`early_probe`)."""
        if probe is not None:
            self.queued_probe = (probe, self.models.actor.forward(pad_sequences(probe)))

    async def sync(self, exp: Batch, version: int, probe: bool | None = None):
        """Sync the actor's weights to the rollout at `version`, the probe where `probes_at` says."""
        probing = self.probes_at(version) if probe is None else probe
        if not self.synced and self.cfg.sync.verify and self.adapter_sync():
            await self.check_base()
        self.synced = True
        if not probing:
            self.queued_probe = None
            return await sync_weights(self.models.actor, self.models.rollout, version, self.cfg.sync,
                                      overlap=self.overlap_sync)
        sequences, prompt_lens = self.probe(exp)
        queued, self.queued_probe = self.queued_probe, None
        actor_probe = queued[1] if queued is not None and queued[0] == sequences else None  # else stale
        return await sync_weights(self.models.actor, self.models.rollout, version, self.cfg.sync,
                                  sequences, prompt_lens, overlap=self.overlap_sync, actor_probe=actor_probe)

    def adapter_sync(self) -> bool:
        """Whether the syncs send the actor's LoRA adapter alone (the rollout keeps its base weights)."""
        plan = self.models.plan
        return plan is not None and plan.lora_sync == "adapters"

    async def check_base(self) -> None:
        """Before the first adapter sync: the rollout's base model must be the actor's (the sync
        never sends it): the fingerprints of the weights each shard started from
        (`xray/backends/base_fingerprint.py`) must agree; WeightSyncError otherwise."""
        actor, rollout = self.models.actor, self.models.rollout
        ours, theirs = await asyncio.gather(actor.base_fingerprint(), rollout.base_fingerprint())
        if None in {*ours, *theirs}:
            return  # weights in another format than safetensors: nothing to compare
        if len(set(ours)) > 1 or set(theirs) != set(ours):
            raise WeightSyncError(
                f"the rollout's base model is not the actor's (weights fingerprint {sorted(set(theirs))} against "
                f"{sorted(set(ours))}): a LoRA run syncs the adapter alone, so the rollout must start from the "
                "actor's base weights: start both from the same directory (model.path, and no actor.model_path "
                "of its own)")

    async def resync(self, rows: list[dict], version: int):
        """Bring the rollout engine to the actor's weights outside a step (after a resume)."""
        rows, self.queued_probe = rows[:self.probe_size()], None  # from a step that did not finish
        await self.wake_rollout()
        gen = await self.models.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(0, greedy=True))
        return await self.sync(gen, version, probe=True)
