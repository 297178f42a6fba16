"""The detached asynchronous run on one set of WholeModels (a tiny Llama with 1,024 positions,
megatron-vllm, two makers and one trainer), driven in this process as `python -m xray.train`
drives it:

- partial rollouts: a maker generating long responses in 2-token segments loads a new weight
  version in the middle of them; the samples that span both versions carry, token by token, the
  version and the log-prob the engine gave at that version (checked against an engine replica
  still at the old version and the replica at the new one, and against the actor);
- the data plane: a run whose experience totals over 24 MiB (three times the driver's memory bound,
  24 times its read bound: the size of a driver that passes the experience through itself) leaves
  this process (the driver) with its peak memory and its read bytes flat, while the trainer
  publishes without waiting;
- head-of-line: with one of the two makers slowed tenfold, the trainer keeps stepping on the
  other maker's samples at 70% or more of the unslowed run's steps/s.
"""
import asyncio
import dataclasses
import json
import os
import time

import pytest
import torch

pytestmark = pytest.mark.ray

PROMPT_CHARS = 440
"""Prompts this long make each sample ~15 KB of experience (~480 positions) at little generation
cost: prefill is cheap (and attention, quadratic in the length, cheaper than with fewer longer rows)."""
BASELINE_STEPS = 14
"""The unslowed steps: the data-plane check (~34 MB of experience) and the head-of-line baseline
(12 steps after two warm-up ones)."""
FP32_PROBE = 2e-5
"""An engine's log-probs against another of the same weights, and against the actor, in fp32 (the
e2e tests' bound: seen up to 2.9e-6)."""


def _memory_of(pid: int) -> dict[str, int]:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    io = dict(line.split(": ") for line in open(f"/proc/{pid}/io").read().splitlines())
    return {"hwm_kb": int(status["VmHWM"].split()[0]), "rchar": int(io["rchar"])}


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, local_ray):
    """(trainer, data) of an asynchronous PPO run on a tiny Llama with long prompts."""
    import yaml

    from algorithms.rl import rl_trainer
    from tests.e2e.test_ppo_e2e import ROOT
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model
    from xray.data.tokenizer import VOCAB_SIZE, save_char_tokenizer
    from xray.run.outputs import RunDir
    from xray.train import resolve

    tmp = tmp_path_factory.mktemp("async-run")
    spec = TinySpec(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=2, num_kv_heads=2, max_position_embeddings=1024)
    model = build_tiny_model(tmp / "tiny", spec, seed=3)
    save_char_tokenizer(model)
    rng = torch.Generator().manual_seed(0)
    with open(tmp / "long.jsonl", "w") as f:
        for i in range(400):
            digits = "".join(str(int(d)) for d in torch.randint(0, 10, (PROMPT_CHARS - 8,), generator=rng))
            f.write(json.dumps({"prompt": f"{digits} {i % 7}+{i % 5}=", "answer": str(i % 7 + i % 5)}) + "\n")
    cfg = yaml.safe_load((ROOT / "configs/ppo_async_2makers_1trainer.yaml").read_text())
    cfg["model"]["path"] = str(model)
    cfg["data"].update(path=str(tmp / "long.jsonl"), max_prompt_tokens=PROMPT_CHARS + 8, eval_size=8)
    cfg["rollout"].update(max_new_tokens=40)  # the engines' room; the runs below generate 4
    for role in ("actor", "critic", "reference"):
        cfg[role]["micro_batch_size"] = 16
    cfg["ppo"].update(rollout_batch_size=160, mini_batch_size=160, ppo_epochs=1)
    cfg["trainer"].update(save_every=0, max_restarts=0, report=False, timeline_step=0)
    path = tmp / "async.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    _, run_cfg, plan, _, _ = resolve(["ppo", "--config", str(path)])
    with rl_trainer(run_cfg, plan, RunDir(tmp / "run")) as (trainer, data):
        yield trainer, data


async def _steps(trainer, data, n: int) -> list[tuple[float, dict]]:
    """`n` more asynchronous steps as the run command takes them; (end time, metrics) per step."""
    from xray.run.detached.supervisor import Detached

    rows: list[tuple[float, dict]] = []

    async def on_step(step: int, metrics: dict) -> None:
        rows.append((time.perf_counter(), metrics))

    first, cfg = trainer.state.step + 1, trainer.cfg
    trainer.cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=4))
    try:
        await Detached(trainer, data).run(range(first, first + n), on_step)
    finally:
        trainer.cfg = cfg
    return rows


def rows_of(group):
    """A group's Batch (its rows of the Batch its maker put)."""
    import ray

    ref, first, end = group.item
    return ray.get(ref).index(slice(first, end))


def versions_of(group) -> list[int]:
    """The weight versions that sampled a group's response tokens."""
    import ray

    from xray.data import columns as C

    batch = rows_of(group)
    return batch[C.BEHAVIOUR_VERSIONS][batch[C.LOSS_MASK] > 0].tolist()


def test_partial_rollouts_carry_each_tokens_version_and_log_prob(long_run):
    """A push in the middle of long generations: the samples it splits carry two versions, and
    each token's behaviour log-prob is the engine's at the version that sampled it."""
    import ray

    from xray.run.detached.buffer import BufferActor
    from xray.run.detached.maker import ExperienceMaker
    from xray.data import columns as C
    from xray.sync import stage
    from xray.sync.weights import random_probe

    trainer, data = long_run
    m, cfg = trainer.models, trainer.cfg
    cfg = dataclasses.replace(cfg, async_=dataclasses.replace(cfg.async_, segment_tokens=2))
    start = trainer.state.step
    buffer = ray.remote(BufferActor).options(num_cpus=0).remote(data.train, data.sampler, 4, [[0]], 100, "wait", 4, start)
    maker = ray.remote(ExperienceMaker).options(num_cpus=0, max_concurrency=100).remote(
        0, m.rollout.replica(0), m.reference, trainer.score_fn, buffer, cfg, [], trainer.pad_id, 4, start, 10.0)
    running = maker.run.remote()  # no stop token: a sample runs to 40 tokens (or eos), 20 slowed segments
    while ray.get(maker.stats.remote())["segments"] < 3:
        time.sleep(0.02)

    async def one_update() -> float:  # a PPO update of the actor on samples of the other replica
        from xray.data.batch import Batch

        rows = data.next_train_rows()[:16]
        gen = m.rollout.replica(1).generate([r["prompt_ids"] for r in rows], trainer.sampling(1), pad_id=trainer.pad_id)
        exp, old = await gen, await m.actor.forward(gen)
        values = await m.critic.forward(gen)
        advantages = torch.randn(exp[C.LOSS_MASK].shape, generator=torch.Generator().manual_seed(1))
        await trainer.train(Batch({C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK],
                                   C.LOSS_MASK: exp[C.LOSS_MASK], C.OLD_LOGPROBS: old[C.LOGPROBS],
                                   C.BEHAVIOUR_LOGPROBS: exp[C.BEHAVIOUR_LOGPROBS], C.OLD_VALUES: values[C.VALUES],
                                   C.ADVANTAGES: advantages * exp[C.LOSS_MASK], C.RETURNS: values[C.VALUES]}), 1)
        probe, lens = random_probe(data.model_dir, 1, 1, seed=5)
        t0 = time.perf_counter()
        loaded = maker.load.remote(stage(m.actor, start + 1, cfg.sync, probe, lens))
        published = time.perf_counter() - t0
        report, _ = await loaded
        assert report.version == start + 1 and report.max_abs_logprob_diff <= FP32_PROBE
        return published

    published = asyncio.run(one_update())
    assert published < 0.1  # the publisher never waits for the maker's generations
    groups = []  # in the order they ended: the first may have ended (eos) before the push
    while not any(len({*versions_of(g)}) > 1 for g in groups) and len(groups) < 16:
        taking = buffer.take.remote(start + 1)
        ready, _ = ray.wait([taking, running], num_returns=1)
        if running in ready:
            ray.get(running)  # the maker's error
        groups += ray.get(taking)[0]
    maker.stop.remote()
    ray.get(running)
    from xray.data.batch import Batch

    batch = Batch.concat([rows_of(g) for g in groups], pad_width=True)
    mask, versions = batch[C.LOSS_MASK] > 0, batch[C.BEHAVIOUR_VERSIONS]
    split = [i for i in range(len(batch)) if set(versions[i][mask[i]].tolist()) == {start, start + 1}]
    assert split, "the push landed between two segments of no sample"
    sequences = [list(batch[C.PROMPT_IDS][i]) + list(batch[C.RESPONSE_IDS][i]) for i in split]
    lens = [len(batch[C.PROMPT_IDS][i]) for i in split]
    old_engine = m.rollout.replica(1).logprobs(sequences, lens).get()  # still at the old version
    new_engine = m.rollout.replica(0).logprobs(sequences, lens).get()
    actor = m.actor.forward(batch.index(split)).get()[C.LOGPROBS]
    moved = 0.0
    for row, i in enumerate(split):
        behaviour, v = batch[C.BEHAVIOUR_LOGPROBS][i][mask[i]], versions[i][mask[i]]
        old, new = torch.tensor(old_engine[row]), torch.tensor(new_engine[row])
        assert (behaviour[v == start] - old[v == start]).abs().max() <= FP32_PROBE
        assert (behaviour[v == start + 1] - new[v == start + 1]).abs().max() <= FP32_PROBE
        assert (behaviour[v == start + 1] - actor[row][mask[i]][v == start + 1]).abs().max() <= FP32_PROBE
        moved = max(moved, float((old[v == start + 1] - new[v == start + 1]).abs().max()))
    assert moved > 100 * FP32_PROBE  # the two versions differ where it matters: the check can fail
    for handle in (maker, buffer):
        ray.kill(handle)
    asyncio.run(trainer.resync(data.eval_rows, trainer.state.step))  # both replicas at the actor's weights again


def test_no_experience_through_the_driver_and_no_head_of_line_blocking(long_run, monkeypatch):
    """One run proves both: its `BASELINE_STEPS` steps are the data-plane check and the unslowed
    baseline of the head-of-line check; 10 more steps with maker 1 slowed tenfold are the other side."""
    trainer, data = long_run

    def steps_per_s(rows: list[tuple[float, dict]]) -> float:
        ends = [end for end, _ in rows[2:]]  # after two warm-up steps
        return (len(ends) - 1) / (ends[-1] - ends[0])

    before = _memory_of(os.getpid())
    rows = asyncio.run(_steps(trainer, data, BASELINE_STEPS))
    after = _memory_of(os.getpid())
    experience = sum(m["async/experience_bytes"] for _, m in rows)
    assert experience >= 24 << 20, experience
    assert after["hwm_kb"] - before["hwm_kb"] < 8 << 10
    assert after["rchar"] - before["rchar"] < 1 << 20
    steps = [m for _, m in rows]
    assert all(m["async/publish_s"] < 0.1 for m in steps)  # a push never waits for the makers
    first = trainer.state.step - BASELINE_STEPS  # the version the makers held at the start; then one push a step
    versions = [m["sync/version"] for m in steps if "sync/version" in m]
    assert versions == sorted(set(versions)), versions  # none lost
    assert versions[-1] >= first + BASELINE_STEPS - 3, versions  # little lag
    assert sum(m.get("sync/pushes_verified", 0) for m in steps) == versions[-1] - first, versions  # each once
    assert all(m["async/push_latency_s"] > 0 for m in steps if "sync/version" in m)  # every push reported

    monkeypatch.setenv("XRAY_MAKER_SLOWDOWN", "1:10")
    slowed = asyncio.run(_steps(trainer, data, 10))
    made = [sum(m[f"async/trainer0_from_maker{i}"] for _, m in slowed[2:]) for i in range(2)]
    assert made[0] > made[1], made  # the fast maker fed most of it
    assert steps_per_s(slowed) >= 0.7 * steps_per_s(rows), (steps_per_s(slowed), steps_per_s(rows), made)
