"""Length-grouped micro-batches: order, trimming, the slice's denominators, and the exactness claim
(grouped and trimmed micro-batches give the gradient of the whole slice, for the PPO losses)."""
import pytest
import torch

from algorithms.core.policy_loss import PolicyLoss
from algorithms.ppo.value_loss import ValueLoss
from xray.check.reference import policy_loss as plain_loss
from xray.data import columns as C
from xray.data.batch import Batch, BatchError
from xray.data.lengths import NORM, LossNorm, grouped_micro_batches, train_micro_batches

pytestmark = pytest.mark.unit

LENGTHS = [5, 12, 7, 3, 12, 9, 4, 10]  # real tokens per row; the batch is 14 wide
PROMPT = 2


def _batch(seed: int = 0, width: int = 14) -> Batch:
    g = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)
    attn = torch.zeros(n, width, dtype=torch.long)
    for i, length in enumerate(LENGTHS):
        attn[i, :length] = 1
    ids = torch.randint(3, 60, (n, width), generator=g) * attn
    loss_mask = attn[:, 1:].clone().float()
    loss_mask[:, :PROMPT - 1] = 0
    t = width - 1
    return Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: attn, C.LOSS_MASK: loss_mask,
                  C.OLD_LOGPROBS: -torch.rand(n, t, generator=g) * 3,
                  C.ADVANTAGES: torch.randn(n, t, generator=g),
                  C.OLD_VALUES: torch.randn(n, t, generator=g), C.RETURNS: torch.randn(n, t, generator=g),
                  C.SCORES: torch.arange(n, dtype=torch.float)}, {"tag": list(range(n))})


def test_groups_longest_first_trims_and_carries_the_slice_denominators():
    batch = _batch()
    micro = grouped_micro_batches(batch, 2)
    assert [mb["tag"] for mb in micro] == [[1, 4], [7, 5], [2, 0], [6, 3]]
    assert [mb[C.INPUT_IDS].shape[1] for mb in micro] == [12, 10, 7, 4]
    assert [mb[C.LOSS_MASK].shape[1] for mb in micro] == [11, 9, 6, 3]
    assert [mb[C.SCORES].tolist() for mb in micro] == [[1.0, 4.0], [7.0, 5.0], [2.0, 0.0], [6.0, 3.0]]
    tokens = sum(n - PROMPT for n in LENGTHS)  # response tokens: the loss mask's ones
    assert float(batch[C.LOSS_MASK].sum()) == tokens
    for mb in micro:
        assert mb.meta[NORM] == LossNorm(tokens / 4, len(LENGTHS) / 4)
        torch.testing.assert_close(mb[C.INPUT_IDS], batch[C.INPUT_IDS][mb["tag"], :mb[C.INPUT_IDS].shape[1]])
    wide = grouped_micro_batches(batch, 2, trim=False)
    assert {mb[C.INPUT_IDS].shape[1] for mb in wide} == {14}
    assert [mb["tag"] for mb in wide] == [mb["tag"] for mb in micro]


def test_only_a_loss_that_asks_is_grouped_and_bad_sizes_say_the_fix():
    batch = _batch()
    assert [mb["tag"] for mb in train_micro_batches(batch, plain_loss, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(train_micro_batches(batch, PolicyLoss(), 4)[0][C.INPUT_IDS][0]) == 12
    with pytest.raises(BatchError, match="does not divide"):
        grouped_micro_batches(batch, 3)
    with pytest.raises(BatchError, match="loss_mask"):
        grouped_micro_batches(batch.select([C.INPUT_IDS, C.ATTENTION_MASK]), 2)


def _model():
    from transformers import AutoModelForCausalLM

    from xray.builtin.tiny_llama import TinySpec, hf_config

    torch.manual_seed(0)
    spec = TinySpec(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return AutoModelForCausalLM.from_config(hf_config(spec)).float()


def _gradient(model, micro: list[Batch], loss_fn) -> torch.Tensor:
    """The flat gradient of the mean over micro-batches of `loss_fn` (as every engine accumulates)."""
    from xray.backends.hf_logprobs import hf_logprobs

    model.zero_grad(set_to_none=True)
    for mb in micro:
        logp = hf_logprobs(model, mb)
        outputs = {C.LOGPROBS: logp, C.VALUES: logp * 0.5 + 0.1}
        loss, _ = loss_fn(outputs, mb)
        (loss / len(micro)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("loss_fn", [PolicyLoss(cliprange=0.2), PolicyLoss(loss_agg_mode="seq-mean-token-sum"),
                                     PolicyLoss(loss_agg_mode="seq-mean-token-mean"), ValueLoss(vf_coef=1.0)],
                         ids=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "value"])
def test_grouped_trimmed_micro_batches_give_the_whole_slice_gradient(loss_fn):
    model = _model()
    batch = _batch(seed=1)
    whole = _gradient(model, [batch], loss_fn)
    grouped = _gradient(model, grouped_micro_batches(batch, 2), loss_fn)
    torch.testing.assert_close(grouped, whole, rtol=1e-4, atol=1e-6)
    if getattr(loss_fn, "loss_agg_mode", "token-mean") == "token-mean":
        # each micro-batch's own token mean weighs the rows of short micro-batches more
        own = [Batch(mb.tensors, mb.lists, {}) for mb in grouped_micro_batches(batch, 2)]
        assert float((_gradient(model, own, loss_fn) - whole).abs().max()) > 1e-2 * float(whole.abs().max())


@pytest.mark.parametrize("loss_fn", [PolicyLoss(cliprange=0.2), PolicyLoss(loss_agg_mode="seq-mean-token-mean"),
                                     ValueLoss(vf_coef=1.0)], ids=["token-mean", "seq-mean-token-mean", "value"])
def test_replicas_averaging_their_slices_give_the_mini_batch_gradient_whatever_rows_each_holds(loss_fn):
    """A mini-batch with its totals (`with_totals`) cut into 2 data-parallel slices: the mean of
    the slices' gradients (the engines' all-reduce) is the whole mini-batch's, for the rows split
    as they come and as `balanced_rows` assigns them; without the totals a slice divides by its own."""
    from xray.run.minibatches import balanced_rows
    from xray.data.lengths import TOTALS, with_totals

    model = _model()
    batch = _batch(seed=2)
    whole = _gradient(model, [batch], loss_fn)
    for rows in (torch.arange(8), balanced_rows(batch, torch.arange(8), 2)):
        mini = with_totals(batch.index(rows))
        assert mini.meta[TOTALS] == (float(batch[C.LOSS_MASK].sum()), 8.0)
        slices = mini.split(2)
        averaged = sum(_gradient(model, grouped_micro_batches(s, 2, replicas=2), loss_fn) for s in slices) / 2
        torch.testing.assert_close(averaged, whole, rtol=1e-4, atol=1e-6)
    own = batch.split(2)  # each slice's own denominators: another mean where the slices' tokens differ
    averaged = sum(_gradient(model, grouped_micro_batches(s, 2), loss_fn) for s in own) / 2
    if getattr(loss_fn, "loss_agg_mode", "token-mean") == "token-mean":
        assert float((averaged - whole).abs().max()) > 1e-3 * float(whole.abs().max())


def test_balanced_rows_even_the_replicas_tokens():
    from xray.run.minibatches import balanced_rows

    batch = _batch()
    rows = torch.arange(8)
    order = balanced_rows(batch, rows, 2)
    tokens = [int(batch[C.ATTENTION_MASK][order[i * 4:(i + 1) * 4]].sum()) for i in range(2)]
    assert sorted(order.tolist()) == list(range(8)) and abs(tokens[0] - tokens[1]) <= 1, tokens  # 62 tokens in all
    assert balanced_rows(batch, rows, 1).tolist() == rows.tolist()
