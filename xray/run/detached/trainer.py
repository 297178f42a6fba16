"""The trainer of an asynchronous run (any RL algorithm: PPO, GRPO, RLOO, REINFORCE++, on-policy
distillation): a Ray actor with its own loop (`xray.run.detached.supervisor` starts it
beside the makers and the buffer).

Its loop, step after step up to the step the driver allows (a checkpoint or the end): take the
next `rollout_batch_size` scored groups from the buffer (`xray.run.detached.buffer`; each trainer,
an actor replica, its own share from the makers the graph lets feed it, in whatever order they
were made), fetch them here, recompute log-probs (the proximal policy) and, in PPO, values with
the current weights, compute advantages (`targets`), train with the decoupled PPO loss, and every
`async.push_every` steps publish the weights: export them into the object store (queued on the
actor ahead of the next step, which trains on while they travel) and hand each maker its
trainer's copy (`ExperienceMaker.load`). A push never waits for a maker: each loads between two of
its generations, and the step whose window a load completes in reports it (`sync/*`, push
latency from publish to the last maker loaded). The driver receives each step's metrics
(`next_metrics`, with the token ids of the step's first `trainer.log_rollouts` groups for
`rollouts.jsonl`), and nothing else: the experience stays between the makers, the object store
and this actor.
"""
from __future__ import annotations

import asyncio
import math
import time

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.rewards.compose import means
from xray.run.algorithm import Algorithm, Experience
from xray.run.detached.buffer import take_experience
from xray.run.detached.episode_maker import episode_metrics
from xray.run.rollout_log import ROLLOUT_ROWS, pick_rollouts
from xray.run.step import RLTrainer

TRAINER_STATE = "trainer_state"
"""A step's answer carries the trainer's state after it (its KL controller's) under this key, for
the driver (not a metric): a new trainer taking over from one that died restores it (`adopt`)."""


class AsyncTrainer:
    """The trainer's loop (a Ray actor: `ray.remote(AsyncTrainer)`)."""

    def __init__(self, cfg, models, pad_id: int, stop_ids: list[int], buffer, makers: list, pusher: list[int],
                 step: int, kl_state: dict, model_dir: str, run_path: str | None, algorithm: Algorithm,
                 publish: bool = True):
        """`publish`: publish the models' weights now (the run's start); a trainer taking over from
        one that died publishes the weights it restores instead (`adopt`)."""
        self.t = RLTrainer(cfg, models, None, pad_id, stop_ids, algorithm)
        self.snapshots = None
        """The actor's and critic's snapshots in memory after every step (`trainer.memory_snapshots`;
        taken here, in order with this trainer's own calls): what `recover` restores."""
        if cfg.trainer.memory_snapshots and run_path is not None:
            from xray.run.checkpoints import FlashCheckpoints
            from xray.run.outputs import RunDir

            self.snapshots = FlashCheckpoints(RunDir(run_path), self.t.models, self.t.trained)
        self.t.kl.load_state_dict(kl_state)
        self.t.state.step = step
        self.buffer, self.makers, self.pusher = buffer, list(makers), list(pusher)
        self.changed: asyncio.Condition | None = None
        self.metrics: dict[int, dict] = {}
        """Steps done whose metrics the driver has not taken yet."""
        self.stopping = False
        self.runs_ended = 0
        """Calls of `run` that have returned (or raised)."""
        self.pushes: list[dict] = []
        """Pushes whose loads are not all in: version, publish time, one load ref per maker."""
        self.staged: dict = {}
        """The latest published version, per pushing trainer (a new maker loads it first)."""
        self.model_dir = model_dir
        self.rollback = (0, -1)
        """(rollbacks so far, the version the last went back to): versions above it were discarded
        (`recover`); every load names it (`ExperienceMaker.load`)."""
        self.checked = step
        """The newest version checked end to end: by the makers' fresh tokens (`check_fresh`) or by a
        probe its push carried (`push`): a version pushed `sync.probe_every` after it probes."""
        if publish:
            self.publish_start()

    def _condition(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
        return self.changed

    async def run(self, last: int) -> int:
        """Train steps up to `last` (or a requested stop, after the step under way); the step reached."""
        changed = self._condition()
        try:
            while self.t.state.step < last and not self.stopping:
                step = self.t.state.step + 1
                metrics = await self.step(step)
                async with changed:
                    self.metrics[step] = metrics
                    changed.notify_all()
        finally:
            self.stopping = False
            async with changed:
                self.runs_ended += 1
                changed.notify_all()
        return self.t.state.step

    async def next_metrics(self, step: int, run: int) -> dict | None:
        """Step `step`'s metrics once it is done, or None when the `run`-th call of `run` (counted
        from 1) ended before it: a requested stop, or an error (which that call raises)."""
        changed = self._condition()
        async with changed:
            while step not in self.metrics and self.runs_ended < run:
                await changed.wait()
            return self.metrics.pop(step, None)

    def request_stop(self) -> None:
        """End `run` after the step under way (a signal, a failure elsewhere)."""
        self.stopping = True

    def state(self) -> dict:
        return {"step": self.t.state.step, "kl": self.t.kl.state_dict()}

    async def settle(self) -> None:
        """Wait until the snapshots being taken are complete (or failed)."""
        if self.snapshots is not None:
            await self.snapshots.settle()

    async def recover(self, models) -> dict:
        """After the actor or critic lost a Workhorse (the driver replaced their models: `models`),
        restore both from the newest complete snapshot in memory and publish its weights; the makers
        and the buffer went on meanwhile. The restored step and KL state, and where they came from.
        RuntimeError when no snapshot is complete (the run then goes back to its checkpoint)."""
        if self.snapshots is None:
            raise RuntimeError("no snapshots in memory (trainer.memory_snapshots is off)")
        self.t.models = models
        self.stopping = False  # a stop asked for the run that ended (it may have ended on its own first)
        self.snapshots.follow(models)
        await self.snapshots.settle()
        held = self.snapshots.restorable()
        if held is None:
            raise RuntimeError("no complete snapshot in memory")
        sources = await asyncio.gather(*[getattr(models, role).load(
            str(held.directory / role), **self.snapshots.held_for(held.directory, role)) for role in self.t.trained])
        self.t.kl.load_state_dict(held.trainer_state["kl"])
        self.t.state.step = held.step
        back = await self.buffer_back_to(held.step)
        self.snapshots.forget_after(held.step)
        self.metrics = {s: m for s, m in self.metrics.items() if s <= held.step}
        from xray.sync.weights import random_probe  # publish the restored weights (a new maker's first
        # version); a maker holding a discarded version loads them first, whatever is on its way; probed
        self.t.synced, self.checked = False, held.step  # (restored into new Workhorses)
        self.push(*random_probe(self.model_dir, models.actor.parallel.dp, 1, seed=held.step))
        return {"step": held.step, "kl": self.t.kl.state_dict(), "given_back": back,
                "source": "memory" if set(sources) == {"memory"} else "disk"}

    async def adopt(self, steps: list[tuple[int, dict]], models) -> dict | None:
        """Take over from a trainer actor that died: the newest of `steps` ((step, its KL state),
        newest first: those the driver saw end) whose snapshot the trained models still keep
        becomes this trainer's (`FlashCheckpoints.adopt`), and is restored as after a lost Workhorse
        (`recover`: the models, the buffer brought back to its step, its weights published to the
        makers under a new rollback). What `recover` returns; None when no snapshot is held."""
        if self.snapshots is None:
            return None
        self.rollback = (await self.buffer.epoch.remote(), -1)  # this trainer's rollbacks follow the last one's
        for step, kl in steps:
            if await self.snapshots.adopt(step, {"step": step, "kl": kl}):
                return await self.recover(models)
        return None

    async def buffer_back_to(self, step: int) -> int:
        """Bring the buffer back to the trainer's `step` (a snapshot's): the groups it took since
        given back to the front of their queues, trained again, not skipped; the versions above it
        discarded, the groups they sampled made again (`ExperienceBuffer.back_to`); how many lost
        steps' groups were given back."""
        self.rollback = (self.rollback[0] + 1, step)  # versions above it now name other weights
        return await self.buffer.back_to.remote(step, self.rollback[0])

    async def breakpoint(self, on_disk: int) -> dict | None:
        """The run ends in an error (its makers stopped): write the newest complete snapshot in
        memory as the checkpoint of its step when that is newer than step `on_disk` (the latest
        checkpoint on disk; `xray/run/breakpoint.py`), and bring the buffer back to that step for
        the driver's snapshot of it. The step, its KL state and the checkpoint's directory; None
        when no snapshot is newer."""
        from xray.run.breakpoint import write_snapshot

        if self.snapshots is None:
            return None
        await self.snapshots.settle()
        held = self.snapshots.restorable()
        if held is None or held.step <= on_disk:
            return None
        await write_snapshot(held)
        await self.buffer_back_to(held.step)
        return {"step": held.step, "kl": held.trainer_state["kl"], "directory": str(held.directory)}

    def set_makers(self, makers: list) -> None:
        """Replaced makers (the pushes go to them from now on)."""
        self.makers = list(makers)

    def latest(self) -> dict:
        """The latest published version, per maker (what a replacement loads first)."""
        return {i: self.staged[d] for i, d in enumerate(self.pusher)}

    def epoch(self) -> tuple[int, int]:
        """`rollback`: what a replaced maker's first load names."""
        return self.rollback

    def publish_start(self) -> None:
        """Publish the weights the run starts from (what the rollout holds already), so that a
        replaced maker has a version to load before the first push."""
        from xray.sync import stage
        from xray.sync.weights import random_probe

        actor, cfg = self.t.models.actor, self.t.cfg.sync
        probe, lens = random_probe(self.model_dir, actor.parallel.dp, 1, seed=self.t.state.step) if cfg.verify \
            else (None, None)
        self.staged = {d: stage(actor, self.t.state.step, cfg, probe, lens, replica=d)
                       for d in sorted(set(self.pusher))}

    async def step(self, step: int) -> dict:
        """One trainer step: take, recompute, train, publish every `push_every` steps; its metrics,
        and under `ROLLOUT_ROWS` its first groups for `rollouts.jsonl`."""
        t, acfg = self.t, self.t.cfg.async_
        start = time.time()
        taken, batches = await take_experience(self.buffer, t.state.step)  # a group lost: made again
        parts = [Batch.concat(groups, pad_width=True) for groups in batches]
        exp = Batch.concat(parts, pad_width=True)
        waited_s = time.time() - start
        proximal, values = await self.recompute(exp)
        mask = exp[C.LOSS_MASK]
        makers = torch.tensor([g.maker for groups, rows in zip(taken, batches) for g, b in zip(groups, rows)
                               for _ in range(len(b))])  # each row's maker, in the order of `exp`
        fresh = self.check_fresh(proximal, exp, mask, makers)  # before the batch is trained on
        kl_coef = t.kl.value
        columns, measured = self.targets(exp, proximal, values, mask)
        picked = pick_rollouts(exp, exp[C.SCORES], columns.get(C.ADVANTAGES), mask, t.cfg.trainer.log_rollouts,
                               t.cfg.rollout.n_samples)  # the driver writes them (`ROLLOUT_ROWS`)
        train = await t.train(Batch(columns), step, parts=len(parts))
        t.kl.update(measured.get("kl_sequence", 0.0), len(exp))
        t.state.step = step
        if self.snapshots is not None:  # queued on the Workhorses before the push's export and the next step
            await self.snapshots.take(step, {"step": step, "kl": t.kl.state_dict()}, persist=False)
        publish_s = 0.0
        if step % acfg.push_every == 0:
            t0 = time.time()
            self.push(*t.probe(exp))
            publish_s = time.time() - t0
        end = time.time()
        scores = exp[C.SCORES]
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                **measured, "kl_coef": kl_coef, **train, **t.gap(proximal, exp, mask), **fresh,
                "response_length": float(mask.sum(1).mean()), **staleness(exp, step - 1),
                **{f"async/trainer{d}_from_maker{i}": float(sum(g.maker == i for g in groups))
                   for d, groups in enumerate(taken) for i in range(len(self.makers))},
                "async/trainer_busy": 1.0 - waited_s / (end - start), "async/publish_s": publish_s,
                **({"sync/versions_since_e2e": float(step - self.checked)} if t.cfg.sync.verify else {}),
                "async/experience_bytes": float(sum(b.nbytes() for b in parts)),
                **(await self.maker_busy(start, end, [g.counts for groups in taken for g in groups])),
                "samples_per_s": len(exp) / (end - start), **self.loaded(),
                **(await self.buffer.stats.remote()), ROLLOUT_ROWS: picked, TRAINER_STATE: {"kl": t.kl.state_dict()}}

    async def recompute(self, exp: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The actor's log-probs of `exp` with the weights it holds now (the proximal policy) and the
        critic's values (None in a critic-free run), at once."""
        models = self.t.models
        answers = await asyncio.gather(models.actor.forward(exp),
                                       *([models.critic.forward(exp)] if models.critic is not None else []))
        return answers[0][C.LOGPROBS], answers[1][C.VALUES] if len(answers) > 1 else None

    def targets(self, exp: Batch, logprobs: torch.Tensor, values: torch.Tensor | None,
                mask: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The train batch's columns and the algorithm's metrics: the same `Algorithm.targets` as
        the synchronous step, on the makers' scores, the reference's and teacher's log-probs they
        gathered, and the `logprobs` and `values` recomputed here (rows a reward filter dropped,
        their loss mask all zero, are left out of their group's statistics)."""
        e = Experience(exp, exp[C.SCORES], mask, logprobs,
                       exp[C.REF_LOGPROBS] if C.REF_LOGPROBS in exp else None, values,  # no reference: no KL
                       exp[C.TEACHER_LOGPROBS] if C.TEACHER_LOGPROBS in exp else None, mask.sum(1) > 0)
        columns, measured = self.t.algorithm.targets(e, self.t.kl.value)
        return {C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK], C.LOSS_MASK: mask,
                C.OLD_LOGPROBS: logprobs, C.BEHAVIOUR_LOGPROBS: exp[C.BEHAVIOUR_LOGPROBS], **columns}, measured

    async def maker_busy(self, start: float, end: float, counts: list[dict]) -> dict[str, float]:
        """The makers' mean busy share of [start, end], from their measured intervals; with episodes,
        the `counts` of those trained (`episode/*`, with the makers' runtime counts); each reward
        function's mean over the samples the makers scored meanwhile (`reward/<name>`)."""
        stats = await asyncio.gather(*[m.stats.remote() for m in self.makers], return_exceptions=True)
        live = [s for s in stats if isinstance(s, dict)]
        busy = sum(max(0.0, min(b, end) - max(a, start)) for s in live for a, b in s["busy"])
        return {"async/maker_busy": busy / ((end - start) * max(1, len(live))),
                **episode_metrics(counts + [s["episodes"] for s in live if "episodes" in s]),
                **means(s["rewards"] for s in live if "rewards" in s)}

    def check_fresh(self, proximal: torch.Tensor, exp: Batch, mask: torch.Tensor,
                    makers: torch.Tensor | None = None) -> dict[str, float]:
        """The end-to-end check of the makers' syncs, for free: the tokens sampled with the weights
        this trainer holds now (BEHAVIOUR_VERSIONS equal to its version), the makers' log-probs of
        them against the actor's `proximal` ones, within the probe's bound
        (`SyncVerification.end_to_end_bound`), before the batch is trained on; WeightSyncError beyond it.
        `sync/fresh_gap_mean`, `_max` and `sync/fresh_tokens` (0: nothing fresh this step), and per
        maker i (`makers`: each row's maker) `sync/maker<i>_fresh_tokens`: the tokens of its samples
        that checked the version it holds end to end."""
        t = self.t
        fresh = mask * (exp[C.BEHAVIOUR_VERSIONS].long() == t.state.step).to(mask.dtype)
        gap = t.gap(proximal, exp, fresh) if fresh.sum() > 0 else {}
        out = {"sync/fresh_tokens": float(fresh.sum())}
        if makers is not None:
            per_row = fresh.sum(1)
            out.update({f"sync/maker{i}_fresh_tokens": float(per_row[makers == i].sum())
                        for i in sorted(set(makers.tolist()))})
        if gap:
            out.update({"sync/fresh_gap_mean": gap["rollout_logprob_gap_mean"],
                        "sync/fresh_gap_max": gap["rollout_logprob_gap_max"]})
            if t.cfg.sync.verify and not t.end_to_end_bound().holds(gap):  # or NaN
                t.end_to_end_failed(gap)
            self.checked = max(self.checked, t.state.step)
        return out

    def probes(self, version: int) -> bool:
        """Whether the push of `version` carries the log-prob probe: the first push of this trainer,
        the run's last, every push when no step checks end to end, and a version `sync.probe_every`
        after the newest one checked end to end (`checked`): makers that lag behind the trainer
        sample no fresh tokens of the versions they load, and a version goes unchecked end to end
        for fewer than `probe_every` pushes in a row."""
        t = self.t
        return (not t.synced or not t.checks_end_to_end or version >= t.cfg.trainer.steps
                or version - self.checked >= t.probe_interval())

    def push(self, sequences: list[list[int]], prompt_lens: list[int]) -> None:
        """Publish the weights at the trainer's version: stage one export per pushing trainer
        (queued on the actor before the next step's calls) and ask every maker to load its copy;
        nothing here waits for the loads (each maker's answer is awaited by a task of its own)."""
        from xray.sync import stage

        version, cfg, actor = self.t.state.step, self.t.cfg.sync, self.t.models.actor
        if not self.probes(version):  # the makers' fresh samples check it end to end (`step`)
            sequences, prompt_lens = None, None
        elif cfg.verify:  # every maker that loads it runs the probe; one that fails fails the run
            self.checked = version
        self.t.synced = True
        self.staged = {d: stage(actor, version, cfg, sequences, prompt_lens, replica=d)
                       for d in sorted(set(self.pusher))}
        loads = [asyncio.ensure_future(_settled(m.load.remote(self.staged[self.pusher[i]], *self.rollback)))
                 for i, m in enumerate(self.makers)]
        self.pushes.append({"version": version, "published": time.time(), "loads": loads})

    def loaded(self) -> dict[str, float]:
        """The verification of every push that every maker has answered since the last step
        (loaded, or skipped for a newer version; a lost maker's answer is None: the driver
        replaces it). A push answered after its step ended is reported with the next one:
        `sync/version` is the newest, `sync/pushes_verified` how many, the held counts summed; per
        maker i, `sync/maker<i>_version` the newest version it loaded (checked completely and
        exactly) and `sync/maker<i>_probed_version` the newest whose load ran the probe."""
        answered: list[tuple[dict, list]] = []
        makers: dict[str, float] = {}  # per maker: the newest version it loaded, and the newest it probed
        while self.pushes and all(task.done() for task in self.pushes[0]["loads"]):
            push = self.pushes.pop(0)
            results = [task.result() for task in push["loads"]]
            for i, result in enumerate(results):
                if result is not None:
                    makers[f"sync/maker{i}_version"] = float(push["version"])
                    if not math.isnan(result[0].max_abs_logprob_diff):
                        makers[f"sync/maker{i}_probed_version"] = float(push["version"])
            reports = [r for r in results if r is not None]
            if reports:
                answered.append((push, reports))
        if not answered:
            return {}
        every = [r for _, reports in answered for r in reports]
        probed = [r for r, _ in every if not math.isnan(r.max_abs_logprob_diff)]
        push = answered[-1][0]
        return {"sync/version": float(push["version"]), "sync/pushes_verified": float(len(answered)),
                "sync/loads_probed": float(len(probed)), **makers,  # loads whose delivery ran the probe
                **({"sync/max_abs_logprob_diff": max(r.max_abs_logprob_diff for r in probed),
                    "sync/mean_abs_logprob_diff": max(r.mean_abs_logprob_diff for r in probed)} if probed else {}),
                **{k: sum(r.counts()[k] for r, _ in every) for k in every[0][0].counts()},  # absent unverified
                "sync/replicas_loaded": float(len(every)),  # loads answered: replicas x pushes
                "sync/verify_s": max(r.verify_s for r, _ in every),
                "async/push_latency_s": max(done - p["published"] for p, rs in answered for _, done in rs)}

    async def finish(self) -> None:
        """Bring every maker to the trainer's last weights (for the evaluation after the run)."""
        from xray.sync.weights import random_probe

        held = await asyncio.gather(*[m.stats.remote() for m in self.makers])
        if any(h["version"] != self.t.state.step for h in held) and \
                (not self.pushes or self.pushes[-1]["version"] != self.t.state.step):
            self.push(*random_probe(self.model_dir, self.t.models.actor.parallel.dp, 1, seed=self.t.state.step))
        for push in self.pushes:
            await asyncio.gather(*push["loads"])
        self.pushes = []


def staleness(exp: Batch, version: int) -> dict[str, float]:
    """Staleness per token of the experience a step trains on at weight `version` (versions behind
    the weights that sampled each response token): mean and max; and the samples whose tokens
    span several versions (partial rollouts)."""
    mask = exp[C.LOSS_MASK] > 0
    versions = exp[C.BEHAVIOUR_VERSIONS].long()
    behind = (version - versions)[mask].float()
    big = torch.iinfo(torch.long).max
    spans = (versions.masked_fill(~mask, -1).amax(1) > versions.masked_fill(~mask, big).amin(1)) & mask.any(1)
    return {"async/staleness": float(behind.max()) if behind.numel() else 0.0,
            "async/staleness_token_mean": float(behind.mean()) if behind.numel() else 0.0,
            "async/partial_samples": float(spans.sum())}


async def _settled(ref):
    """A maker's answer to a load, or None when the maker is gone."""
    try:
        return await ref
    except Exception:  # noqa: BLE001 - a lost maker: the driver replaces it and logs why
        return None
