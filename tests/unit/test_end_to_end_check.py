"""The end-to-end check of a weight sync, for free: a step's rollout log-probs against the actor's
own before the step trains on them. Off-policy (PPO, critic-free with KL or epochs) the trainer
compares them with its recomputed old log-probs; on-policy the policy loss compares them with the
training forward's and, beyond the bound, asks the engine to leave the whole update out (every
replica agreeing); the sync's probe then runs only at the first sync, every `sync.probe_every` and
the last."""
import asyncio
import types

import pytest
import torch

from algorithms.core.policy_loss import PolicyLoss
from xray.backends.optim import skips_update
from xray.data import columns as C
from xray.data.batch import Batch
from xray.sync import WeightSyncError
from xray.sync.end_to_end import GapBound
from algorithms.specs import default_config, command_spec

pytestmark = pytest.mark.unit
NO_REF = "--device_groups.train_group.workers=[actor]"  # kl_in=none starts no reference


def batch(gap: float) -> tuple[dict, Batch]:
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 6, generator=g)
    behaviour = logprobs.clone()
    behaviour[2, 3] += gap
    mask = torch.ones(4, 6)
    mask[:, :2] = 0  # prompt positions: never compared
    behaviour[0, 0] += 5.0
    b = Batch({C.LOSS_MASK: mask, C.ADVANTAGES: torch.randn(4, 6, generator=g), C.BEHAVIOUR_LOGPROBS: behaviour})
    return {C.LOGPROBS: logprobs.requires_grad_()}, b


def test_on_policy_loss_leaves_the_update_out_beyond_the_bound():
    loss_fn = PolicyLoss(on_policy=True, end_to_end_bound=GapBound("max", 1e-3))
    assert C.BEHAVIOUR_LOGPROBS in loss_fn.reads
    outputs, b = batch(gap=1e-4)
    loss, metrics = loss_fn(outputs, b)
    assert metrics["abort_update"] == 0.0 and metrics["rollout_gap_max"] == pytest.approx(1e-4, rel=1e-3)
    assert float(loss.detach()) != 0.0
    outputs, b = batch(gap=0.05)  # one token of one sample off: a bad sync
    loss, metrics = loss_fn(outputs, b)
    assert metrics["abort_update"] == 1.0 and float(loss.detach()) == 0.0
    outputs, b = batch(gap=float("nan"))
    assert loss_fn(outputs, b)[1]["abort_update"] == 1.0
    assert C.BEHAVIOUR_LOGPROBS not in PolicyLoss(on_policy=True).reads


def test_any_abort_leaves_the_whole_update_out():
    assert skips_update(0.0, 0.25) and skips_update(None, 1.0) and skips_update(1.0, 0.0)
    assert not skips_update(0.5, 0.0) and not skips_update(None, None)


def trainer(algo: str, *argv: str):
    from xray.run.step import RLTrainer
    from tests.unit.test_rollout_sleep import ROOT, fake_models
    from xray.train import resolve

    
    config = ROOT / "configs" / "ppo_tiny_cpu.yaml" if algo == "ppo" else default_config(algo)
    _, cfg, plan, _, _ = resolve([algo, "--config", str(config), "--data.eval_size=8", "--trainer.steps=25", *argv])
    models = fake_models([], cfg, plan, rows=8)
    return RLTrainer(cfg, models, lambda rows, r: (torch.ones(len(r)), None), pad_id=0, stop_ids=[1],
                     algorithm=command_spec(algo).algorithm(cfg))


def test_the_trainer_fails_a_bad_sync_before_training_and_probes_first_every_and_last():
    t = trainer("ppo")
    outputs, b = batch(gap=1e-5)
    exp = Batch({C.BEHAVIOUR_LOGPROBS: b[C.BEHAVIOUR_LOGPROBS]})
    gap = t.check_end_to_end(outputs[C.LOGPROBS].detach(), exp, b[C.LOSS_MASK])
    assert gap["rollout_logprob_gap_max"] == pytest.approx(1e-5, rel=1e-2)
    outputs, b = batch(gap=0.01)  # fp32 on both sides: sync.tolerance 1e-3
    with pytest.raises(WeightSyncError, match="failed the end-to-end check.*not trained on"):
        t.check_end_to_end(outputs[C.LOGPROBS].detach(), Batch({C.BEHAVIOUR_LOGPROBS: b[C.BEHAVIOUR_LOGPROBS]}),
                           b[C.LOSS_MASK])
    assert t.checks_end_to_end
    probed = []
    for version in range(1, 26):
        probed += [version] if t.probes_at(version) else []
        t.synced = True
    assert probed == [1, 10, 20, 25]  # first, every sync.probe_every=10, last (trainer.steps=25)
    with pytest.raises(ValueError, match="probe_every=0"):
        trainer("ppo", "--sync.probe_every=0").probes_at(3)


def test_on_policy_critic_free_checks_in_its_training_forward():
    t = trainer("grpo", "--ppo.ppo_epochs=1", "--critic_free.kl_in=none", "--ppo.rollout_batch_size=8", NO_REF,
                "--ppo.mini_batch_size=32")
    assert t.on_policy and t.policy_loss.end_to_end_bound == GapBound("max", t.cfg.sync.tolerance) and t.checks_end_to_end
    unverified = trainer("grpo", "--ppo.ppo_epochs=1", "--critic_free.kl_in=none", "--ppo.rollout_batch_size=8", NO_REF,
                         "--ppo.mini_batch_size=32", "--sync.verify=false")
    assert unverified.policy_loss.end_to_end_bound is None and not unverified.checks_end_to_end


def test_an_asynchronous_trainer_checks_the_tokens_sampled_with_its_own_weights():
    import types

    from xray.run.detached.trainer import AsyncTrainer

    t = trainer("ppo")
    t.state.step = 7  # the trainer holds weight version 7
    outputs, b = batch(gap=0.05)  # token (2, 3) off by 0.05: a bad sync of version 7 ...
    versions = torch.full((4, 6), 6)
    exp = Batch({C.BEHAVIOUR_LOGPROBS: b[C.BEHAVIOUR_LOGPROBS], C.BEHAVIOUR_VERSIONS: versions})
    owner = types.SimpleNamespace(t=t, checked=0)
    proximal = outputs[C.LOGPROBS].detach()
    out = AsyncTrainer.check_fresh(owner, proximal, exp, b[C.LOSS_MASK])
    assert out == {"sync/fresh_tokens": 0.0}  # ... unseen while every token is of version 6 (stale by design)
    versions[2] = 7  # row 2 sampled with version 7: compared
    with pytest.raises(WeightSyncError, match="failed the end-to-end check"):
        AsyncTrainer.check_fresh(owner, proximal, exp, b[C.LOSS_MASK])
    versions[2], versions[1] = 6, 7  # a fresh row that is right
    out = AsyncTrainer.check_fresh(owner, proximal, exp, b[C.LOSS_MASK], makers=torch.tensor([0, 1, 1, 0]))
    assert out["sync/fresh_tokens"] == 4.0 and out["sync/fresh_gap_max"] == 0.0 and owner.checked == 7
    assert (out["sync/maker0_fresh_tokens"], out["sync/maker1_fresh_tokens"]) == (0.0, 4.0)  # row 1: maker 1


def test_an_asynchronous_trainer_probes_a_version_when_no_fresh_tokens_checked_the_ones_before():
    """Makers that lag behind the trainer sample no tokens with the weights it holds, so no step
    checks those versions end to end: the push `sync.probe_every` versions after the newest one
    checked (by fresh tokens or a probe) carries the probe; fresh tokens put it off."""
    from xray.run.detached.trainer import AsyncTrainer

    t = trainer("ppo", "--sync.probe_every=3", "--trainer.steps=20")
    owner = types.SimpleNamespace(t=t, checked=0)
    probes = lambda v: AsyncTrainer.probes(owner, v)  # noqa: E731
    assert probes(1)  # the first push
    t.synced = True
    lagging = [v for v in range(1, 12) if probes(v) and not setattr(owner, "checked", v)]
    assert lagging == [3, 6, 9]  # never more than 2 versions in a row unchecked end to end
    owner.checked = 12  # fresh tokens of version 12 checked it
    assert not probes(13) and not probes(14) and probes(15) and probes(20)  # and the run's last
    outputs, b = batch(gap=1e-5)
    t.state.step = 16  # a step whose batch holds fresh tokens of the trainer's version moves `checked`
    exp = Batch({C.BEHAVIOUR_LOGPROBS: b[C.BEHAVIOUR_LOGPROBS], C.BEHAVIOUR_VERSIONS: torch.full((4, 6), 16)})
    AsyncTrainer.check_fresh(owner, outputs[C.LOGPROBS].detach(), exp, b[C.LOSS_MASK])
    assert owner.checked == 16 and not probes(18) and probes(19)


def test_an_asynchronous_trainer_reports_per_maker_which_versions_were_checked_how():
    """Each maker's newest loaded version (its sync checked completely and exactly) and the newest
    whose load ran the probe; a maker that skipped a version (a newer one arrived) or was lost
    answers None and reports nothing for it."""
    from xray.run.detached.trainer import AsyncTrainer
    from xray.sync import SyncReport

    def report(version, probed):
        diff = 0.001 if probed else float("nan")
        return SyncReport(version, 10, 0.1, 0.01, diff, mean_abs_logprob_diff=diff, held_exact=3, held_functional=1,
                          unchecked=0, held_tensors=4), 100.0 + version

    async def pushes():
        loop = asyncio.get_running_loop()
        out = []
        for version, answers in ((4, [report(4, True), report(4, True)]), (5, [report(5, False), None])):
            loads = []
            for answer in answers:
                done = loop.create_future()
                done.set_result(answer)
                loads.append(done)
            out.append({"version": version, "published": 99.0, "loads": loads})
        return out

    owner = types.SimpleNamespace(pushes=asyncio.run(pushes()))
    out = AsyncTrainer.loaded(owner)
    assert out["sync/version"] == 5.0 and out["sync/pushes_verified"] == 2.0 and out["sync/loads_probed"] == 2.0
    assert (out["sync/maker0_version"], out["sync/maker0_probed_version"]) == (5.0, 4.0)
    assert (out["sync/maker1_version"], out["sync/maker1_probed_version"]) == (4.0, 4.0)  # it skipped 5
    assert out["sync/held_exact"] == 9.0 and out["sync/replicas_loaded"] == 3.0 and owner.pushes == []


def test_the_bf16_bound_passes_each_sides_own_bf16_error_and_fails_a_wrong_model():
    """In bf16 the mean gap is bounded, the largest only logged. Measured on vs_trl's small model at
    sync 257 (a false alarm at the old per-token bound of 0.25): at one token HF fp32 gave -1.4468,
    Megatron bf16 -1.6314 and vLLM bf16 -1.3630, each side's own rounding, 0.268 apart; a real
    SmolLM2 run's worst token was 0.874 apart (it failed the per-token bound of 0.5) while its mean
    stayed at 0.04. Both pass among tokens with SmolLM2's bf16 noise; the same probe with every
    token 0.2 off (a wrong weight moves every token) fails, and so does NaN."""
    from xray.config.schema import SyncConfig
    from xray.sync.weights import check_logprobs, probe_bound

    bound = probe_bound(SyncConfig(), ["bfloat16", "float32"])
    g = torch.Generator().manual_seed(0)
    actor = -torch.rand(4, 24, generator=g) * 3
    lens = [4] * 4
    probe = [[1] * 25 for _ in range(4)]
    noise = torch.randn(4, 24, generator=g) * 0.06  # rms 0.065-0.069 measured on SmolLM2
    engine_t = actor + noise
    engine_t[0, 6] = actor[0, 6] + 0.2684
    engine_t[1, 9] = actor[1, 9] - 0.874
    engine = [row[p - 1:].tolist() for row, p in zip(engine_t, lens)]
    gap = check_logprobs(actor, engine, probe, lens, 257, bound)
    assert gap["rollout_logprob_gap_max"] == pytest.approx(0.874, abs=1e-3)
    assert 0.04 < gap["rollout_logprob_gap_mean"] < 0.07
    wrong = [[x + 0.2 for x in row] for row in engine]
    with pytest.raises(WeightSyncError, match=r"by 2\.\d+e-01 on average .*bound: mean gap per token <= 0.15"):
        check_logprobs(actor, wrong, probe, lens, 258, bound)
    engine[2][3] = float("nan")
    with pytest.raises(WeightSyncError, match="nan on average"):
        check_logprobs(actor, engine, probe, lens, 259, bound)
    fp32 = probe_bound(SyncConfig(), ["float32"])  # fp32: the largest gap of any token is bounded
    with pytest.raises(WeightSyncError, match=r"up to 8\.7\d+e-01 .*bound: max gap per token <= 0.001"):
        check_logprobs(actor, [row[p - 1:].tolist() for row, p in zip(engine_t, lens)], probe, lens, 260, fp32)


def test_an_on_policy_bf16_step_bounds_the_mean_gap_of_each_micro_batch():
    loss_fn = PolicyLoss(on_policy=True, end_to_end_bound=GapBound("mean", 0.15))
    outputs, b = batch(gap=0.9)  # one token far off: bf16's tail, within the mean bound
    loss, metrics = loss_fn(outputs, b)
    assert metrics["abort_update"] == 0.0 and metrics["rollout_gap_max"] == pytest.approx(0.9, rel=1e-3)
    outputs, b = batch(gap=0.0)
    b[C.BEHAVIOUR_LOGPROBS].add_(0.2)  # every token off: a wrong weight
    loss, metrics = loss_fn(outputs, b)
    assert metrics["abort_update"] == 1.0 and float(loss.detach()) == 0.0
