"""Asynchronous PPO's pure parts: the decoupled loss, the experience buffer's admission control,
staleness policy, arrival-order takes and routing, per-token staleness, the maker/trainer graph,
and each trainer's share of the mini-batches."""
from types import SimpleNamespace

import pytest
import torch

from xray.run.detached.trainer import staleness
from xray.run.detached.buffer import ExperienceBuffer, Group
from algorithms.core.policy_loss import PolicyLoss, behaviour_weight
from xray.run.minibatches import mini_batch_rows
from xray.config.graph import build_graph
from xray.config.typed import ConfigError
from xray.data import columns as C
from xray.data.batch import Batch

pytestmark = pytest.mark.unit


def batch(old, behaviour, advantages, mask):
    return Batch({C.OLD_LOGPROBS: old, C.BEHAVIOUR_LOGPROBS: behaviour, C.ADVANTAGES: advantages, C.LOSS_MASK: mask})


def test_decoupled_loss_is_the_synchronous_loss_at_staleness_0():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g)
    new = (old + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_()
    adv, mask = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    b = batch(old, old.clone(), adv, mask)  # the behaviour policy is the proximal one
    sync_loss, _ = PolicyLoss(cliprange=0.2)({C.LOGPROBS: new}, b)
    async_loss, metrics = PolicyLoss(cliprange=0.2, behaviour_weight_cap=2.0)({C.LOGPROBS: new}, b)
    assert torch.equal(sync_loss, async_loss) and metrics["behaviour_weight"] == 1.0
    (g_sync,) = torch.autograd.grad(sync_loss, new)
    (g_async,) = torch.autograd.grad(async_loss, new)
    assert torch.equal(g_sync, g_async)
    assert C.BEHAVIOUR_LOGPROBS in PolicyLoss(behaviour_weight_cap=2.0).reads
    assert C.BEHAVIOUR_LOGPROBS not in PolicyLoss().reads


def test_truncated_weight_per_token():
    proximal = torch.log(torch.tensor([[0.5, 0.5, 0.9, 0.2]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.4]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = behaviour_weight(proximal, behaviour, mask, cap=3.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 3.0, 0.0]]))  # ratio 1, 2, 9 -> capped at 3; off the mask 0
    adv = torch.ones(1, 4)
    loss, _ = PolicyLoss(cliprange=10.0, behaviour_weight_cap=3.0)(
        {C.LOGPROBS: proximal}, batch(proximal, behaviour, adv, mask))
    assert loss.item() == pytest.approx(-(1.0 + 2.0 + 3.0) / 3)  # ratio 1 at the proximal policy: -A x w


def prompts():
    """A sampler of numbered prompt rows, 4 at a time."""
    drawn = iter(range(10_000))
    return lambda: [{"n": next(drawn)} for _ in range(4)]


def group(key, row, version, maker=0, tokens=3):
    return Group([f"ref{key}"], version, maker, tokens, row, key)


def test_admission_is_areals_rule_and_leases_may_be_partial():
    # share 4, max_staleness 1: a maker at version v may have started (1 + v + 1) x 4 groups in all
    buf = ExperienceBuffer(share=4, feeds=[[0], [0]], draw=prompts(), max_staleness=1, capacity=10)
    first = buf.lease(0, 6, maker_version=0)
    assert [k for k, _ in first] == [1, 2, 3, 4, 5, 6] and [r["n"] for _, r in first] == [0, 1, 2, 3, 4, 5]
    assert len(buf.lease(1, 6, maker_version=0)) == 2  # 8 - 6: a partial lease
    assert buf.lease(1, 6, maker_version=0) == []  # the bound: wait for newer weights
    assert len(buf.lease(1, 6, maker_version=1)) == 4  # (1 + 1 + 1) x 4 - 8
    assert buf.running == [12] and buf.stats()["async/prompts_in_flight"] == 12.0
    drop = ExperienceBuffer(share=4, feeds=[[0]], draw=prompts(), on_stale="drop", capacity=2)
    assert len(drop.lease(0, 20, maker_version=0)) == 8  # drop: only the capacity bounds it


def test_takes_in_arrival_order_so_a_slow_maker_blocks_no_one():
    buf = ExperienceBuffer(share=2, feeds=[[0], [0]], draw=prompts(), max_staleness=1, capacity=4)
    slow = buf.lease(1, 2, 0)  # maker 1 leases first and is still making
    fast = buf.lease(0, 4, 0)
    assert buf.take(0) is None
    buf.put([group(k, r, 0) for k, r in fast[:2]])
    taken = buf.take(0)  # maker 0's groups, made after maker 1's were leased, go first
    assert [g.key for g in taken[0]] == [k for k, _ in fast[:2]] and all(g.maker == 0 for g in taken[0])
    assert buf.put([group(k, r, 0, maker=1) for k, r in slow]) == 2
    assert [g.maker for g in buf.take(1)[0]] == [1, 1]


def test_too_stale_groups_are_made_again_or_dropped():
    for on_stale in ("wait", "drop"):
        buf = ExperienceBuffer(share=2, feeds=[[0]], draw=prompts(), max_staleness=1, on_stale=on_stale, capacity=4)
        leased = buf.lease(0, 4, 0)
        buf.put([group(k, r, version=0) for k, r in leased[:2]] + [group(k, r, version=2) for k, r in leased[2:]])
        taken = buf.take(trainer_version=2)  # the two of version 0 are 2 behind: too stale
        assert [g.version for g in taken[0]] == [2, 2] and buf.queues[0] == []
        if on_stale == "wait":  # their prompts first in line, nothing lost
            assert buf.requeued_stale == 2 and [r["n"] for r in buf.rows] == [0, 1]
            assert [r["n"] for _, r in buf.lease(0, 2, 2)] == [0, 1]
        else:
            assert buf.dropped == 2 and not buf.rows


def test_a_lost_makers_prompts_are_queued_again_once():
    buf = ExperienceBuffer(share=2, feeds=[[0], [0]], draw=prompts(), max_staleness=2, capacity=4)
    mine, other = buf.lease(0, 3, 0), buf.lease(1, 1, 0)
    buf.put([group(*mine[0], 0)])  # one of the lost maker's groups was put before it died
    assert buf.requeue(0) == 2 and buf.running == [1]
    assert [r["n"] for r in buf.rows] == [1, 2]
    assert buf.put([group(*mine[1], 0)]) == 0 and buf.late == 1  # a put that raced the requeue: ignored
    again = buf.lease(1, 2, 0)
    assert [r["n"] for _, r in again] == [1, 2]  # the same prompts, new leases
    assert buf.put([group(k, r, 0, maker=1) for k, r in [*other, *again]]) == 3
    assert sorted(g.row["n"] for g in buf.queues[0]) == [0, 1, 2, 3]


def test_a_take_with_a_lost_group_is_given_back_and_its_prompt_made_again():
    buf = ExperienceBuffer(share=2, feeds=[[0], [0]], draw=prompts(), max_staleness=2, capacity=4)
    leased = buf.lease(0, 3, 0)
    assert buf.put([group(k, r, 0) for k, r in leased]) == 3
    taken = buf.take(0)
    assert [g.row["n"] for g in taken[0]] == [0, 1] and buf.accepted == [3]
    assert buf.give_back(taken, {(0, 1)}) == 1  # group n=1's experience was gone
    assert [g.row["n"] for g in buf.queues[0]] == [0, 2]  # the fetched one first in line, in order
    assert [r["n"] for r in buf.rows] == [1] and buf.accepted == [2] and buf.requeued_lost == 1
    assert buf.take(0) is not None and buf.queues[0] == []
    again = buf.lease(1, 1, 0)  # any maker makes it again, first in line
    assert [r["n"] for _, r in again] == [1]
    assert buf.stats()["async/requeued_lost"] == 1.0


def test_a_rollback_makes_again_what_discarded_versions_sampled():
    """The trainer went back to version 3 (rollback 1): version-4 groups queued or put by a maker
    that had not loaded the restored weights are made again; the same groups of rollback 1 stay."""
    buf = ExperienceBuffer(share=2, feeds=[[0]], draw=prompts(), max_staleness=2, capacity=4, version=3)
    leased = buf.lease(0, 4, 3)
    buf.put([Group(["r"], 3, 0, 3, r, k, newest=v) for (k, r), v in zip(leased[:2], (3, 4))])
    buf.rewind(3, 0, epoch=1)
    assert [g.row["n"] for g in buf.queues[0]] == [0] and [r["n"] for r in buf.rows] == [1]
    assert buf.requeued_rollback == 1 and buf.accepted == [3 * 2 + 1]
    (k2, r2), (k3, r3) = leased[2:]
    assert buf.put([Group(["r"], 4, 0, 3, r2, k2, newest=4, epoch=0)]) == 0  # sampled by discarded weights
    assert buf.put([Group(["r"], 3, 0, 3, r3, k3, newest=4, epoch=1)]) == 1  # version 4 of rollback 1
    assert [r["n"] for r in buf.rows] == [2, 1] and buf.requeued_rollback == 2 and buf.running == [0]
    assert buf.stats()["async/requeued_rollback"] == 2.0


def test_the_buffer_keeps_the_takes_in_hand_and_gives_them_back_when_the_trainer_goes_back():
    """Steps 1-3 take two groups each; the trainer (or a new one: the buffer outlives it) goes back
    to step 1's snapshot: steps 2 and 3's groups go back to the front of the queue in their order
    (trained again, nothing skipped) and nothing counts as unaccepted; the takes kept are the last
    HELD_TAKES, and a step older than those counts as never accepted (its prompts made again)."""
    from xray.run.detached.buffer import HELD_TAKES

    buf = ExperienceBuffer(share=2, feeds=[[0]], draw=prompts(), max_staleness=9, capacity=9)
    buf.put([group(k, r, 0) for k, r in buf.lease(0, 8, 0)])
    taken = [buf.take(v) for v in range(3)]
    assert [[g.row["n"] for g in t[0]] for t in taken] == [[0, 1], [2, 3], [4, 5]]
    assert sorted(buf.in_hand) == [1, 2, 3] and buf.last_taken == 3 and buf.accepted == [8]
    assert buf.back_to(1, epoch=1) == 2
    assert [g.row["n"] for g in buf.queues[0]] == [2, 3, 4, 5, 6, 7] and buf.accepted == [8]
    assert sorted(buf.in_hand) == [1] and buf.last_taken == 1 and buf.epoch == 1
    for v in range(1, HELD_TAKES + 2):  # more takes than kept: the oldest go
        buf.put([group(k, r, v) for k, r in buf.lease(0, 2, v)])
        buf.take(v)
    assert sorted(buf.in_hand) == list(range(HELD_TAKES + 2 - HELD_TAKES + 1, HELD_TAKES + 3))
    before, queued = buf.accepted[0], len(buf.queues[0])
    assert buf.back_to(1, epoch=2) == HELD_TAKES  # steps 3..10 given back; step 2's take is no longer in hand:
    assert len(buf.queues[0]) == queued + 2 * HELD_TAKES and buf.accepted[0] == before - 2  # made again
    assert buf.last_taken == 1 and not buf.in_hand


def test_a_rollback_cuts_the_discarded_tokens_of_the_samples_in_the_making():
    from types import SimpleNamespace

    from xray.run.detached.maker import ExperienceMaker
    from xray.run.detached.sample import Sample

    cfg = SimpleNamespace(async_=SimpleNamespace(segment_tokens=2, max_in_flight=0),
                          rollout=SimpleNamespace(max_new_tokens=6))
    maker = ExperienceMaker(0, None, None, None, None, cfg, [], 0, share=2, version=4)
    going = Sample(1, {}, [5, 6, 7], [-0.1, -0.2, -0.3], [3, 3, 4])
    ended = Sample(1, {}, [8, 9], [-0.4, -0.5], [4, 4], done=True)  # its group waits for `going`
    kept = Sample(2, {}, [1], [-0.6], [3], done=True)
    maker.pending, maker.active = {1: [going, ended], 2: [kept]}, [going]
    maker._roll_back(3, 1)
    assert (going.response, going.logprobs, going.versions) == ([5, 6], [-0.1, -0.2], [3, 3])
    assert ended.response == [] and not ended.done and maker.active == [going, ended]
    assert kept.done and kept.response == [1]
    assert {s.epoch for g in maker.pending.values() for s in g} == {1} and maker.epoch == 1


def test_a_makers_episode_turns_share_one_call_and_record_their_version():
    """Turns of several leases' episodes queued together go in one generate call (padded to the
    replica's dp), each gets its part with the version that sampled it; a load between two calls
    shows in the next call's version."""
    import asyncio
    from types import SimpleNamespace

    from xray.run.detached.maker import ExperienceMaker
    from xray.run.detached.episode_maker import TurnBatcher, episode_metrics
    from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS, WEIGHT_VERSION

    calls = []

    class Replica:  # answers each prompt with its last token + 1
        parallel = SimpleNamespace(dp=2)

        async def generate(self, prompts, sampling):
            calls.append(len(prompts))
            await asyncio.sleep(0.01)
            return {C.RESPONSE_IDS: [[p[-1] + 1] for p in prompts], RESPONSE_LOGPROBS: [[-0.5]] * len(prompts),
                    FINISH_REASON: ["length"] * len(prompts)}

    cfg = SimpleNamespace(async_=SimpleNamespace(segment_tokens=0, max_in_flight=0),
                          rollout=SimpleNamespace(max_new_tokens=4))
    maker = ExperienceMaker(1, Replica(), None, None, None, cfg, [], 0, share=2, version=3)
    turns = TurnBatcher(maker)

    async def play():
        first = await asyncio.gather(turns.generate([[1], [2]], {"max_new_tokens": 2}),
                                     turns.generate([[7]], {"max_new_tokens": 3}))
        maker.version = 4  # a load between two calls
        return first, await turns.generate([[9]], {"max_new_tokens": 1})

    (a, b), c = asyncio.run(play())
    assert calls == [4, 2]  # 3 turns in one call, padded to dp=2; then 1, padded
    assert a[C.RESPONSE_IDS] == [[2], [3]] and b[C.RESPONSE_IDS] == [[8]] and c[C.RESPONSE_IDS] == [[10]]
    assert (a[WEIGHT_VERSION], b[WEIGHT_VERSION], c[WEIGHT_VERSION]) == (3, 3, 4) and len(maker.busy) == 2
    assert episode_metrics([{}]) == {}
    got = episode_metrics([{"episodes": 2, "turns": 5, "tool_calls": 1, "tool_episodes": 1, "ends_done": 2,
                            "env_wait_s": 0.5, "generate_calls": 3}, {"episodes": 2, "turns": 3, "ends_max_turns": 2}])
    assert got == {"episode/turns": 2.0, "episode/tool_calls": 0.25, "episode/tool_call_share": 0.25,
                   "episode/env_wait_s": 0.5, "episode/generate_calls": 3, "episode/episodes": 4,
                   "episode/ends_done": 2, "episode/ends_max_turns": 2}


def test_buffer_takes_each_trainers_share():
    buf = ExperienceBuffer(share=1, feeds=[[0], [1]], draw=prompts(), max_staleness=0, capacity=2)
    a = buf.lease(0, 1, 0)
    buf.put([group(*a[0], 0)])
    assert buf.take(0) is None and len(buf.queues[0]) == 1  # trainer 1 has nothing: nothing taken
    b = buf.lease(1, 1, 0)
    buf.put([group(*b[0], 0, maker=1)])
    assert [[g.maker for g in q] for q in buf.take(0)] == [[0], [1]]
    with pytest.raises(ValueError):
        ExperienceBuffer(share=0, feeds=[[0]], draw=prompts())


def test_staleness_is_counted_per_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    versions = torch.tensor([[0, 3, 3, 4], [0, 4, 4, 0]], dtype=torch.int32)  # row 0 spans versions 3 and 4
    out = staleness(Batch({C.LOSS_MASK: mask, C.BEHAVIOUR_VERSIONS: versions}), version=5)
    assert out["async/staleness"] == 2.0 and out["async/partial_samples"] == 1.0
    assert out["async/staleness_token_mean"] == pytest.approx((2 + 2 + 1 + 1 + 1) / 5)


def test_graph_defaults_names_and_errors():
    g = build_graph({}, {}, makers=2, trainers=2)
    assert g.feeds == ((0, 1), (0, 1)) and g.pusher == (0, 1) and g.pushed_by(1) == [1]
    g = build_graph({"maker0": ["trainer0"], "maker1": ["trainer1", "trainer0"]}, {"trainer1": ["maker0", "maker1"]}, 2, 2)
    assert g.feeds == ((0,), (0, 1)) and g.pusher == (1, 1) and g.pushed_by(0) == []
    for feeds, pushes, match in (({"maker2": ["trainer0"]}, {}, "maker0..maker1"),
                                 ({"maker0": ["trainer0"], "maker1": ["trainer0"]}, {}, "trainer1 is fed by no maker"),
                                 ({"maker0": []}, {}, "empty"),
                                 ({}, {"trainer0": ["maker0"], "trainer1": ["maker0"]}, "under one trainer"),
                                 ({}, {"trainer5": ["maker0"]}, "trainer0..trainer1")):
        with pytest.raises(ConfigError, match=match):
            build_graph(feeds, pushes, 2, 2)


def test_each_replica_trains_on_its_own_part():
    rows = mini_batch_rows(16, mini_batch_size=8, parts=2, seed=3)
    assert len(rows) == 2 and sorted(torch.cat(rows).tolist()) == list(range(16))
    for mb in rows:  # dp=2 splits a mini-batch in halves: the first from part 0, the second from part 1
        assert all(r < 8 for r in mb[:4].tolist()) and all(r >= 8 for r in mb[4:].tolist())
    order = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    assert [r.tolist() for r in mini_batch_rows(16, 8, 1, 3)] == [order[:8].tolist(), order[8:].tolist()]


def test_a_maker_failing_on_a_scorer_already_replaced_is_not_a_second_fault():
    from xray.run.detached.supervisor import Detached

    d = object.__new__(Detached)  # the rule alone (`Detached._same_fault`), no Ray
    d.handed = {"reference": {0, 2}}  # makers 0 and 2 went on when the reference was replaced
    died = SimpleNamespace(role="reference")
    assert d._same_fault(0, died) and not d._same_fault(0, died)  # once: a later failure is a new fault
    assert not d._same_fault(1, died)  # maker 1 was itself replaced with the reference: it had the new one
    assert not d._same_fault(2, SimpleNamespace(role="teacher")) and not d._same_fault(2, RuntimeError("x"))
    assert d._same_fault(2, died) and d.handed == {"reference": set()}
