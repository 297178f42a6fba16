"""trlX-style PPO over WholeModels: the step, evaluation, and the state a resume needs.

One step, as on paper:
  1. rollout: the rollout engine samples responses for a batch of prompts;
  2. score, concurrently: actor log-probs, reference log-probs, critic values (fed the rollout's
     answer by reference, straight from the rollout's Workhorses), and the reward;
  3. per-token rewards = -kl_coef * (logp - ref_logp), the score added at the last response token;
  4. GAE advantages (whitened) and returns;
  5. `ppo_epochs` passes of mini-batches: clipped policy loss on the actor, clipped value loss on
     the critic; every mini-batch is queued on both models at once, so each trains through them
     back to back while the other does the same;
  6. KL controller update, then the actor's weights synced (and verified) to the rollout engine.
Everything random is seeded from (run seed, step), so a resumed run repeats the same numbers.
The driver fetches only what it computes on (responses for the score, log-probs and values for
the advantages), and every wait is awaited on the run's one event loop.
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
from xray.config.batches import TRAINED, TrainBatches, train_batches
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.run.models import Models
from xray.sync import sync_weights

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
        self.seconds[f"time/{phase}_s"] = time.perf_counter() - t0


def mini_batch_rows(n: int, mini_batch_size: int, parts: int, seed: int) -> list[torch.Tensor]:
    """One epoch's mini-batches of rows 0..n-1, shuffled: each is the concatenation, in part order,
    of `mini_batch_size / parts` rows of each of `parts` equal contiguous parts (with one part,
    a plain seeded shuffle cut in order)."""
    size, share = n // parts, mini_batch_size // parts
    orders = [p * size + torch.randperm(size, generator=torch.Generator().manual_seed(seed + 104_729 * p))
              for p in range(parts)]
    return [torch.cat([order[start:start + share] for order in orders]) for start in range(0, size, share)]


class PPOTrainer:
    """Drives the actor, critic, reference and rollout WholeModels through PPO steps."""

    def __init__(self, cfg: RunConfig, models: Models, score_fn: ScoreFn, pad_id: int, stop_ids: list[int]):
        self.cfg, self.models, self.score_fn = cfg, models, score_fn
        self.pad_id, self.stop_ids = pad_id, stop_ids
        ppo = cfg.ppo
        self.kl = build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        cap = cfg.async_.behaviour_weight_cap if cfg.trainer.mode == "async" else None
        self.policy_loss = PolicyLoss(cliprange=ppo.cliprange, behaviour_weight_cap=cap)
        self.value_loss = ValueLoss(cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef)
        self.state = PPOState()

    def batches(self) -> TrainBatches:
        """Mini- and micro-batches for the models' current layout (elastic groups change it)."""
        plan = self.models.plan
        devices = {r.role: r.num_workhorses for r in plan.roles if r.role in TRAINED} if plan else {}
        return train_batches(self.cfg, devices)

    def sampling(self, step: int, greedy: bool = False) -> dict[str, Any]:
        r = self.cfg.rollout
        return dict(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=r.max_new_tokens, n=1 if greedy else r.n_samples,
                    stop_token_ids=self.stop_ids, seed=self.cfg.seed * 100003 + step)

    async def step(self, rows: list[dict]) -> dict[str, float]:
        """One PPO step on prompt `rows` (each with `prompt_ids` and its dataset columns)."""
        t, step, ppo, m = PhaseTimer(), self.state.step + 1, self.cfg.ppo, self.models
        with t("generate"):
            gen = m.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(step), pad_id=self.pad_id)
            forwards = m.actor.forward(gen), m.reference.forward(gen), m.critic.forward(gen)
            exp = await gen
        rows = [rows[i // self.cfg.rollout.n_samples] for i in range(len(exp))]
        with t("score"):
            scores, keep = await self.score(rows, exp, gen)
            old, ref, values = await asyncio.gather(*forwards)
        mask = exp[C.LOSS_MASK] if keep is None else exp[C.LOSS_MASK] * keep[:, None].float()
        shaped = shape_scores(scores, self.cfg.reward.scale, self.cfg.reward.clip)
        rewards = kl_penalized_rewards(old[C.LOGPROBS], ref[C.LOGPROBS], mask, shaped, self.kl.value)
        advantages, returns = gae(rewards, values[C.VALUES], mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = whiten(advantages, mask)
        train_batch = Batch({C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK],
                             C.LOSS_MASK: mask, C.OLD_LOGPROBS: old[C.LOGPROBS], C.OLD_VALUES: values[C.VALUES],
                             C.ADVANTAGES: advantages, C.RETURNS: returns})
        with t("train"):
            train = await self.train(train_batch, step)
        kl = sequence_kl(old[C.LOGPROBS], ref[C.LOGPROBS], mask)
        kl_coef = self.kl.value
        self.kl.update(kl, len(exp))
        with t("sync"):
            report = await self.sync(exp, step)
        self.state.step = step
        tokens = int(exp[C.ATTENTION_MASK].sum())
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                "kl": kl, "kl_coef": kl_coef, **train,
                "response_length": float(mask.sum(1).mean()), "sync/max_abs_logprob_diff": report.max_abs_logprob_diff,
                "sync/verify_s": report.verify_s, **t.seconds,
                "tokens_per_s": tokens / max(1e-9, sum(t.seconds.values()))}

    async def score(self, rows: list[dict], generated: Batch, pending) -> "tuple[torch.Tensor, torch.Tensor | None]":
        """Scores of the generated responses: a reward WholeModel scores the rollout's answer by
        reference (`ascore`); a Python function runs in a worker thread, off the event loop."""
        if hasattr(self.score_fn, "ascore"):
            return await self.score_fn.ascore(rows, pending)
        return await asyncio.to_thread(self.score_fn, rows, list(generated[C.RESPONSE_IDS]))

    async def train(self, exp: Batch, step: int, parts: int = 1) -> dict[str, float]:
        """`ppo_epochs` shuffled passes of mini-batches through actor and critic. Every mini-batch
        is queued on both at once: each model runs its steps in order, back to back. `parts`: `exp`
        is that many equal parts, one per actor replica in dp order (an asynchronous run's trainers),
        and each replica's slice of every mini-batch comes from its own part."""
        ppo, b = self.cfg.ppo, self.batches()
        calls = []
        for epoch in range(ppo.ppo_epochs):
            for rows in mini_batch_rows(len(exp), b.mini_batch_size, parts, self.cfg.seed * 7919 + step * 31 + epoch):
                mb = exp.index(rows)
                calls.append(self.models.actor.train_step(mb, self.policy_loss, b.micro_of("actor")))
                calls.append(self.models.critic.train_step(mb, self.value_loss, b.micro_of("critic")))
        results = await asyncio.gather(*calls)
        stats = [{**{f"actor/{k}": v for k, v in actor.items()}, **{f"critic/{k}": v for k, v in critic.items()}}
                 for actor, critic in zip(results[::2], results[1::2])]
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

    async def sync(self, exp: Batch, version: int):
        sequences, prompt_lens = self.probe(exp)
        return await sync_weights(self.models.actor, self.models.rollout, version, self.cfg.sync,
                                  sequences, prompt_lens)

    async def resync(self, rows: list[dict], version: int):
        """Bring the rollout engine to the actor's weights outside a step (after a resume)."""
        rows = rows[:self.probe_size()]
        gen = await self.models.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(0, greedy=True))
        return await self.sync(gen, version)

    async def evaluate(self, rows: list[dict]) -> float:
        """Mean score of greedy responses on held-out `rows` (accuracy for a 0/1 reward)."""
        pending = self.models.rollout.generate([r["prompt_ids"] for r in rows], self.sampling(0, greedy=True),
                                               pad_id=self.pad_id)
        scores, keep = await self.score(rows, await pending, pending)
        if keep is not None:
            scores = scores[keep.bool()]
        return float(scores.mean()) if len(scores) else 0.0
