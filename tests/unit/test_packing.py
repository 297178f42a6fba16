"""Sequence packing (`xray/data/packing.py`, `xray/backends/hf_packed.py`): the packed layout and its
way back to rows, and a Hugging Face model attending row by row in a packed sequence giving the
padded forward's log-probs and gradient; the row-by-row attention is the one that ran."""
import pytest
import torch

from tests.unit.test_length_groups import _batch, _model
from xray.data import columns as C
from xray.data.packing import pack_rows

pytestmark = pytest.mark.unit


def test_rows_pack_one_after_another_with_their_own_positions_and_come_back():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    pack = pack_rows(ids, (ids != 0).long())
    assert pack.ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert pack.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert pack.cu_seqlens.tolist() == [0, 3, 5, 9] and pack.max_len == 4
    out = torch.stack([pack.ids, -pack.ids], dim=-1).float()  # [1, T, 2]
    assert pack.unpack(out)[..., 0].tolist() == ids.float().tolist()
    assert pack.unpack(out)[..., 1].tolist() == (-ids).float().tolist()
    with pytest.raises(ValueError, match="at least one token"):
        pack_rows(ids, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))


def test_a_packed_hugging_face_forward_equals_the_padded_one(monkeypatch):
    import xray.backends.hf_packed as hp
    from xray.backends.deepspeed.model import role_outputs
    from xray.backends.hf_packed import use_rows_attention

    model = _model()
    batch = _batch(seed=4)
    real = batch[C.ATTENTION_MASK][:, 1:].bool()
    mask = batch[C.LOSS_MASK]

    def step(packed: bool):
        model.zero_grad(set_to_none=True)
        logp = role_outputs(model, batch, "actor", entropy=False, packed=packed)[C.LOGPROBS]
        (-(logp * mask).sum() / mask.sum()).backward()
        return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    padded, grad = step(False)
    use_rows_attention(model)
    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(hp.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: rows.append(q.shape[2]) or sdpa(q, *a, **k))
    packed, packed_grad = step(True)
    lengths = batch[C.ATTENTION_MASK].sum(1).tolist()
    assert rows == lengths * 2  # each row alone, in each of the model's two layers
    assert float((packed - padded)[real].abs().max()) <= 1e-5
    assert bool(packed.isfinite().all())  # past each row: the log-probs of zero logits, masked downstream
    torch.testing.assert_close(packed_grad, grad, rtol=1e-5, atol=1e-7)
