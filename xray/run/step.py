"""The step of every RL algorithm over WholeModels (trlX's flow), and the state a resume needs.

One step, whatever the algorithm (`xray/run/algorithm.py` is all the step knows of it):
  1. generate: the rollout engine samples `rollout.n_samples` responses to each prompt (or plays
     episodes: `xray/run/episodes/`); where the rollout sleeps (`rollout.sleep`: vLLM sharing its
     GPUs with trained roles) its memory is freed once it has generated and taken back before the
     sync;
  2. score, concurrently: the reward, and the forwards the algorithm needs, fed the rollout's
     answer by reference: the actor's log-probs (the old policy; an on-policy step without a
     critic or KL skips it, its old log-probs being the train step's own), the reference's (where
     the KL is used), the critic's values (PPO), the teacher's (on-policy distillation's term);
     with dynamic sampling, more rounds of prompts while the algorithm wants them;
  3. targets: the algorithm's advantages (and returns), the one place they are computed
     (`Algorithm.targets`; the asynchronous trainer calls the same);
  4. the end-to-end check of the last sync on these samples, before they are trained on;
  5. `ppo.ppo_epochs` passes of mini-batches through the trained roles (`ppo.target_kl` stops
     after an epoch whose approx KL exceeds it);
  6. the KL controller's update, then the actor's weights synced and verified (`xray/run/verify.py`).
Everything random is seeded from (run seed, step), so a resumed run repeats the same numbers.
The driver fetches only what it computes on, and every wait is awaited on the run's one event loop.
"""
from __future__ import annotations

import asyncio
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from xray.config.batches import TRAINED, TrainBatches, train_batches
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.lengths import with_totals
from xray.run.algorithm import Algorithm, Experience, LossFacts, Sampled
from xray.run.evaluate import evaluation
from xray.run.minibatches import balanced_rows, mini_batch_rows
from xray.run.models import Models, reference_forward
from xray.run.phases import PhaseTimer, rollout_sampling
from xray.run.recovery.policy import RestartBudget
from xray.run.rollout_log import pick_rollouts
from xray.run.verify import SyncVerification

# score_fn(prompt_rows, response_ids) -> (scores [B], keep mask [B] or None); or an object with
# `async ascore(prompt_rows, generated)` that scores the rollout's answer by reference.
ScoreFn = Callable[[list[dict], list[list[int]]], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass
class RunState:
    """Everything a resume needs besides the models' own checkpoints."""

    step: int = 0
    kl: dict = field(default_factory=dict)
    eval_before: float | None = None


class RLTrainer(SyncVerification):
    """Drives the run's WholeModels through the steps of `algorithm`."""

    def __init__(self, cfg: RunConfig, models: Models, score_fn: ScoreFn, pad_id: int, stop_ids: list[int],
                 algorithm: Algorithm):
        self.cfg, self.models, self.score_fn = cfg, models, score_fn
        self.pad_id, self.stop_ids, self.algorithm = pad_id, stop_ids, algorithm
        self.trained = algorithm.trained
        """The roles a step trains (and a checkpoint holds)."""
        self.kl = algorithm.kl_controller()
        self.state = RunState()
        self.restarts = RestartBudget(cfg.trainer.max_restarts)
        """The run's one restart budget (`xray/run/recovery/policy.py`): every recovery draws on it."""
        self.kl_in, self.teacher_coef = algorithm.kl_in, algorithm.teacher_coef
        self.uses_reference = self.kl_in != "none"
        """Whether the reference's log-probs enter the step."""
        self.critic = "critic" in self.trained
        plan = getattr(models, "plan", None)
        self.sleeps = bool(plan is not None and plan.rollout_sleep)
        """Whether the rollout engine sleeps while the trained roles work (the plan's `rollout.sleep`)."""
        self.overlap_sync = plan is None or not plan.shares_devices("actor", "rollout")
        """Whether a sync runs the actor's probe while the rollout loads (not when they share devices)."""
        self.episodes = None
        """With `env.name` or `env.agent`: the step's samples are episodes
        (`xray.run.episodes.samples.EpisodeSamples`, set by `make_trainer`)."""
        self.rollout_rows: list[dict] = []
        """The last step's first `trainer.log_rollouts` groups (`xray.run.rollout_log.pick_rollouts`),
        which the loop writes to `rollouts.jsonl`; an asynchronous run's driver puts its trainer's here."""
        self.more_rows = None
        """Where dynamic sampling draws more prompt rows (the run's `RunData.next_train_rows`)."""
        self.replays = cfg.actor.moe.routing_replay
        """The actor's forwards replay the rollout's expert routing (ROUTED_EXPERTS)."""
        self.on_policy = (algorithm.skips_old_forward and self.kl_in == "none" and not self.teacher_coef
                          and cfg.ppo.ppo_epochs == 1 and cfg.rollout.quantization == "none"
                          and cfg.trainer.mode == "sync"
                          and self.batches().mini_batch_size == cfg.ppo.rollout_batch_size * cfg.rollout.n_samples)
        """One update on the batch with the weights that sampled it: the actor's old-policy forward
        is skipped (TRL's num_iterations=1)."""
        off_policy = cfg.trainer.mode == "async" or cfg.rollout.quantization != "none"
        cap = cfg.async_.behaviour_weight_cap if off_policy else None
        bound = self.end_to_end_bound() if self.on_policy and cfg.sync.verify else None  # the check rides on
        self._losses = algorithm.losses(LossFacts(cap, self.on_policy, self.replays, bound))  # the training forward
        self.policy_loss = self._losses["actor"]

    @property
    def algo(self) -> str:
        return self.algorithm.name

    def losses(self) -> dict[str, Any]:
        """Each trained role's loss function."""
        return self._losses

    def batches(self) -> TrainBatches:
        """Mini- and micro-batches for the models' current layout (elastic groups change it)."""
        plan = self.models.plan
        devices = {r.role: r.num_workhorses for r in plan.roles if r.role in TRAINED} if plan else {}
        return train_batches(self.cfg, devices)

    def sampling(self, step: int, greedy: bool = False) -> dict[str, Any]:
        return rollout_sampling(self.cfg, self.stop_ids, step, greedy)

    async def step(self, rows: list[dict]) -> dict[str, float]:
        """One step on prompt `rows` (each with `prompt_ids` and its dataset columns)."""
        t, step = PhaseTimer(), self.state.step + 1
        self.reward_parts()  # drop what evaluations scored: a step reports its own samples
        sampled, dynamic = await self.samples(rows, step, t)
        exp, scores, keep, answers = sampled.exp, sampled.scores, sampled.keep, sampled.answers
        mask = exp[C.LOSS_MASK] if keep is None else exp[C.LOSS_MASK] * keep[:, None].float()
        logprobs = torch.zeros_like(mask) if self.on_policy else answers["actor"][C.LOGPROBS]
        e = Experience(exp, scores, mask, logprobs, _logprobs(answers.get("reference")),
                       answers["critic"][C.VALUES] if "critic" in answers else None,
                       _logprobs(answers.get("teacher")), keep)
        targets, measured = self.algorithm.targets(e, self.kl.value)
        self.rollout_rows = pick_rollouts(exp, scores, targets.get(C.ADVANTAGES), mask, self.cfg.trainer.log_rollouts,
                                          self.cfg.rollout.n_samples, keep)
        columns = {C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK], C.LOSS_MASK: mask,
                   **({} if self.on_policy else {C.OLD_LOGPROBS: logprobs}), **targets, **self.behaviour(exp)}
        if self.replays:  # the actor's forwards route as the rollout did
            columns[C.ROUTED_EXPERTS] = exp[C.ROUTED_EXPERTS]
        gap = {} if self.on_policy else self.check_end_to_end(logprobs, exp, mask)  # before training on it
        with t("train"):
            train = await self.train(Batch(columns), step, probe=self.early_probe(exp))
        if "actor/rollout_gap_max" in train:  # on-policy: checked in the training forward, the update left out
            gap = {"rollout_logprob_gap_mean": train.pop("actor/rollout_gap_mean"),
                   "rollout_logprob_gap_max": train.pop("actor/rollout_gap_max")}
            if train.pop("actor/abort_update"):
                self.end_to_end_failed(gap)
        return {**await self.finish_step(step, t, exp, scores, mask, measured, train, gap), **dynamic}

    async def sample(self, rows: list[dict], step: int, t: PhaseTimer) -> Sampled:
        """One round of samples: generated, scored, and the forwards the algorithm needs."""
        m = self.models
        with t("generate"):
            await self.wake_rollout()
            gen = await self.rollout(rows, self.sampling(step))
            forwards = {**({} if self.on_policy else
                           {"actor": m.actor.forward(gen, routing=True) if self.replays else m.actor.forward(gen)}),
                        **({"reference": reference_forward(m, gen)} if self.uses_reference else {}),
                        **({"critic": m.critic.forward(gen)} if self.critic else {}),
                        **({"teacher": m.teacher.forward(gen)} if self.teacher_coef else {})}
            exp = gen if isinstance(gen, Batch) else await gen
        await self.sleep_rollout(t)
        rows = [rows[i // self.cfg.rollout.n_samples] for i in range(len(exp))]
        with t("score"):
            scores, keep = await self.score(rows, exp, gen)
            answers = await asyncio.gather(*forwards.values())
        return Sampled(exp, scores, keep, dict(zip(forwards, answers)))

    async def samples(self, rows: list[dict], step: int, t: PhaseTimer) -> tuple[Sampled, dict[str, float]]:
        """The step's samples: one round, or rounds of more prompts (`more_rows`) while the
        algorithm wants them (dynamic sampling), joined by the algorithm."""
        rounds = [await self.sample(rows, step, t)]
        while self.algorithm.wants_more(rounds, len(rows)):
            rounds.append(await self.sample(self.more_rows(), step, t))
        return self.algorithm.select(rounds, len(rows))

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

    async def finish_step(self, step: int, t: PhaseTimer, exp: Batch, scores: torch.Tensor, mask: torch.Tensor,
                          measured: dict[str, float], train: dict[str, float],
                          gap: dict[str, float] | None = None) -> dict[str, float]:
        """The KL controller's update and the sync (step 6); the step's metrics (`measured`: the
        algorithm's KL and distillation metrics; `gap`: the rollout's log-prob gap to the actor)."""
        kl_coef = self.kl.value
        self.kl.update(measured.get("kl_sequence", 0.0), len(exp))
        await self.wake_rollout(t)
        with t("sync"):
            report = await self.sync(exp, step)
        self.state.step = step
        tokens = int(exp[C.ATTENTION_MASK].sum())
        kl = {k: v for k, v in measured.items() if not k.startswith("distill/")}
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                **self.reward_parts(), **kl, "kl_coef": kl_coef, **train, **(gap or {}),
                "response_length": float(mask.sum(1).mean()),
                **({"sync/max_abs_logprob_diff": report.max_abs_logprob_diff,  # the syncs that ran the probe
                    "sync/mean_abs_logprob_diff": report.mean_abs_logprob_diff}
                   if not math.isnan(report.max_abs_logprob_diff) else {}),
                **report.counts(),  # the held counts, measured; absent when sync.verify is off
                "sync/verify_s": report.verify_s, "sync/version": float(report.version), **t.seconds,
                "tokens_per_s": tokens / max(1e-9, sum(t.seconds.values())),
                **(self.episodes.metrics if self.episodes is not None else {}),
                **{k: v for k, v in measured.items() if k.startswith("distill/")}}

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

    def reward_parts(self) -> dict[str, float]:
        """`reward/<name>`: each reward function's mean since the last call (`RewardScorer.take_metrics`);
        nothing for a reward model."""
        take = getattr(self.score_fn, "take_metrics", None)
        return take() if take is not None else {}

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
        self.queue_probe(probe)
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
            kwargs = getattr(self.models.actor, "init_kwargs", None)
            model_dir = kwargs.get("model_dir") if isinstance(kwargs, dict) else None
            config = Path(str(model_dir)) / "config.json" if model_dir else None
            self._hidden = int(json.loads(config.read_text()).get("hidden_size", 0)) if config and config.is_file() else 0
        return self._hidden

    async def evaluate(self, rows: list[dict]) -> float:
        """Mean score of responses to held-out `rows` under the `eval` section's sampling (greedy by
        default: the accuracy, for a 0/1 reward); the run's evaluations write more
        (`xray.run.evaluate.Evaluations`)."""
        return (await evaluation(self, rows))[1]["eval"]


def _logprobs(answer) -> torch.Tensor | None:
    return None if answer is None else answer[C.LOGPROBS]
