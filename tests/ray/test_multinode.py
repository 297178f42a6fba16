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
