"""trlX-style PPO over WholeModels: the step, evaluation, and the state a resume needs.

One step, as on paper:
  1. rollout: the rollout engine samples responses for a batch of prompts;
  2. score, concurrently: actor log-probs, reference log-probs, critic values, and the reward;
  3. per-token rewards = -kl_coef * (logp - ref_logp), the score added at the last response token;
  4. GAE advantages (whitened) and returns;
  5. `ppo_epochs` passes of mini-batches: clipped policy loss on the actor, clipped value loss on
     the critic, both models training concurrently;
  6. KL controller update, then the actor's weights synced (and verified) to the rollout engine.
Everything random is seeded from (run seed, step), so a resumed run repeats the same numbers.
"""
from __future__ import annotations

import asyncio
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from algorithms.ppo.gae import gae, whiten
from algorithms.ppo.kl import build_kl_controller, sequence_kl
from algorithms.ppo.losses import PolicyLoss, ValueLoss
from algorithms.ppo.rewards import kl_penalized_rewards, shape_scores
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.sequences import pack_sequences
from xray.run.models import Models
from xray.sync import sync_weights

# score_fn(prompt_rows, response_ids) -> (scores [B], keep mask [B] or None)
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
        yield
        self.seconds[f"time/{phase}_s"] = time.perf_counter() - t0


class PPOTrainer:
    """Drives the actor, critic, reference and rollout WholeModels through PPO steps."""

    def __init__(self, cfg: RunConfig, models: Models, score_fn: ScoreFn, pad_id: int, stop_ids: list[int]):
        self.cfg, self.models, self.score_fn = cfg, models, score_fn
        self.pad_id, self.stop_ids = pad_id, stop_ids
        ppo = cfg.ppo
        self.kl = build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        self.policy_loss = PolicyLoss(cliprange=ppo.cliprange)
        self.value_loss = ValueLoss(cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef)
        self.state = PPOState()

    def sampling(self, step: int, greedy: bool = False) -> dict[str, Any]:
        r = self.cfg.rollout
        return dict(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=r.max_new_tokens, n=1 if greedy else r.n_samples,
                    stop_token_ids=self.stop_ids, seed=self.cfg.seed * 100003 + step)

    async def step(self, rows: list[dict]) -> dict[str, float]:
        """One PPO step on prompt `rows` (each with `prompt_ids` and its dataset columns)."""
        t, step, ppo = PhaseTimer(), self.state.step + 1, self.cfg.ppo
        with t("generate"):
            gen = await self.models.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(step))
        rows = [rows[i // self.cfg.rollout.n_samples] for i in range(len(gen))]
        exp = pack_sequences(gen[C.PROMPT_IDS], gen[C.RESPONSE_IDS], self.pad_id)
        with t("score"):
            old, ref, values, (scores, keep) = await asyncio.gather(
                self.models.actor.forward(exp), self.models.reference.forward(exp),
                self.models.critic.forward(exp), asyncio.to_thread(self.score_fn, rows, gen[C.RESPONSE_IDS]))
        mask = exp[C.LOSS_MASK] if keep is None else exp[C.LOSS_MASK] * keep[:, None].float()
        shaped = shape_scores(scores, self.cfg.reward.scale, self.cfg.reward.clip)
        rewards = kl_penalized_rewards(old[C.LOGPROBS], ref[C.LOGPROBS], mask, shaped, self.kl.value)
        advantages, returns = gae(rewards, values[C.VALUES], mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = whiten(advantages, mask)
        exp.tensors.update({C.OLD_LOGPROBS: old[C.LOGPROBS], C.OLD_VALUES: values[C.VALUES],
                            C.ADVANTAGES: advantages, C.RETURNS: returns, C.LOSS_MASK: mask})
        with t("train"):
            train = await self.train(exp, step)
        kl = sequence_kl(old[C.LOGPROBS], ref[C.LOGPROBS], mask)
        kl_coef = self.kl.value
        self.kl.update(kl, len(gen))
        with t("sync"):
            report = self.sync(exp, step)
        self.state.step = step
        tokens = int(exp[C.ATTENTION_MASK].sum())
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                "kl": kl, "kl_coef": kl_coef, **train,
                "response_length": float(mask.sum(1).mean()), "sync/max_abs_logprob_diff": report.max_abs_logprob_diff,
                "sync/verify_s": report.verify_s, **t.seconds,
                "tokens_per_s": tokens / max(1e-9, sum(t.seconds.values()))}

    async def train(self, exp: Batch, step: int) -> dict[str, float]:
        """`ppo_epochs` shuffled passes of mini-batches through actor and critic, concurrently."""
        ppo, n = self.cfg.ppo, len(exp)
        stats: list[dict[str, float]] = []
        for epoch in range(ppo.ppo_epochs):
            g = torch.Generator().manual_seed(self.cfg.seed * 7919 + step * 31 + epoch)
            order = torch.randperm(n, generator=g)
            for start in range(0, n, ppo.mini_batch_size):
                mb = exp.index(order[start:start + ppo.mini_batch_size])
                actor, critic = await asyncio.gather(
                    self.models.actor.train_step(mb, self.policy_loss, self.cfg.actor.micro_batch_size),
                    self.models.critic.train_step(mb, self.value_loss, self.cfg.critic.micro_batch_size))
                stats.append({**{f"actor/{k}": v for k, v in actor.items()},
                              **{f"critic/{k}": v for k, v in critic.items()}})
        return {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}

    def probe_size(self) -> int:
        """Probe sequences per sync: at least 4, divisible by the actor's and rollout's dp."""
        a, r = self.models.actor.parallel.dp, self.models.rollout.parallel.dp
        k = a * r // math.gcd(a, r)
        return k * max(1, math.ceil(4 / k))

    def probe(self, exp: Batch) -> tuple[list[list[int]], list[int]]:
        """A few of this step's sequences, for verifying the sync."""
        k = self.probe_size()
        if len(exp) < k:
            raise ValueError(f"a step of {len(exp)} samples is too small to verify a sync with {k} probes; "
                             "raise ppo.rollout_batch_size")
        prompts, responses = exp[C.PROMPT_IDS][:k], exp[C.RESPONSE_IDS][:k]
        return [p + r_ for p, r_ in zip(prompts, responses)], [len(p) for p in prompts]

    def sync(self, exp: Batch, version: int):
        sequences, prompt_lens = self.probe(exp)
        return sync_weights(self.models.actor, self.models.rollout, version, self.cfg.sync,
                            sequences, prompt_lens)

    async def resync(self, rows: list[dict], version: int):
        """Bring the rollout engine to the actor's weights outside a step (after a resume)."""
        rows = rows[:self.probe_size()]
        gen = await self.models.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(0, greedy=True))
        return self.sync(pack_sequences(gen[C.PROMPT_IDS], gen[C.RESPONSE_IDS], self.pad_id), version)

    async def evaluate(self, rows: list[dict]) -> float:
        """Mean score of greedy responses on held-out `rows` (accuracy for a 0/1 reward)."""
        gen = await self.models.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(0, greedy=True))
        scores, keep = await asyncio.to_thread(self.score_fn, rows, gen[C.RESPONSE_IDS])
        if keep is not None:
            scores = scores[keep.bool()]
        return float(scores.mean()) if len(scores) else 0.0
