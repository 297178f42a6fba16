"""The critic-free step (GRPO, RLOO, REINFORCE++, on-policy distillation) over WholeModels: PPO's
clipped policy update with the value model replaced by the other responses to the same prompt, or
by a teacher's judgement of each sampled token.

One step, as in the papers:
  1. rollout: `rollout.n_samples` responses to each of `ppo.rollout_batch_size` prompts;
  2. score, concurrently: actor log-probs (the old policy) and, when the KL is used, reference
     log-probs; with a teacher (`opd`, `distill.teacher_coef`) the teacher's log-probs of the
     same tokens; the reward of every response (an on-policy step, one optimizer step on the batch
     and no KL, skips the actor's forward: the old log-probs are the train step's own, as TRL
     does with num_iterations=1; not with a quantized rollout, whose log-prob gap to the actor
     is a metric);
  3. KL to the reference, where `critic_free.kl_in` puts it: subtracted from the reward (k1,
     `ppo.kl_coef` per nat), or later a loss term; or nowhere (no reference model runs);
  4. advantages by the algorithm's estimator (`algorithms.critic_free.advantages`), plus
     `distill.teacher_coef` x (teacher - actor log-prob) per token; `opd`'s are that term alone
     (weight 1: the reward only measures, `reward/mean` and the evaluations);
  5. `ppo.ppo_epochs` passes of mini-batches of the clipped policy loss on the actor alone (clip
     ranges, aggregation and KL guards as PPO's, plus the KL loss term; with a quantized rollout
     each token weighted by the truncated importance weight against the rollout's log-probs);
  6. the actor's weights synced (and verified) to the rollout engine.
As in PPO, a sleeping rollout (`rollout.sleep`) frees its GPU memory once it has generated and
takes it back before the sync.
No critic WholeModel is started; checkpoints hold the actor alone.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import torch

from algorithms.critic_free.advantages import (grpo_advantages, per_token, reinforce_pp_advantages,
                                               rloo_advantages, teacher_advantages, teacher_metrics)
from algorithms.critic_free.dynamic import Sampled, select, varied_count
from algorithms.ppo.kl_estimators import kl_metrics, kl_terms
from algorithms.ppo.rewards import kl_penalized_rewards, run_scores
from algorithms.ppo.trainer import PhaseTimer, PPOTrainer, policy_loss_of
from xray.config.critic_free import CRITIC_FREE as ALGOS, kl_placement
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.run.models import reference_forward

class CriticFreeTrainer(PPOTrainer):
    """Drives the actor, the rollout and (for the KL) the reference through critic-free steps."""

    trained = ("actor",)

    def __init__(self, cfg: RunConfig, models, score_fn, pad_id: int, stop_ids: list[int], algo: str):
        super().__init__(cfg, models, score_fn, pad_id, stop_ids)
        if algo not in ALGOS:
            raise ValueError(f"unknown critic-free algorithm {algo!r}; choose one of {', '.join(ALGOS)}")
        self.algo, self.kl_in = algo, kl_placement(cfg, algo)
        self.teacher_coef = 1.0 if algo == "opd" else cfg.distill.teacher_coef
        """The teacher's term's weight in the advantages (0: no teacher runs)."""
        self.uses_reference = self.kl_in != "none"
        self.more_rows = None
        """Where dynamic sampling draws more prompt rows (the run's `RunData.next_train_rows`)."""
        self.on_policy = (self.kl_in == "none" and not self.teacher_coef and cfg.ppo.ppo_epochs == 1
                          and cfg.rollout.quantization == "none" and cfg.trainer.mode == "sync"
                          and self.batches().mini_batch_size == cfg.ppo.rollout_batch_size * cfg.rollout.n_samples)
        self.replays = cfg.actor.moe.routing_replay
        """The actor's forwards replay the rollout's expert routing (ROUTED_EXPERTS)."""
        self.policy_loss = dataclasses.replace(
            policy_loss_of(cfg, cfg.ppo.kl_coef if self.kl_in == "loss" else 0.0, cfg.critic_free.kl_estimator),
            on_policy=self.on_policy, routing=self.replays)
        if self.on_policy and cfg.sync.verify:  # no separate actor forward: the check rides on the training one
            self.policy_loss = dataclasses.replace(self.policy_loss, end_to_end_bound=self.end_to_end_bound())

    def losses(self) -> dict[str, Any]:
        return {"actor": self.policy_loss}

    def advantages(self, scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                   mask: torch.Tensor, valid: torch.Tensor | None,
                   teacher: torch.Tensor | None = None) -> torch.Tensor:
        """Step 4: per-token advantages `[B, T-1]` of this run's algorithm, with the teacher's term."""
        if self.algo == "opd":
            return teacher_advantages(logprobs, teacher, mask)
        own = self.algorithm_advantages(scores, logprobs, ref_logprobs, mask, valid)
        return own if teacher is None else own + teacher_advantages(logprobs, teacher, mask, self.teacher_coef)

    def algorithm_advantages(self, scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                             mask: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """GRPO's, RLOO's or REINFORCE++'s per-token advantages `[B, T-1]`."""
        coef = self.kl.value if self.kl_in == "reward" else 0.0
        n, cf = self.cfg.rollout.n_samples, self.cfg.critic_free
        if self.algo == "reinforce_pp":  # per-token rewards, returns-to-go, normalised over the batch
            reference = logprobs if ref_logprobs is None else ref_logprobs
            rewards = kl_penalized_rewards(logprobs, reference, mask, scores, coef)
            return reinforce_pp_advantages(rewards, mask, self.cfg.ppo.gamma, self.cfg.ppo.whiten_min_std)
        if coef:  # the sequence's reward less kl_coef x its summed k1
            scores = scores - coef * (kl_terms(logprobs, ref_logprobs, "k1") * mask).sum(1)
        if self.algo == "grpo":
            return per_token(grpo_advantages(scores, n, cf.scale_by_std, valid=valid), mask)
        return per_token(rloo_advantages(scores, n, valid=valid), mask)

    async def sample(self, rows: list[dict], step: int, t: PhaseTimer) -> Sampled:
        """One round of samples: generated, scored, and the forwards the step needs."""
        m = self.models
        with t("generate"):
            await self.wake_rollout()
            gen = await self.rollout(rows, self.sampling(step))
            forwards = ([] if self.on_policy else [m.actor.forward(gen, routing=self.replays)]) + \
                ([reference_forward(m, gen)] if self.kl_in != "none" else []) + \
                ([m.teacher.forward(gen)] if self.teacher_coef else [])
            exp = gen if isinstance(gen, Batch) else await gen
        await self.sleep_rollout(t)
        rows = [rows[i // self.cfg.rollout.n_samples] for i in range(len(exp))]
        with t("score"):
            scores, keep = await self.score(rows, exp, gen)
            answers = await asyncio.gather(*forwards)
        return Sampled(exp, scores, keep, list(answers))

    async def samples(self, rows: list[dict], step: int, t: PhaseTimer) -> tuple[Sampled, dict[str, float]]:
        """The step's samples: one round, or with `critic_free.dynamic_sampling` rounds of more
        prompts (`more_rows`) until the batch's groups vary (`algorithms/critic_free/dynamic.py`)."""
        first = await self.sample(rows, step, t)
        cf, n = self.cfg.critic_free, self.cfg.rollout.n_samples
        if not cf.dynamic_sampling:
            return first, {}
        rounds = [first]
        while sum(varied_count(r, n) for r in rounds) < len(rows) and len(rounds) < cf.max_sample_rounds:
            rounds.append(await self.sample(self.more_rows(), step, t))
        return select(rounds, n, len(rows))

    async def step(self, rows: list[dict]) -> dict[str, float]:
        """One critic-free step on prompt `rows` (each with `prompt_ids` and its dataset columns)."""
        t, step = PhaseTimer(), self.state.step + 1
        sampled, dynamic = await self.samples(rows, step, t)
        exp, scores, keep, answers = sampled.exp, sampled.scores, sampled.keep, sampled.answers
        mask = exp[C.LOSS_MASK] if keep is None else exp[C.LOSS_MASK] * keep[:, None].float()
        if self.on_policy:  # no KL either: the log-probs only shape (zero) KL terms
            logprobs, ref_logprobs = torch.zeros_like(mask), None
        else:
            logprobs = answers[0][C.LOGPROBS]
            ref_logprobs = answers[1][C.LOGPROBS] if self.kl_in != "none" else None
        teacher = answers[-1][C.LOGPROBS] if self.teacher_coef else None
        shaped = run_scores(torch.where(mask.sum(1) > 0, scores.float(), 0.0), mask, self.cfg)
        columns = {C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK], C.LOSS_MASK: mask,
                   C.ADVANTAGES: self.advantages(shaped, logprobs, ref_logprobs, mask, keep, teacher),
                   **self.behaviour(exp)}
        if self.replays:  # the actor's forwards route as the rollout did
            columns[C.ROUTED_EXPERTS] = exp[C.ROUTED_EXPERTS]
        if not self.on_policy:
            columns[C.OLD_LOGPROBS] = logprobs
        if self.kl_in == "loss":
            columns[C.REF_LOGPROBS] = ref_logprobs
        gap = {} if self.on_policy else self.check_end_to_end(logprobs, exp, mask)  # before training on it
        with t("train"):
            train = await self.train(Batch(columns), step, probe=self.early_probe(exp))
        if "actor/rollout_gap_max" in train:  # on-policy: checked in the training forward, the update left out
            gap = {"rollout_logprob_gap_mean": train.pop("actor/rollout_gap_mean"),
                   "rollout_logprob_gap_max": train.pop("actor/rollout_gap_max")}
            if train.pop("actor/abort_update"):
                self.end_to_end_failed(gap["rollout_logprob_gap_max"], gap["rollout_logprob_gap_mean"])
        kl = kl_metrics(logprobs, ref_logprobs, mask) if ref_logprobs is not None else {}
        distill = teacher_metrics(logprobs, teacher, mask) if teacher is not None else {}
        return {**await self.finish_step(step, t, exp, scores, mask, kl, train, gap), **dynamic, **distill}

