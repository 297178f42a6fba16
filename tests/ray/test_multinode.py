"""Multi-node placement: two Ray nodes on one machine (127.0.0.1), one device group across both."""
import pytest

from xray.config.parallel import ParallelDims
from xray.wholemodel import WholeModel
from xray.workhorse.echo import EchoWorkhorse

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from xray.wholemodel.cluster import bind_loopback, ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    bind_loopback()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ensure_ray(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_group_spans_both_nodes_and_all_reduces(two_nodes):
    import ray

    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    wm = WholeModel(EchoWorkhorse, role="span", parallel=ParallelDims(dp=2))
    try:
        results = wm.all_reduce(5.0).get()
        assert [r["sum"] for r in results] == [11.0, 11.0]  # (5 + 0) + (5 + 1)
        assert len({r["node"] for r in results}) == 2, "the two Workhorses must sit on different nodes"
    finally:
        wm.shutdown()


def test_wholemodel_actor_sits_on_the_head_node(two_nodes):
    """Rank 0 pinned to the second node (not the head): the control plane stays on the head node,
    whose loss ends the cluster anyway, so losing rank 0's node leaves it standing."""
    import ray
    from ray.util.placement_group import placement_group

    from xray.wholemodel.placement import Bundles

    pg = placement_group([{"CPU": 1, "node_b": 0.5}, {"CPU": 1, "node_a": 0.5}], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    wm = WholeModel(EchoWorkhorse, role="pinned", parallel=ParallelDims(dp=2), bundles=Bundles(pg, (0, 1)))
    try:
        rank0_node = wm.all_reduce(0.0).get()[0]["node"]
        driver_node = ray.get_runtime_context().get_node_id()
        assert rank0_node != driver_node
        assert ray.get(wm._actor.node_id.remote()) == two_nodes.head_node.node_id
    finally:
        wm.shutdown()
        ray.util.remove_placement_group(pg)


def test_a_restart_keeps_the_live_shards_and_builds_the_others_in_standby_processes(two_nodes):
    """`WholeModel.restart` after a loss: the live rank rebuilds in its own process (`Workhorse.rejoin`),
    the lost one in the warm standby of its node (`WholeModel.keep_standby`, one per node; no new
    process), the group works, and the pool is refilled with a new process; a survivor that does not
    answer (busy in a call, as one stuck in a collective) is replaced too; a serving Workhorse refuses
    `become`."""
    import time

    import ray

    wm = WholeModel(EchoWorkhorse, role="standing", parallel=ParallelDims(dp=2))

    def standbys_warm(what: str) -> set[int]:
        deadline = time.monotonic() + 60
        while not wm.standby_ready():
            assert time.monotonic() < deadline, f"the standby processes never {what}"
            time.sleep(0.1)
        return set(ray.get(wm._actor.standby_pids.remote()))

    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        assert wm.keep_standby(1, nodes) == {node: 1 for node in nodes}
        standby = standbys_warm("warmed")
        before = [r["node"] for r in wm.all_reduce(0.0).get()]
        old = [p["pid"] for p in wm.ping().get()]
        ray.kill(wm.shard_handles()[1])
        wm.restart()
        now = [p["pid"] for p in wm.ping().get()]
        assert wm.rejoined == [0] and now[0] == old[0] and now[1] in standby
        results = wm.all_reduce(5.0).get()
        assert [r["sum"] for r in results] == [11.0, 11.0] and [r["node"] for r in results] == before
        refilled = standbys_warm("refilled")
        assert len(refilled) == 2 and refilled & standby == standby - {now[1]}
        busy = wm.sleep(30.0, ranks=[0])  # rank 0 busy for 30 s: it does not answer the restart's 5 s question
        ray.kill(wm.shard_handles()[1])
        wm.restart()
        assert wm.rejoined == [] and not {p["pid"] for p in wm.ping().get()} & set(now)
        assert [r["sum"] for r in wm.all_reduce(1.0).get()] == [3.0, 3.0]
        with pytest.raises(Exception):
            busy.get()
        with pytest.raises(Exception, match="serving Workhorse"):
            ray.get(wm.shard_handles()[0].become.remote(rank=0, parallel=ParallelDims(dp=2)))
    finally:
        wm.shutdown()


class _RejoinFails(EchoWorkhorse):
    """A survivor whose rebuild in its own process fails (as a library's teardown might)."""

    def rejoin(self, master_addr: str, master_port: int, *layout):
        raise RuntimeError("this survivor cannot rejoin")


def test_a_survivor_that_fails_to_rejoin_gives_way_to_new_processes(two_nodes):
    """A restart whose survivor fails to rejoin does not wait for the group (the new rank would sit
    in the rendezvous until its 300 s timeout): every rank starts in a new process, and the group
    works."""
    import time

    import ray

    wm = WholeModel(_RejoinFails, role="failing", parallel=ParallelDims(dp=2))
    try:
        old = {p["pid"] for p in wm.ping().get()}
        ray.kill(wm.shard_handles()[1])
        t0 = time.monotonic()
        wm.restart()
        took = time.monotonic() - t0
        assert wm.rejoined == [] and not {p["pid"] for p in wm.ping().get()} & old
        assert [r["sum"] for r in wm.all_reduce(2.0).get()] == [5.0, 5.0]
        assert took < 60, took
    finally:
        wm.shutdown()


def test_a_resize_keeps_the_standing_devices_processes(two_nodes):
    """An elastic resize (`Models.place`) on the standing devices: rank 1's device alone kept
    (`standing`, `reserve(keep=...)`), the model restarts at dp=1 and rank 1's process becomes
    rank 0 of a group of one (`Workhorse.relayout`: its rank, layout and seed); grown back to dp=2
    on that device and a newly reserved one, it keeps its process again at rank 0 and the new rank
    starts a process; the group all-reduces at each size."""
    import ray

    from xray.wholemodel.placement import Bundles, reserve, standing

    full = reserve("resized", 2, "CPU", packs=((0,), (1,)))
    wm = WholeModel(EchoWorkhorse, role="resized", parallel=ParallelDims(dp=2), bundles=full)
    spare = None
    try:
        pids = [p["pid"] for p in wm.ping().get()]
        kept = standing(full)
        assert [pg.id for pg in kept] == [pg.id for pg in full.placement_groups()]
        ray.util.remove_placement_group(full.groups[0])  # rank 0's device given back
        assert [pg.id for pg in standing(full)] == [full.groups[1].id]
        one = reserve("resized", 1, "CPU", keep=standing(full))
        assert one.placement_group is full.groups[1]  # nothing new reserved
        wm.restart(ParallelDims(dp=1), one)
        assert wm.rejoined == [0] and [p["pid"] for p in wm.ping().get()] == [pids[1]]
        info = wm.layout[0]
        assert (info.rank, info.world_size, info.dp_size) == (0, 1, 1)
        assert [r["sum"] for r in wm.all_reduce(4.0).get()] == [4.0]
        two = reserve("resized", 2, "CPU", packs=((0,), (1,)), keep=[one.placement_group])
        spare = two.groups[1]
        assert two.groups[0] is one.placement_group and spare is not one.placement_group
        wm.restart(ParallelDims(dp=2), two)
        now = [p["pid"] for p in wm.ping().get()]
        assert wm.rejoined == [0] and now[0] == pids[1] and now[1] not in pids
        assert [r["sum"] for r in wm.all_reduce(5.0).get()] == [11.0, 11.0]
    finally:
        wm.shutdown()
        for pg in (full.groups[1], spare):
            if pg is not None:
                ray.util.remove_placement_group(pg)


def test_a_snapshot_replica_outlives_the_node_it_was_taken_on(two_nodes):
    """The in-memory snapshots' replicas (`xray/run/snapshot_holder.py`): a Workhorse's answer on a
    third node (tensors as numpy arrays, `to_wire`) is put again on another node (the driver's) by
    that node's holder, as the holder's own object; the third node removed, the replica's reference
    reads the whole answer (no object of the lost node is needed), and a dropped copy is released.
    Last in this module: it adds and removes a node."""
    import asyncio

    import ray
    import torch
    from ray.util.placement_group import placement_group, remove_placement_group

    from xray.backends.snapshot import from_wire, to_wire
    from xray.run.snapshot_holder import Replicator
    from xray.wholemodel.placement import Bundles

    node = two_nodes.add_node(num_cpus=1, resources={"node_c": 1})
    two_nodes.wait_for_nodes()
    pg = placement_group([{"CPU": 1, "node_c": 1}])
    ray.get(pg.ready(), timeout=60)
    wm = WholeModel(EchoWorkhorse, role="snapped", parallel=ParallelDims(dp=1), bundles=Bundles(pg, (0,)))
    try:
        replicas = Replicator()
        assert replicas.refresh({"snapped": wm}) == 3
        [shard_node] = replicas.nodes["snapped"]
        assert shard_node == node.node_id and replicas.target(shard_node) == ray.get_runtime_context().get_node_id()
        answer = wm.wire_payload(8)  # 8 MB answered on node_c, kept in its object store
        nodes, [replica] = asyncio.run(replicas.hold("step-1", {"snapped": list(answer.refs)}))["snapped"]
        assert nodes == [node.node_id] and replica != answer.refs[0]
        two_nodes.remove_node(node)
        ray.get(wm._actor.pid.remote())  # the control plane lives on
        assert node.node_id not in Replicator.alive()
        copy = from_wire(ray.get(replica, timeout=60))
        assert copy["x"].dtype == torch.bfloat16 and copy["x"].numel() * 2 >= 8 << 20
        assert bool((copy["x"] == 1.5).all())
        assert replicas.refresh() == 2 and node.node_id not in replicas.holders
        replicas.keep(["step-2"])
        assert replicas.held == set()
    finally:
        wm.shutdown()
        remove_placement_group(pg)
