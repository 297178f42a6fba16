"""Token-budget micro-batches (`xray/data/budget.py`): the cut respects the budget, a common count
splits the costliest micro-batches, forwards come back in row order and width, and a budgeted
train step takes the whole slice's gradient (the same arithmetic as length groups)."""
import pytest
import torch

from algorithms.core.policy_loss import PolicyLoss
from algorithms.ppo.value_loss import ValueLoss
from tests.unit.test_length_groups import LENGTHS, _batch, _gradient, _model
from xray.data import columns as C
from xray.data.batch import BatchError
from xray.data.budget import budget_groups, forward_micro_batches, restored
from xray.data.lengths import NORM, LossNorm, train_micro_batches
from algorithms.specs import command_spec

pytestmark = pytest.mark.unit


def test_rows_go_longest_first_under_the_budget_and_a_count_splits_the_costliest():
    lengths = torch.tensor(LENGTHS)  # 5, 12, 7, 3, 12, 9, 4, 10
    groups = [g.tolist() for g in budget_groups(lengths, 24)]
    assert groups == [[1, 4], [7, 5], [2, 0, 6], [3]]  # 2x12, 2x10, 3x7, then 3 alone as 4x7 > 24
    assert all(len(g) * max(LENGTHS[i] for i in g) <= 24 for g in groups)
    assert [g.tolist() for g in budget_groups(lengths, 10)] == [[1], [4], [7], [5], [2], [0, 6], [3]]  # 2x5 fits
    # a row longer than the budget goes alone
    assert [g.tolist() for g in budget_groups(lengths, 11)][:2] == [[1], [4]]
    split = [g.tolist() for g in budget_groups(lengths, 24, count=6)]
    assert sorted(i for g in split for i in g) == list(range(8)) and len(split) == 6
    assert split == [[1], [4], [7, 5], [2], [0, 6], [3]]  # the costliest split: 2x12 (24), then 3x7 (21 > 2x10)
    with pytest.raises(BatchError, match="needs 4"):
        budget_groups(lengths, 24, count=3)
    with pytest.raises(BatchError, match="positive token budget"):
        budget_groups(lengths, 0)


def test_a_budgeted_forward_comes_back_in_row_order_and_width():
    batch = _batch()
    micro, order = forward_micro_batches(batch, 24)
    assert [mb[C.INPUT_IDS].shape for mb in micro] == [(2, 12), (2, 10), (3, 7), (1, 3)]
    outs = [{C.LOGPROBS: mb[C.INPUT_IDS][:, 1:].float()} for mb in micro]
    back = restored(outs, order, batch[C.INPUT_IDS].shape[1] - 1)[C.LOGPROBS]
    torch.testing.assert_close(back, batch[C.INPUT_IDS][:, 1:].float())  # ids past a row's end are 0
    assert len(forward_micro_batches(batch, 24, agree=lambda n: n + 2)[0]) == 6


@pytest.mark.parametrize("loss_fn", [PolicyLoss(cliprange=0.2), PolicyLoss(loss_agg_mode="seq-mean-token-mean"),
                                     ValueLoss(vf_coef=1.0)], ids=["token-mean", "seq-mean-token-mean", "value"])
def test_budgeted_micro_batches_give_the_whole_slice_gradient(loss_fn):
    model = _model()
    batch = _batch(seed=3)
    whole = _gradient(model, [batch], loss_fn)
    for budget, agree in ((24, None), (30, lambda n: 7)):
        micro = train_micro_batches(batch, loss_fn, 2, max_tokens=budget, agree=agree)
        assert len(micro) == (4 if agree is None else 7) and len({len(mb) for mb in micro}) > 1
        tokens = float(batch[C.LOSS_MASK].sum())
        assert micro[0].meta[NORM] == LossNorm(tokens / len(micro), len(LENGTHS) / len(micro))
        torch.testing.assert_close(_gradient(model, micro, loss_fn), whole, rtol=1e-4, atol=1e-6)


def test_the_config_budget_reaches_the_engines_and_a_pipeline_or_bad_budget_is_refused():
    from tests.unit.test_config import DEFAULT, groups
    from xray.config import ConfigError, load_config
    from xray.config.plan import plan_run
    from xray.run.models import role_init_kwargs

    cfg = load_config(DEFAULT, [("critic.max_tokens_per_micro_batch", 512)])
    assert role_init_kwargs(cfg, "critic", "deepspeed", "m")["max_tokens_per_micro_batch"] == 512
    assert "max_tokens_per_micro_batch" not in role_init_kwargs(cfg, "actor", "megatron", "m")
    cfg = load_config(DEFAULT, groups() + [("actor.pp", 2), ("actor.dp", 1), ("actor.max_tokens_per_micro_batch", 512)])
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch and actor.packing need actor.pp=1"):
        plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    cfg = load_config(DEFAULT, groups() + [("actor.pp", 2), ("actor.dp", 1), ("actor.packing", True)])
    with pytest.raises(ConfigError, match="actor.packing need actor.pp=1"):
        plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    assert role_init_kwargs(load_config(DEFAULT, [("actor.packing", True)]), "actor", "megatron", "m")["packing"]
    with pytest.raises(ConfigError, match="positive budget"):
        plan_run(load_config(DEFAULT, [("reference.max_tokens_per_micro_batch", 0)]), "megatron-vllm", command_spec("ppo"))
