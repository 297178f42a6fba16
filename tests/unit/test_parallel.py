"""ParallelDims: Megatron rank order, collectors, and model-shape checks."""
import pytest

from xray.config.parallel import LayoutError, ParallelDims

pytestmark = pytest.mark.unit


def test_rank_order_tp_fastest_then_dp_then_pp():
    d = ParallelDims(tp=2, pp=2, dp=2)
    got = [(c.tp_rank, c.dp_rank, c.pp_rank) for c in map(d.coords, range(8))]
    assert got == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert d.collectors() == [4, 6]
    assert [d.rank_of(c.tp_rank, c.pp_rank, c.dp_rank) for c in map(d.coords, range(8))] == list(range(8))


def test_model_checks_say_the_fix():
    with pytest.raises(LayoutError, match="tp=3 does not divide the model's 4 attention heads"):
        ParallelDims(tp=3).check_model(2, 4, 4)
    with pytest.raises(LayoutError, match="key/value heads"):
        ParallelDims(tp=4).check_model(2, 8, 2)
    with pytest.raises(LayoutError, match="pp=3 is greater than the model's 2 layers"):
        ParallelDims(pp=3).check_model(2, 4, 4)
    with pytest.raises(LayoutError, match="positive integer"):
        ParallelDims(tp=0)
