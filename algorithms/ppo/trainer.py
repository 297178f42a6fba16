"""trlX-style PPO over WholeModels: the step, evaluation, and the state a resume needs.

One step, as on paper:
  1. rollout: the rollout engine samples responses for a batch of prompts;
  2. score, concurrently: actor log-probs, reference log-probs, critic values (fed the rollout's
     answer by reference, straight from the rollout's Workhorses), the reward, and with
     `distill.teacher_coef` the teacher's log-probs (its weighted term added to the advantages);
  3. per-token rewards = -kl_coef * (logp - ref_logp), the score added at the last response token;
  4. GAE advantages (whitened, with a floor on the std) and returns;
  5. `ppo_epochs` passes of mini-batches: clipped policy loss on the actor, clipped value loss on
     the critic; every mini-batch is queued on both models at once, so each trains through them
     back to back while the other does the same (with `ppo.target_kl`, epoch by epoch, stopping
     once an epoch's approx KL exceeds it);
  6. KL controller update, then the actor's weights synced (and verified) to the rollout engine.
Where the rollout sleeps (`rollout.sleep`: vLLM sharing its GPUs with trained roles), its GPU
memory is freed once it has generated (steps 2 to 5 run without it) and taken back before the sync.
The `kl` metric is the mean per-token k1 estimate of KL(actor || reference), `kl_k3` the k3 one;
`rollout_logprob_gap_mean` / `_max` how far the rollout's log-probs of its samples are from the
actor's. With a quantized rollout (`rollout.quantization`) the samples come from other weights than
the actor's, and the policy loss weights each token by the truncated importance weight
min(pi_actor / pi_rollout, async.behaviour_weight_cap), as decoupled PPO does for stale samples.
Everything random is seeded from (run seed, step), so a resumed run repeats the same numbers.
The driver fetches only what it computes on (responses for the score, log-probs and values for
the advantages), and every wait is awaited on the run's one event loop.
"""
from __future__ import annotations

import asyncio
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from algorithms.critic_free.advantages import teacher_advantages, teacher_metrics
from algorithms.ppo.gae import gae, whiten
from algorithms.ppo.kl import build_kl_controller
from algorithms.ppo.kl_estimators import kl_metrics
from algorithms.ppo.losses import PolicyLoss, ValueLoss, rollout_gap
from algorithms.ppo.rewards import kl_penalized_rewards, run_scores
from xray.config.batches import TRAINED, TrainBatches, train_batches
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.balance import balanced_order, row_cost
from xray.data.batch import Batch
from xray.data.lengths import with_totals
from xray.run.models import Models, reference_forward
from xray.sync import sync_weights
from xray.sync.weights import WeightSyncError, pad_sequences, probe_tolerance

# score_fn(prompt_rows, response_ids) -> (scores [B], keep mask [B] or None); or an object with
# `async ascore(prompt_rows, generated)` that scores the rollout's answer by reference.
ScoreFn = Callable[[list[dict], list[list[int]]], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass
class PPOState:
    """Everything a resume needs besides the models' own checkpoints."""

    step: int = 0
    kl: dict = field(default_factory=dict)
    eval_before: float | None = None


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        except Exception as exc:
            if not hasattr(exc, "phase"):
                exc.phase = phase  # where the step failed: recovery (algorithms.ppo.recovery) asks
            raise
        key = f"time/{phase}_s"  # a phase run twice in a step (dynamic sampling's rounds) adds up
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0


def mini_batch_rows(n: int, mini_batch_size: int, parts: int, seed: int) -> list[torch.Tensor]:
    """One epoch's mini-batches of rows 0..n-1, shuffled: each is the concatenation, in part order,
    of `mini_batch_size / parts` rows of each of `parts` equal contiguous parts (with one part,
    a plain seeded shuffle cut in order)."""
    size, share = n // parts, mini_batch_size // parts
    orders = [p * size + torch.randperm(size, generator=torch.Generator().manual_seed(seed + 104_729 * p))
              for p in range(parts)]
    return [torch.cat([order[start:start + share] for order in orders]) for start in range(0, size, share)]


def balanced_rows(exp: Batch, rows: torch.Tensor, replicas: int, hidden_size: int = 0) -> torch.Tensor:
    """A mini-batch's `rows` reordered so that each of `replicas` consecutive equal slices (what
    each data-parallel replica trains) costs about the same (`xray.data.balance`: Karmarkar-Karp
    on tokens and attention); as they are with one replica."""
    if replicas <= 1 or len(rows) % replicas:
        return rows
    lengths = exp[C.ATTENTION_MASK].index_select(0, rows).sum(1).tolist()
    return rows[balanced_order([row_cost(int(n), hidden_size) for n in lengths], replicas)]


def ppo_targets(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scores: torch.Tensor, cfg: RunConfig, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3 and 4: the KL-penalised per-token rewards, GAE, whitening; (advantages, returns)."""
    ppo = cfg.ppo
    shaped = run_scores(scores, mask, cfg)
    rewards = kl_penalized_rewards(logprobs, ref_logprobs, mask, shaped, kl_coef)
    advantages, returns = gae(rewards, values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten(advantages, mask, min_std=ppo.whiten_min_std)
    return advantages, returns


def policy_loss_of(cfg: RunConfig, kl_coef: float = 0.0, kl_estimator: str = "k3") -> PolicyLoss:
    """The actor's loss with the run's clip ranges, aggregation and guard (`kl_coef`: a KL loss
    term); with the truncated behaviour weight wherever the samples come from other weights than
    the actor's: an asynchronous run's makers, or a quantized rollout."""
    ppo = cfg.ppo
    off_policy = cfg.trainer.mode == "async" or cfg.rollout.quantization != "none"
    cap = cfg.async_.behaviour_weight_cap if off_policy else None
    return PolicyLoss(cliprange=ppo.cliprange, behaviour_weight_cap=cap, cliprange_high=ppo.cliprange_high,
                      loss_agg_mode=ppo.loss_agg_mode, kl_coef=kl_coef, kl_estimator=kl_estimator,
                      max_approx_kl=ppo.max_approx_kl)


def rollout_sampling(cfg: RunConfig, stop_ids: list[int], step: int, greedy: bool = False) -> dict[str, Any]:
    """The generation engine's sampling settings for call `step` (seeded by it): the `rollout`
    section's, or one greedy response (evaluation)."""
    r = cfg.rollout
    return dict(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                max_new_tokens=r.max_new_tokens, n=1 if greedy else r.n_samples,
                stop_token_ids=stop_ids, seed=cfg.seed * 100003 + step)


class PPOTrainer:
    """Drives the actor, critic, reference and rollout WholeModels through PPO steps."""

    algo = "ppo"
    trained: tuple[str, ...] = ("actor", "critic")
    """The roles a step trains (and a checkpoint holds)."""

    def __init__(self, cfg: RunConfig, models: Models, score_fn: ScoreFn, pad_id: int, stop_ids: list[int]):
        self.cfg, self.models, self.score_fn = cfg, models, score_fn
        self.pad_id, self.stop_ids = pad_id, stop_ids
        ppo = cfg.ppo
        self.kl = build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        self.policy_loss = policy_loss_of(cfg)
        self.value_loss = ValueLoss(cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef)
        self.state = PPOState()
        self.teacher_coef = cfg.distill.teacher_coef
        """The teacher's term's weight in the advantages (0: no teacher scores the samples)."""
        self.uses_reference = True
        """Whether the reference's log-probs enter the step (PPO's KL penalty always)."""
        plan = getattr(models, "plan", None)
        self.sleeps = bool(plan is not None and plan.rollout_sleep)
        """Whether the rollout engine sleeps while the trained roles work (the plan's `rollout.sleep`)."""
        self.overlap_sync = plan is None or not plan.shares_devices("actor", "rollout")
        """Whether a sync runs the actor's probe while the rollout loads (not when they share devices)."""
        self.queued_probe = None
        """Without `overlap_sync`: (probe sequences, the actor's forward over them), queued by
        `train` right behind the step's last update; the next `sync` takes it if its probe is the
        same (a step that failed between the two leaves a stale one, which is dropped)."""
        self.episodes = None
        """With `env.name` or `env.agent`: the step's samples are episodes
        (`algorithms.ppo.episodes.EpisodeSamples`, set by `make_trainer`)."""

    def losses(self) -> dict[str, Any]:
        """Each trained role's loss function."""
        return {"actor": self.policy_loss, "critic": self.value_loss}

    def batches(self) -> TrainBatches:
        """Mini- and micro-batches for the models' current layout (elastic groups change it)."""
        plan = self.models.plan
        devices = {r.role: r.num_workhorses for r in plan.roles if r.role in TRAINED} if plan else {}
        return train_batches(self.cfg, devices)

    def sampling(self, step: int, greedy: bool = False) -> dict[str, Any]:
        return rollout_sampling(self.cfg, self.stop_ids, step, greedy)

    async def step(self, rows: list[dict]) -> dict[str, float]:
        """One PPO step on prompt `rows` (each with `prompt_ids` and its dataset columns)."""
        t, step, m = PhaseTimer(), self.state.step + 1, self.models
        with t("generate"):
            await self.wake_rollout()
            gen = await self.rollout(rows, self.sampling(step))
            coef = self.teacher_coef  # on-policy distillation's term (`xray/config/distill.py`)
            forwards = (m.actor.forward(gen), reference_forward(m, gen), m.critic.forward(gen),
                        *([m.teacher.forward(gen)] if coef else []))
            exp = gen if isinstance(gen, Batch) else await gen
        await self.sleep_rollout(t)
        rows = [rows[i // self.cfg.rollout.n_samples] for i in range(len(exp))]
        with t("score"):
            scores, keep = await self.score(rows, exp, gen)
            old, ref, values, *teacher = await asyncio.gather(*forwards)
        mask = exp[C.LOSS_MASK] if keep is None else exp[C.LOSS_MASK] * keep[:, None].float()
        advantages, returns = ppo_targets(old[C.LOGPROBS], ref[C.LOGPROBS], values[C.VALUES], mask, scores,
                                          self.cfg, self.kl.value)
        if teacher:  # after whitening: the teacher's term keeps its scale, as on the critic-free steps
            advantages = advantages + teacher_advantages(old[C.LOGPROBS], teacher[0][C.LOGPROBS], mask, coef)
        train_batch = Batch({C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK],
                             C.LOSS_MASK: mask, C.OLD_LOGPROBS: old[C.LOGPROBS], C.OLD_VALUES: values[C.VALUES],
                             C.ADVANTAGES: advantages, C.RETURNS: returns, **self.behaviour(exp)})
        gap = self.check_end_to_end(old[C.LOGPROBS], exp, mask)  # before the batch is trained on
        with t("train"):
            train = await self.train(train_batch, step, probe=self.early_probe(exp))
        metrics = await self.finish_step(step, t, exp, scores, mask, kl_metrics(old[C.LOGPROBS], ref[C.LOGPROBS], mask),
                                         train, gap)
        return {**metrics, **(teacher_metrics(old[C.LOGPROBS], teacher[0][C.LOGPROBS], mask) if teacher else {})}

    async def rollout(self, rows: list[dict], sampling: dict[str, Any]):
        """The samples of prompt `rows`: the rollout's generation, pending (its forwards queue
        behind it); or, with an environment, the episodes' Batch (`self.episodes`)."""
        if self.episodes is not None:
            return await self.episodes.play(rows, sampling)
        return self.models.rollout.generate([r["prompt_ids"] for r in rows], sampling, pad_id=self.pad_id)

    def behaviour(self, exp: Batch) -> dict[str, torch.Tensor]:
        """The rollout's log-probs of its samples as a train-batch column, where the policy loss
        weights by them (a quantized rollout); else nothing."""
        reads = C.BEHAVIOUR_LOGPROBS in self.policy_loss.reads
        return {C.BEHAVIOUR_LOGPROBS: exp[C.BEHAVIOUR_LOGPROBS]} if reads else {}

    @staticmethod
    def gap(old: torch.Tensor, exp: Batch, mask: torch.Tensor) -> dict[str, float]:
        """`rollout_logprob_gap_mean` / `_max` (`rollout_gap`) when the rollout gave its log-probs."""
        return rollout_gap(old, exp[C.BEHAVIOUR_LOGPROBS], mask) if C.BEHAVIOUR_LOGPROBS in exp else {}

    def check_end_to_end(self, old: torch.Tensor, exp: Batch, mask: torch.Tensor) -> dict[str, float]:
        """The end-to-end check of the last sync, for free: the rollout's log-probs of this step's
        samples against the actor's recomputation of the same tokens (`old`, same weights in a
        synchronous run), per token, within the probe's bound for the dtypes (`probe_tolerance`),
        before the batch is trained on: a bad sync fails the run before it does harm. The gap
        metrics; WeightSyncError beyond the bound."""
        gap = self.gap(old, exp, mask)
        if gap and self.cfg.sync.verify and not gap["rollout_logprob_gap_max"] <= self.end_to_end_bound():  # or NaN
            self.end_to_end_failed(gap["rollout_logprob_gap_max"], gap["rollout_logprob_gap_mean"])
        return gap

    def end_to_end_bound(self) -> float:
        """The end-to-end check's bound on |rollout - actor| per token: the probe's for the dtypes."""
        dtypes = [self.cfg.model.dtype, self.cfg.rollout.dtype or self.cfg.model.dtype]
        return probe_tolerance(self.cfg.sync, dtypes, self.cfg.rollout.quantization != "none")

    def end_to_end_failed(self, worst: float, mean: float) -> None:
        raise WeightSyncError(
            f"weight version {self.state.step} failed the end-to-end check: the rollout's log-probs of this "
            f"step's samples differ from the actor's by up to {worst:.3e} (mean {mean:.3e}, bound "
            f"{self.end_to_end_bound():g}); the engine computes otherwise than the actor (a wrong name mapping, "
            "or a tensor the exact checks cannot see). The batch was not trained on")

    synced: bool = False
    """Whether this process has synced the rollout once (its first sync probes)."""
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
        every = self.cfg.sync.probe_every
        if every < 1:
            raise ValueError(f"sync.probe_every={every}; give 1 (probe every sync) or more")
        return (not self.synced or not self.checks_end_to_end or version % every == 0
                or version >= self.cfg.trainer.steps)

    async def finish_step(self, step: int, t: PhaseTimer, exp: Batch, scores: torch.Tensor, mask: torch.Tensor,
                          kl: dict[str, float], train: dict[str, float],
                          gap: dict[str, float] | None = None) -> dict[str, float]:
        """The KL controller's update and the sync (step 6); the step's metrics (`gap`: the rollout's
        log-prob gap to the actor, where the actor's old log-probs were computed)."""
        kl_coef = self.kl.value
        self.kl.update(kl.get("kl_sequence", 0.0), len(exp))
        await self.wake_rollout(t)
        with t("sync"):
            report = await self.sync(exp, step)
        self.state.step = step
        tokens = int(exp[C.ATTENTION_MASK].sum())
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                **kl, "kl_coef": kl_coef, **train, **(gap or {}),
                "response_length": float(mask.sum(1).mean()),
                **({"sync/max_abs_logprob_diff": report.max_abs_logprob_diff}  # the syncs that ran the probe
                   if not math.isnan(report.max_abs_logprob_diff) else {}),
                "sync/held_exact": float(report.held_exact), "sync/held_functional": float(report.held_functional),
                "sync/unchecked": float(report.unchecked),
                "sync/verify_s": report.verify_s, "sync/version": float(report.version), **t.seconds,
                "tokens_per_s": tokens / max(1e-9, sum(t.seconds.values())),
                **(self.episodes.metrics if self.episodes is not None else {})}

    async def sleep_rollout(self, t: PhaseTimer) -> None:
        """Free the rollout engine's GPU memory for the trained roles (`time/rollout_sleep_s`);
        nothing unless the plan turned `rollout.sleep` on."""
        if self.sleeps:
            with t("rollout_sleep"):
                await self.models.rollout.sleep()

    async def wake_rollout(self, t: PhaseTimer | None = None) -> None:
        """Take the rollout engine's GPU memory back before it generates or loads weights
        (`time/rollout_wake_s` with `t`); nothing when it is awake or sleeping is off."""
        if self.sleeps:
            with t("rollout_wake") if t is not None else nullcontext():
                await self.models.rollout.wake_up()

    async def score(self, rows: list[dict], generated: Batch, pending) -> "tuple[torch.Tensor, torch.Tensor | None]":
        """Scores of the generated responses: a reward WholeModel scores the rollout's answer by
        reference (`ascore`); a Python function runs in a worker thread, off the event loop, and
        an `async def` one is awaited on it; episodes come with their environment's rewards."""
        if self.episodes is not None:
            return self.episodes.scores(generated)
        if hasattr(self.score_fn, "ascore"):
            return await self.score_fn.ascore(rows, pending)
        if getattr(self.score_fn, "is_async", False):  # an `async def` reward function: every sample at once
            return await self.score_fn.acall(rows, list(generated[C.RESPONSE_IDS]))
        return await asyncio.to_thread(self.score_fn, rows, list(generated[C.RESPONSE_IDS]))

    async def train(self, exp: Batch, step: int, parts: int = 1,
                    probe: list[list[int]] | None = None) -> dict[str, float]:
        """`ppo_epochs` shuffled passes of mini-batches through the trained roles. Every mini-batch
        is queued on each at once: each model runs its steps in order, back to back. With
        `ppo.target_kl`, epoch by epoch: no further epoch once one's mean approx KL exceeds it.
        `parts`: `exp` is that many equal parts, one per actor replica in dp order (an asynchronous
        run's trainers), and each replica's slice of every mini-batch comes from its own part;
        with one part, a mini-batch's rows go to the actor's replicas by cost (`balanced_rows`).
        Each mini-batch carries its loss totals (`with_totals`): the loss is its mean, however
        its rows are spread over replicas and micro-batches.
        `probe` (`early_probe`): the next sync's probe, queued on the actor behind the last update."""
        ppo, b, losses = self.cfg.ppo, self.batches(), self.losses()
        queued: list[list] = []  # per mini-batch, each role's answer
        dp = self.models.actor.parallel.dp if parts == 1 else 1  # parts: each replica's rows are its own
        for epoch in range(ppo.ppo_epochs):
            this_epoch = [[getattr(self.models, role).train_step(mini, loss, b.micro_of(role))
                           for role, loss in losses.items()]
                          for rows in mini_batch_rows(len(exp), b.mini_batch_size, parts,
                                                      self.cfg.seed * 7919 + step * 31 + epoch)
                          for mini in [with_totals(exp.index(balanced_rows(exp, rows, dp, self.hidden_size())))]]
            queued.extend(this_epoch)
            if ppo.target_kl is not None and epoch + 1 < ppo.ppo_epochs:
                actor = [(await calls[0])["approx_kl"] for calls in this_epoch]
                if sum(actor) / len(actor) > ppo.target_kl:
                    break
        if probe is not None:
            self.queued_probe = (probe, self.models.actor.forward(pad_sequences(probe)))
        results = [await asyncio.gather(*calls) for calls in queued]
        stats = [{f"{role}/{k}": v for role, answer in zip(losses, result) for k, v in answer.items()}
                 for result in results]
        means = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0] if not k.endswith("/update_skipped")}
        means["ppo/epochs"] = float(epoch + 1)
        means["actor/updates_skipped"] = float(sum(s["actor/update_skipped"] for s in stats))
        return means

    def hidden_size(self) -> int:
        """The actor's width, for the cost model of `balanced_rows` (0 when unknown: tokens only)."""
        if not hasattr(self, "_hidden"):
            import json
            from pathlib import Path

            kwargs = getattr(self.models.actor, "init_kwargs", None)
            model_dir = kwargs.get("model_dir") if isinstance(kwargs, dict) else None
            config = Path(str(model_dir)) / "config.json" if model_dir else None
            self._hidden = int(json.loads(config.read_text()).get("hidden_size", 0)) if config and config.is_file() else 0
        return self._hidden

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

    async def sync(self, exp: Batch, version: int, probe: bool | None = None):
        """Sync the actor's weights to the rollout at `version`, the probe where `probes_at` says."""
        probing = self.probes_at(version) if probe is None else probe
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

    async def resync(self, rows: list[dict], version: int):
        """Bring the rollout engine to the actor's weights outside a step (after a resume)."""
        rows, self.queued_probe = rows[:self.probe_size()], None  # from a step that did not finish
        await self.wake_rollout()
        gen = await self.models.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(0, greedy=True))
        return await self.sync(gen, version, probe=True)

    async def evaluate(self, rows: list[dict]) -> float:
        """Mean score of greedy responses on held-out `rows` (accuracy for a 0/1 reward)."""
        await self.wake_rollout()
        pending = await self.rollout(rows, self.sampling(0, greedy=True))
        scores, keep = await self.score(rows, pending if isinstance(pending, Batch) else await pending, pending)
        if keep is not None:
            scores = scores[keep.bool()]
        return float(scores.mean()) if len(scores) else 0.0
