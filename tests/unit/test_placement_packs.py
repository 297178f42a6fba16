"""Node packs: each replica's tp x pp devices reserved on one node (STRICT_PACK), without Ray."""
import sys
import types
from pathlib import Path

import pytest

from xray.config.packing import describe_packs, node_packs, whole_replicas
from xray.config.parallel import LayoutError, ParallelDims

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_a_pack_per_replica_in_megatron_rank_order():
    assert node_packs(8, [ParallelDims(tp=2, dp=4)], 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
    # pp=2: rank = tp_rank + tp * (dp_rank + dp * pp_rank), so replica 0 is ranks 0, 1 (stage 0) and 4, 5 (stage 1)
    assert node_packs(8, [ParallelDims(tp=2, pp=2, dp=2)], 8) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert node_packs(4, [ParallelDims(dp=4)]) == ((0,), (1,), (2,), (3,))
    assert node_packs(3, []) == ((0,), (1,), (2,))  # no layout: no constraint


def test_colocated_roles_share_packs_that_hold_every_replica_of_each():
    actor, critic = ParallelDims(tp=2, dp=4), ParallelDims(tp=1, pp=2, dp=4)  # critic replica d: ranks d, d + 4
    packs = node_packs(8, [actor, critic], 8)
    assert packs == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert whole_replicas(packs, [actor, critic])


def test_a_replica_larger_than_a_node_keeps_only_its_tensor_parallel_groups_together():
    layout = ParallelDims(tp=2, pp=2, dp=1)
    packs = node_packs(4, [layout], per_node=2)
    assert packs == ((0, 1), (2, 3))  # stage 0 on one node, stage 1 perhaps on another
    assert not whole_replicas(packs, [layout])
    with pytest.raises(LayoutError, match="lower tp to at most 2"):
        node_packs(4, [ParallelDims(tp=4)], per_node=2)
    with pytest.raises(LayoutError, match="cannot be packed on 6 devices"):
        node_packs(6, [ParallelDims(tp=2, dp=2)])


def test_describe_packs_counts_them():
    assert describe_packs(((0, 1), (2, 3), (4, 5))) == "3 packs of 2"
    assert describe_packs(((0, 1, 2, 3), (4, 5))) == "1 pack of 4 and 1 pack of 2"


def test_bundles_map_each_rank_to_its_placement_group():
    from xray.wholemodel.placement import Bundles, pack_slots

    assert pack_slots(8, ((0, 1, 4, 5), (2, 3, 6, 7))) == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                           (0, 2), (0, 3), (1, 2), (1, 3)]
    with pytest.raises(ValueError, match="exactly once"):
        pack_slots(3, ((0, 1),))
    one = Bundles("pg", (0, 1))  # one placement group, as callers that reserve their own build it
    assert one.slots() == [("pg", 0), ("pg", 1)] and one.placement_groups() == ["pg"]
    split = Bundles("a", (0, 1, 0, 1), 2, ("a", "a", "b", "b"))
    assert split.slots() == [("a", 0), ("a", 1), ("b", 0), ("b", 1)] and split.placement_groups() == ["a", "b"]
    with pytest.raises(ValueError, match="one per rank"):
        Bundles("a", (0, 1), 1, ("a",))


class FakeRay:
    """`ray` as `reserve` uses it: placement groups recorded, every one granted at once."""

    def __init__(self):
        self.created, self.removed = [], []
        self.util = types.SimpleNamespace(remove_placement_group=self.removed.append)

    def placement_group(self, bundles, strategy, name):
        pg = types.SimpleNamespace(bundles=bundles, strategy=strategy, name=name, ready=lambda: name)
        self.created.append(pg)
        return pg

    def wait(self, refs, num_returns, timeout):
        assert num_returns == len(refs)
        return refs, []


def test_reserve_plan_makes_one_strict_pack_group_per_replica(monkeypatch):
    from xray.train import resolve
    from xray.wholemodel.placement import release_all, reserve_plan

    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.util", fake.util)
    monkeypatch.setitem(sys.modules, "ray.util.placement_group",
                        types.SimpleNamespace(placement_group=fake.placement_group))
    _, _, plan, _, _ = resolve(["ppo", "--config", str(ROOT / "configs/ppo_gpu_2nodes.yaml")])
    bundles = reserve_plan(plan, threads=4)
    assert len(fake.created) == 8 and {pg.strategy for pg in fake.created} == {"STRICT_PACK"}
    train = [pg for pg in fake.created if "train_group" in pg.name]
    assert [pg.bundles for pg in train] == [[{"GPU": 1, "xray_train_node": 1.0}] * 2] * 4
    actor = bundles["actor"]
    assert actor is bundles["critic"] is bundles["reference"] and actor.share == 3
    assert actor.indices == (0, 1, 0, 1, 0, 1, 0, 1) and actor.placement_groups() == train
    assert [pg.name for pg, _ in actor.slots()][::2] == [pg.name for pg in train]  # ranks 2k, 2k+1: pack k
    assert bundles["rollout"].share == 1 and len(bundles["rollout"].placement_groups()) == 4
    release_all(list(bundles.values()))
    assert sorted(pg.name for pg in fake.removed) == sorted(pg.name for pg in fake.created)  # each once
