"""Weight sync actor -> rollout through the runtime: exact greedy output, verification, sampling.

A Megatron actor with tp=2 is trained a few steps, then synced to a rollout engine of 2
replicas (vLLM, and DeepSpeed-Inference). After the sync, greedy generation of 16 prompts must
equal Hugging Face `generate` on the actor's exported weights token for token (with a top-2
logit gap > 1e-3 along the way, so the comparison means something); a tensor corrupted in transit
must be caught by the verification; sampling with a seed must repeat, and the engine's
log-probs must agree with the actor's recomputation. A vLLM rollout of 2 replicas of tp=2 starts,
syncs and generates what Hugging Face does (slow tier).
"""
import asyncio

import pytest
import ray
import torch

from tests.backends.rollout_common import (hf_greedy, hf_sequence_stats, make_prompts, pattern_batch,
                                           trained_tiny_model)
from xray.check.reference import policy_loss
from xray.config.optim import OptimConfig
from xray.config.parallel import ParallelDims
from xray.config.schema import SyncConfig
from xray.data import columns as C
from xray.sync import WeightSyncError, sync_weights
from xray.sync.weights import pad_sequences
from xray.transport.wire import pack_bucket
from xray.wholemodel import WholeModel
from xray.workhorse.rollout import RolloutWorkhorse
from xray.workhorse.train import TrainWorkhorse

pytestmark = pytest.mark.ray
GREEDY = dict(temperature=0.0, max_new_tokens=12, stop_token_ids=[2], seed=0)


@pytest.fixture(scope="module")
def actor(local_ray, tmp_path_factory):
    model_dir = trained_tiny_model(tmp_path_factory.mktemp("sync") / "tiny", steps=30)
    wm = WholeModel(TrainWorkhorse, role="actor", parallel=ParallelDims(tp=2),
                    init_kwargs=dict(backend="megatron", model_dir=str(model_dir), optim=OptimConfig(lr=5e-3)))
    for step in range(3):  # move the actor away from the directory both sides start from
        wm.train_step(pattern_batch(8, 24, 256, seed=10 + step), policy_loss, 4).get()
    yield wm, model_dir
    wm.shutdown()


@pytest.mark.parametrize("engine", ["vllm", "dsinfer"])
def test_sync_then_greedy_equals_hf_and_corruption_is_caught(actor, engine):
    from transformers import AutoModelForCausalLM

    actor_wm, model_dir = actor
    rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(dp=2),
                         init_kwargs=dict(backend=engine, model_dir=str(model_dir), max_model_len=256))
    try:
        prompts = make_prompts(16)
        before = rollout.generate(prompts, GREEDY).get()
        probe = [p + r for p, r in zip(prompts[:4], before[C.RESPONSE_IDS][:4])]
        report = asyncio.run(sync_weights(actor_wm, rollout, 1, SyncConfig(), probe, [len(p) for p in prompts[:4]]))
        assert report.max_abs_logprob_diff <= 1e-4 and report.bytes > 0
        # every tensor compared bit for bit where the engine shows it; vLLM on CPU repacks its
        # linear layers and drops their plain weights (embedding, 5 norms, lm_head stay readable):
        # its 8 fused linear layers are checked by their products; nothing is left unchecked
        assert report.held_exact == (2 * 21 if engine == "dsinfer" else 2 * 7), report
        assert report.held_functional == (0 if engine == "dsinfer" else 2 * 8) and report.unchecked == 0, report
        assert rollout.weight_version().get() == [1, 1]

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        hf.load_state_dict(actor_wm.state_dict().get())
        expected = hf_greedy(hf, prompts, GREEDY["max_new_tokens"])
        got = rollout.generate(prompts, GREEDY).get()
        assert got.meta["weight_version"] == 1
        assert got[C.RESPONSE_IDS] == expected
        assert got[C.RESPONSE_IDS] != before[C.RESPONSE_IDS]  # the sync changed what the engine says
        _, gap = hf_sequence_stats(hf, [p + r for p, r in zip(prompts, expected)], [len(p) for p in prompts])
        assert gap > 1e-3

        sampling = dict(temperature=1.0, max_new_tokens=8, seed=7)
        a, b = rollout.generate(prompts, sampling).get(), rollout.generate(prompts, sampling).get()
        assert a[C.RESPONSE_IDS] == b[C.RESPONSE_IDS]
        seqs = [p + r for p, r in zip(prompts, a[C.RESPONSE_IDS])]
        actor_logp = actor_wm.forward(pad_sequences(seqs)).get()[C.LOGPROBS]
        worst = max(float((actor_logp[i, len(p) - 1:len(p) - 1 + len(lp)] - torch.tensor(lp)).abs().max())
                    for i, (p, lp) in enumerate(zip(prompts, a["response_logprobs"])) if lp)
        assert worst <= 1e-4

        with pytest.raises(WeightSyncError, match="version 2 failed verification"):
            asyncio.run(sync_weights(actor_wm, rollout, 2, SyncConfig(), probe, [len(p) for p in prompts[:4]],
                                     corrupt="model.layers.1.mlp.down_proj.weight"))
        # each way a real sync goes wrong, caught by its part (xray/transport/faults.py)
        o_proj, down = "model.layers.{}.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"
        for fault, caught in ((f"swap:{o_proj.format(0)},{o_proj.format(1)}", "changed in transit"),
                              (f"rows:{down}", "changed in transit"), (f"transpose:{o_proj.format(0)}", "changed in transit"),
                              ("drop:model.norm.weight", "incomplete.*sent but never loaded .model.norm.weight"),
                              ("unsent:model.norm.weight", "incomplete.*needs were not sent .model.norm.weight"),
                              (f"rename:{o_proj.format(0)},{o_proj.format(1)}", "the rollout engine's log-probs differ")):
            with pytest.raises(WeightSyncError, match=caught):  # a wrong mapping: only the probe can see it
                asyncio.run(sync_weights(actor_wm, rollout, 2, SyncConfig(), probe, [len(p) for p in prompts[:4]],
                                         corrupt=fault))

        # a bucket that does not load fails the finish_sync queued behind it: no version taken
        held_version = rollout.weight_version().get()[0]
        shard = rollout.shard_handles()[0]
        load = shard.load_bucket.remote(pack_bucket([("model.layers.0.no_such_proj.weight", torch.zeros(4))]))
        finish = shard.finish_sync.remote(3)
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(load)
        with pytest.raises(ray.exceptions.RayTaskError, match="version 3 failed on rollout replica 0: a bucket did not load"):
            ray.get(finish)
        assert rollout.weight_version().get()[0] == held_version
        # a push that fails before queueing finish_sync queues abort_sync: the next sync is clean
        shard.load_bucket.remote(pack_bucket([("model.layers.0.no_such_proj.weight", torch.zeros(4))]))
        ray.get(shard.abort_sync.remote())
        asyncio.run(sync_weights(actor_wm, rollout, 4, SyncConfig(), probe, [len(p) for p in prompts[:4]]))
        assert rollout.weight_version().get() == [4, 4]
    finally:
        rollout.shutdown()


@pytest.mark.slow  # 6 processes: the default tier's budget
def test_vllm_tp2_dp2_generates_and_syncs(actor):
    """Two vLLM replicas of tp=2 (4 processes): each replica's shards form their own world (vLLM's
    external launcher wants one of tp); the sync reaches all four and greedy output matches HF."""
    from transformers import AutoModelForCausalLM

    actor_wm, model_dir = actor
    rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(tp=2, dp=2),
                         init_kwargs=dict(backend="vllm", model_dir=str(model_dir), max_model_len=256))
    try:
        prompts = make_prompts(8)
        probe = [list(p) + [5, 6, 7] for p in prompts[:4]]
        report = asyncio.run(sync_weights(actor_wm, rollout, 1, SyncConfig(), probe, [len(p) for p in prompts[:4]]))
        assert report.max_abs_logprob_diff <= 1e-4 and rollout.weight_version().get() == [1, 1, 1, 1]
        # each of the 4 shards checked its own part of the 15 tensors it holds: the vocabulary-parallel
        # embedding and head and the norms bit for bit, its slices of the linear layers by their products
        assert report.unchecked == 0 and report.held_exact + report.held_functional == 4 * 15, report
        assert report.held_exact >= 4 * 7, report
        with pytest.raises(WeightSyncError, match="changed in transit"):
            asyncio.run(sync_weights(actor_wm, rollout, 2, SyncConfig(), probe, [len(p) for p in prompts[:4]],
                                     corrupt="rows:model.layers.1.mlp.down_proj.weight"))
        asyncio.run(sync_weights(actor_wm, rollout, 1, SyncConfig(), probe, [len(p) for p in prompts[:4]]))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        hf.load_state_dict(actor_wm.state_dict().get())
        got = rollout.generate(prompts, GREEDY).get()
        assert got[C.RESPONSE_IDS] == hf_greedy(hf, prompts, GREEDY["max_new_tokens"])
    finally:
        rollout.shutdown()


@pytest.mark.slow  # 27 s: the default tier's budget (the bf16 e2e runs verify their syncs exactly)
def test_bf16_sync_is_verified_exactly(local_ray, tmp_path_factory, actor):
    """A bf16 Megatron actor (tp=2) synced to a bf16 vLLM and a bf16 DeepSpeed-Inference replica:
    the exact checks pass (every readable engine tensor bit-equal to the actor's; the coarse probe
    passes the runtime's `bf16_mean_tolerance`, or the sync would fail), and a tensor changed in transit fails the sync even though the
    probe could not see it. An fp32 actor's weights reach a bf16 engine rounded to nearest, as
    held-checked."""
    model_dir = trained_tiny_model(tmp_path_factory.mktemp("sync16") / "tiny", steps=30)
    bf16_actor = WholeModel(TrainWorkhorse, role="actor", parallel=ParallelDims(tp=2),
                            init_kwargs=dict(backend="megatron", model_dir=str(model_dir),
                                             optim=OptimConfig(lr=5e-3), dtype="bfloat16"))
    rollouts = [WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(dp=1),
                           init_kwargs=dict(backend=engine, model_dir=str(model_dir), max_model_len=256,
                                            dtype="bfloat16")) for engine in ("vllm", "dsinfer")]
    try:
        for step in range(2):
            bf16_actor.train_step(pattern_batch(8, 24, 256, seed=10 + step), policy_loss, 4).get()
        prompts = make_prompts(4)
        probe = [p + r for p, r in zip(prompts, rollouts[0].generate(prompts, GREEDY).get()[C.RESPONSE_IDS])]
        lens = [len(p) for p in prompts]
        for rollout, holds, read_back in zip(rollouts, (15, 21), (7, 21)):  # tests/e2e/test_ppo_e2e.HOLDS
            report = asyncio.run(sync_weights(bf16_actor, rollout, 1, SyncConfig(), probe, lens))
            # the probe is coarse in bf16: the exact check is the proof
            assert report.held_exact + report.held_functional == holds and report.held_exact >= read_back, report
            with pytest.raises(WeightSyncError, match="changed in transit"):
                asyncio.run(sync_weights(bf16_actor, rollout, 2, SyncConfig(), probe, lens,
                                         corrupt="model.layers.1.mlp.down_proj.weight"))
        fp32_actor = actor[0]
        report = asyncio.run(sync_weights(fp32_actor, rollouts[1], 3, SyncConfig(), probe, lens))
        assert report.held_exact == 21
    finally:
        for m in (bf16_actor, *rollouts):
            m.shutdown()


@pytest.mark.parametrize("engine", ["vllm", pytest.param("dsinfer", marks=pytest.mark.slow)])  # the default tier's budget
def test_every_transport_syncs_exactly(actor, engine):
    """The process group, the shared-memory slots and the object store bring the same weights to
    2 replicas (greedy output equal), verified the same way, a tensor changed in transit caught;
    `auto` on one CPU node takes the slots; `overlap=False` runs the actor's probe before the push
    (queued together: each actor rank runs its probe, then its part of the push), the others while
    it sends."""
    actor_wm, model_dir = actor
    rollout = WholeModel(RolloutWorkhorse, role="rollout", parallel=ParallelDims(dp=2),
                         init_kwargs=dict(backend=engine, model_dir=str(model_dir), max_model_len=256))
    try:
        prompts = make_prompts(8)
        probe = [p + [5, 6, 7, 8] for p in prompts[:4]]
        lens = [len(p) for p in prompts[:4]]
        pg = asyncio.run(sync_weights(actor_wm, rollout, 1, SyncConfig(transport="pg"), probe, lens))
        assert pg.transport == "pg" and pg.max_abs_logprob_diff <= 1e-4
        assert pg.held_exact == (2 * 21 if engine == "dsinfer" else 2 * 7)
        assert pg.held_functional == (0 if engine == "dsinfer" else 2 * 8)
        by_group = rollout.generate(prompts, GREEDY).get()[C.RESPONSE_IDS]
        for version, transport in ((2, "objstore"), (3, "auto"), (4, "shm")):
            actor_wm.busy_time().get()  # drained: what follows is this sync's
            report = asyncio.run(sync_weights(actor_wm, rollout, version, SyncConfig(transport=transport,
                                                                                     bucket_mb=1), probe, lens,
                                              overlap=version != 2))
            assert report.transport == ("shm" if transport == "auto" else transport), report
            ranks = [r["intervals"] for r in actor_wm.busy_time().get()]
            probe_first = {max(end for _, end, name in busy if name == "forward") <=
                           min(start for start, _, name in busy if name == "push_weights")
                           for busy in ranks if any(name == "push_weights" for *_, name in busy)}
            assert probe_first == {version == 2}, ranks  # overlap=False: each rank's probe before its push
            assert report.bytes == pg.bytes and (report.held_exact, report.held_functional) == (pg.held_exact, pg.held_functional)
            assert rollout.generate(prompts, GREEDY).get()[C.RESPONSE_IDS] == by_group
        for version, transport in ((5, "pg"), (6, "shm")):
            with pytest.raises(WeightSyncError, match=f"version {version} failed verification"):
                asyncio.run(sync_weights(actor_wm, rollout, version, SyncConfig(transport=transport), probe, lens,
                                         corrupt="model.layers.1.mlp.down_proj.weight"))
    finally:
        rollout.shutdown()
