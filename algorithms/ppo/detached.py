"""Detached asynchronous PPO (`trainer.mode: async`): experience makers and a trainer joined by a buffer.

ColossalChat's design on xray's WholeModels, all on the run's one event loop:
- each **experience maker** drives one rollout replica (`rollout.replica(d)`): it takes prompts,
  samples with the weights it holds (recording their version and the engine's own log-probs, the
  behaviour policy), has the reference model score them by reference and the reward score them,
  and puts the experience batch into the buffer (`algorithms.ppo.buffer`), then goes on;
- the **trainer** (the actor and critic WholeModels, whatever their data-parallel size) takes the
  oldest fresh-enough batch, recomputes log-probs (the proximal policy) and values with its current
  weights, computes advantages, trains with the decoupled PPO loss (`PolicyLoss` with a truncated
  behaviour weight), and every `async.push_every` steps pushes its weights to every maker, each
  push verified and made under that maker's lock only, so the other makers keep sampling.
With `on_stale: wait` a maker whose weights are more than `max_staleness` versions behind the
trainer's waits for a push. Interleaving is not deterministic: runs are not bitwise repeatable.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from algorithms.ppo.buffer import maker_must_wait
from algorithms.ppo.gae import gae, whiten
from algorithms.ppo.kl import sequence_kl
from algorithms.ppo.rewards import kl_penalized_rewards, shape_scores
from xray.data import columns as C
from xray.data.batch import Batch
from xray.sync import sync_weights


@dataclass
class MakerStats:
    """What the makers did since the last trainer step."""

    busy_s: float = 0.0
    samples: int = 0
    waited: int = 0
    """Times a maker waited for new weights (on_stale: wait)."""


@dataclass
class Detached:
    """Makers and trainer of one asynchronous run around a PPOTrainer (its models, losses, data)."""

    trainer: object
    next_rows: object
    """Callable giving the next batch of prompt rows."""
    makers: list = field(default_factory=list)
    locks: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    """The weight version each maker holds."""
    version: int = 0
    """The trainer's weight version: trainer steps done."""
    stats: MakerStats = field(default_factory=MakerStats)

    def __post_init__(self) -> None:
        import ray

        from algorithms.ppo.buffer import BufferActor

        cfg = self.trainer.cfg
        rollout = self.trainer.models.rollout
        self.makers = [rollout.replica(d) for d in range(rollout.parallel.dp)]
        self.locks = [asyncio.Lock() for _ in self.makers]
        self.versions = [self.trainer.state.step] * len(self.makers)
        self.version = self.trainer.state.step
        self.pushed = asyncio.Event()
        self.buffer = ray.remote(BufferActor).options(num_cpus=0).remote(
            cfg.async_.buffer_capacity, cfg.async_.max_staleness)

    # -- makers ----------------------------------------------------------------------------------
    async def maker(self, i: int) -> None:
        """Maker `i`'s loop: sample, score, put; forever (cancelled at the end of the run)."""
        acfg, t = self.trainer.cfg.async_, self.trainer
        calls = 0
        while True:
            while maker_must_wait(acfg.on_stale, self.version, self.versions[i], acfg.max_staleness):
                self.stats.waited += 1
                self.pushed.clear()
                await self.pushed.wait()
            await self.buffer.room.remote()
            rows = self.next_rows()
            start = time.perf_counter()
            async with self.locks[i]:
                version = self.versions[i]
                calls += 1
                gen = self.makers[i].generate([r["prompt_ids"] for r in rows],
                                              t.sampling(1_000_003 * (i + 1) + calls), pad_id=t.pad_id)
                ref = t.models.reference.forward(gen)  # by reference, queued before the answer is in
                exp = await gen
            rows = [rows[j // t.cfg.rollout.n_samples] for j in range(len(exp))]
            scores, keep = await t.score(rows, exp, gen)
            mask = exp[C.LOSS_MASK] if keep is None else exp[C.LOSS_MASK] * keep[:, None].float()
            batch = Batch({C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK],
                           C.LOSS_MASK: mask, C.BEHAVIOUR_LOGPROBS: exp[C.BEHAVIOUR_LOGPROBS],
                           C.REF_LOGPROBS: (await ref)[C.LOGPROBS], C.SCORES: scores},
                          {C.PROMPT_IDS: exp[C.PROMPT_IDS], C.RESPONSE_IDS: exp[C.RESPONSE_IDS]})
            self.stats.busy_s += time.perf_counter() - start
            self.stats.samples += len(batch)
            await self.buffer.put.remote([_put(batch)], version)

    # -- trainer ---------------------------------------------------------------------------------
    async def take(self, makers: list[asyncio.Task]) -> tuple[Batch, int]:
        """The next batch for the trainer; a maker that failed stops the run with its error."""
        taking = asyncio.ensure_future(self.buffer.take.remote(self.version))
        done, _ = await asyncio.wait([taking, *makers], return_when=asyncio.FIRST_COMPLETED)
        for task in makers:
            if task in done:
                taking.cancel()
                task.result()  # raises the maker's error
                raise RuntimeError("an experience maker stopped without an error")
        (ref,), version, staleness = taking.result()
        return await ref, staleness

    async def step(self, step: int, makers: list[asyncio.Task]) -> dict[str, float]:
        """One trainer step: take a batch, recompute, train, push every `push_every` steps."""
        t, ppo, acfg = self.trainer, self.trainer.cfg.ppo, self.trainer.cfg.async_
        start = time.perf_counter()
        exp, staleness = await self.take(makers)
        self.last = exp
        waited_s = time.perf_counter() - start
        proximal, values = await asyncio.gather(t.models.actor.forward(exp), t.models.critic.forward(exp))
        mask = exp[C.LOSS_MASK]
        shaped = shape_scores(exp[C.SCORES], t.cfg.reward.scale, t.cfg.reward.clip)
        rewards = kl_penalized_rewards(proximal[C.LOGPROBS], exp[C.REF_LOGPROBS], mask, shaped, t.kl.value)
        advantages, returns = gae(rewards, values[C.VALUES], mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = whiten(advantages, mask)
        train = await t.train(Batch({
            C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK], C.LOSS_MASK: mask,
            C.OLD_LOGPROBS: proximal[C.LOGPROBS], C.BEHAVIOUR_LOGPROBS: exp[C.BEHAVIOUR_LOGPROBS],
            C.OLD_VALUES: values[C.VALUES], C.ADVANTAGES: advantages, C.RETURNS: returns}), step)
        kl, kl_coef = sequence_kl(proximal[C.LOGPROBS], exp[C.REF_LOGPROBS], mask), t.kl.value
        t.kl.update(kl, len(exp))
        self.version = t.state.step = step
        sync = await self.push(exp) if step % acfg.push_every == 0 else {}
        wall = time.perf_counter() - start
        made, self.stats = self.stats, MakerStats()
        scores = exp[C.SCORES]
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                "kl": kl, "kl_coef": kl_coef, **train,
                "response_length": float(mask.sum(1).mean()), "async/staleness": float(staleness),
                "async/waited": float(made.waited), "async/trainer_busy": 1.0 - waited_s / wall,
                "async/maker_busy": min(1.0, made.busy_s / (wall * len(self.makers))),
                "samples_per_s": len(exp) / wall, **sync, **(await self.buffer.stats.remote())}

    async def push(self, exp: Batch) -> dict[str, float]:
        """The trainer's weights to every maker at its version, each verified, each under its lock."""
        sequences, prompt_lens = self.trainer.probe(exp)

        async def one(i: int):
            async with self.locks[i]:
                report = await sync_weights(self.trainer.models.actor, self.makers[i], self.version,
                                            self.trainer.cfg.sync, sequences, prompt_lens)
                self.versions[i] = self.version
                return report

        reports = await asyncio.gather(*[one(i) for i in range(len(self.makers))])
        self.pushed.set()
        return {"sync/max_abs_logprob_diff": max(r.max_abs_logprob_diff for r in reports),
                "sync/verify_s": max(r.verify_s for r in reports), "async/version": float(self.version)}

    async def run(self, steps: range, on_step) -> None:
        """Trainer steps `steps` with the makers running beside them; awaits `on_step(step, metrics)`
        after each (metrics, checkpoints)."""
        makers = [asyncio.ensure_future(self.maker(i)) for i in range(len(self.makers))]
        try:
            for step in steps:
                await on_step(step, await self.step(step, makers))
        finally:
            for task in makers:
                task.cancel()
            await asyncio.gather(*makers, return_exceptions=True)
            import ray

            ray.kill(self.buffer)
        if self.versions != [self.version] * len(self.makers) and getattr(self, "last", None) is not None:
            await self.push(self.last)  # the makers end on the trainer's last weights (for the eval)


def _put(batch: Batch):
    import ray

    return ray.put(batch)
